"""The engine's sans-IO core: decides each step's batch and narrates every request's life.

Inputs are calls (a request arrived, an abort arrived, a step finished); outputs are the next
batch (:class:`SchedulerOutput`) and :mod:`fd.control.events` values. No clock, no I/O, no
randomness: the same calls give the same outputs, so a journal of them replays a run.

A step is in flight from ``schedule()`` handing its batch to the runner until ``update()``
folds its result back; meanwhile the runner may still be writing the KV blocks of every request
in it. That is why an abort of a request in an in-flight step only marks it
(``AbortRequested``) and waits for the ``update()`` of the last step holding it to say
``Drained`` before the blocks go back: handing them to another request earlier would let the
still-running step overwrite its KV.

Async scheduling (``max_steps_in_flight=2``): step N+1 is decided while step N runs, so the
runner goes from one step to the next without waiting for the engine loop. A decode in N+1
feeds :data:`~fd.engine.core.sequence.PLACEHOLDER` for the token N samples (the runner fills it in).
Such a speculative ``schedule()`` never preempts (the victim's blocks may be in use by step N):
if a decision needs that, it stops there and refuses to schedule ahead again until nothing is
in flight, when an ordinary ``schedule()`` makes it. A request that finishes in ``update(N)``
(EOS, a stop string) while N+1 holds it is finished like an abort: its token from N+1 is
dropped and its blocks and ``Final`` wait for ``update(N+1)``. Known ends (``max_tokens``, the
context) are not scheduled past. A request whose share of a step failed (``RunnerOutput.failed``)
finishes the same way, with ``finish_reason="error"``; the others in the step go on.

Every call returns the events it made: ``schedule()`` in its batch (``SchedulerOutput.events``:
``Preempted``, and the ``Final`` of a request that outgrew the whole pool), the others as a
list. How a request's story ends is built by :mod:`fd.control.endings`, as everywhere else.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

from fd.control import endings
from fd.control.events import Event, Preempted, Tokens
from fd.control.request_data import RequestData
from fd.engine.core import finish
from fd.engine.core.admission import claimable, refusal
from fd.engine.core.block_manager import BlockManager
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import Aborted, RunnerOutput, ScheduledSeq, SchedulerOutput
from fd.engine.core.prefix_cache import PrefixCache
from fd.engine.core.sequence import Sequence, Status
from fd.engine.core.shares import share
from fd.engine.core.snapshot import snapshot


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self._prefix = PrefixCache(self.blocks, config.enable_prefix_caching)
        self._seqs: dict[str, Sequence] = {}  # every unfinished request, in arrival order
        self._waiting: deque[Sequence] = deque()
        self._by_priority = config.scheduling_policy == "priority"
        self._running: list[Sequence] = []  # sorted by arrival: the last is preempted first
        self._in_flight: deque[SchedulerOutput] = deque()  # oldest first
        self._in_flight_ids: dict[str, int] = {}  # request id -> in-flight steps holding it
        # step -> aborting requests that in-flight step no longer holds: the runner left them
        # out (skipped()) or has finished the step (finished()); update() passes over them
        self._skipped: dict[int, set[str]] = {}
        # aborting requests that in-flight steps still hold, in the order their aborts came
        # (a dict, not a set: the order of the events finished() emits must replay exactly)
        self._aborting: dict[str, None] = {}
        # A speculative schedule() met a decision (preemption) that needs no step in flight.
        self._stalled = False
        self._arrivals = 0
        self.step = 0
        # prefix caching: prompt tokens looked up in the cache at admission, and found there
        self.num_cache_queries = 0
        self.num_cache_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.blocks.num_total

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks the prefix cache holds (in use or free): prefixes a new request can share."""
        return self.blocks.num_cached

    def cached_block_hashes(self) -> list[bytes]:
        """The hashes of the blocks the prefix cache holds, for the placement card."""
        return self.blocks.cached_hashes()

    @property
    def num_draining(self) -> int:
        """Aborted requests whose blocks wait for the runner to finish a step holding them."""
        return len(self._aborting)

    def knows(self, request_id: str) -> bool:
        return request_id in self._seqs

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight_ids

    def discards(self, request_id: str) -> bool:
        """The next token folded back for this request will be dropped (it is being aborted,
        or it finished while a later step held it): not worth detokenizing."""
        seq = self._seqs.get(request_id)
        return seq is not None and seq.done

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def can_admit(self) -> int:
        """How many more requests to claim now (fd/engine/core/admission.py)."""
        return claimable(self.config, self.blocks, len(self._running), self._waiting)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state, for debugging and ``fd replay --at STEP``."""
        return snapshot(
            self.step,
            self.blocks,
            self._in_flight,
            self._in_flight_ids,
            self._running,
            self._waiting,
            self._seqs.values(),
        )

    # ------------------------------------------------------------------ arrivals

    def add(self, request_id: str, data: RequestData, generated: tuple[int, ...] = ()) -> list[Event]:
        """Admit a claimed request. A prompt that can never run is finished with ``error``.

        ``generated``: tokens another engine already produced and published for it (a
        failover or a drain hand-back). They count as output, not prompt, so ``max_tokens``,
        ``usage`` and the per-token seeded sampling go on where the other engine stopped; the
        first prefill simply recomputes them, as after a preemption.
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in this scheduler")
        events: list[Event] = []
        n = len(data.prompt_token_ids)
        total = n + len(generated)
        error = refusal(data, self.config, self.blocks)
        if error is not None:
            events.append(endings.error_final(request_id, endings.usage(n, len(generated)), error))
            return events
        seq = Sequence(request_id, tuple(data.prompt_token_ids), data.sampling, self._arrivals, data.priority)
        self._arrivals += 1
        if generated:
            seq.token_ids.extend(int(t) for t in generated)
            # Already done (the other engine died between its last token and its final), or
            # no longer fits the pool: finish now rather than recompute for nothing.
            reason, stop_reason = finish.reason(seq, seq.token_ids[-1], None, self.config)
            if reason is None and self.blocks.blocks_for(total + 1) > self.blocks.num_total:
                reason = "length"
            if reason is not None:
                seq.status = Status.FINISHED
                events += endings.release(request_id, 0, self.step, reason, seq.usage(), stop_reason)
                return events
        self._seqs[request_id] = seq
        self._wait(seq)
        return events

    # ------------------------------------------------------------------ aborts

    def abort(self, request_id: str, source: str, error: str | None = None) -> Aborted:
        """Stage 1 of the abort protocol, and stages 2-3 too if no step is writing its blocks.
        ``error``: why, when the abort is a failure rather than a wish (the watchdog's
        timeout): the same stages, and a ``final`` that says ``error`` with it. The request is
        in the answer's ``drop`` while a step in flight holds it."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.done:
            return Aborted()  # unknown, finished (maybe awaiting a step), already aborting: no-op
        events: list[Event] = [endings.abort_requested(request_id, source, self.step)]
        seq.error = error
        if request_id in self._in_flight_ids:
            seq.aborting = source  # finished() or update() drains and releases it
            self._aborting[request_id] = None
            return Aborted(events, (request_id,))
        self._drain(seq, events, self.step)  # (nothing discarded: no step held it)
        return Aborted(events)

    def abort_all(self, source: str) -> Aborted:
        out = Aborted()
        for rid in list(self._seqs):
            out += self.abort(rid, source)
        return out

    def finished(self, step: int, ran: tuple[int, int] | None = None) -> list[Event]:
        """The runner has finished every step up to ``step``: their results are in, not yet
        folded back (the engine loop may be busy with the last one's tokens for a while).
        None of them writes KV any more, so an aborting request that no later step holds
        drains and releases now; its tokens from those steps are dropped when ``update()``
        folds them in. Only the release moves: the events of the requests that go on, and
        their order, are the same as without this call. ``ran`` (when the runner ran ``step``,
        wall ms) is for the journal; nothing here reads it."""
        events: list[Event] = []
        for rid in [r for r in self._aborting if r in self._in_flight_ids]:
            seq = self._seqs[rid]
            held = [
                (o, ss)
                for o in self._in_flight
                for ss in o.seqs
                if ss.request_id == rid and rid not in self._skipped.get(o.step, ())
            ]
            if any(o.step > step for o, _ in held):
                continue  # a step still running (or queued) writes its KV
            for o, ss in held:
                self._skipped.setdefault(o.step, set()).add(rid)
                if ss.sample:
                    seq.num_discarded += 1  # computed, and dropped
                self._leave(seq, ss)
            self._drain(seq, events, step)
        return events

    def skipped(self, step: int, request_ids: tuple[str, ...] | list[str]) -> list[Event]:
        """In-flight ``step`` writes none of these aborting requests' blocks any more: the
        runner started it without them (it was told of their abort before it began the step),
        or stopped writing theirs as it ran (fd/engine/runner/step_cut.py). Once no other step holds them
        they drain and release now, not when it returns; that step's result has no token for
        them."""
        events: list[Event] = []
        out = next((o for o in self._in_flight if o.step == step), None)
        if out is None:
            return events  # already folded in (the news came late): nothing to gain
        skipped = self._skipped.setdefault(step, set())
        for ss in out.seqs:
            rid = ss.request_id
            seq = self._seqs.get(rid)
            if rid not in request_ids or rid in skipped or seq is None or seq.aborting is None:
                continue  # only an aborting request may be left out: its tokens are dropped
            skipped.add(rid)
            if not self._leave(seq, ss):
                self._drain(seq, events, step)
        return events

    # ------------------------------------------------------------------ steps

    def schedule(self) -> SchedulerOutput:
        """The next step's batch: decodes first, then unfinished prefills, then waiting (FCFS).

        Running requests that need a block take it from the most recently arrived running
        request (recompute preemption). A request that alone holds the whole pool and still
        needs a block is finished with ``length``: the KV cache is its context limit.
        """
        cfg = self.config
        if len(self._in_flight) >= cfg.max_steps_in_flight:
            raise RuntimeError(f"step {self._in_flight[-1].step} is still in flight; update() it first")
        speculative = bool(self._in_flight)
        if speculative and self._stalled:
            return SchedulerOutput(step=self.step, seqs=())  # wait for the steps in flight
        events: list[Event] = []
        self._stalled = False
        self.step += 1
        step = self.step
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        scheduled: dict[str, None] = {}

        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for s in self._running:
            (decoding if s.is_decoding else prefilling).append(s)
        # Prompt tokens this step may still compute: the whole budget, or beside decodes the
        # cap (SchedulerConfig.prefill_per_decode), counted once the decodes are in.
        prefill_left = budget
        decodes_in = False
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if not seq.is_decoding and not decodes_in:
                decodes_in = True
                prefill_left = self._prefill_room(batch, budget)
            if seq.status is not Status.RUNNING or seq.done:
                continue  # preempted earlier in this loop; or only waiting for a step in flight
            if seq.num_pending and finish.ends_on_pending(seq, self.config):
                continue  # its pending token is its last: finished when that step is folded in
            want = min(seq.num_unscheduled, budget)
            if want == 0:
                continue
            decode = seq.is_decoding
            if not decode:
                want = self._cap_chunk(min(want, prefill_left))
                if want == 0:
                    break  # (the cap is spent; the rest are prefills too, and must not preempt)
            while True:
                n = want
                if not decode:
                    n = min(n, self._room(seq))  # a smaller chunk beats preempting someone
                end = seq.num_scheduled + n
                if n > 0 and self.blocks.shortfall(seq.request_id, end) == 0:
                    break
                if speculative:  # a victim's blocks may be in use by the step in flight
                    self._stalled = True
                    break
                victim = next(s for s in reversed(self._running) if s.request_id not in scheduled)
                if victim is not seq:
                    self._preempt(victim, step, events)
                    continue
                if not batch and len(self._running) == 1:
                    self._release(seq, "length", None, events, step)
                else:
                    self._preempt(seq, step, events)
                n = 0
                break
            if self._stalled:
                break
            if n == 0:
                continue
            self.blocks.ensure(seq.request_id, seq.num_scheduled + n)
            batch.append((seq, n))
            scheduled[seq.request_id] = None
            budget -= n
            if not decode:
                prefill_left -= n

        if not decodes_in:
            prefill_left = self._prefill_room(batch, budget)
        while (
            self._waiting
            and budget > 0
            and prefill_left > 0
            and len(self._running) < cfg.max_num_seqs
            and not self._stalled
        ):
            seq = self._waiting[0]
            hit = self._prefix.cached_prefix(seq)
            need = seq.num_unscheduled - len(hit) * self.blocks.block_size
            n = self._cap_chunk(min(need, budget, prefill_left))
            # Start a prompt only when the free blocks hold all of it, even if it runs in chunks:
            # one started on the last few blocks would be preempted again as soon as a decode
            # needs one (and a request preempted in this very step would take its own blocks
            # back). Strict FCFS: nobody overtakes the head of the queue. (Cached blocks it
            # takes that are free now are not free for the rest of it.)
            room = self._room(seq) - self.blocks.num_free_among(hit) * self.blocks.block_size
            if room < need or (n < need and not cfg.enable_chunked_prefill):
                break
            self._waiting.popleft()
            if hit:  # computed already: it starts after them, and they are registered
                self.blocks.acquire(seq.request_id, hit)
                seq.num_registered = len(hit)
                seq.num_computed_tokens = len(hit) * self.blocks.block_size
            if cfg.enable_prefix_caching:
                self.num_cache_queries += seq.num_tokens
                self.num_cache_hits += seq.num_computed_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.blocks.ensure(seq.request_id, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            bisect.insort(self._running, seq, key=self._order)
            batch.append((seq, n))
            scheduled[seq.request_id] = None
            budget -= n
            prefill_left -= n

        seqs = tuple(self._scheduled_seq(seq, n) for seq, n in batch)
        out = SchedulerOutput(
            step=step, seqs=seqs, num_batched_tokens=cfg.max_num_batched_tokens - budget, events=tuple(events)
        )
        if seqs:
            self._in_flight.append(out)
            ids = self._in_flight_ids
            for ss in seqs:
                ids[ss.request_id] = ids.get(ss.request_id, 0) + 1
        return out

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Event]:
        """Fold the oldest in-flight step's results in: emit tokens, finish, drain aborts."""
        events: list[Event] = []
        if out.empty:
            return events
        if not self._in_flight or out.step != self._in_flight[0].step:
            expected = self._in_flight[0].step if self._in_flight else None
            raise RuntimeError(f"update() for step {out.step}; the oldest step in flight is {expected}")
        if result.step != out.step:
            raise ValueError(f"runner output is for step {result.step}, not {out.step}")
        skipped = self._skipped.pop(out.step, ())
        failed = result.failed
        for ss in out.seqs:
            if ss.request_id in skipped:
                continue
            if (
                ss.sample
                and not self._seqs[ss.request_id].done
                and ss.request_id not in result.sampled
                and ss.request_id not in failed
            ):
                raise ValueError(f"runner output for step {out.step} has no token for {ss.request_id}")
        step = out.step
        self._in_flight.popleft()
        for ss in out.seqs:
            rid = ss.request_id
            if rid in skipped:
                continue  # accounted for (and maybe released): left out, or let go at finished()
            seq = self._seqs[rid]
            later = self._leave(seq, ss)  # steps after this one that still hold the request
            if seq.done:
                if ss.sample and rid in result.sampled:
                    seq.num_discarded += 1
                if later:
                    continue
                if seq.aborting is not None:
                    self._drain(seq, events, step)
                else:
                    assert seq.finishing is not None  # (done, and not aborting)
                    finish_reason, finish_stop = seq.finishing
                    self._release(seq, finish_reason, finish_stop, events, step)
                continue
            if rid in failed:
                # Its KV of this step may be half written: nothing of it is kept or cached.
                # Like any finish, its blocks wait for a later step that still holds it.
                seq.error = failed[rid]
                if later:
                    seq.finishing = ("error", None)
                else:
                    self._release(seq, "error", None, events, step)
                continue
            seq.num_computed_tokens += len(ss.token_ids)
            self._prefix.register(seq)
            if not ss.sample:
                continue
            token = int(result.sampled[rid])
            seq.token_ids.append(token)
            events.append(Tokens(request_id=rid, token_ids=(token,), step=step))
            reason, stop_reason = finish.reason(seq, token, result.stopped.get(rid), self.config)
            if reason is not None:
                if later:  # the next step computes one more token for it: drop that one
                    seq.finishing = (reason, stop_reason)
                else:
                    self._release(seq, reason, stop_reason, events, step)
        return events

    # ------------------------------------------------------------------ internals

    def _prefill_room(self, batch: list[tuple[Sequence, int]], budget: int) -> int:
        """The prompt tokens a step whose decodes are ``batch`` may compute: the budget left,
        capped at ``prefill_per_decode`` tokens per decode (a KV block's worth at least) when it
        has any decode (and chunked prefill, without which a prompt cannot be sliced)."""
        per = self.config.prefill_per_decode
        if per and batch and self.config.enable_chunked_prefill:
            return min(budget, max(self.config.block_size, per * len(batch)))
        return budget

    def _cap_chunk(self, n: int) -> int:
        t = self.config.long_prefill_threshold
        return min(n, t) if t and self.config.enable_chunked_prefill else n

    def _room(self, seq: Sequence) -> int:
        """Tokens past the scheduled ones that the held plus the free blocks can hold."""
        held = self.blocks.num_held(seq.request_id) + self.blocks.num_free
        return held * self.blocks.block_size - seq.num_scheduled

    def _scheduled_seq(self, seq: Sequence, n: int) -> ScheduledSeq:
        """Its share of the step being made, which is in flight from now (:meth:`_leave`)."""
        ss = share(seq, n, self.blocks.table(seq.request_id))
        seq.num_in_flight += n
        if ss.sample:
            seq.num_pending += 1
        return ss

    def _leave(self, seq: Sequence, ss: ScheduledSeq) -> int:
        """One in-flight step is done with ``seq`` (folded in, or run without it): returns
        how many later in-flight steps still hold it."""
        ids = self._in_flight_ids
        later = ids[ss.request_id] - 1
        if later:
            ids[ss.request_id] = later
        else:
            del ids[ss.request_id]
        seq.num_in_flight -= len(ss.token_ids)
        if ss.sample:
            seq.num_pending -= 1
        return later

    def _drain(self, seq: Sequence, events: list[Event], step: int) -> None:
        """Stages 2 and 3 of an abort: no step can write its blocks any more."""
        self._aborting.pop(seq.request_id, None)
        events.append(endings.drained(seq.request_id, step, seq.num_discarded))
        self._release(seq, "abort" if seq.error is None else "error", None, events, step)

    def _order(self, seq: Sequence) -> tuple[int, int]:
        """Who starts first and is preempted last: by arrival, or with the priority policy by
        (priority, arrival)."""
        return (seq.priority if self._by_priority else 0, seq.arrival)

    def _wait(self, seq: Sequence) -> None:
        """Into the waiting queue: at its end (fcfs: the newest arrival), or in its place by
        :meth:`_order`."""
        if not self._by_priority:
            self._waiting.append(seq)
            return
        key = self._order(seq)
        at = next((i for i, s in enumerate(self._waiting) if self._order(s) > key), len(self._waiting))
        self._waiting.insert(at, seq)

    def _preempt(self, seq: Sequence, step: int, events: list[Event]) -> None:
        count = self.blocks.free(seq.request_id) if self.blocks.owns(seq.request_id) else 0
        self._running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = seq.num_registered = 0
        seq.num_preemptions += 1
        if self._by_priority:
            self._wait(seq)
        else:
            self._waiting.appendleft(seq)  # victims go latest-first, so the front stays FCFS
        events.append(Preempted(request_id=seq.request_id, count=count, step=step))

    def _release(
        self, seq: Sequence, reason: str, stop_reason: str | int | None, events: list[Event], step: int
    ) -> None:
        """Give the blocks back, then say so, then the request's one Final."""
        count = self.blocks.free(seq.request_id) if self.blocks.owns(seq.request_id) else 0
        if seq.status is Status.RUNNING:
            self._running.remove(seq)
        elif seq.status is Status.WAITING:
            self._waiting.remove(seq)
        seq.status = Status.FINISHED
        del self._seqs[seq.request_id]
        error = seq.error if reason == "error" else None
        events += endings.release(seq.request_id, count, step, reason, seq.usage(), stop_reason, error)
