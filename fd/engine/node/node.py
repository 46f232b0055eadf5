"""The engine node: the I/O shell around the engine core and its pure scheduler.

Everything that touches Redis, threads or the clock lives in the node and the objects it is
built from (named on :class:`EngineNode`); every decision lives in
:class:`fd.engine.core.scheduler.Scheduler`, which one object owns and steps
(:class:`fd.engine.node.engine_core.EngineCore`): control events (aborts), arrivals and step
results wait in its inboxes and are applied at one point of each step, in one order, and that
order is what the journal records. The node's loop (:meth:`EngineNode._step_loop`) does the I/O
around each step.

The model step runs on the runner (a worker process, or the step thread) while the loop keeps
reading ``P:control``, claiming requests and publishing the previous step's events, so a step
is genuinely in flight while aborts arrive. With async scheduling (the default) the next step
is decided and queued behind the running one before its results come back, so two can be in
flight. That is the case the abort protocol exists for: an abort that lands during a step
only marks the request; its blocks come back after the step has finished writing them.

Faults (DESIGN.md §1, issue 7):

- Redis going away is a pause. Every Redis call in the loops survives a connection error: it
  is logged, retried with backoff, and the engine's state (scheduler, KV blocks, the events
  not yet published) waits meanwhile. Published events are never lost or repeated
  (:mod:`fd.engine.node.outbox`).
- A dead engine's requests are taken over by a live one, which continues them from the tokens
  already on their streams (:mod:`fd.engine.node.failover`); a request that failed ``max_attempts``
  times ends with ``final finish_reason=error``.
- Every write to a request's story is fenced (fd/control/fence.py): it lands only while the
  request's owner key holds this engine's owner token for it. An engine whose write is refused,
  or that finds its ownership taken at a heartbeat (it was thought dead: a long pause, a
  partition), drops the request without another word: the new owner writes its story.
- Drain (``type=drain engine=<id>``, or SIGTERM in ``fd engine``): claim nothing new, hand back
  what never started, let running requests finish for ``drain_timeout_s``, hand back the rest,
  exit. A handed-back request is re-queued on ``P:requests`` and continued by whichever engine
  claims it, after a ``preempted handback=1`` note on its stream.
- A request with no progress (no token) for ``request_timeout_s`` is aborted through the
  scheduler (``abort_requested source=timeout``) and ends with ``final finish_reason=error``.
- A step that raises never ends the engine: the requests whose share failed (the runner says
  which, ``RunnerOutput.failed``; a runner that cannot tell fails the whole step) end with
  ``final finish_reason=error``, and the rest go on (DESIGN.md §4b).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from fd.control.bus import Bus
from fd.control.events import (
    Abort,
    AbortAll,
    Drain,
    Event,
    LoadLora,
    UnloadLora,
)
from fd.engine.core.adapters import Adapters
from fd.engine.core.scheduler import Scheduler
from fd.engine.journal.journal import JournalRecorder, journaled
from fd.engine.node.aborts import AbortCounter, Aborts
from fd.engine.node.admission import Admission
from fd.engine.node.control_reader import ControlReader
from fd.engine.node.drain import Draining
from fd.engine.node.emitter import Emitter
from fd.engine.node.engine_core import EngineCore
from fd.engine.node.failover import OrphanFinder
from fd.engine.node.heartbeat import Heartbeat
from fd.engine.node.lanes import CardWriter, LaneClaims
from fd.engine.node.node_config import EngineConfig
from fd.engine.node.publisher import Publisher
from fd.engine.node.redis_link import RETRYABLE, RedisLink, Stopped
from fd.engine.node.request_table import RequestTable
from fd.engine.node.step_driver import StepDriver
from fd.engine.runner.lora_runtime import LoraLoader
from fd.engine.runner.runners import Runner

log = logging.getLogger("fd.engine.node.node")


class EngineNode:
    """One engine: the scheduler, and the objects around it that do its I/O — claiming and
    starting requests (:class:`~fd.engine.node.admission.Admission`), aborts
    (:class:`~fd.engine.node.aborts.Aborts`), the engine core that decides each step
    (:class:`~fd.engine.node.engine_core.EngineCore`) and its driver of the runner
    (:class:`~fd.engine.node.step_driver.StepDriver`), a drain (:class:`~fd.engine.node.drain.
    Draining`), events to the outbox (:class:`~fd.engine.node.emitter.Emitter`) and out to Redis
    (:class:`~fd.engine.node.publisher.Publisher`), the heartbeat (:class:`~fd.engine.node.heartbeat.
    Heartbeat`), the control stream's reader (:class:`~fd.engine.node.control_reader.ControlReader`). The node runs the loops that drive them, in one order."""

    def __init__(
        self,
        bus: Bus,
        control_bus: Bus,
        runner: Runner,
        tokenizer: Any,
        cfg: EngineConfig,
        metrics: Any = None,
        stats_interval_s: float = 0.0,
    ):
        """``stats_interval_s``: log vLLM's throughput line this often while busy (0: never)."""
        # Two clients: the control reader blocks on its own connection, so a blocked XREAD
        # never holds up the step loop's XREADGROUP and XADDs.
        self.bus = bus
        self.control_bus = control_bus
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.metrics = metrics
        self.id = cfg.engine_id
        self.sched = journaled(
            Scheduler(
                cfg.scheduler_config(
                    num_blocks=runner.num_blocks,
                    eos_token_ids=runner.eos_token_ids,
                    vocab_size=runner.vocab_size,
                    model_max_len=runner.max_model_len,
                )
            ),
            self.id,
            enabled=cfg.journal,
            clock=time.time,
        )
        context, kv = self.sched.config.max_model_len, runner.num_blocks * cfg.block_size
        if kv < context:  # (vLLM refuses to start; here such a request ends early instead)
            log.warning(
                "the KV cache holds %d tokens, fewer than the context of %d: a request "
                "that outgrows it ends with finish_reason length (give --max-model-len "
                "%d, or more --kv-cache-mb)",
                kv,
                context,
                kv,
                extra={"engine": cfg.engine_id},
            )
        # The step loop, waiting for a reply, an arrival, an abort, blocks: look again.
        self._wake = asyncio.Event()
        self._stopping = False
        # Every request this engine runs, its owner tokens, and aborts it remembers.
        self.requests = RequestTable()
        self.link = RedisLink(
            self.id, cfg.retry_backoff_s, cfg.retry_backoff_max_s, stopping=lambda: self._stopping
        )
        journal = self.sched if isinstance(self.sched, JournalRecorder) else None
        self.publisher = Publisher(
            bus, self.id, self.requests, self.link, lambda r, why: self.aborts.lose(r, why), journal
        )
        self._drain = Draining(
            self.id, bus, self.link, self.sched, self.requests, self.publisher, cfg.drain_timeout_s
        )
        self.heartbeat = Heartbeat(
            self.id,
            bus,
            self.sched,
            self.requests,
            self.link,
            self.status,
            lambda r, why: self.aborts.lose(r, why),
            self._wake,
            cfg.heartbeat_s,
            cfg.heartbeat_ttl_s,
            metrics,
        )
        # The step thread: an in-process runner's steps, and LoRA loads between them.
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"step-{self.id}")
        self.adapters = Adapters(tuple(runner.lora_names))  # LoRA (fd.engine.core.adapters)
        self.lora = LoraLoader(runner, pool, self.adapters, self.id, self.heartbeat.beat_now)
        self.emitter = Emitter(
            self.id,
            bus.keys,
            self.publisher,
            self.requests,
            self.sched,
            self.adapters,
            self.lora,
            metrics,
            released=self.heartbeat.publish_gauges,
        )
        self._emit = self.emitter.emit
        counter = AbortCounter(metrics)
        self.driver = StepDriver(runner, self.id, pool, self.lora.done)
        # The one owner of the scheduler: every step is decided in EngineCore.step.
        self.core = EngineCore(
            self.sched,
            self.driver,
            self.requests,
            self._emit,
            counter.count,
            self.heartbeat.publish_gauges,
            self._wake,
        )
        self.aborts = Aborts(
            self.id,
            bus,
            self.core,
            self.requests,
            self.link,
            self.publisher,
            self._emit,
            counter,
            cfg.tombstone_ttl_s,
        )
        self.admission = Admission(
            cfg,
            bus,
            self.core,
            self.requests,
            self.link,
            self.publisher,
            self._emit,
            self.aborts,
            self.adapters,
            tokenizer,
            closed=lambda: self._draining or self._stopping,
            lanes=LaneClaims(bus, self.id, cfg.steal_after_ms),
        )
        lanes = self.admission.lanes
        self.card = CardWriter(bus, self.id, self.sched, cfg.heartbeat_ttl_s, alone=lambda: not lanes.peers)
        self._task: asyncio.Task | None = None
        self._noted_busy = False  # the last load noted on P:lifecycle was a busy one
        self._leaving: asyncio.Task | None = None  # a drain's release of its lane
        self._orphans = OrphanFinder(bus, self.id, cfg.failover_idle_ms)
        self.control = ControlReader(
            self.id,
            control_bus,
            self.link,
            self._on_control,
            self._flush,
            self._wake,
            lambda: self._stopping,
            cfg.control_block_ms,
            cfg.retry_backoff_s,
        )
        self.stats_interval_s = stats_interval_s
        self._cursor: bytes | None = None
        self._started_ms = int(time.time() * 1000)

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """Create the consumer group and fix the control cursor, before ``run``: anything
        published after this returns is seen by this engine."""
        await self.bus.ensure_group()
        await self.lora.load_registered(await self.bus.loras())
        newest = await self.control_bus.control_cursor()
        since = int(time.time() * 1000) - self.cfg.control_lookback_ms
        newest_ms = int(newest.split(b"-")[0])
        self._cursor = newest if newest_ms < since else b"%d-0" % since

    async def run(self) -> None:
        if self._cursor is None:
            await self.prepare()
        cursor = self._cursor
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.core.start(loop)
        if isinstance(self.sched, JournalRecorder):
            start = self.sched.start_record()
            await self.bus.publish(self.bus.keys.journal(self.id), replace(start, ts=int(time.time() * 1000)))
        cursor = await self.control.catch_up(cursor)
        tasks = [
            asyncio.create_task(self.control.run(cursor), name=f"control-{self.id}"),
            asyncio.create_task(
                self.heartbeat.run(self._sleep_while_running, lambda: self._stopping),
                name=f"heartbeat-{self.id}",
            ),
            asyncio.create_task(self._failover_loop(), name=f"failover-{self.id}"),
            asyncio.create_task(
                self.card.run(self._sleep_while_running, lambda: self._stopping or self._draining),
                name=f"card-{self.id}",
            ),
        ]
        if self.stats_interval_s > 0:
            stats = self.heartbeat.log_throughput(
                self.stats_interval_s,
                lambda: (self.core.prompt_tokens, self.core.generation_tokens),
                self._sleep_while_running,
                lambda: self._stopping,
            )
            tasks.append(asyncio.create_task(stats, name=f"stats-{self.id}"))
        if self.cfg.request_timeout_s > 0:
            watch = self.aborts.watch_timeouts(
                self.cfg.request_timeout_s, self._sleep_while_running, lambda: self._stopping
            )
            tasks.append(asyncio.create_task(watch, name=f"watchdog-{self.id}"))
        log.info("engine started", extra={"engine": self.id, "blocks": self.sched.num_total_blocks})
        try:
            await self._step_loop()
        except Stopped:
            pass
        finally:
            self._stopping = True
            await asyncio.gather(*tasks, return_exceptions=True)
            self.driver.close(loop)
            await self.card.leave()
            await self.heartbeat.forget()
            log.info("engine stopped", extra={"engine": self.id})

    def stop(self) -> None:
        """Stop now. Requests still running are taken over by live peers (the heartbeat is
        deleted on the way out, so they need not wait for it to expire)."""
        self._stopping = True
        self.admission.wake_idle()
        self._wake.set()

    def drain(self) -> None:
        """Stop claiming, finish or hand back what runs, then return from :meth:`run`."""
        if self._drain.start():
            self.admission.wake_idle()
            self._wake.set()
            # (no new placements for it; what waits on its lane goes to the others)
            task = asyncio.get_running_loop().create_task(self.card.leave())
            self._leaving = task

    @property
    def _draining(self) -> bool:
        return self._drain.active

    @property
    def handed_back(self) -> int:
        """Requests a drain re-queued for another engine."""
        return self._drain.handed_back

    @property
    def steps(self) -> int:
        """Steps folded in so far."""
        return self.core.steps

    @property
    def step_seconds(self) -> float:
        return self.core.step_seconds

    @property
    def redis_errors(self) -> int:
        """Redis calls that failed and were retried."""
        return self.link.errors

    @property
    def fenced(self) -> int:
        """Requests dropped because the fence refused their events."""
        return self.aborts.fenced

    @property
    def taken_over(self) -> int:
        """Requests continued from a dead engine."""
        return self.admission.taken_over

    # ------------------------------------------------------------------ in this process (fd serve)

    def hears_local_arrivals(self) -> None:
        """An API in this process will say when it submits (``fd serve``): from now on the
        engine claims when told so (:meth:`on_local_arrival`), and otherwise only every
        ``CLAIM_POLL_S`` (for requests from anywhere else), not before every step, nor in a
        blocking read while idle (whose reply, a few callbacks long, waited behind the
        ingress of the burst that woke it: the first burst after start was claimed whole)."""
        self.admission.arrivals_told = True

    def on_local_arrival(self) -> None:
        """This process's API put requests on ``P:requests`` (``fd serve``)."""
        self.admission.announced()
        self._wake.set()

    # ------------------------------------------------------------------ step loop

    async def _step_loop(self) -> None:
        """The engine's loop: around each step (EngineCore.step, where every decision is
        made), its I/O: new work claimed before a step is decided, what the step produced
        published after, and a wait for the runner's next reply (or an abort, an arrival)."""
        loop = asyncio.get_running_loop()
        core, admission = self.core, self.admission
        # Runs while steps are in flight, even when stopping: a step's result is never left
        # behind (its tokens are published, its aborts drained).
        while core.flying or not self._stopping:
            closed = self._draining or self._stopping
            # With async scheduling the next step is decided while the last one runs, queued
            # behind it: the runner never waits for this loop. Not while draining, which acts
            # between steps; stopping decides none (what runs is taken over by live peers),
            # and only folds in what is in flight.
            ahead = 0 if self._stopping else 1 if self._draining else core.depth
            room = core.room(ahead)
            if room and core.flying and not closed:
                # The runner is busy: claim first, so requests that arrived during its step
                # join the step decided now (as they would join the next step one at a time).
                await admission.claim(block=False)
            if self.requests.unannounced:
                await self._flush()  # their `claimed` before a step runs them
            if room and core.aborts_pending:
                # Hang-ups come in waves (a client's pool, a load balancer's cut): one turn of
                # the loop's sockets first, so the rest of this one is heard before the next
                # step is decided and its requests are in no step the release waits on.
                await asyncio.sleep(0)
            stepped = core.step(ahead, self._drain.due if self._draining else None)
            if stepped.handed_back:
                await self._drain.hand_back(stepped.handed_back)
            busy = core.has_work() or bool(core.flying)
            if stepped.decided or self._noted_busy and not busy:
                # (each step while busy, and once as the work runs out; with the step's events)
                self.publisher.put(self.bus.keys.lifecycle, self.heartbeat.load())
                self._noted_busy = busy
            await self._flush()
            if not core.flying and not core.has_work():
                if closed:
                    break
                if admission.arrivals_told:
                    await admission.await_arrival(loop)
                    await admission.claim(block=False)
                else:
                    await admission.claim(block=True)
                continue
            if stepped.decided and len(core.flying) < ahead:
                continue  # room for one more ahead: decide it before waiting
            # Until the runner replies; with none in flight (waiting for blocks, draining) look
            # again soon.
            await core.wait(None if core.flying else 0.01)
        await self._flush()

    # ------------------------------------------------------------------ control events

    async def _on_control(self, ev: Event, entry_id: bytes | None = None) -> None:
        if isinstance(ev, Abort):
            await self.aborts.abort(ev.request_ids, ev.source)
        elif isinstance(ev, AbortAll):
            if ev.engine in (None, "", self.id):
                await self.aborts.abort_all(ev, entry_id)
        elif isinstance(ev, Drain):
            # the look-back must not replay a drain meant for an earlier life of this id
            if ev.engine == self.id and ev.ts >= self._started_ms:
                self.drain()
        elif isinstance(ev, LoadLora):
            if self.adapters.want_load(ev.name):
                self.lora.load(ev.name, ev.path)
        elif isinstance(ev, UnloadLora):
            if self.adapters.unload(ev.name, self.requests.using_lora(ev.name)):
                self.lora.forget(ev.name)
            self.heartbeat.beat_now()

    async def _flush(self) -> None:
        """Publish what the loops queued (fd.engine.node.publisher); every loop flushes through here."""
        await self.publisher.flush()

    async def _sleep_while_running(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < end:
            await asyncio.sleep(min(0.05, max(0.0, end - time.monotonic())))

    # ------------------------------------------------------------------ failover

    async def _failover_loop(self) -> None:
        while not self._stopping:
            await self._sleep_while_running(self.cfg.failover_interval_s)
            if self._stopping or self._draining:
                continue
            ok = self.link.ok_since
            if ok is None or (ok and time.monotonic() - ok < self.cfg.heartbeat_ttl_s):
                continue  # just back from an outage: let live peers renew their heartbeats
            try:
                await self._take_over_orphans()
            except RETRYABLE as e:
                self.link.failed("failover", e)
            except Stopped:
                return
            except Exception:
                log.exception("failover scan failed", extra={"engine": self.id})

    async def _take_over_orphans(self) -> None:
        room = self.core.can_admit()

        def mine(rid: str) -> bool:
            return self.requests.holds(rid) or self.core.knows(rid)

        orphans, done, aborted = await self._orphans.scan(max(room, 0), mine)
        for entry, fields in done:
            if fields is None:
                await self.bus.ack_request(entry)
            else:  # it never decodes: a dead letter, and acked
                await self.bus.decode_requests([(entry, fields)])
        for entry, rid in aborted:  # read by an engine that died before acking it
            await self.aborts.write_tombstone_story(rid)
            await self._flush()
            await self.bus.ack_request(entry)
        for o in orphans:
            if self._draining or self._stopping or self.core.can_admit() <= 0:
                break
            log.info(
                "taking over", extra={"request_id": o.request.request_id, "owner": o.owner, "engine": self.id}
            )
            await self.admission.admit(o.entry_id, o.request, takeover=True, owner=o.owner)
        if orphans:
            await self._flush()
            self._wake.set()

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.id,
            "blocks_total": self.sched.num_total_blocks,
            "blocks_free": self.sched.num_free_blocks,
            "running": self.sched.num_running,
            "waiting": self.sched.num_waiting,
            "cache_queries": self.sched.num_cache_queries,
            "cache_hits": self.sched.num_cache_hits,
            "step": self.sched.step,
            "draining": int(self._draining),
            "fenced": self.fenced,
            "ts": int(time.time() * 1000),
            **self.adapters.status(),
        }
