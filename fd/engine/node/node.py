"""The engine node: the I/O shell around the pure scheduler.

Everything that touches Redis, threads or the clock lives in the node and the objects it is
built from (named on :class:`EngineNode`); every decision lives in
:class:`fd.engine.core.scheduler.Scheduler`. One loop owns the scheduler, so control events (aborts)
and step results are applied in one order, and that order is what the journal records.

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
from collections import deque
from dataclasses import replace
from typing import Any

from fd.control.bus import Bus
from fd.control.events import (
    Abort,
    AbortAll,
    BlocksReleased,
    Drain,
    Event,
    LoadLora,
    Preempted,
    Request,
    Tokens,
    UnloadLora,
)
from fd.engine.core.adapters import Adapters
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.journal.journal import JournalRecorder, journaled
from fd.engine.node import failover
from fd.engine.node.aborts import Aborts
from fd.engine.node.admission import Admission
from fd.engine.node.control_reader import ControlReader
from fd.engine.node.emitter import Emitter
from fd.engine.node.failover import OrphanFinder
from fd.engine.node.heartbeat import Heartbeat
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
    (:class:`~fd.engine.node.aborts.Aborts`), the runner's steps (:class:`~fd.engine.node.step_driver.
    StepDriver`), events to the outbox (:class:`~fd.engine.node.emitter.Emitter`) and out to Redis
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
        self._wake = asyncio.Event()  # the step loop, waiting for blocks or work: look again
        self._stopping = False
        self._draining = False
        self._drain_deadline: float | None = None
        # Every request this engine runs, its owner tokens, and aborts it remembers.
        self.requests = RequestTable()
        self.link = RedisLink(
            self.id, cfg.retry_backoff_s, cfg.retry_backoff_max_s, stopping=lambda: self._stopping
        )
        journal = self.sched if isinstance(self.sched, JournalRecorder) else None
        self.publisher = Publisher(
            bus, self.id, self.requests, self.link, lambda r, why: self.aborts.lose(r, why), journal
        )
        self.driver = StepDriver(
            runner,
            self.id,
            self._finished,
            self._on_skipped,
            lambda n, e: self.lora.done(n, e),
            result_in=self._result_in,
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
        self.adapters = Adapters(tuple(runner.lora_names))  # LoRA (fd.engine.core.adapters)
        self.lora = LoraLoader(runner, self.driver.pool, self.adapters, self.id, self.heartbeat.beat_now)
        self.emitter = Emitter(
            self.id,
            bus.keys,
            self.publisher,
            self.requests,
            self.sched,
            self.adapters,
            self.lora,
            self._dropped,
            metrics,
            released=self.heartbeat.publish_gauges,
        )
        self._emit = self.emitter.emit
        self.aborts = Aborts(
            self.id,
            bus,
            self.sched,
            self.requests,
            self.link,
            self.publisher,
            self._emit,
            self._wake,
            cfg.tombstone_ttl_s,
            metrics,
        )
        self.admission = Admission(
            cfg,
            bus,
            self.sched,
            self.requests,
            self.link,
            self.publisher,
            self._emit,
            self.aborts,
            self.adapters,
            tokenizer,
            closed=lambda: self._draining or self._stopping,
        )
        # Steps handed to the runner whose results are not folded in yet, oldest first.
        self._flying: deque[tuple[SchedulerOutput, asyncio.Future, float]] = deque()
        self._fold_failed: BaseException | None = None  # a fold in the driver's callback raised
        # The step loop holds a step it decided and hands over after an await: the driver's
        # callback folds nothing in meanwhile, or a step it decided would reach the runner first.
        self._handing_over = False
        self._heard = 0  # self.aborts.heard when the last step was decided
        self._task: asyncio.Task | None = None
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
        self.steps = 0
        self.step_seconds = 0.0
        # Tokens the steps folded in so far: prompt tokens computed (a recompute's too) and
        # tokens sampled, for the throughput line.
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.stats_interval_s = stats_interval_s
        self.handed_back = 0
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
        self.driver.start(loop)
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
        ]
        if self.stats_interval_s > 0:
            stats = self.heartbeat.log_throughput(
                self.stats_interval_s,
                lambda: (self.prompt_tokens, self.generation_tokens),
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
        if not self._draining:
            log.info("draining", extra={"engine": self.id})
            self._draining = True
            self.admission.wake_idle()
            self._wake.set()

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

    def on_local_control(self, ev: Event) -> None:
        """An abort published in this process (``fd serve``'s API), heard before the control
        read brings it (fd.engine.node.aborts)."""
        if not self._stopping:
            self.aborts.on_local(ev)

    # ------------------------------------------------------------------ step loop

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        depth = self.sched.config.max_steps_in_flight
        flying = self._flying
        # Runs while steps are in flight, even when stopping: a step's result is never left
        # behind (its tokens are published, its aborts drained).
        while flying or not self._stopping:
            if self._draining and not flying:
                await self._drain_tick()  # hands requests back: only with nothing in flight
            if not flying and not self.sched.has_work():
                await self._flush()
                if self._draining or self._stopping:
                    break
                if self.admission.arrivals_told:
                    await self.admission.await_arrival(loop)
                    await self.admission.claim(block=False)
                else:
                    await self.admission.claim(block=True)
                continue
            out = None
            # With async scheduling the next step is decided now, while the last one runs,
            # and queued behind it on the step thread: the runner never waits for this loop.
            # Not while draining or stopping, which act between steps.
            ahead = 1 if self._draining or self._stopping else depth
            claimed = False
            if len(flying) < ahead:
                if flying:
                    # The runner is busy with the step in flight: claim first, so requests that
                    # arrived during it join the step decided now (as they would join the next
                    # step one at a time), not the one after.
                    claimed = True
                    await self.admission.claim(block=False)
                if self.aborts.heard != self._heard:
                    # Hang-ups come in waves (a client's pool, a load balancer's cut): one turn
                    # of the loop's sockets first, so the rest of this one is heard before the
                    # next step is decided and its requests are in no step the release waits on.
                    await asyncio.sleep(0)
                if len(flying) < ahead:  # (a result folded in meanwhile may have stepped ahead)
                    self._heard = self.aborts.heard
                    out = self.sched.schedule()
                    self._emit(list(out.events))  # preemptions decided by this schedule()
                    if not out.empty:
                        unannounced = self.requests.unannounced
                        if unannounced and any(ss.request_id in unannounced for ss in out.seqs):
                            self._handing_over = True
                            try:
                                await self._flush()  # their `claimed` first (RequestTable.unannounced)
                            finally:
                                self._handing_over = False
                        self._hand_over(out)
            if not flying:
                # Work exists but none can run (e.g. waiting for blocks): wait for an event.
                await self._flush()
                self._wake.clear()
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation
                # that comes as the wait ends (CPython gh-86296), and a cancelled engine (fd
                # serve's shutdown, a test's kill) would go on running.
                try:
                    async with asyncio.timeout(0.01):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            if out is not None and not out.empty and len(flying) < ahead:
                continue  # room for one more ahead: decide it before waiting
            # While the oldest step runs: publish what the last one produced (one pipelined
            # round trip), take new work.
            done, fut, t0 = flying[0]
            try:
                await self._flush()
                if not claimed and await self.admission.claim(block=False):
                    await self._flush()  # their `claimed` now, not after this step
            finally:
                result = await fut  # never leave the step's result behind, even when stopping
            if self._fold_failed is not None:
                raise self._fold_failed
            if flying and flying[0][1] is fut:  # (not folded in by the driver's callback)
                self._fold_oldest(result)
        await self._flush()

    def _hand_over(self, out: SchedulerOutput) -> None:
        """The step to the runner, behind those in flight."""
        loop = asyncio.get_running_loop()
        self._flying.append((out, self.driver.submit(loop, out), time.perf_counter()))

    def _fold_oldest(self, result: RunnerOutput) -> None:
        flying = self._flying
        done, _, t0 = flying.popleft()
        now = time.perf_counter()
        self.step_seconds += now - t0
        if flying:  # the next one was queued behind this one: its time starts now
            nxt, nfut, nt0 = flying[0]
            flying[0] = (nxt, nfut, max(nt0, now))
        self.steps += 1
        self._apply(done, result)

    def _result_in(self) -> None:
        """The oldest step's result is in (the driver's callback): fold it back and decide and
        hand over the next step now. The step loop publishes the tokens and claims new work
        when its task runs; a step that needs either first (the last fold's tokens not out yet,
        requests whose ``claimed`` is not), and draining or stopping, which act between steps,
        are left to it."""
        flying = self._flying
        if self._fold_failed is not None or self._handing_over or not flying:
            return
        fut = flying[0][1]
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return  # (a failed step: the step loop raises it)
        try:
            caught_up = self.publisher.caught_up  # (before this fold queues its tokens)
            self._fold_oldest(fut.result())
            if not caught_up or self._draining or self._stopping or self.requests.unannounced:
                return
            if len(flying) >= self.sched.config.max_steps_in_flight or self.aborts.heard != self._heard:
                return  # (aborts just heard: the step loop hears the sockets before it decides)
            out = self.sched.schedule()
            self._emit(list(out.events))  # preemptions decided by this schedule()
            if not out.empty:
                self._hand_over(out)
        except BaseException as e:  # noqa: BLE001 - the step loop raises it, as its own
            self._fold_failed = e

    def _finished(self, step: int, ran: tuple[int, int] | None = None) -> None:
        """A step's result is in. The loop folds it back when it gets to it, which can be
        milliseconds later (at 128 streams, behind the last step's token publish and the
        clients' writes); but the runner is done with the KV blocks of every step up to this
        one now, so the scheduler hears it now (and the journal has when each step ended):
        an aborted request that only those steps held is released at once."""
        evs = self.sched.finished(step, ran)
        if evs:
            self._emit(evs)  # (their blocks_released sets the gauges: Emitter.released)
            self.publisher.flush_soon()

    def _release_finished(self) -> None:
        """An abort just heard (or a queued step left it out) for a request held only by
        steps whose results are in already: released now, not at their fold-in."""
        if not self.sched.num_draining:
            return
        last = None
        for out, fut, _ in self._flying:
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                break
            last = out.step
        if last is not None:
            self._finished(last)

    def _dropped(self, rids: list[str]) -> None:
        """Aborted requests that a step in flight holds: the runner leaves them out of a step
        queued behind the running one if it can, and those held only by steps whose results
        are in already are released now."""
        self.driver.drop(self.sched.step, rids)
        self._release_finished()

    def _apply(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """Fold a finished step back in: text first (stop strings end requests), then the
        scheduler's decisions."""
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
                log.exception("detokenizing failed", extra={"request_id": rid, "engine": self.id})
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
                for j, e in enumerate(entries):
                    got.setdefault(first + j, e)
        self.generation_tokens += len(result.sampled)
        # (a decode feeds one token, the last sampled; what else a step feeds is prompt)
        self.prompt_tokens += out.num_batched_tokens - sum(1 for ss in out.seqs if ss.num_generated)
        evs = self.sched.update(out, result)
        now = time.monotonic()
        for ev in evs:
            if type(ev) is Tokens and (live := requests.get(ev.request_id)) is not None:
                live.progress = now
        self._emit(evs, deltas, result.logprobs, result.embeddings)
        self.heartbeat.publish_gauges()

    # ------------------------------------------------------------------ drain

    async def _drain_tick(self) -> None:
        """Between steps (nothing in flight): hand back what waits at once, and everything
        once the drain timeout is up."""
        now = time.monotonic()
        snap = None
        if self._drain_deadline is None:
            self._drain_deadline = now + self.cfg.drain_timeout_s
            snap = self.sched.snapshot()
            rids = list(snap["waiting"])
        elif now >= self._drain_deadline and self.sched.has_work():
            snap = self.sched.snapshot()
            rids = list(snap["running"]) + list(snap["waiting"])
        else:
            return
        rids = [r for r in rids if not self.requests.silent(r)]
        if rids:
            await self._hand_back(rids)

    async def _hand_back(self, rids: list[str]) -> None:
        back: list[tuple[str, bytes, Request, str]] = []
        for rid in rids:
            live, token = self.requests.get(rid), self.requests.tokens.get(rid)
            if live is not None:
                live.silent = True
            evs = self.sched.abort(rid, "engine")  # nothing is in flight: released at once
            count = sum(e.count for e in evs if isinstance(e, BlocksReleased))
            self._emit(evs)  # bookkeeping only: silent
            if live is None:
                continue
            entry, req = live.entry, live.request
            self.publisher.put(
                self.bus.keys.req(rid),
                Preempted(
                    request_id=rid,
                    count=count,
                    engine=self.id,
                    step=self.sched.step,
                    handback=True,
                    ts=int(time.time() * 1000),
                ),
            )
            if token is not None:
                back.append((rid, entry, req, token))
        await self._flush()  # the notes (and every token before them) first
        self.handed_back += await failover.hand_back(self.bus, self.link, self.id, back)

    async def _on_control(self, ev: Event, entry_id: bytes | None = None) -> None:
        if isinstance(ev, Abort):
            rids = self.aborts.echoed(ev)
            if rids:
                await self.aborts.abort(rids, ev.source)
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

    def _on_skipped(self, step: int, rids: list[str]) -> None:
        """The worker started ``step`` without these aborting requests: drain and release."""
        evs = self.sched.skipped(step, rids)
        if evs:
            self._emit(evs)
            self.publisher.flush_soon()
        self._release_finished()  # those held only by steps whose results are in go now

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
        room = self.sched.can_admit()

        def mine(rid: str) -> bool:
            return self.requests.holds(rid) or self.sched.knows(rid)

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
            if self._draining or self._stopping or self.sched.can_admit() <= 0:
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
