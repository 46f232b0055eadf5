"""The engine's core: the one object that owns the scheduler and decides every step, in one
place, :meth:`EngineCore.step` (vLLM v1's ``EngineCore.step``, nano-vllm's ``LLMEngine.step``).

Everything that changes a request's state in the scheduler comes in through an inbox and is
applied at one point of each step, in one order: the runner's replies (a step's result, or a
queued step that left aborting requests out), then arrivals (requests admission has owned and
announced), then aborts (from ``P:control``, the fence, the watchdog, a drain's hand-back).
The scheduler is then asked for the next step, which goes to the runner. So the order the
scheduler hears things in is the order the journal records, and no other code in the engine
calls ``schedule()``.

With async scheduling the runner holds two steps: step N+1 is decided and queued while step N
runs, so the model never waits for this loop. An abort of a request a step in flight holds
comes back from the scheduler as data (``Aborted.drop``), and the runner is told to leave it
out of the step it has not started; its blocks come back once no step in flight holds them.

The core does no Redis I/O and keeps no network state: its events go to ``emit`` (the node's
:class:`~fd.engine.node.emitter.Emitter`), which the node's loop publishes around each step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeAlias

from fd.control.events import BlocksReleased, Event, Tokens
from fd.control.request_data import RequestData
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.core.protocol import SchedulerLike
from fd.engine.node.request_table import RequestTable
from fd.engine.node.step_driver import StepFailed
from fd.engine.runner.runners import Skipped

log = logging.getLogger("fd.engine.node.node")


#: What the runner says of a step, in the order it says it.
Reply: TypeAlias = RunnerOutput | Skipped | StepFailed


class Driver(Protocol):
    """How steps reach the runner: fd/engine/node/step_driver.py's for the engine node (a
    worker process, or the step thread), fd/engine/runner/llm.py's for offline generation."""

    def start(self, loop: Any, reply: Callable[[Reply], None]) -> None: ...
    def submit(self, out: SchedulerOutput) -> None: ...
    def drop(self, step: int, request_ids: list[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request admission has owned: it joins the scheduler once its ``claimed`` is out."""

    data: RequestData
    generated: tuple[int, ...] = ()  # what its client already has (a takeover, a hand-back)


@dataclass(frozen=True, slots=True)
class AbortOrder:
    request_id: str
    source: str
    error: str | None = None  # a failure (the watchdog's timeout, lost output), said in its final
    counted: bool = True  # in fd_abort_requests_total{source} if it takes effect


@dataclass(slots=True)
class Stepped:
    """What one :meth:`EngineCore.step` did: whether it handed the runner a step, and the
    requests a drain handed back, with the KV blocks each released (for its ``preempted``
    note)."""

    decided: bool = False
    handed_back: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        sched: SchedulerLike,
        driver: Driver,
        requests: RequestTable,
        emit: Callable[..., None],
        counted: Callable[[str], None],
        moved: Callable[[], None],
        wake: asyncio.Event,
    ) -> None:
        self.sched = sched
        self.driver = driver
        self.requests = requests
        self.emit = emit  # events out (fd.engine.node.emitter.Emitter.emit)
        self.counted = counted  # an abort took effect here: fd_abort_requests_total{source}
        # The scheduler's counts changed (a step folded in, or one decided, which takes blocks):
        # the engine's gauges follow, so /metrics shows the blocks the scheduler holds now.
        self.moved = moved
        self.depth = sched.config.max_steps_in_flight
        #: steps handed to the runner whose results are not folded in yet, oldest first, with
        #: when each started to count (the one behind the running one: when that one ended)
        self.flying: deque[tuple[SchedulerOutput, float]] = deque()
        self._replies: deque[Reply] = deque()
        self._arrivals: dict[str, Arrival] = {}
        self._aborts: deque[AbortOrder] = deque()
        #: set by every inbox, and by whoever wants the loop to look again (stop, drain)
        self.wake = wake
        self.steps = 0
        self.step_seconds = 0.0
        # Tokens folded in so far: prompt tokens computed (a recompute's too) and tokens
        # sampled, for the throughput line.
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.driver.start(loop, self.reply)

    # ------------------------------------------------------------------ inboxes

    def reply(self, reply: Reply) -> None:
        """The runner's word on a step (fd.engine.node.step_driver), in the order it came."""
        self._replies.append(reply)
        self.wake.set()

    def arrive(self, request_id: str, data: RequestData, generated: tuple[int, ...] = ()) -> None:
        self._arrivals[request_id] = Arrival(data, generated)
        self.wake.set()

    def abort(self, request_id: str, source: str, error: str | None = None, *, counted: bool = True) -> None:
        self._aborts.append(AbortOrder(request_id, source, error, counted))
        self.wake.set()

    # ------------------------------------------------------------------ what it knows

    def knows(self, request_id: str) -> bool:
        """The scheduler has it, or will at the next step."""
        return request_id in self._arrivals or self.sched.knows(request_id)

    def can_admit(self) -> int:
        return self.sched.can_admit() - len(self._arrivals)

    def has_work(self) -> bool:
        return bool(self._arrivals) or self.sched.has_work()

    @property
    def aborts_pending(self) -> bool:
        return bool(self._aborts)

    def room(self, ahead: int) -> bool:
        """The next :meth:`step` decides a step: fewer than ``ahead`` will be in flight once
        the results already in are folded."""
        done = sum(1 for r in self._replies if isinstance(r, RunnerOutput))
        return len(self.flying) - done < ahead

    async def wait(self, timeout: float | None) -> None:
        """Until an inbox has something (or ``timeout``)."""
        if timeout is None:
            await self.wake.wait()
            return
        # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that
        # comes as the wait ends (CPython gh-86296), and a cancelled engine (fd serve's
        # shutdown, a test's kill) would go on running.
        try:
            async with asyncio.timeout(timeout):
                await self.wake.wait()
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ the step

    def step(self, ahead: int, drain: Callable[[], Iterable[str]] | None = None) -> Stepped:
        """One step of the engine: apply what came in, in one order, then decide the next step
        and hand it to the runner if fewer than ``ahead`` are in flight. ``drain``: while the
        engine drains, what it hands back now, asked only with no step in flight (so their
        blocks come back at once)."""
        self.wake.clear()  # (what comes in from here on wakes the next wait)
        stepped = Stepped()
        moved = bool(self._replies)
        # 1. The runner's replies, in order: a Skipped note comes before its step's result.
        while self._replies:
            reply = self._replies.popleft()
            if isinstance(reply, StepFailed):
                raise reply.error  # a failed step or a dead worker ends the engine's loop
            if isinstance(reply, Skipped):
                self.emit(self.sched.skipped(reply.step, reply.request_ids))
            else:
                self._fold(reply)
        # 2. Arrivals whose `claimed` is on their stream (RequestTable.unannounced): no step
        # runs a request before that, so a poison request counts as an attempt.
        unannounced = self.requests.unannounced
        for rid in [r for r in self._arrivals if r not in unannounced]:
            a = self._arrivals.pop(rid)
            self.emit(self.sched.add(rid, a.data, a.generated))
        # 3. Aborts; one of a request still arriving waits for it.
        events: list[Event] = []
        drop: list[str] = []
        for _ in range(len(self._aborts)):
            order = self._aborts.popleft()
            if order.request_id in self._arrivals:
                self._aborts.append(order)
                continue
            got = self.sched.abort(order.request_id, order.source, order.error)
            if got.events and order.counted:
                self.counted(order.source)
            events += got.events
            drop += got.drop
        for rid in drain() if drain is not None and not self.flying else ():
            if not self.sched.knows(rid):
                continue  # (it ended: an abort just applied)
            live = self.requests.get(rid)
            if live is not None:
                live.silent = True  # its next owner writes its story
            got = self.sched.abort(rid, "engine")
            stepped.handed_back[rid] = sum(e.count for e in got.events if isinstance(e, BlocksReleased))
            events += got.events
        self.emit(events)
        if drop:
            # A step queued behind the running one may not have started: the runner leaves
            # these out of it, and their blocks come back after the running step instead.
            self.driver.drop(self.sched.step, drop)
        # 4. The next step, behind those in flight.
        if len(self.flying) < ahead:
            out = self.sched.schedule()
            self.emit(list(out.events))  # preemptions decided by this schedule()
            if not out.empty:
                self.flying.append((out, time.perf_counter()))
                self.driver.submit(out)
                stepped.decided = True
                moved = True
        if moved:
            self.moved()
        return stepped

    # ------------------------------------------------------------------ folding a result in

    def _fold(self, result: RunnerOutput) -> None:
        """A step's result: the runner is done with its KV blocks (``finished``: what only
        it held is released first), then its tokens, text first (stop strings end requests),
        then the scheduler's decisions."""
        out, t0 = self.flying.popleft()
        now = time.perf_counter()
        self.step_seconds += now - t0
        if self.flying:  # the next one was queued behind this one: its time starts now
            nxt, nt0 = self.flying[0]
            self.flying[0] = (nxt, max(nt0, now))
        self.steps += 1
        self.emit(self.sched.finished(result.step, result.ran))
        deltas: dict[str, str] = {}
        stopped: dict[str, str] = {}
        failed: dict[str, str] = {}
        requests = self.requests
        for rid, tok in result.sampled.items():
            live = requests.get(rid)
            if live is None or live.detok is None or self.sched.discards(rid):
                continue  # aborted, or finished while this step ran: its token is dropped
            try:
                delta, stop = live.detok.push((tok,))
            except Exception as e:  # noqa: BLE001 - this request's alone: it ends with an error
                log.exception("detokenizing failed", extra={"request_id": rid})
                live.detok = None  # (nothing more to flush from it)
                failed[rid] = f"detokenizing token {tok} failed: {type(e).__name__}: {e}"
                continue
            deltas[rid] = delta
            if stop is not None:
                stopped[rid] = stop
        if failed:
            result = replace(
                result,
                sampled={r: t for r, t in result.sampled.items() if r not in failed},
                failed={**result.failed, **failed},
            )
        if stopped:
            result = replace(result, stopped={**result.stopped, **stopped})
        for rid, (first, entries) in result.prompt_logprobs.items():
            live = requests.get(rid)
            got = None if live is None else live.prompt_lp
            if got is not None:  # (a recompute after a preemption scores it again: kept once)
                for j, entry in enumerate(entries):
                    got.setdefault(first + j, entry)
        self.generation_tokens += len(result.sampled)
        # (a decode feeds one token, the last sampled; what else a step feeds is prompt)
        self.prompt_tokens += out.num_batched_tokens - sum(1 for ss in out.seqs if ss.num_generated)
        evs = self.sched.update(out, result)
        mono = time.monotonic()
        for ev in evs:
            if type(ev) is Tokens and (live := requests.get(ev.request_id)) is not None:
                live.progress = mono
        self.emit(evs, deltas, result.logprobs, result.embeddings)
