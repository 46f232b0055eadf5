"""The engine node: the I/O shell around the pure scheduler.

Everything that touches Redis, threads or the clock lives here; every decision lives in
:class:`engine.scheduler.Scheduler`. One loop owns the scheduler, so control events (aborts)
and step results are applied in one order, and that order is what the journal records.

The model step runs in a worker thread while the loop keeps reading ``P:control``, claiming
requests and publishing the previous step's events, so a step is genuinely in flight while
aborts arrive. That is the case the abort protocol exists for: an abort that lands during a
step only marks the request; its blocks come back after the step has finished writing them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from control.bus import Bus
from control.keys import ABORTED_OWNER
from control.events import (
    Abort,
    AbortAll,
    AbortRequested,
    BlocksReleased,
    Claimed,
    Drain,
    Drained,
    Event,
    Final,
    Request,
    Tokens,
)
from engine.config import SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.journal import JournalRecorder, journaled
from engine.outputs import RunnerOutput, SchedulerOutput
from engine.scheduler import Scheduler

log = logging.getLogger("engine.node")



class Runner(Protocol):
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


@dataclass
class EngineConfig:
    engine_id: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_waiting: int = 16
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 5
    tombstone_ttl_s: int = 600
    claim_block_ms: int = 50  # idle wait for new requests; never cancelled (DESIGN §6)
    control_block_ms: int = 50
    # A starting engine also reads the control stream's recent past: an abort published while
    # no engine was up must still win over the request it names (tombstone via P:owner).
    control_lookback_ms: int = 30_000
    journal: bool = True  # one P:journal:<engine> entry per step, for `fd replay`


class EngineNode:
    def __init__(self, bus: Bus, control_bus: Bus, runner: Runner, tokenizer: Any,
                 cfg: EngineConfig, metrics: Any = None):
        # Two clients: the control reader blocks on its own connection, so a blocked XREAD
        # never holds up the step loop's XREADGROUP and XADDs.
        self.bus = bus
        self.control_bus = control_bus
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.metrics = metrics
        self.id = cfg.engine_id
        self.sched = journaled(Scheduler(SchedulerConfig(
            num_blocks=runner.num_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=runner.max_model_len,
            eos_token_ids=tuple(runner.eos_token_ids),
            max_num_waiting=cfg.max_num_waiting,
        )), self.id, enabled=cfg.journal, clock=time.time)
        self._entry: dict[str, bytes] = {}  # request id -> its P:requests entry, XACKed at final
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborting: set[str] = set()  # noted while in the in-flight step; tokens discarded
        self._abort_noted_at: dict[str, float] = {}
        self._outbox: list[tuple[str, Event]] = []
        self._expire: list[str] = []
        self._ack: list[bytes] = []
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._stopping = False
        self._draining = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"step-{self.id}")
        self.steps = 0
        self.step_seconds = 0.0
        self._cursor: bytes | None = None
        self._started_ms = int(time.time() * 1000)

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """Create the consumer group and fix the control cursor, before ``run``: anything
        published after this returns is seen by this engine."""
        await self.bus.ensure_group()
        newest = await self.control_bus.control_cursor()
        since = int(time.time() * 1000) - self.cfg.control_lookback_ms
        newest_ms = int(newest.split(b"-")[0])
        self._cursor = newest if newest_ms < since else b"%d-0" % since

    async def run(self) -> None:
        if self._cursor is None:
            await self.prepare()
        cursor = self._cursor
        if isinstance(self.sched, JournalRecorder):
            start = self.sched.start_record()
            await self.bus.publish(self.bus.keys.journal(self.id), replace(start, ts=int(time.time() * 1000)))
        tasks = [
            asyncio.create_task(self._control_loop(cursor), name=f"control-{self.id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.id}"),
        ]
        log.info("engine started", extra={"engine": self.id, "blocks": self.sched.num_total_blocks})
        try:
            await self._step_loop()
        finally:
            self._stopping = True
            await asyncio.gather(*tasks, return_exceptions=True)
            self._pool.shutdown(wait=True)
            log.info("engine stopped", extra={"engine": self.id})

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ------------------------------------------------------------------ step loop

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self.sched.has_work():
                await self._flush()
                if self._draining:
                    break
                await self._claim(block=True)
                continue
            out = self.sched.schedule()
            self._emit(self.sched.take_events())  # preemptions decided by this schedule()
            if out.empty:
                # Work exists but none can run (e.g. waiting for blocks): wait for an event.
                await self._flush()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.01)
                except asyncio.TimeoutError:
                    pass
                continue
            t0 = time.perf_counter()
            fut = loop.run_in_executor(self._pool, self.runner.execute, out)
            # While the step runs: publish what the previous step produced (one pipelined
            # round trip), take new work. The next step starts right after this one.
            await self._flush()
            if await self._claim(block=False):
                await self._flush()  # their `claimed` now, not after this step
            result = await fut
            self.step_seconds += time.perf_counter() - t0
            self.steps += 1
            self._apply(out, result)
        await self._flush()

    async def _claim(self, block: bool) -> int:
        """Take as many requests from ``P:requests`` as the scheduler can admit now (pull-based:
        what this engine cannot start stays in Redis for another engine)."""
        if self._draining or self._stopping:
            return 0
        n = self.sched.can_admit()
        if n <= 0:
            if block:
                await asyncio.sleep(self.cfg.claim_block_ms / 1000)
            return 0
        got = await self.bus.claim_requests(self.id, n, self.cfg.claim_block_ms if block else None)
        for entry_id, req in got:
            await self._admit(entry_id, req)
        return len(got)

    async def _admit(self, entry_id: bytes, req: Request) -> None:
        rid = req.request_id
        won, current = await self.bus.try_own(rid, self.id, self.bus.req_ttl_s)
        if not won:
            # An abort got here first (tombstone): it already wrote the request's final.
            # The request is never prefilled.
            log.info("claim lost", extra={"request_id": rid, "owner": current})
            await self.bus.ack_request(entry_id)
            return
        self._entry[rid] = entry_id
        sp = req.data.sampling
        self._detok[rid] = IncrementalDetokenizer(
            self.tokenizer, stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output)
        self._emit([Claimed(request_id=rid, engine=self.id, attempt=1)])
        self._emit(self.sched.add(rid, req.data))

    def _apply(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """Fold a finished step back in: text first (stop strings end requests), then the
        scheduler's decisions."""
        deltas: dict[str, str] = {}
        stopped: dict[str, str] = {}
        for rid, tok in result.sampled.items():
            if rid in self._aborting or rid not in self._detok:
                continue  # the token of an aborted request is discarded; don't decode it
            delta, stop = self._detok[rid].push((tok,))
            deltas[rid] = delta
            if stop is not None:
                stopped[rid] = stop
        if stopped:
            result = replace(result, stopped={**result.stopped, **stopped})
        evs = self.sched.update(out, result)
        for i, ev in enumerate(evs):
            if isinstance(ev, Tokens) and ev.request_id in deltas:
                evs[i] = replace(ev, text=deltas.pop(ev.request_id))
        self._emit(evs)
        self._publish_gauges()

    # ------------------------------------------------------------------ control

    async def _control_loop(self, cursor: bytes) -> None:
        while not self._stopping:
            try:
                cursor, events = await self.control_bus.read_control(cursor, self.cfg.control_block_ms)
            except Exception:  # Redis hiccup: keep the engine alive, retry shortly
                log.exception("control read failed", extra={"engine": self.id})
                await asyncio.sleep(0.5)
                continue
            for _, ev in events:
                await self._on_control(ev)
            if events:
                await self._flush()
                self._wake.set()

    async def _on_control(self, ev: Event) -> None:
        if isinstance(ev, Abort):
            for rid in ev.request_ids:
                await self._abort(rid, ev.source)
        elif isinstance(ev, AbortAll):
            if ev.engine in (None, "", self.id):
                for rid in list(self._entry):
                    await self._abort(rid, ev.source)
        elif isinstance(ev, Drain):
            # the look-back must not replay a drain meant for an earlier life of this id
            if ev.engine == self.id and ev.ts >= self._started_ms:
                log.info("draining", extra={"engine": self.id})
                self._draining = True

    async def _abort(self, rid: str, source: str) -> None:
        # Counted where the abort takes effect: every engine reads every abort (broadcast),
        # but exactly one engine owns the request or wins its tombstone.
        if self.sched.knows(rid):
            evs = self.sched.abort(rid, source)
            if evs:
                self._count_abort(source)
            self._emit(evs)
            return
        # Not ours (yet): race the claim for it. Whoever wins SET NX decides; if the abort
        # wins, no engine will ever prefill the request and this engine writes its story.
        won, owner = await self.bus.try_own(rid, ABORTED_OWNER, self.cfg.tombstone_ttl_s)
        if not won:
            return  # owned by an engine (it handles it), finished, or already aborted
        self._count_abort(source)
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        self._emit([
            AbortRequested(request_id=rid, source=source),
            Drained(request_id=rid),
            BlocksReleased(request_id=rid, count=0),
            Final(request_id=rid, finish_reason="abort", usage=usage),
        ])

    def _count_abort(self, source: str) -> None:
        if self.metrics is not None:
            self.metrics.abort_requests_total.labels(source=source).inc()

    # ------------------------------------------------------------------ output

    def _emit(self, evs: list[Event]) -> None:
        now = time.time()
        ts = int(now * 1000)
        for ev in evs:
            rid = ev.request_id  # type: ignore[attr-defined]
            if isinstance(ev, (AbortRequested, BlocksReleased, Final)) and rid in self._detok:
                # The request emits no more tokens: text held back (a possible stop-string
                # prefix, an incomplete UTF-8 character) goes out now, before the end of its
                # story, so nothing but the protocol's own events follows abort_requested.
                tail = self._detok.pop(rid).flush()
                if tail:
                    self._outbox.append((self.bus.keys.req(rid), Tokens(
                        request_id=rid, token_ids=(), text=tail, ts=ts, step=self.sched.step)))
            if isinstance(ev, AbortRequested):
                self._abort_noted_at[rid] = now
                if self.sched.in_flight(rid):
                    self._aborting.add(rid)
            elif isinstance(ev, BlocksReleased):
                t = self._abort_noted_at.pop(rid, None)
                if t is not None and self.metrics is not None:
                    self.metrics.abort_release_seconds.observe(now - t)
            elif isinstance(ev, Final):
                self._aborting.discard(rid)
                self._expire.append(self.bus.keys.req(rid))
                self._expire.append(self.bus.keys.owner(rid))
                entry = self._entry.pop(rid, None)
                if entry is not None:
                    self._ack.append(entry)
            fields: dict[str, Any] = {"ts": ts}
            if hasattr(ev, "engine") and not getattr(ev, "engine"):
                fields["engine"] = self.id
            self._outbox.append((self.bus.keys.req(rid), replace(ev, **fields)))

    async def _flush(self) -> None:
        # Both the step loop and the control loop flush (an abort noted mid-step is published
        # at once, not after the step). The lock keeps batches in the order they were made:
        # two pipelines on two pooled connections could otherwise overtake each other.
        async with self._flush_lock:
            if isinstance(self.sched, JournalRecorder):
                entry = self.sched.drain()
                if entry is not None:
                    self._outbox.append((self.bus.keys.journal(self.id),
                                         replace(entry, ts=int(time.time() * 1000))))
            if not self._outbox and not self._ack:
                return
            items, self._outbox = self._outbox, []
            expire, self._expire = self._expire, []
            ack, self._ack = self._ack, []
            await self.bus.publish_many(items, expire=expire, ack=ack)

    def _publish_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        m.kv_blocks_total.set(self.sched.num_total_blocks)
        m.kv_blocks_free.set(self.sched.num_free_blocks)
        m.num_requests_running.set(self.sched.num_running)
        m.num_requests_waiting.set(self.sched.num_waiting)

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            try:
                await self.bus.heartbeat(self.id, self.status(), self.cfg.heartbeat_ttl_s)
            except Exception:
                log.exception("heartbeat failed", extra={"engine": self.id})
            self._publish_gauges()
            for _ in range(int(self.cfg.heartbeat_s / 0.05)):
                if self._stopping:
                    break
                await asyncio.sleep(0.05)

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.id,
            "blocks_total": self.sched.num_total_blocks,
            "blocks_free": self.sched.num_free_blocks,
            "running": self.sched.num_running,
            "waiting": self.sched.num_waiting,
            "step": self.sched.step,
            "draining": int(self._draining),
            "ts": int(time.time() * 1000),
        }
