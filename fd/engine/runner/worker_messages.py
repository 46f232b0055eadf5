"""What crosses the model worker's pipe (fd/engine/runner/worker.py), both ways, and the pipe's
form of a step.

The engine sends commands (:data:`Command`; None, like the pipe closing, stops the worker);
the worker answers with replies: :class:`Ready` once, then :class:`StepDone`, :class:`Warmed`,
:class:`Failed`, and the :class:`~fd.engine.runner.runners.Skipped` and
:class:`~fd.engine.runner.runners.LoraDone` notes every pipelined runner gives.

Every message is a NamedTuple: it pickles as a tuple and one reference to its class, where a
frozen dataclass goes through ``__getstate__``/``__setstate__`` in Python. A step is sent every
step: with 32 rows (2.6 kB, ~13 µs to pickle and ~9 µs to unpickle as a bare tuple) a
NamedTuple adds ~40 bytes and ~1.5 µs each way, a frozen dataclass ~3 µs each way. The rows
themselves stay plain tuples: as NamedTuples they doubled to tripled the step's pickling.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput

#: A :class:`ScheduledSeq` on the pipe: its fields in order, its SamplingParams by number.
SeqRow: TypeAlias = tuple[
    str,  # request_id
    tuple[int, ...],  # token_ids
    int,  # start_pos
    tuple[int, ...],  # block_table
    bool,  # sample
    int,  # the number of its SamplingParams (Step.new, now or in a step before)
    int,  # num_generated
    tuple[int, ...],  # history
    int,  # num_prompt_tokens
    int,  # prompt_len
    int | None,  # prompt_next
]

# ---------------------------------------------------------------------- engine -> worker


class Step(NamedTuple):
    """Run a step (:class:`StepEncoder`'s form of a :class:`SchedulerOutput`)."""

    step: int
    num_batched_tokens: int
    reset: bool  # forget every SamplingParams numbered so far, before taking ``new``
    new: list[tuple[int, SamplingParams]]  # SamplingParams not sent before, and their numbers
    seqs: list[SeqRow]


class Drop(NamedTuple):
    """Leave these aborting requests out of every queued step up to ``step``, and stop the
    running one writing their KV (fd/engine/runner/step_cut.py)."""

    step: int
    request_ids: tuple[str, ...]


class LoadLora(NamedTuple):
    """Load adapter ``name`` from ``path``, between steps; answered with a LoraDone."""

    name: str
    path: str


class UnloadLora(NamedTuple):
    """Forget adapter ``name``, between steps; answered with a LoraDone."""

    name: str


class Warmup(NamedTuple):
    """Warm the model up; answered with :class:`Warmed`."""


#: What the engine sends the worker.
Command: TypeAlias = Step | Drop | LoadLora | UnloadLora | Warmup

# ---------------------------------------------------------------------- worker -> engine


class Ready(NamedTuple):
    """The worker's first reply: the model is loaded, and these are its limits."""

    num_blocks: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    lora_names: tuple[str, ...]
    cpus: list[int]


class StepDone(NamedTuple):
    """A step's result as it crosses the pipe: a plain tuple of :class:`RunnerOutput`'s
    fields (a dataclass would pickle through copyreg), and the seconds the step took."""

    step: int
    sampled: dict[str, int]
    stopped: dict[str, str]
    ran: tuple[int, int] | None
    logprobs: dict[str, Any]
    prompt_logprobs: dict[str, Any]
    embeddings: dict[str, bytes]
    failed: dict[str, str]
    busy_s: float

    def output(self) -> RunnerOutput:
        return RunnerOutput(
            step=self.step,
            sampled=self.sampled,
            stopped=self.stopped,
            ran=self.ran,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            embeddings=self.embeddings,
            failed=self.failed,
        )


class Warmed(NamedTuple):
    """The warm-up is done."""


class Failed(NamedTuple):
    """The worker failed outside a step (to start, or a warm-up): its traceback."""

    error: str


# ---------------------------------------------------------------------- a step's pipe form


class StepEncoder:
    """The pipe's form of a step: plain tuples, which pickle in C, instead of dataclasses,
    which pickle through copyreg (7% of ``fd serve``'s loop at 8 streams went to pickling
    steps); and each request's SamplingParams sent once, then named by a number. Bounded: past
    ``MAX_PARAMS`` the worker is told to forget them all and they are sent again."""

    MAX_PARAMS = 4096

    def __init__(self) -> None:
        # id(params) -> (number, params: kept alive, so the id is not reused)
        self._keys: dict[int, tuple[int, SamplingParams]] = {}
        self._next = 0

    def encode(self, out: SchedulerOutput) -> Step:
        keys = self._keys
        reset = len(keys) > self.MAX_PARAMS
        if reset:
            keys.clear()
            self._next = 0
        new = []
        seqs: list[SeqRow] = []
        for ss in out.seqs:
            sp = ss.sampling
            known = keys.get(id(sp))
            if known is None or known[1] is not sp:
                known = keys[id(sp)] = (self._next, sp)
                self._next += 1
                new.append((known[0], sp))
            seqs.append(
                (
                    ss.request_id,
                    ss.token_ids,
                    ss.start_pos,
                    ss.block_table,
                    ss.sample,
                    known[0],
                    ss.num_generated,
                    ss.history,
                    ss.num_prompt_tokens,
                    ss.prompt_len,
                    ss.prompt_next,
                )
            )
        return Step(out.step, out.num_batched_tokens, reset, new, seqs)


class StepDecoder:
    """The worker's side of :class:`StepEncoder`: decodes steps in the order sent, so its
    table of SamplingParams is the encoder's."""

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}

    def decode(self, msg: Step) -> SchedulerOutput:
        params = self._params
        if msg.reset:
            params.clear()
        for key, sp in msg.new:
            params[key] = sp
        return SchedulerOutput(
            step=msg.step,
            num_batched_tokens=msg.num_batched_tokens,
            seqs=tuple(
                ScheduledSeq(
                    rid,
                    toks,
                    start,
                    table,
                    sample,
                    params[key],
                    gen,
                    history,
                    num_prompt,
                    prompt_len,
                    prompt_next,
                )
                for rid, toks, start, table, sample, key, gen, history, num_prompt, prompt_len, prompt_next in msg.seqs
            ),
        )
