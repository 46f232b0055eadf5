"""The engine journal: every state-changing scheduler call, in order, with a digest of its result.

The scheduler is pure and deterministic, so its calls are the whole story of a run: feed the
same calls to a fresh :class:`~fd.engine.core.scheduler.Scheduler` and it must decide the same batches
and emit the same events. :class:`JournalRecorder` wraps the scheduler with the same API and
writes down, per call, its inputs and a compact digest of its outputs; the node drains them
once per step into one ``P:journal:<engine>`` entry (:class:`fd.control.events.JournalStep`)
published in the step's one pipelined round trip. ``fd replay`` (:mod:`fd.engine.journal.replay`)
re-executes the calls and compares digests.

Format of one call (JSON, in ``JournalStep.data["calls"]``)::

    {"op": "add", "rid": ..., "data": RequestData.to_json(), "ev": [...], "free": n}
        (plus "gen": [token ids] when the request resumes another engine's generation)
    {"op": "abort", "rid": ..., "source": ..., ["error": ...,] "ev": [...], "free": n}
    {"op": "abort_all", "source": ..., "ev": [...], "free": n}
    {"op": "schedule", "out": [step, num_batched_tokens, [seq...]], "ev": [...], "free": n}
    {"op": "skip", "step": n, "rids": [...], "ev": [...], "free": n}
        (the runner left these aborting requests out of in-flight step n)
    {"op": "finished", "step": n, "ev": [...], "free": n}
        (the runner finished every step up to n, results not folded in yet: as each result
        comes in, and again as an abort is heard for a request only finished steps hold;
        with "ran": [start ms, end ms] when the runner said when it ran step n, informational)
    {"op": "update", "step": out.step, "rstep": result.step, "sampled": {...}, "stopped": {...},
     "ev": [...], "free": n}
        (with "failed": {rid: error} when requests' shares of the step failed)

With a clock, every call also has ``"t"`` (wall ms; informational, never compared).
A call that raised has ``"raised": "<ExceptionType>"`` instead of ``ev``/``out``. ``free`` is
the free block count after the call: with the block tables in the batch digests it lets the
journal alone prove (or disprove) that no block leaked, without re-executing anything.

Digests are lists of JSON scalars (no tuples), so a digest read back from JSON compares equal
to one computed afresh. A scheduled seq is ``[rid, start_pos, n_tokens, sample, base, new]``:
its block table is the first ``base`` blocks of the table last recorded for ``rid`` plus the
``new`` ones, so a decode step costs a few ints per request, not its whole table.

What is not recorded: read-only queries (``can_admit``, ``knows``...). The events
``schedule()`` returns in its batch (``SchedulerOutput.events``) are digested with it, as the
``ev`` of its call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fd.control.events import (
    AbortRequested,
    BlocksReleased,
    Drained,
    Event,
    Final,
    JournalStart,
    JournalStep,
    Preempted,
    Tokens,
)
from fd.control.request_data import RequestData
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import Aborted, RunnerOutput, SchedulerOutput
from fd.engine.core.protocol import SchedulerLike
from fd.engine.core.scheduler import Scheduler


def config_to_json(cfg: SchedulerConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_json(d: dict[str, Any]) -> SchedulerConfig:
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    # (a journal's JSON: each value as the field it names takes it; eos_token_ids a tuple again)
    fields: dict[str, Any] = {
        k: (tuple(v) if k == "eos_token_ids" else v) for k, v in d.items() if k in known
    }
    return SchedulerConfig(**fields)


# --------------------------------------------------------------------------- digests


#: one event or one batch, as the journal writes it down (JSON values)
Digest = list[Any]


def _tokens(e: Tokens) -> Digest:
    return ["tokens", e.request_id, list(e.token_ids), e.step]


def _preempted(e: Preempted) -> Digest:
    return ["preempted", e.request_id, e.count, e.step]


def _abort_requested(e: AbortRequested) -> Digest:
    return ["abort_requested", e.request_id, e.source, e.step]


def _drained(e: Drained) -> Digest:
    return ["drained", e.request_id, e.discarded_tokens, e.step]


def _blocks_released(e: BlocksReleased) -> Digest:
    return ["blocks_released", e.request_id, e.count, e.step]


def _final(e: Final) -> Digest:
    return [
        "final",
        e.request_id,
        e.finish_reason,
        e.usage.get("completion_tokens", 0),
        e.stop_reason,
        e.error,
    ]


_EVENT_DIGESTS: dict[type[Event], Callable[[Any], Digest]] = {
    Tokens: _tokens,
    Preempted: _preempted,
    AbortRequested: _abort_requested,
    Drained: _drained,
    BlocksReleased: _blocks_released,
    Final: _final,
}


def digest_event(e: Event) -> Digest:
    f = _EVENT_DIGESTS.get(type(e))
    if f is None:  # an event type this module does not know yet: still compared, by value
        return [e.TYPE, getattr(e, "request_id", ""), repr(e)]
    return f(e)


class Digester:
    """Turns call results into digests. Stateful only for the block-table deltas, so the
    recorder and a replay each keep one and, fed the same history, produce equal digests."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, ...]] = {}  # rid -> block table last recorded

    def events(self, evs: list[Event]) -> list[Digest]:
        if not evs:
            return []
        out: list[Digest] = []
        tables = self.tables
        for e in evs:
            if type(e) is Tokens:  # the common case, inlined
                out.append(["tokens", e.request_id, list(e.token_ids), e.step])
                continue
            out.append(digest_event(e))
            if isinstance(e, (Preempted, BlocksReleased)):
                tables.pop(e.request_id, None)
        return out

    def batch(self, out: SchedulerOutput) -> Digest:
        tables = self.tables
        seqs: Digest = []
        append = seqs.append
        for s in out.seqs:
            rid = s.request_id
            table = s.block_table
            prev = tables.get(rid)
            if prev is None:
                base = 0
            elif table == prev:  # a decode inside its last block: nothing new
                append([rid, s.start_pos, len(s.token_ids), s.sample, len(table), []])
                continue
            else:
                n = len(prev)
                base = n if n <= len(table) and table[:n] == prev else 0
            tables[rid] = table
            append([rid, s.start_pos, len(s.token_ids), s.sample, base, list(table[base:])])
        return [out.step, out.num_batched_tokens, seqs]


# --------------------------------------------------------------------------- recorder


class JournalRecorder:
    """A :class:`Scheduler` that writes down what it is told and what it decides.

    Same API as the scheduler, so the node swaps one for the other; ``drain()`` once per step
    hands back the step's :class:`JournalStep` (the node stamps ``ts`` when it publishes).
    """

    def __init__(self, scheduler: Scheduler, engine_id: str = "", clock: Callable[[], float] | None = None):
        self.scheduler = scheduler
        self.engine_id = engine_id
        # Optional wall clock (e.g. time.time): stamps each call with "t" (ms) so abort-to-
        # release latency is measured per call, not per entry. Never compared by replay.
        self._clock = clock
        self._calls: list[dict[str, Any]] = []
        self._digest = Digester()
        self._seq = 0

    # ------------------------------------------------------------------ journal

    def start_record(self) -> JournalStart:
        """The segment header; publish it before the first step's entry."""
        return JournalStart(engine=self.engine_id, config=config_to_json(self.scheduler.config))

    def drain(self) -> JournalStep | None:
        """The calls recorded since the last drain as one entry, or None if there were none."""
        if not self._calls:
            return None
        calls, self._calls = self._calls, []
        ev = JournalStep(
            engine=self.engine_id, step=self.scheduler.step, seq=self._seq, data={"calls": calls}
        )
        self._seq += 1
        return ev

    # ------------------------------------------------------------------ read-only queries

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def step(self) -> int:
        return self.scheduler.step

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.scheduler.num_total_blocks

    @property
    def num_cache_queries(self) -> int:
        return self.scheduler.num_cache_queries

    @property
    def num_cache_hits(self) -> int:
        return self.scheduler.num_cache_hits

    @property
    def num_cached_blocks(self) -> int:
        return self.scheduler.num_cached_blocks

    def cached_block_hashes(self) -> list[bytes]:
        return self.scheduler.cached_block_hashes()

    @property
    def num_draining(self) -> int:
        return self.scheduler.num_draining

    def knows(self, request_id: str) -> bool:
        return self.scheduler.knows(request_id)

    def in_flight(self, request_id: str) -> bool:
        return self.scheduler.in_flight(request_id)

    def discards(self, request_id: str) -> bool:
        return self.scheduler.discards(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def can_admit(self) -> int:
        return self.scheduler.can_admit()

    def snapshot(self) -> dict[str, Any]:
        return self.scheduler.snapshot()

    # ------------------------------------------------------------------ recorded calls

    def _record(self, call: dict[str, Any], fn: Callable[..., list[Event]], *args: Any) -> list[Event]:
        if self._clock is not None:
            call["t"] = int(self._clock() * 1000)
        try:
            evs = fn(*args)
        except Exception as e:
            call["raised"] = type(e).__name__
            call["free"] = self.scheduler.num_free_blocks
            self._calls.append(call)
            raise
        call["ev"] = self._digest.events(evs)
        call["free"] = self.scheduler.num_free_blocks
        self._calls.append(call)
        return evs

    def add(self, request_id: str, data: RequestData, generated: tuple[int, ...] = ()) -> list[Event]:
        call: dict[str, Any] = {"op": "add", "rid": request_id, "data": data.to_json()}
        if generated:  # a resumed request (failover, drain hand-back)
            call["gen"] = [int(t) for t in generated]
        return self._record(call, self.scheduler.add, request_id, data, tuple(generated))

    def abort(self, request_id: str, source: str, error: str | None = None) -> Aborted:
        call: dict[str, Any] = {"op": "abort", "rid": request_id, "source": source}
        if error is not None:
            call["error"] = error
        return self._record_aborted(call, lambda: self.scheduler.abort(request_id, source, error))

    def abort_all(self, source: str) -> Aborted:
        return self._record_aborted(
            {"op": "abort_all", "source": source}, lambda: self.scheduler.abort_all(source)
        )

    def _record_aborted(self, call: dict[str, Any], fn: Callable[[], Aborted]) -> Aborted:
        got: list[Aborted] = []

        def events() -> list[Event]:
            got.append(fn())
            return got[0].events

        self._record(call, events)
        return got[0]

    def schedule(self) -> SchedulerOutput:
        call: dict[str, Any] = {"op": "schedule"}
        if self._clock is not None:
            call["t"] = int(self._clock() * 1000)
        s = self.scheduler
        try:
            out = s.schedule()
        except Exception as e:
            call["raised"] = type(e).__name__
            call["free"] = s.num_free_blocks
            self._calls.append(call)
            raise
        # events before the batch: a victim preempted and re-admitted in this very step must
        # have its old table forgotten before its new one is recorded
        call["ev"] = self._digest.events(list(out.events))
        call["out"] = self._digest.batch(out)
        call["free"] = s.num_free_blocks
        self._calls.append(call)
        return out

    def finished(self, step: int, ran: tuple[int, int] | None = None) -> list[Event]:
        call: dict[str, Any] = {"op": "finished", "step": step}
        if ran is not None:
            call["ran"] = list(ran)
        return self._record(call, self.scheduler.finished, step, ran)

    def skipped(self, step: int, request_ids: tuple[str, ...] | list[str]) -> list[Event]:
        return self._record(
            {"op": "skip", "step": step, "rids": list(request_ids)},
            self.scheduler.skipped,
            step,
            list(request_ids),
        )

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Event]:
        call: dict[str, Any] = {
            "op": "update",
            "step": out.step,
            "rstep": result.step,
            "sampled": {k: int(v) for k, v in result.sampled.items()},
            "stopped": dict(result.stopped),
        }
        if result.failed:
            call["failed"] = dict(result.failed)
        return self._record(call, self.scheduler.update, out, result)


def journaled(
    scheduler: Scheduler, engine_id: str = "", enabled: bool = True, clock: Callable[[], float] | None = None
) -> SchedulerLike:
    """The scheduler the node should drive: recorded, or bare when the journal is off."""
    return JournalRecorder(scheduler, engine_id, clock) if enabled else scheduler
