"""A runner that stands in for a GPU: each step waits a fixed time and "samples" tokens by hash.

Scaling questions (does a second engine double throughput? does the control plane keep up?)
need engines whose steps cost what a GPU step costs, not what a 2-core CPU forward costs: on
this kind of machine a real forward competes for the cores with Redis, the API and the load
generator, so every comparison would measure CPU contention instead. ``TimedRunner`` keeps the
whole engine (scheduler, KV block accounting, streams, aborts) and replaces only the forward
with ``time.sleep``, which runs in the node's worker thread and holds neither the GIL nor a
core.

Tokens are a pure function of ``(request_id, position)``, so runs are reproducible and an
aborted-then-compared request gives the same prefix. When a tokenizer is given, tokens are
drawn only from ids that decode to whole, printable UTF-8 text: every step then yields one
non-empty text delta, i.e. one SSE chunk per token, which is what latency benchmarks count.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fd.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from fd.engine.runner.runners import InProcessRunner

DEFAULT_NUM_BLOCKS = 4096  # no memory behind them: sized so blocks never limit a benchmark
EMBED_DIM = 16  # an embeddings request's made-up vector


def _text_token_ids(tokenizer: Any, eos: Sequence[int]) -> list[int]:
    ids = []
    for i in range(tokenizer.vocab_size):
        if i in eos or tokenizer.is_special(i):
            continue
        b = tokenizer.id_to_bytes(i)
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a character: the detokenizer would hold it back
        if s.strip() and s.isprintable():
            ids.append(i)
    return ids


class TimedRunner(InProcessRunner):
    """An :class:`~fd.engine.runner.runners.InProcessRunner` with a timed wait instead of a forward.

    A step takes ``step_ms + per_token_ms * tokens it computes + per_row_ms * requests it
    samples for`` (at least; ``time.sleep`` may oversleep, never undersleep), measured from
    the start of ``execute``. The tokens a step computes leave out a prompt's cached prefix,
    so a prefix-cache hit saves here what it saves on a model whose cost this fits
    (bench/placement.py fits the three to SmolLM2-135M on this machine).
    """

    def __init__(
        self,
        num_blocks: int = DEFAULT_NUM_BLOCKS,
        *,
        step_ms: float,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int = 2048,
        vocab_size: int = 512,
        per_token_ms: float = 0.0,
        per_row_ms: float = 0.0,
        token_ids: Sequence[int] | None = None,
        tokenizer: Any = None,
    ):
        if step_ms < 0 or per_token_ms < 0 or per_row_ms < 0:
            raise ValueError("step_ms, per_token_ms and per_row_ms must be >= 0")
        self.num_blocks = int(num_blocks)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size)
        self.step_ms = float(step_ms)
        self.per_token_ms = float(per_token_ms)
        self.per_row_ms = float(per_row_ms)
        if token_ids is None and tokenizer is not None:
            token_ids = _text_token_ids(tokenizer, self.eos_token_ids)
        if token_ids is None:
            # ids 0..3 are special in fd's tiny model (and in many vocabularies); never EOS
            token_ids = [
                i for i in range(min(4, self.vocab_size - 1), self.vocab_size) if i not in self.eos_token_ids
            ]
        self.token_ids = tuple(token_ids)
        if not self.token_ids:
            raise ValueError("no token ids to sample from")
        self.steps = 0
        self.busy_s = 0.0

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        *,
        step_ms: float,
        num_blocks: int | None = None,
        per_token_ms: float = 0.0,
        per_row_ms: float = 0.0,
    ) -> TimedRunner:
        """The runner ``fd engine --executor timed`` uses: the model's limits and EOS from its
        tokenizer, text-only tokens."""
        return cls(
            num_blocks or DEFAULT_NUM_BLOCKS,
            step_ms=step_ms,
            eos_token_ids=tokenizer.eos_token_ids,
            max_model_len=tokenizer.max_model_len,
            vocab_size=tokenizer.vocab_size,
            per_token_ms=per_token_ms,
            per_row_ms=per_row_ms,
            tokenizer=tokenizer,
        )

    def token_at(self, request_id: str, position: int) -> int:
        """The token a request gets at ``position`` (its index in prompt + output)."""
        h = hashlib.blake2b(f"{request_id}\0{position}".encode(), digest_size=8).digest()
        return self.token_ids[int.from_bytes(h, "little") % len(self.token_ids)]

    def _sample(self, s: ScheduledSeq) -> int:
        return self.token_at(s.request_id, s.start_pos + len(s.token_ids))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        if not out.seqs:
            return RunnerOutput(step=out.step, sampled={})
        sampled = {s.request_id: self._sample(s) for s in out.seqs if s.sample}
        ntok = out.num_batched_tokens or sum(len(s.token_ids) for s in out.seqs)
        rows = len(sampled)
        deadline = t0 + (self.step_ms + self.per_token_ms * ntok + self.per_row_ms * rows) / 1000.0
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        self.steps += 1
        self.busy_s += time.perf_counter() - t0
        embeddings = {
            s.request_id: self.embedding_of(s.request_id) for s in out.seqs if s.sample and s.sampling.embed
        }
        return RunnerOutput(step=out.step, sampled=sampled, embeddings=embeddings)

    def embedding_of(self, request_id: str) -> bytes:
        """An embeddings request's vector (float32 bytes, EMBED_DIM of them): made up, like the
        tokens, but the same for the same request id."""
        h = hashlib.blake2b(request_id.encode(), digest_size=EMBED_DIM).digest()
        return np.frombuffer(h, dtype=np.uint8).astype("<f4").tobytes()

    def warmup(self) -> None:
        """Nothing to warm up; here so callers can treat it like ``ModelRunner``."""
