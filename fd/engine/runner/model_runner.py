"""Runs the scheduler's steps on the model: batch building, the forward, sampling.

The scheduler hands over a :class:`SchedulerOutput` (which tokens of which requests, at which
positions, in which KV blocks); the runner flattens it into one mixed batch (prefill chunks and
decode tokens together, fd/engine/runner/batch.py), runs the model once, and samples one token
for each sequence that asked for one. Sequences are split into at most two attention groups,
single-token ones (decode) and chunks, so a long prefill does not pad every decode row to its
length.

``execute`` runs on the engine node's worker thread; it touches no asyncio state, and Paddle
kernels run without the GIL, so the event loop keeps serving while a step computes.

Steps must run in the order they were scheduled: with async scheduling a decode may feed
:data:`~fd.engine.core.sequence.PLACEHOLDER`, which stands for the token this runner sampled for that
request in the step just before, and only the runner knows it when the step starts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import paddle

from fd.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from fd.engine.core.sequence import PLACEHOLDER
from fd.engine.model import qgemm
from fd.engine.model.forward_batch import ForwardBatch
from fd.engine.model.llama import Llama
from fd.engine.model.loader import load_model
from fd.engine.runner.batch import build_batch
from fd.engine.runner.malloc import pin_thresholds, release_free
from fd.engine.runner.runners import InProcessRunner
from fd.engine.runner.sampler import Sampler, token_logprobs
from fd.engine.runner.step_cut import StepCut

log = logging.getLogger("fd.engine.runner.model_runner")

DEFAULT_KV_CACHE_BYTES = {"cpu": 256 << 20, "gpu": 4 << 30}
#: Prompt positions whose logits are made at once when a request scores its prompt: 256 rows
#: of a 152k vocabulary are ~150 MB of float32.
SCORE_ROWS = 256


def _eos_token_ids(model_dir: str) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            v = json.load(f).get("eos_token_id")
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _gemms(device: str, batch_invariant: bool) -> str:
    """Which GEMMs the model runs by default: on a CPU build with MKL's packed GEMMs, packed
    or eager, whichever is faster on this machine (fd/engine/model/packed_gemm.py), unless
    batch-invariant (whose row padding is tuned to eager MKL's tiles, fd/engine/model/llama.py)."""
    from fd.engine.model import packed_gemm

    return "auto" if device == "cpu" and not batch_invariant and packed_gemm.available() else "eager"


class ModelRunner(InProcessRunner):
    """The model, run in this process: an :class:`~fd.engine.runner.runners.InProcessRunner` (on the
    node's step thread, or in the worker process of fd/engine/runner/worker.py)."""

    loads_lora = True

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        batch_invariant: bool = False,
        progress: bool = False,
        lora_modules: dict[str, str] | None = None,
        max_lora_rank: int | None = None,
        gemms: str | None = None,
        weight_format: str = "float32",
    ):
        """``gemms``: the model's GEMMs (fd/engine/model/llama.py); None: the device's default.
        ``weight_format``: what its dense weights are held and computed in (``float32``,
        ``int8``, ``bfloat16``: fd/engine/model/qgemm.py)."""
        pin_thresholds()  # step buffers on the heap, not fresh mmaps (fd/engine/runner/malloc.py)
        paddle.set_device(device)
        self.device = device
        self.model: Llama = load_model(
            model_dir,
            device,
            progress=progress,
            batch_invariant=batch_invariant,
            gemms=gemms or _gemms(device, batch_invariant),
            weight_format=weight_format,
        )
        release_free()  # (what the load freed: fd/engine/runner/malloc.py)
        self.block_size = block_size
        if num_blocks is None:
            budget = kv_cache_bytes or DEFAULT_KV_CACHE_BYTES["cpu" if device == "cpu" else "gpu"]
            num_blocks = max(1, budget // self.model.kv_bytes_per_block(block_size))
        self.num_blocks = int(num_blocks)
        self.model.allocate_kv_cache(self.num_blocks, block_size)
        plan = self.model.gemm_plan
        if self.model.weight_format != "float32":
            log.info(
                "model GEMMs: %s weights, %s kernels (fd/engine/model/qgemm.py)",
                self.model.weight_format,
                "Paddle's weight-only" if self.model.gpu_weight_only else qgemm.isa(self.model.weight_format),
                extra={"weight_format": self.model.weight_format},
            )
        else:
            log.info(
                "model GEMMs: %s",
                plan if plan.max_threads else f"{self.model.gemms} on Paddle's threads",
                extra={"gemms": self.model.gemms, "gemm_threads": self.model.gemm_threads},
            )
        self.eos_token_ids = _eos_token_ids(model_dir)
        self.max_model_len = self.model.cfg.max_position_embeddings
        self.vocab_size = self.model.cfg.vocab_size
        self.sampler = Sampler(seed, self.eos_token_ids)
        self._last_sampled: dict[str, int] = {}  # what a placeholder in the next step stands for
        self._lost: frozenset[str] = frozenset()  # requests that failed in the step just before
        self._model_dir = model_dir
        self._guides = None  # fd.engine.runner.guided.Guides, made for the first guided request
        # LoRA adapters (vLLM's --lora-modules name=path): loaded now, each in a slot of its own;
        # more at run time (load_lora)
        self.lora_slots: dict[str, int] = {}
        self._max_lora_rank = max_lora_rank
        for name, path in (lora_modules or {}).items():
            self.load_lora(name, path)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(self.lora_slots)

    def load_lora(self, name: str, path: str) -> None:
        """An adapter into a free slot (raises, loading nothing, if it cannot be served)."""
        from fd.engine.model.lora import load_adapter

        adapter = load_adapter(name, path, self.model.cfg, self._max_lora_rank)
        slot = min(set(range(len(self.lora_slots) + 1)) - set(self.lora_slots.values()))
        self.model.add_lora(slot, adapter)
        self.lora_slots[name] = slot

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (no step to come may name it: the engine makes sure)."""
        slot = self.lora_slots.pop(name, None)
        if slot is not None:
            self.model.loras.pop(slot, None)

    # ------------------------------------------------------------------ step

    def execute(self, out: SchedulerOutput, cut: StepCut | None = None) -> RunnerOutput:
        """Run one step. A step that raises is run again one request at a time (:meth:`_isolate`),
        so a request that breaks it fails alone (``RunnerOutput.failed``) and the others get
        their tokens. A request that failed has no token for the placeholder its decode in the
        next step feeds: that share fails at once, without breaking the next step too.
        ``cut``: aborts that land while the step runs (fd/engine/runner/step_cut.py); a request it
        stopped writing has no token, as if the step had left it out, and is not run again."""
        lost, self._lost = self._lost, frozenset()
        doomed: dict[str, str] = {}
        if lost:
            doomed = {
                s.request_id: "its step before failed"
                for s in out.seqs
                if s.request_id in lost and s.token_ids == (PLACEHOLDER,)
            }
            if doomed:
                out = replace(out, seqs=tuple(s for s in out.seqs if s.request_id not in doomed))
        last = self._last_sampled
        try:
            result = self._step(out, cut)
        except Exception:  # noqa: BLE001 - whose it is, the requests one at a time tell
            log.warning(
                "step %d failed; running its %d request(s) one at a time",
                out.step,
                len(out.seqs),
                exc_info=True,
            )
            result = None
        if result is None:  # (out of the handler: each request's failure is told on its own)
            if cut is not None and cut.stopped:  # (their blocks may be another's by now)
                out = replace(out, seqs=tuple(s for s in out.seqs if s.request_id not in cut.stopped))
            result = self._isolate(out, last)
        elif cut is not None and cut.stopped:  # (half-computed: as if left out of the step)
            result = replace(
                result, sampled={r: t for r, t in result.sampled.items() if r not in cut.stopped}
            )
        if doomed:
            result = replace(result, failed={**result.failed, **doomed})
        self._lost = frozenset(result.failed)
        return result

    def _isolate(self, out: SchedulerOutput, last: dict[str, int]) -> RunnerOutput:
        """``out`` again, each request a step of its own from where the failed step began
        (``last``: what its placeholders stand for). Each feeds the same tokens at the same
        positions into its own blocks, so the KV the failed batch may have half written is
        written again as the batch would have; a seeded request samples the same token."""
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        prompt_lp: dict = {}
        embeddings: dict[str, bytes] = {}
        failed: dict[str, str] = {}
        for ss in out.seqs:
            self._last_sampled = last
            try:
                r = self._step(replace(out, seqs=(ss,), num_batched_tokens=len(ss.token_ids)))
            except Exception as e:  # noqa: BLE001 - this request's alone: it ends with an error
                log.warning("request %r failed in step %d", ss.request_id, out.step, exc_info=True)
                failed[ss.request_id] = f"the model step failed for this request: {type(e).__name__}: {e}"
                continue
            sampled.update(r.sampled)
            logprobs.update(r.logprobs)
            prompt_lp.update(r.prompt_logprobs)
            embeddings.update(r.embeddings)
        self._last_sampled = sampled
        return RunnerOutput(
            step=out.step,
            sampled=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            embeddings=embeddings,
            failed=failed,
        )

    def _step(self, out: SchedulerOutput, cut: StepCut | None = None) -> RunnerOutput:
        if not out.seqs:
            return RunnerOutput(step=out.step, sampled={})
        scored: list = []
        batch, sampled = self.prepare(out.seqs, scored)
        if cut is not None:
            batch.new_slots = self._cut_slots(out.seqs, batch, cut)
        embed = [i for i, s in enumerate(sampled) if s.sampling.embed]
        embeddings: dict[str, bytes] = {}
        if scored or embed:
            h = self.model.hidden(batch)
            prompt_lp = self._prompt_logprobs(h, len(sampled), scored) if scored else {}
            logits = self.model.head(h[: self.model.pad_rows(len(sampled))]) if sampled else None
            if embed:  # (row i: sampled[i]'s last token, here its prompt's last)
                rows = h[: len(sampled)].numpy().astype("<f4", copy=False)
                embeddings = {sampled[i].request_id: rows[i].tobytes() for i in embed}
        else:
            logits, prompt_lp = self.model.forward(batch), {}
        if not sampled:
            self._last_sampled = {}
            return RunnerOutput(step=out.step, sampled={}, prompt_logprobs=prompt_lp)
        n = len(sampled)
        guided = [i for i, s in enumerate(sampled) if s.sampling.guided]
        if all(s.sampling.greedy and s.sampling.plain for s in sampled):
            tokens = paddle.argmax(logits, axis=-1).numpy()[:n].tolist()
        else:
            rows = logits.numpy()[:n]
            if guided:
                rows = rows.copy()  # (log-probabilities below are the model's own)
            for i in guided:  # what the request's grammar does not allow next is ruled out
                s = sampled[i]
                allowed = self.guides.allowed(s.request_id, s.sampling.guided, self._seen(s)[1])
                if allowed is not None:  # (None: its grammar has not begun)
                    rows[i][~allowed] = -np.inf
            tokens = self.sampler.sample(
                rows,
                [s.sampling for s in sampled],
                [s.num_generated for s in sampled],
                [
                    self._seen(s) if s.sampling.penalized or s.sampling.bad_words_ids else None
                    for s in sampled
                ],
            )
        if guided or self._guides is not None:
            for i in guided:
                self.guides.took(sampled[i].request_id, tokens[i])
            self.guides.keep_only({sampled[i].request_id for i in guided})
        self._last_sampled = {s.request_id: t for s, t in zip(sampled, tokens, strict=False)}
        wanted = [i for i, s in enumerate(sampled) if s.sampling.logprobs is not None]
        if not wanted:
            return RunnerOutput(
                step=out.step, sampled=self._last_sampled, prompt_logprobs=prompt_lp, embeddings=embeddings
            )
        rows = logits.numpy()[:n]
        return RunnerOutput(
            step=out.step,
            sampled=self._last_sampled,
            logprobs={
                sampled[i].request_id: token_logprobs(rows[i], tokens[i], sampled[i].sampling.logprobs)
                for i in wanted
            },
            prompt_logprobs=prompt_lp,
            embeddings=embeddings,
        )

    def _cut_slots(self, seqs: Sequence[ScheduledSeq], batch: ForwardBatch, cut: StepCut):
        """The model's per-layer question (ForwardBatch.new_slots): the slot mapping with the
        rows of requests ``cut`` stops sent to the trash slot, once they are asked for."""
        spans: dict[str, tuple[int, int]] = {}
        row = 0
        for s in seqs:  # (each request's rows, as prepare() lays them out)
            spans[s.request_id] = (row, row + len(s.token_ids))
            row += len(s.token_ids)
        slots: list[np.ndarray] = []  # the mapping as cut so far

        def new_slots():
            stop = cut.take()
            if not stop:
                return None
            if not slots:
                slots.append(batch.slot_mapping.numpy().copy())
            for rid in stop:
                a, b = spans[rid]
                slots[0][a:b] = self.model.trash_slot
            mapping = self.model.tensor(slots[0])
            cut.stopped_writing(stop)
            return mapping

        return new_slots

    def _prompt_logprobs(self, h, n: int, scored: list) -> dict[str, tuple[int, tuple]]:
        """The prompt tokens' log-probabilities of the seqs that asked, from the hidden rows
        after the ``n`` sampled ones (:meth:`prepare`'s ``scored``). Their logits are made
        SCORE_ROWS rows at a time: a 2,048-token chunk's at once would be 1.2 GB with a 152k
        vocabulary (on the device, then again on the host)."""
        targets = [(s, t) for s, _, ts in scored for t in ts]
        lps: list = []
        for a in range(0, len(targets), SCORE_ROWS):
            part = targets[a : a + SCORE_ROWS]
            rows = self.model.head(h[n + a : n + a + len(part)]).numpy()
            # each with the token's rank in its row, 1 the likeliest (vLLM's prompt_logprobs)
            lps.extend(
                (*token_logprobs(row, t, s.sampling.prompt_logprobs), int((row > row[t]).sum()) + 1)
                for row, (s, t) in zip(rows, part, strict=False)
            )
        out, r = {}, 0
        for s, first, ts in scored:
            out[s.request_id] = (first, tuple(lps[r : r + len(ts)]))
            r += len(ts)
        return out

    @property
    def guides(self):
        if self._guides is None:
            from fd.engine.runner.guided import Guides

            with open(os.path.join(self._model_dir, "tokenizer.json"), encoding="utf-8") as f:
                self._guides = Guides(f.read(), self.vocab_size, self.eos_token_ids)
        return self._guides

    def _seen(self, s: ScheduledSeq) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt, output) tokens of a penalized request so far: the scheduler's, plus the one
        this runner sampled for it in the step just before if the scheduler has not got it yet
        (async scheduling: then the scheduler counts it in ``num_generated`` only)."""
        prompt, output = s.history[: s.num_prompt_tokens], s.history[s.num_prompt_tokens :]
        missing = s.num_generated - len(output)
        if missing:
            last = self._last_sampled.get(s.request_id)
            if missing != 1 or last is None:
                raise RuntimeError(
                    f"{s.request_id!r}: {missing} generated token(s) neither in its "
                    "history nor sampled in the step before (steps out of order?)"
                )
            output += (last,)
        return prompt, output

    def logits(self, out: SchedulerOutput) -> np.ndarray:
        """The logits [num sampled seqs, vocab] of a step (tests and debugging)."""
        batch, sampled = self.prepare(out.seqs)
        return self.model.forward(batch).numpy()[: len(sampled)]

    def warmup(self) -> None:
        """One prefill and one decode through scratch blocks, so first requests do not pay for
        kernel selection and allocator growth. Writes only block 0, which no live request owns
        yet."""
        from fd.control.sampling import SamplingParams

        sp = SamplingParams(temperature=0.0)
        n = min(self.block_size, self.max_model_len - 1)
        for start, toks in ((0, tuple(range(n))), (n - 1, (0,))):
            seq = ScheduledSeq("warmup", toks, start, (0,), True, sp, 0)
            self._step(SchedulerOutput(step=-1, seqs=(seq,)))  # (raises: a model that cannot run)

    # ------------------------------------------------------------------ batch

    def prepare(
        self, seqs: Sequence[ScheduledSeq], scored: list | None = None
    ) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        """The flattened batch of a step, and the seqs to sample for (fd/engine/runner/batch.py)."""
        return build_batch(self.model, self.block_size, seqs, self._last_sampled, self.lora_slots, scored)
