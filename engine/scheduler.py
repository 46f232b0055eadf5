"""The engine's sans-IO core: decides each step's batch and narrates every request's life.

Inputs are calls (a request arrived, an abort arrived, a step finished); outputs are the next
batch (:class:`SchedulerOutput`) and :mod:`control.events` values. No clock, no I/O, no
randomness: the same calls give the same outputs, so a journal of them replays a run.

Exactly one step is in flight at a time: ``schedule()`` hands a batch to the runner, and until
``update()`` folds its result back, the runner may still be writing the KV blocks of every
request in it. That is why an abort of a request in the in-flight step only marks it
(``AbortRequested``) and waits for ``update()`` to say ``Drained`` before the blocks go back:
handing them to another request earlier would let the still-running step overwrite its KV.

Events ``schedule()`` produces (``Preempted``, and the ``Final`` of a request that outgrew the
whole pool) cannot be returned with the batch, so they are held and put at the front of the
next list any call returns (``take_events()``, ``update()``, ``abort()``, ``add()``...): call
``take_events()`` right after ``schedule()`` to publish them promptly. Nothing is lost or
reordered either way.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

from control.events import (AbortRequested, BlocksReleased, Drained, Event, Final, Preempted,
                            RequestData, Tokens)
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self._seqs: dict[str, Sequence] = {}  # every unfinished request, in arrival order
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # sorted by arrival: the last is preempted first
        self._in_flight: SchedulerOutput | None = None
        self._in_flight_ids: dict[str, ScheduledSeq] = {}
        self._pending: list[Event] = []
        self._arrivals = 0
        self.step = 0

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

    def knows(self, request_id: str) -> bool:
        return request_id in self._seqs

    def in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight_ids

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def can_admit(self) -> int:
        """How many more requests to claim now.

        Claiming is pull-based, so a request this engine cannot start soon is better left in
        Redis for another engine. Bounded by free running slots, by a small waiting queue,
        and by the blocks not already spoken for by the waiting requests' prompts (each new
        request needs at least one block).
        """
        cfg = self.config
        slots = cfg.max_num_seqs - len(self._running) - len(self._waiting)
        queue = cfg.max_num_waiting - len(self._waiting)
        committed = sum(self.blocks.blocks_for(s.num_tokens + 1) for s in self._waiting)
        spare_blocks = self.blocks.num_free - committed
        return max(0, min(slots, queue, spare_blocks))

    def take_events(self) -> list[Event]:
        """Events produced by ``schedule()`` (preemptions) not yet returned by another call."""
        return self._take()

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state, for debugging and ``fd replay --at STEP``."""
        return {
            "step": self.step,
            "num_total_blocks": self.blocks.num_total,
            "num_free_blocks": self.blocks.num_free,
            "in_flight": list(self._in_flight_ids),
            "running": [s.request_id for s in self._running],
            "waiting": [s.request_id for s in self._waiting],
            "requests": [
                {
                    "request_id": s.request_id,
                    "status": s.status.value,
                    "arrival": s.arrival,
                    "num_prompt_tokens": s.num_prompt_tokens,
                    "num_output_tokens": s.num_output_tokens,
                    "num_computed_tokens": s.num_computed_tokens,
                    "num_preemptions": s.num_preemptions,
                    "aborting": s.aborting,
                    "block_table": list(self.blocks.table(s.request_id)),
                }
                for s in self._seqs.values()
            ],
        }

    # ------------------------------------------------------------------ arrivals

    def add(self, request_id: str, data: RequestData,
            generated: tuple[int, ...] = ()) -> list[Event]:
        """Admit a claimed request. A prompt that can never run is finished with ``error``.

        ``generated``: tokens another engine already produced and published for it (a
        failover or a drain hand-back). They count as output, not prompt, so ``max_tokens``,
        ``usage`` and the per-token seeded sampling go on where the other engine stopped; the
        first prefill simply recomputes them, as after a preemption.
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already in this scheduler")
        events = self._take()
        n = len(data.prompt_token_ids)
        total = n + len(generated)
        error = None
        if n == 0:
            error = "empty prompt"
        elif n + 1 > self.config.max_model_len:
            error = (f"prompt has {n} tokens; max_model_len {self.config.max_model_len} leaves "
                     "no room to generate")
        elif self.config.vocab_size and max(data.prompt_token_ids) >= self.config.vocab_size:
            error = (f"prompt token id {max(data.prompt_token_ids)} is outside the model's "
                     f"vocabulary of {self.config.vocab_size}")
        elif self.blocks.blocks_for(n + 1) > self.blocks.num_total:
            error = (f"prompt has {n} tokens; the KV cache holds only "
                     f"{self.blocks.num_total * self.blocks.block_size}")
        if error is not None:
            usage = {"prompt_tokens": n, "completion_tokens": len(generated),
                     "total_tokens": total}
            events.append(Final(request_id=request_id, finish_reason="error", usage=usage,
                                error=error))
            return events
        seq = Sequence(request_id, tuple(data.prompt_token_ids), data.sampling, self._arrivals)
        self._arrivals += 1
        if generated:
            seq.token_ids.extend(int(t) for t in generated)
            # Already done (the other engine died between its last token and its final), or
            # no longer fits the pool: finish now rather than recompute for nothing.
            reason, stop_reason = self._finish_reason(seq, seq.token_ids[-1], None)
            if reason is None and self.blocks.blocks_for(total + 1) > self.blocks.num_total:
                reason = "length"
            if reason is not None:
                seq.status = Status.FINISHED
                events.append(BlocksReleased(request_id=request_id, count=0, step=self.step))
                events.append(Final(request_id=request_id, finish_reason=reason,
                                    usage=seq.usage(), stop_reason=stop_reason))
                return events
        self._seqs[request_id] = seq
        self._waiting.append(seq)
        return events

    # ------------------------------------------------------------------ aborts

    def abort(self, request_id: str, source: str) -> list[Event]:
        """Stage 1 of the abort protocol, and stages 2-3 too if no step is writing its blocks."""
        events = self._take()
        seq = self._seqs.get(request_id)
        if seq is None or seq.aborting is not None:
            return events  # unknown, finished, or already being aborted: nothing to do
        events.append(AbortRequested(request_id=request_id, source=source, step=self.step))
        if request_id in self._in_flight_ids:
            seq.aborting = source  # update() drains and releases it
            return events
        events.append(Drained(request_id=request_id, step=self.step, discarded_tokens=0))
        self._release(seq, "abort", None, events, self.step)
        return events

    def abort_all(self, source: str) -> list[Event]:
        events = self._take()
        for rid in list(self._seqs):
            events.extend(self.abort(rid, source))
        return events

    # ------------------------------------------------------------------ steps

    def schedule(self) -> SchedulerOutput:
        """The next step's batch: decodes first, then unfinished prefills, then waiting (FCFS).

        Running requests that need a block take it from the most recently arrived running
        request (recompute preemption). A request that alone holds the whole pool and still
        needs a block is finished with ``length``: the KV cache is its context limit.
        """
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step} is still in flight; update() it first")
        cfg = self.config
        self.step += 1
        step = self.step
        budget = cfg.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        scheduled: dict[str, None] = {}

        decoding = [s for s in self._running if s.is_decoding]
        prefilling = [s for s in self._running if not s.is_decoding]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            want = min(seq.num_uncomputed, budget)
            if not seq.is_decoding:
                want = self._cap_chunk(want)
            while True:
                n = want
                if not seq.is_decoding:
                    n = min(n, self._room(seq))  # a smaller chunk beats preempting someone
                end = seq.num_computed_tokens + n
                if n > 0 and self.blocks.shortfall(seq.request_id, end) == 0:
                    break
                victim = next(s for s in reversed(self._running) if s.request_id not in scheduled)
                if victim is not seq:
                    self._preempt(victim, step)
                    continue
                if not batch and len(self._running) == 1:
                    self._release(seq, "length", None, self._pending, step)
                else:
                    self._preempt(seq, step)
                n = 0
                break
            if n == 0:
                continue
            self.blocks.ensure(seq.request_id, seq.num_computed_tokens + n)
            batch.append((seq, n))
            scheduled[seq.request_id] = None
            budget -= n

        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            need = seq.num_uncomputed
            n = self._cap_chunk(min(need, budget))
            # Start a prompt only when the free blocks hold all of it, even if it runs in chunks:
            # one started on the last few blocks would be preempted again as soon as a decode
            # needs one (and a request preempted in this very step would take its own blocks
            # back). Strict FCFS: nobody overtakes the head of the queue.
            if self._room(seq) < need or (n < need and not cfg.enable_chunked_prefill):
                break
            self._waiting.popleft()
            self.blocks.ensure(seq.request_id, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            bisect.insort(self._running, seq, key=lambda s: s.arrival)
            batch.append((seq, n))
            scheduled[seq.request_id] = None
            budget -= n

        seqs = tuple(self._scheduled_seq(seq, n) for seq, n in batch)
        out = SchedulerOutput(step=step, seqs=seqs,
                              num_batched_tokens=cfg.max_num_batched_tokens - budget)
        if seqs:
            self._in_flight = out
            self._in_flight_ids = {s.request_id: s for s in seqs}
        return out

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Event]:
        """Fold the in-flight step's results in: emit tokens, finish, and drain aborts."""
        events = self._take()
        if out.empty and self._in_flight is None:
            return events
        if self._in_flight is None or out.step != self._in_flight.step:
            expected = None if self._in_flight is None else self._in_flight.step
            raise RuntimeError(f"update() for step {out.step}; the step in flight is {expected}")
        if result.step != out.step:
            raise ValueError(f"runner output is for step {result.step}, not {out.step}")
        step = out.step
        self._in_flight = None
        self._in_flight_ids = {}
        for ss in out.seqs:
            seq = self._seqs[ss.request_id]
            if seq.aborting is not None:
                discarded = 1 if ss.sample and ss.request_id in result.sampled else 0
                events.append(Drained(request_id=seq.request_id, step=step,
                                      discarded_tokens=discarded))
                self._release(seq, "abort", None, events, step)
                continue
            seq.num_computed_tokens += len(ss.token_ids)
            if not ss.sample:
                continue
            if ss.request_id not in result.sampled:
                raise ValueError(f"runner output for step {step} has no token for {ss.request_id}")
            token = int(result.sampled[ss.request_id])
            seq.token_ids.append(token)
            events.append(Tokens(request_id=seq.request_id, token_ids=(token,), step=step))
            reason, stop_reason = self._finish_reason(seq, token, result.stopped.get(ss.request_id))
            if reason is not None:
                self._release(seq, reason, stop_reason, events, step)
        return events

    # ------------------------------------------------------------------ internals

    def _take(self) -> list[Event]:
        events, self._pending = self._pending, []
        return events

    def _cap_chunk(self, n: int) -> int:
        t = self.config.long_prefill_threshold
        return min(n, t) if t and self.config.enable_chunked_prefill else n

    def _room(self, seq: Sequence) -> int:
        """Tokens past the computed ones that the held plus the free blocks can hold."""
        held = self.blocks.num_held(seq.request_id) + self.blocks.num_free
        return held * self.blocks.block_size - seq.num_computed_tokens

    def _scheduled_seq(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=tuple(seq.token_ids[start:start + n]),
            start_pos=start,
            block_table=self.blocks.table(seq.request_id),
            sample=start + n == seq.num_tokens,
            sampling=seq.sampling,
            num_generated=seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence, step: int) -> None:
        count = self.blocks.free(seq.request_id) if self.blocks.owns(seq.request_id) else 0
        self._running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)  # victims go latest-first, so the front stays FCFS
        self._pending.append(Preempted(request_id=seq.request_id, count=count, step=step))

    def _finish_reason(self, seq: Sequence, token: int, stop_string: str | None):
        sp = seq.sampling
        if token in sp.stop_token_ids:
            return "stop", str(token)
        if not sp.ignore_eos and token in self.config.eos_token_ids:
            return "stop", None
        if stop_string is not None:
            return "stop", stop_string
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    def _release(self, seq: Sequence, reason: str, stop_reason: str | None,
                 events: list[Event], step: int) -> None:
        """Give the blocks back, then say so, then the request's one Final."""
        count = self.blocks.free(seq.request_id) if self.blocks.owns(seq.request_id) else 0
        if seq.status is Status.RUNNING:
            self._running.remove(seq)
        elif seq.status is Status.WAITING:
            self._waiting.remove(seq)
        seq.status = Status.FINISHED
        del self._seqs[seq.request_id]
        events.append(BlocksReleased(request_id=seq.request_id, count=count, step=step))
        events.append(Final(request_id=seq.request_id, finish_reason=reason, usage=seq.usage(),
                            stop_reason=stop_reason))
