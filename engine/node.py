"""The engine node: the I/O shell around the pure scheduler.

Everything that touches Redis, threads or the clock lives here; every decision lives in
:class:`engine.scheduler.Scheduler`. One loop owns the scheduler, so control events (aborts)
and step results are applied in one order, and that order is what the journal records.

The model step runs in a worker thread while the loop keeps reading ``P:control``, claiming
requests and publishing the previous step's events, so a step is genuinely in flight while
aborts arrive. With async scheduling (the default) the next step is decided and queued behind
the running one before its results come back, so two can be in flight. That is the case the abort protocol exists for: an abort that lands during a
step only marks the request; its blocks come back after the step has finished writing them.

Faults (DESIGN.md §1, issue 7):

- Redis going away is a pause. Every Redis call in the loops survives a connection error: it
  is logged, retried with backoff, and the engine's state (scheduler, KV blocks, the events
  not yet published) waits meanwhile. Published events are never lost or repeated
  (:mod:`engine.outbox`).
- A dead engine's requests are taken over by a live one, which continues them from the tokens
  already on their streams (:mod:`engine.failover`); a request that failed ``max_attempts``
  times ends with ``final finish_reason=error``.
- Every write to a request's story is fenced (control/fence.py): it lands only while the
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Mapping

from control.bus import Bus
from control.entry_ids import entry_id_key
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
    LoadLora,
    Preempted,
    Request,
    Tokens,
    UnloadLora,
)
from control.fence import Refused
from control.guided import GuidedError
from control.guided import check as check_guided
from control.keys import ABORT_WRITTEN, choice_ids, is_tombstone, owner_attempt, owner_choices, owner_token
from control.ownership import tombstone_story
from control.token_payloads import embedding_field, logprobs_field, prompt_logprobs_field
from control.tokenizer import served_context
from engine import failover
from engine.adapters import Adapters
from engine.config import SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.failover import History, OrphanFinder
from engine.journal import JournalRecorder, journaled
from engine.lora_runtime import LoraLoader
from engine.node_config import EngineConfig, Runner
from engine.outputs import RunnerOutput, SchedulerOutput
from engine.publisher import Publisher
from engine.redis_link import RETRYABLE, RedisLink, Stopped
from engine.request_table import Live, RequestTable
from engine.scheduler import Scheduler

log = logging.getLogger("engine.node")


#: Tombstones laid per round trip for a many-id abort: small enough that the embedded server
#: (which runs a pipeline on the event loop it shares with the API) never stalls the API long.
#: `POST /v1/abort_requests` with 1,000 unknown ids, 50 calls 20 ms apart, in `fd serve`:
#: p99 24-37 ms with 32 a round trip, 3.8-5.3 ms with 8.
TOMBSTONE_BATCH = 8

#: With an API in the same process announcing its requests (``fd serve``), a running engine
#: still asks ``P:requests`` this often for requests from anywhere else (another API node,
#: ``redis-cli``), instead of before every step (8% of the loop at 8 streams).
CLAIM_POLL_S = 0.01


def _wake_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineNode:
    def __init__(
        self,
        bus: Bus,
        control_bus: Bus,
        runner: Runner,
        tokenizer: Any,
        cfg: EngineConfig,
        metrics: Any = None,
    ):
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
                SchedulerConfig(
                    num_blocks=runner.num_blocks,
                    block_size=cfg.block_size,
                    max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_model_len=served_context(cfg.max_model_len, runner.max_model_len),
                    eos_token_ids=tuple(runner.eos_token_ids),
                    max_num_waiting=cfg.max_num_waiting,
                    vocab_size=int(getattr(runner, "vocab_size", 0) or 0),
                    max_steps_in_flight=2 if cfg.async_scheduling else 1,
                    enable_prefix_caching=cfg.enable_prefix_caching,
                    scheduling_policy=cfg.scheduling_policy,
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
        # Every request this engine runs, its owner tokens, and aborts it remembers
        # (engine.request_table).
        self.requests = RequestTable()
        self.link = RedisLink(
            self.id, cfg.retry_backoff_s, cfg.retry_backoff_max_s, stopping=lambda: self._stopping
        )
        # The outbox, acks and TTLs, flushed to the bus in one fenced batch (engine.publisher).
        self.publisher = Publisher(
            bus,
            self.id,
            self.requests,
            self.link,
            self._lose,
            self.sched if isinstance(self.sched, JournalRecorder) else None,
        )
        self.fenced = 0  # requests dropped because the fence refused their events
        self._wake = asyncio.Event()
        self._abort_counters: dict[str, Any] = {}
        self._arrivals_told = False  # an API in this process says when it submits (fd serve)
        self._arrived = False
        self._idle: asyncio.Future | None = None  # the step loop waits for an arrival on it
        self._last_claim = 0.0
        # Steps handed to the runner whose results are not folded in yet, oldest first.
        self._flying: deque[tuple[SchedulerOutput, asyncio.Future, float]] = deque()
        self._task: asyncio.Task | None = None
        self._reader_fd: int | None = None  # a worker's pipe, read by this loop
        self._replies_due: deque[asyncio.Future] = deque()  # its steps, oldest first
        self._stopping = False
        self._draining = False
        self._drain_deadline: float | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"step-{self.id}")
        self._orphans = OrphanFinder(bus, self.id, cfg.failover_idle_ms)
        self.steps = 0
        self.step_seconds = 0.0
        self.taken_over = 0  # requests continued from a dead engine
        self.handed_back = 0
        self._cursor: bytes | None = None
        self._started_ms = int(time.time() * 1000)
        self.adapters = Adapters(tuple(getattr(runner, "lora_names", ())))  # LoRA (engine.adapters)
        self._beats: set[asyncio.Task] = set()  # heartbeats written at once (an adapter loaded)
        self.lora = LoraLoader(runner, self._pool, self.adapters, self.id, self._beat_now)

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
        reads = hasattr(self.runner, "take_ready") and hasattr(self.runner, "fileno")
        if reads:
            # A worker process's replies are read by this loop when its pipe is readable: no
            # thread to wake and hand the GIL back and forth with (that hand-off cost up to
            # ~2 ms a step on a busy box, between the worker's end of a step and this loop).
            self._reader_fd = self.runner.fileno()
            loop.add_reader(self._reader_fd, self._on_replies)
        elif hasattr(self.runner, "drop"):

            def on_skipped(step: int, rids: list[str]) -> None:  # on the step thread
                try:
                    loop.call_soon_threadsafe(self._on_skipped, step, rids)
                except RuntimeError:
                    pass  # the loop is closed: the engine stopped

            self.runner.on_skipped = on_skipped
        if isinstance(self.sched, JournalRecorder):
            start = self.sched.start_record()
            await self.bus.publish(self.bus.keys.journal(self.id), replace(start, ts=int(time.time() * 1000)))
        tasks = [
            asyncio.create_task(self._control_loop(cursor), name=f"control-{self.id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{self.id}"),
            asyncio.create_task(self._failover_loop(), name=f"failover-{self.id}"),
        ]
        if self.cfg.request_timeout_s > 0:
            tasks.append(asyncio.create_task(self._watchdog_loop(), name=f"watchdog-{self.id}"))
        log.info("engine started", extra={"engine": self.id, "blocks": self.sched.num_total_blocks})
        try:
            await self._step_loop()
        except Stopped:
            pass
        finally:
            self._stopping = True
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._reader_fd is not None:
                loop.remove_reader(self._reader_fd)
                self._reader_fd = None
            self._pool.shutdown(wait=True)
            await self._forget_heartbeat()
            log.info("engine stopped", extra={"engine": self.id})

    def stop(self) -> None:
        """Stop now. Requests still running are taken over by live peers (the heartbeat is
        deleted on the way out, so they need not wait for it to expire)."""
        self._stopping = True
        if self._idle is not None:
            _wake_up(self._idle)
        self._wake.set()

    def drain(self) -> None:
        """Stop claiming, finish or hand back what runs, then return from :meth:`run`."""
        if not self._draining:
            log.info("draining", extra={"engine": self.id})
            self._draining = True
            if self._idle is not None:
                _wake_up(self._idle)
            self._wake.set()

    async def _forget_heartbeat(self) -> None:
        try:
            async with asyncio.timeout(2.0):  # (not wait_for: see _step_loop)
                await self.bus.redis.delete(self.bus.keys.engine(self.id))
        except Exception as e:  # Redis down: the key expires on its own
            log.warning("could not delete heartbeat: %s", e, extra={"engine": self.id})

    @property
    def redis_errors(self) -> int:
        """Redis calls that failed and were retried."""
        return self.link.errors

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
                if self._arrivals_told:
                    await self._await_arrival(loop)
                    await self._claim(block=False)
                else:
                    await self._claim(block=True)
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
                    await self._claim(block=False)
                out = self.sched.schedule()
                self._emit(self.sched.take_events())  # preemptions decided by this schedule()
                if not out.empty:
                    unannounced = self.requests.unannounced
                    if unannounced and any(ss.request_id in unannounced for ss in out.seqs):
                        await self._flush()  # their `claimed` first (see RequestTable.unannounced)
                    flying.append((out, self._submit(loop, out), time.perf_counter()))
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
                if not claimed and await self._claim(block=False):
                    await self._flush()  # their `claimed` now, not after this step
            finally:
                result = await fut  # never leave the step's result behind, even when stopping
            flying.popleft()
            now = time.perf_counter()
            self.step_seconds += now - t0
            if flying:  # the next one was queued behind this one: its time starts now
                nxt, nfut, nt0 = flying[0]
                flying[0] = (nxt, nfut, max(nt0, now))
            self.steps += 1
            self._apply(done, result)
        await self._flush()

    def _submit(self, loop: asyncio.AbstractEventLoop, out: SchedulerOutput) -> asyncio.Future:
        """Start a step; its result comes back in order. A worker-process runner takes the
        step down its pipe right here, so it starts the moment the one before it ends, and its
        result is read by this loop (:meth:`_on_replies`); an in-process runner runs it on the
        step thread."""
        submit = getattr(self.runner, "submit", None)
        if self._reader_fd is not None:
            submit(out)
            fut = loop.create_future()
            self._replies_due.append(fut)
            return fut
        if submit is not None:
            submit(out)
            work = self._pool.submit(self.runner.collect)
        else:
            work = self._pool.submit(self._execute, out)
        fut = loop.create_future()

        def done(_work) -> None:  # on the step thread
            try:
                loop.call_soon_threadsafe(self._step_done, fut, work)
            except RuntimeError:
                pass  # the loop is closed: the engine stopped

        work.add_done_callback(done)
        return fut

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        """An in-process runner's step (on the step thread). One that raises fails each of its
        requests, not the engine: this runner could not tell whose share broke it (the model
        runner can, and fails only that one: ``ModelRunner.execute``)."""
        try:
            return self.runner.execute(out)
        except Exception as e:  # noqa: BLE001 - said on each request's stream, in its final
            log.exception("step %d failed", out.step, extra={"engine": self.id})
            return RunnerOutput.failure(out, f"the model step failed: {type(e).__name__}: {e}")

    def _step_done(self, fut: asyncio.Future, work) -> None:
        if fut.cancelled():
            return
        if work.cancelled():
            fut.cancel()
            return
        e = work.exception()
        if e is not None:
            fut.set_exception(e)
        else:
            result = work.result()
            fut.set_result(result)
            self._finished(result.step, result.ran)

    def _on_replies(self) -> None:
        """The worker's pipe is readable: fold in what came, in order — a ``skipped`` note
        (an aborting request left out of a queued step) before that step's result."""
        due = self._replies_due
        try:
            replies = self.runner.take_ready()
        except Exception as e:  # a failed step or a dead worker: every waiting step fails
            while due:
                fut = due.popleft()
                if not fut.done():
                    fut.set_exception(e)
            loop = asyncio.get_running_loop()
            if self._reader_fd is not None:
                loop.remove_reader(self._reader_fd)  # (a dead pipe stays readable)
                self._reader_fd = None
            return
        for reply in replies:
            if isinstance(reply, RunnerOutput):
                if not due:
                    log.error("a step result nobody waits for (step %s)", reply.step)
                    continue
                fut = due.popleft()
                if not fut.done():
                    fut.set_result(reply)
                    self._finished(reply.step, reply.ran)
            elif reply[0] == "lora":
                self.lora.done(reply[1], reply[2])
            else:
                self._on_skipped(reply[1], reply[2])

    def _finished(self, step: int, ran: tuple[int, int] | None = None) -> None:
        """A step's result is in. The loop folds it back when it gets to it, which can be
        milliseconds later (at 128 streams, behind the last step's token publish and the
        clients' writes); but the runner is done with the KV blocks of every step up to this
        one now, so the scheduler hears it now (and the journal has when each step ended):
        an aborted request that only those steps held is released at once."""
        evs = self.sched.finished(step, ran)
        if evs:
            self._emit(evs)
            self._publish_gauges()
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

    async def _await_arrival(self, loop: asyncio.AbstractEventLoop) -> None:
        """Idle, with an API in this process that says when it submits: wait for that (or
        ``CLAIM_POLL_S``, for requests from anywhere else) instead of in a blocking read."""
        if self._arrived or self._stopping or self._draining:
            return
        self._idle = fut = loop.create_future()
        timer = loop.call_later(CLAIM_POLL_S, _wake_up, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._idle = None

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
        if not block and self._arrivals_told:
            now = time.monotonic()
            if not self._arrived and now - self._last_claim < CLAIM_POLL_S:
                return 0  # nothing announced, and asked a moment ago
            self._last_claim = now
        self._arrived = False
        try:
            got = await self.bus.claim_requests(self.id, n, self.cfg.claim_block_ms if block else None)
            self.link.ok()
        except RETRYABLE as e:
            # Entries the lost reply may have carried stay pending here with no owner: the
            # failover scan finds them (this engine's own included) once they are idle.
            self.link.failed("claim", e)
            await asyncio.sleep(0.2 if block else 0)
            return 0
        if len(got) >= n:
            # Took all it may: more may wait behind them, and their announcements were spent
            # on this read. The next chance to claim reads again (else they'd wait for the
            # poll: a wave of 32 was prefilled as 16, then 15 arriving 10 ms late).
            self._arrived = True
        # New requests are owned in one round trip (SET NX for all), not one each: a burst of
        # arrivals reaches its first step sooner.
        owned: dict[str, tuple[bool, str | None]] = {}
        fresh = [req.request_id for _, req in got if not req.resume]
        if len(fresh) > 1:
            try:
                owned = dict(
                    zip(
                        fresh, await self.bus.try_own_many(fresh, owner_token(self.id, 1), self.bus.req_ttl_s)
                    )
                )
            except RETRYABLE as e:
                self.link.failed("claim", e)  # (then each is owned on its own below)
        for entry_id, req in got:
            await self._admit(entry_id, req, owned=owned.get(req.request_id))
        return len(got)

    async def _admit(
        self,
        entry_id: bytes,
        req: Request,
        *,
        takeover: bool = False,
        owner: str | None = None,
        owned: tuple[bool, str | None] | None = None,
    ) -> None:
        """Own the request and start it: a new one, one handed back by a draining engine
        (``req.resume``), or, with ``takeover``, one whose owner (``owner``) is dead."""
        rid = req.request_id
        live = self.requests.get(rid)
        if rid in self.requests.admitting or self.sched.knows(rid) or live is not None:
            if live is not None and live.entry != entry_id and not takeover:
                await self._ack_copy(entry_id, rid)
            return
        self.requests.admitting.add(rid)
        try:
            try:
                hist = await self._own(entry_id, req, takeover, owner, owned)
                self.link.ok()
            except RETRYABLE as e:
                # Owned or not, the entry stays pending: the failover scan comes back to it.
                self.link.failed("claim", e)
                return
            if hist is not None:
                self._start(entry_id, req, *hist)
        finally:
            self.requests.admitting.discard(rid)

    async def _own(
        self,
        entry_id: bytes,
        req: Request,
        takeover: bool,
        owner: str | None,
        owned: tuple[bool, str | None] | None = None,
    ) -> tuple[History, str] | None:
        """Take the owner key with a token of a new attempt (control.keys.owner_token), and
        read what the story says: ``(history, token)``, or None (not ours, or done).

        The attempt is greater than any grant's before it, so a token is never given twice:
        a takeover's is one more than the token it replaces; where there is none to go by
        (a resume, whose owner key the hand-back deleted; a takeover of an absent key or of
        an earlier release's bare engine id) the story is read first, and the attempt is one
        more than the last one claimed there (while no token holds the key, no fenced write
        can change it)."""
        rid = req.request_id
        ttl = self.bus.req_ttl_s
        if takeover:
            last = owner_attempt(owner)
            if last is None:
                last = History.of([ev for _, ev in await self.bus.read_req(rid)]).attempt
            token = owner_token(self.id, last + 1)
            if not await failover.cas_owner(self.bus.redis, self.bus.keys.owner(rid), owner, token, ttl):
                return None  # another engine was faster, or an abort won
            await failover.take_entry(self.bus, entry_id, self.id)
        else:
            if req.resume:
                last = History.of([ev for _, ev in await self.bus.read_req(rid)]).attempt
                token = owner_token(self.id, last + 1)
                owned = None
            else:
                token = owner_token(self.id, 1)  # a new request: the first grant
            won, current = owned if owned is not None else await self.bus.try_own(rid, token, ttl)
            if not won and current == token:
                # A retried SET NX that had in fact got through, or a second entry of a
                # request this engine already ran (an XADD sent twice, one written by hand):
                # the story says which.
                if History.of([ev for _, ev in await self.bus.read_req(rid)]).final:
                    await self._ack_copy(entry_id, rid)
                    return None
            elif not won:
                # An abort got here first (tombstone): the request is never prefilled. Its
                # story is written by whoever flips the tombstone first, maybe this engine.
                log.info("claim lost", extra={"request_id": rid, "owner": current})
                if is_tombstone(current):
                    await self._write_tombstone_story(rid)
                    await self._flush()
                await self.bus.ack_request(entry_id)
                return None
        if not (takeover or req.resume):
            return History(), token
        hist = History.of([ev for _, ev in await self.bus.read_req(rid)])
        if hist.final:  # it had finished; only the ack was missing
            await self.bus.ack_request(entry_id)
            return None
        return hist, token

    async def _ack_copy(self, entry_id: bytes, rid: str) -> None:
        """A second ``P:requests`` entry of a request this engine runs or finished: nothing
        to run, so it leaves the stream (else it stays pending on this live engine, which the
        failover scan never takes from, until the owner key expires)."""
        log.warning(
            "a second entry of the request; acknowledged", extra={"request_id": rid, "engine": self.id}
        )
        try:
            await self.bus.ack_request(entry_id)
        except RETRYABLE as e:  # (still pending: the next look at it acks it)
            self.link.failed("claim", e)

    def _start(self, entry_id: bytes, req: Request, hist: History, token: str) -> None:
        """Synchronous, so no abort can slip in between the checks and ``sched.add``."""
        rid, data = req.request_id, req.data
        live = self.requests.add(rid, entry_id, req, token, time.monotonic())
        n_prompt, n_gen = len(data.prompt_token_ids), len(hist.tokens)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
        dismissed = self.requests.take_dismissed(rid)
        if dismissed is not None or "abort_requested" in hist.noted:
            # Aborted while no live engine ran it (its owner had died, or was handing it back):
            # finish the abort's story, never run it.
            source = dismissed if dismissed is not None else "engine"
            self._count_abort(source)
            evs: list[Event] = []
            if "abort_requested" not in hist.noted:
                evs.append(AbortRequested(request_id=rid, source=source, step=self.sched.step))
            if "drained" not in hist.noted:
                evs.append(Drained(request_id=rid, step=self.sched.step))
            if "blocks_released" not in hist.noted:
                evs.append(BlocksReleased(request_id=rid, count=0, step=self.sched.step))
            evs.append(Final(request_id=rid, finish_reason="abort", usage=usage, step=self.sched.step))
            self._emit(evs)
            return
        if hist.failures >= self.cfg.max_attempts:
            msg = (
                f"request failed on {hist.failures} engine(s); giving up after "
                f"max_attempts={self.cfg.max_attempts}"
            )
            log.warning(msg, extra={"request_id": rid, "engine": self.id})
            self._emit(
                [Final(request_id=rid, finish_reason="error", usage=usage, error=msg, step=self.sched.step)]
            )
            return
        sp = data.sampling
        if sp.lora and sp.lora not in self.adapters.ready:
            self._emit(
                [
                    Final(
                        request_id=rid,
                        finish_reason="error",
                        usage=usage,
                        step=self.sched.step,
                        error=f"this engine has no LoRA adapter {sp.lora!r} (see --lora-modules)",
                    )
                ]
            )
            return
        if sp.guided:  # (the API checked it; a hand-written request may not have been)
            try:
                check_guided(sp.guided)
            except GuidedError as e:
                self._emit(
                    [
                        Final(
                            request_id=rid,
                            finish_reason="error",
                            usage=usage,
                            error=f"sampling.guided does not compile: {e}",
                            step=self.sched.step,
                        )
                    ]
                )
                return
        detok = IncrementalDetokenizer.for_request(self.tokenizer, sp, self.sched.config.eos_token_ids)
        tail = ""
        if hist.tokens:
            # Prime it with what the client already has, so text deltas continue exactly; text
            # the dead engine held back (a partial character, a possible stop-string prefix)
            # and never published is the difference, and goes out first.
            primed, _ = detok.push(hist.tokens)
            if primed.startswith(hist.text):
                tail = primed[len(hist.text) :]
        live.detok = detok
        if sp.prompt_logprobs is not None and not hist.tokens:  # (a takeover: shown already)
            live.prompt_lp = {}
        live.progress = time.monotonic()
        if hist.claims:
            self.taken_over += 1
        evs = [Claimed(request_id=rid, engine=self.id, attempt=owner_attempt(token))]
        if tail:
            evs.append(Tokens(request_id=rid, token_ids=(), text=tail, step=self.sched.step))
        self._emit(evs)
        self.requests.unannounced.add(rid)
        self._emit(self.sched.add(rid, data, tuple(hist.tokens)))

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
        evs = self.sched.update(out, result)
        now = time.monotonic()
        for ev in evs:
            if type(ev) is Tokens and (live := requests.get(ev.request_id)) is not None:
                live.progress = now
        self._emit(evs, deltas, result.logprobs, result.embeddings)
        self._publish_gauges()

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
        for rid, entry, req, token in back:
            key = self.bus.keys.owner(rid)
            # The owner key goes before the request is re-queued: a claimer must find it free.
            released = await self.link.retry(
                "hand back", lambda: failover.cas_owner(self.bus.redis, key, token, None, self.bus.req_ttl_s)
            )
            if not released:
                continue  # no longer ours (taken over meanwhile): nothing to hand back
            await self.link.retry(
                "hand back",
                lambda: self.bus.publish_many(
                    [(self.bus.keys.requests, replace(req, resume=True, ts=0))], ack=[entry]
                ),
            )
            self.handed_back += 1
            log.info("handed back", extra={"request_id": rid, "engine": self.id})

    # ------------------------------------------------------------------ control

    async def _control_loop(self, cursor: bytes) -> None:
        backoff = self.cfg.retry_backoff_s
        while not self._stopping:
            try:
                cursor, events = await self.control_bus.read_control(cursor, self.cfg.control_block_ms)
                backoff = self.cfg.retry_backoff_s
            except RETRYABLE as e:
                self.link.failed("control read", e)
                backoff = await self.link.pause(backoff)
                continue
            except Exception:  # a bug: keep the engine alive, retry shortly
                log.exception("control read failed", extra={"engine": self.id})
                await asyncio.sleep(0.5)
                continue
            try:
                for entry_id, ev in events:
                    await self._on_control(ev, entry_id)
                if events:
                    await self._flush()
                    self._wake.set()
            except Stopped:
                return

    async def _on_control(self, ev: Event, entry_id: bytes | None = None) -> None:
        if isinstance(ev, Abort):
            await self._abort(ev.request_ids, ev.source)
        elif isinstance(ev, AbortAll):
            if ev.engine in (None, "", self.id):
                await self._abort_all(ev, entry_id)
        elif isinstance(ev, Drain):
            # the look-back must not replay a drain meant for an earlier life of this id
            if ev.engine == self.id and ev.ts >= self._started_ms:
                self.drain()
        elif isinstance(ev, LoadLora):
            if self.adapters.want_load(ev.name):
                self.lora.load(ev.name, ev.path)
        elif isinstance(ev, UnloadLora):
            if self.adapters.unload(ev.name, self._lora_in_use(ev.name)):
                self.lora.forget(ev.name)
            self._beat_now()

    # ------------------------------------------------------------------ LoRA at run time

    def _lora_in_use(self, name: str) -> bool:
        return any(live.request.data.sampling.lora == name for live in self.requests.values())

    def _beat_now(self) -> None:
        """Write the heartbeat now (an API node waits on it for an adapter's load)."""
        task = asyncio.get_running_loop().create_task(
            self.bus.heartbeat(self.id, self.status(), self.cfg.heartbeat_ttl_s)
        )
        self._beats.add(task)
        task.add_done_callback(self._beats.discard)

    def hears_local_arrivals(self) -> None:
        """An API in this process will say when it submits (``fd serve``): from now on the
        engine claims when told so (:meth:`on_local_arrival`), and otherwise only every
        ``CLAIM_POLL_S`` (for requests from anywhere else), not before every step, nor in a
        blocking read while idle (whose reply, a few callbacks long, waited behind the
        ingress of the burst that woke it: the first burst after start was claimed whole)."""
        self._arrivals_told = True

    def on_local_arrival(self) -> None:
        """This process's API put requests on ``P:requests`` (``fd serve``)."""
        self._arrivals_told = True
        self._arrived = True
        if self._idle is not None:
            _wake_up(self._idle)
        self._wake.set()

    def on_local_control(self, ev: Event) -> None:
        """An abort published in this process (``fd serve``'s API): stage 1 for the requests
        this engine runs, now rather than when the control read brings it. The same event comes
        again from ``P:control`` and is then a no-op for them; unknown ids (tombstones) are left
        to that read."""
        if not isinstance(ev, Abort) or self._stopping:
            return
        evs: list[Event] = []
        for rid in ev.request_ids:
            if self.sched.knows(rid) and not self.requests.silent(rid):
                mine = self.sched.abort(rid, ev.source)
                if mine:
                    self._count_abort(ev.source)
                evs += mine
        if evs:
            self._emit(evs)
            self.publisher.flush_soon()
            self._wake.set()

    async def _abort_all(self, ev: AbortAll, entry_id: bytes | None) -> None:
        """``abort_all``: every request this engine runs or is owning, and, unless the event
        names an engine, every request on ``P:requests`` accepted in or before the event's
        millisecond that is not finished: the unclaimed ones (each engine lays the same
        tombstones; one wins each, and writes its story), and those other engines run or own
        (each aborts its own). Requests accepted after that are not touched. With
        ``engine=<id>`` the queue is left alone: it belongs to no engine.

        This engine's own requests count by when they were accepted (``arrival_ts``; the
        entry of a resumed one is newer than its acceptance): one accepted after the event
        that this engine claimed before reading the event runs on. (Those it is still
        owning are on ``P:requests`` under their entry, and the scan finds the ones accepted
        by then.)"""
        entries: dict[str, bytes] = {}
        if ev.engine or entry_id is None:
            rids = dict.fromkeys((*self.requests, *self.requests.admitting))
        else:
            until = entry_id_key(entry_id)[0]
            rids = dict.fromkeys(
                rid for rid, live in self.requests.items() if live.request.data.arrival_ts <= until
            )
            queued = await self.link.retry("abort_all", lambda: self.bus.queued_until(entry_id))
            for entry, rid in queued:
                rids[rid] = None
                entries[rid] = entry
        await self._abort(tuple(rids), ev.source, entries)

    async def _abort(
        self, rids: tuple[str, ...], source: str, entries: Mapping[str, bytes] | None = None
    ) -> None:
        """``entries``: the ``P:requests`` entries of some of ``rids`` (``abort_all``'s scan):
        one whose tombstone this engine lays is acknowledged and deleted with its story, so no
        engine claims it only to find the tombstone."""
        # Counted where the abort takes effect: every engine reads every abort (broadcast),
        # but exactly one engine owns the request or wins its tombstone.
        unknown = []
        for rid in rids:
            if not self.sched.knows(rid):
                unknown.append(rid)
            elif not self.requests.silent(rid):  # (handed back or lost: its new owner aborts it)
                evs = self.sched.abort(rid, source)
                if evs:
                    self._count_abort(source)
                self._emit(evs)
        if not unknown:
            return
        # Not ours (yet): race the claim for each with a tombstone (one round trip for all).
        # Whoever wins SET NX decides: if the abort wins, no engine will ever prefill the
        # request. Its story is written now if its stream is there (queued, unclaimed), else by
        # whoever meets the tombstone next (the API submitting it, an engine claiming it).
        results = []
        for i in range(0, len(unknown), TOMBSTONE_BATCH):
            batch = unknown[i : i + TOMBSTONE_BATCH]
            results += await self.link.retry(
                "abort", lambda: self.bus.tombstone_many(batch, source, self.cfg.tombstone_ttl_s)
            )
            await asyncio.sleep(0)  # an in-process Redis runs each batch on this loop: let others in
        choices: list[str] = []
        for rid, (won, owner, exists) in zip(unknown, results):
            if won:
                self._count_abort(source)
                if exists:
                    await self._write_tombstone_story(rid)
                    if entries and rid in entries:
                        self.publisher.ack(rid, entries[rid])  # (after the story: one batch)
            elif (n := owner_choices(owner)) is not None:
                choices += choice_ids(rid, n)  # a response of n choices: abort each of them
            elif (
                owner is not None
                and owner == self.requests.tokens.get(rid)
                and self.sched.knows(rid)
                and not self.requests.silent(rid)
            ):
                # This engine's claim won while the tombstones were on their way, and started
                # the request meanwhile: it is an abort of a known request now.
                evs = self.sched.abort(rid, source)
                if evs:
                    self._count_abort(source)
                self._emit(evs)
            elif not is_tombstone(owner):
                # Owned: by a live engine (which handles it), by a dead one or one handing it
                # back (whoever continues it must still abort it), or by this engine between
                # owning it and starting it. Remember it for the case this engine is the one.
                self._dismiss(rid, source)
        if choices:
            await self._abort(tuple(choices), source)

    async def _write_tombstone_story(self, rid: str) -> None:
        source = await self.link.retry("abort", lambda: self.bus.take_abort_story(rid))
        if source is not None:
            self.requests.tokens[rid] = ABORT_WRITTEN  # (the fence lets the one who flipped it write)
            self._emit(tombstone_story(rid, source))

    @staticmethod
    def _take_prompt_logprobs(live: Live) -> dict | None:
        """The prompt's log-probabilities for the request's first tokens event, once every
        prompt position was scored (its last prefill chunk samples that first token)."""
        got = live.prompt_lp
        if got is None:
            return None
        prompt = live.request.data.prompt_token_ids
        if len(got) < len(prompt) - 1:
            return None
        live.prompt_lp = None
        return prompt_logprobs_field(prompt, [got[p] for p in range(1, len(prompt))])

    def _dismiss(self, rid: str, source: str) -> None:
        self.requests.dismiss(rid, source, time.monotonic(), self.cfg.tombstone_ttl_s)

    def _count_abort(self, source: str, n: int = 1) -> None:
        if self.metrics is not None:
            counter = self._abort_counters.get(source)
            if counter is None:  # (labels() is slow enough to show in a 1,000-id abort)
                counter = self._abort_counters[source] = self.metrics.abort_requests_total.labels(
                    source=source
                )
            counter.inc(n)

    # ------------------------------------------------------------------ output

    def _emit(
        self,
        evs: list[Event],
        texts: dict[str, str] | None = None,
        logprobs: dict[str, tuple[float, tuple]] | None = None,
        embeddings: dict[str, bytes] | None = None,
    ) -> None:
        """Stamp and queue events for the next flush; ``texts``: the step's text deltas, by
        request, for its ``Tokens`` (which the scheduler makes without text), and
        ``logprobs`` and ``embeddings`` the runner's, for those that asked."""
        now = time.time()
        ts = int(now * 1000)
        drop: list[str] = []
        # abort_requested of requests with no record here (a tombstone's story, written
        # whole in one call): their blocks_released follows in the same call.
        noted: dict[str, float] = {}
        put = self.publisher.put
        requests = self.requests
        for ev in evs:
            rid = ev.request_id  # type: ignore[attr-defined]
            live = requests.get(rid)
            silent = live is not None and live.silent
            if type(ev) is Tokens:  # the common case: one per request per step
                if not silent:
                    text = texts.pop(rid, ev.text) if texts else ev.text
                    lp = logprobs.get(rid) if logprobs else None
                    plp = (
                        self._take_prompt_logprobs(live)
                        if live is not None and live.prompt_lp is not None and ev.token_ids
                        else None
                    )
                    emb = embeddings.get(rid) if embeddings else None
                    put(
                        self.bus.keys.req(rid),
                        Tokens(
                            request_id=rid,
                            token_ids=ev.token_ids,
                            text=text,
                            step=ev.step,
                            ts=ts,
                            logprobs=None if lp is None else logprobs_field([lp]),
                            prompt_logprobs=plp,
                            embedding=None if emb is None else embedding_field(emb),
                        ),
                    )
                continue
            if (
                live is not None
                and live.detok is not None
                and isinstance(ev, (AbortRequested, BlocksReleased, Final))
            ):
                # The request emits no more tokens: text held back (a possible stop-string
                # prefix, an incomplete UTF-8 character) goes out now, before the end of its
                # story, so nothing but the protocol's own events follows abort_requested.
                tail = live.detok.flush()
                live.detok = None
                if tail and not silent:
                    put(
                        self.bus.keys.req(rid),
                        Tokens(request_id=rid, token_ids=(), text=tail, ts=ts, step=self.sched.step),
                    )
            if isinstance(ev, AbortRequested):
                if live is not None:
                    live.abort_noted_at = now
                else:
                    noted[rid] = now
                if self.sched.in_flight(rid):
                    drop.append(rid)
            elif isinstance(ev, BlocksReleased):
                if live is not None:
                    t, live.abort_noted_at = live.abort_noted_at, None
                else:
                    t = noted.pop(rid, None)
                if t is not None and self.metrics is not None and not silent:
                    self.metrics.abort_release_seconds.observe(now - t)
            elif isinstance(ev, Final):
                self.publisher.ended(rid)
                requests.forget(rid)
                req = None if live is None else live.request
                if (
                    self.adapters.unloading
                    and req is not None
                    and req.data.sampling.lora
                    and self.adapters.done_with(
                        req.data.sampling.lora, self._lora_in_use(req.data.sampling.lora)
                    )
                ):
                    self.lora.forget(req.data.sampling.lora)
                if silent:
                    continue  # its new owner acks it and writes its final
                if live is not None and live.timed_out:
                    ev = replace(
                        ev,
                        finish_reason="error",
                        error=(f"no progress for {self.cfg.request_timeout_s:g} s (request timeout)"),
                    )
                # (its own story's and owner key's TTL: renewed by the fence with the final)
                if req is not None and req.data.parent:  # see RequestData.parent
                    self.publisher.expire(rid, self.bus.keys.req(req.data.parent))
                    self.publisher.expire(rid, self.bus.keys.owner(req.data.parent))
                if live is not None:
                    self.publisher.ack(rid, live.entry)
            if silent:
                continue
            fields: dict[str, Any] = {"ts": ts}
            if hasattr(ev, "engine") and not getattr(ev, "engine"):
                fields["engine"] = self.id
            put(self.bus.keys.req(rid), replace(ev, **fields))
        if drop and hasattr(self.runner, "drop"):
            # A step queued behind the running one (async scheduling) may not have started:
            # the worker leaves these out of it and says so, and their blocks come back after
            # the running step instead of after that one too.
            try:
                self.runner.drop(self.sched.step, drop)
            except OSError:
                pass  # the worker is gone: its step results say so
        if drop:
            self._release_finished()  # held only by steps whose results are in already

    def _on_skipped(self, step: int, rids: list[str]) -> None:
        """The worker started ``step`` without these aborting requests: drain and release."""
        evs = self.sched.skipped(step, rids)
        if evs:
            self._emit(evs)
            self.publisher.flush_soon()
        self._release_finished()  # those held only by steps whose results are in go now

    async def _flush(self) -> None:
        """Publish what the loops queued (engine.publisher); every loop flushes through here."""
        await self.publisher.flush()

    def _publish_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_engine_gauges(
                blocks_total=self.sched.num_total_blocks,
                blocks_free=self.sched.num_free_blocks,
                running=self.sched.num_running,
                waiting=self.sched.num_waiting,
                cache_queries=self.sched.num_cache_queries,
                cache_hits=self.sched.num_cache_hits,
            )

    # ------------------------------------------------------------------ background loops

    async def _sleep_while_running(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < end:
            await asyncio.sleep(min(0.05, max(0.0, end - time.monotonic())))

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            try:
                await self.bus.heartbeat(self.id, self.status(), self.cfg.heartbeat_ttl_s)
                self.link.ok()
                await self._check_ownership()
            except RETRYABLE as e:
                self.link.failed("heartbeat", e)
            except Exception:
                log.exception("heartbeat failed", extra={"engine": self.id})
            self._publish_gauges()
            await self._sleep_while_running(self.cfg.heartbeat_s)

    async def _check_ownership(self) -> None:
        """A request whose owner key no longer holds this engine's token was taken over (this
        engine looked dead to a peer): stop running it, silently, before its next write would
        meet the fence. Those still held get their owner key's and story's TTL renewed every
        quarter TTL, so a request that runs for longer than the TTL keeps them (the fence
        refuses a write once its owner key is gone)."""
        requests = self.requests
        rids = [r for r, live in requests.items() if not live.silent and self.sched.knows(r)]
        if not rids:
            return
        pipe = self.bus.redis.pipeline(transaction=False)
        for rid in rids:
            pipe.get(self.bus.keys.owner(rid))
        now = time.monotonic()
        due: list[str] = []
        for rid, owner in zip(rids, await pipe.execute()):
            owner = owner.decode() if isinstance(owner, bytes) else owner
            live = requests.get(rid)
            if live is None or live.silent or not self.sched.knows(rid):
                continue
            if owner != requests.tokens.get(rid):
                self._lose(rid, Refused("owner", owner))
            elif now - live.renewed > self.bus.req_ttl_s / 4:
                live.renewed = now
                due += [self.bus.keys.owner(rid), self.bus.keys.req(rid)]
                req = live.request
                if req.data.parent:  # (a choice: its response's story too)
                    due += [self.bus.keys.owner(req.data.parent), self.bus.keys.req(req.data.parent)]
        if due:  # (not atomic with the GET: at worst it renews a new owner's keys, as it would)
            await self.bus.renew(list(dict.fromkeys(due)))
        self._wake.set()

    def _lose(self, rid: str, why: Refused) -> None:
        """The fence refused this request's events, or its owner key moved on: another
        engine runs it (or it ended). Stop scheduling it, drop it in the runner, release its
        blocks, and write nothing more to its story."""
        if not self.requests.lose(rid):
            return  # (a flush made before it was dropped, refused too)
        self.fenced += 1
        log.warning(
            "fenced: not the owner any more; dropping",
            extra={"request_id": rid, "engine": self.id, "owner": why.owner, "why": why.why},
        )
        live = self.requests.get(rid)
        if live is not None and not live.silent and self.sched.knows(rid):
            live.silent = True
            self._emit(self.sched.abort(rid, "engine"))
            self._wake.set()

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
                await self.bus._requests_or_dead([(entry, fields)])
        for entry, rid in aborted:  # read by an engine that died before acking it
            await self._write_tombstone_story(rid)
            await self._flush()
            await self.bus.ack_request(entry)
        for o in orphans:
            if self._draining or self._stopping or self.sched.can_admit() <= 0:
                break
            log.info(
                "taking over", extra={"request_id": o.request.request_id, "owner": o.owner, "engine": self.id}
            )
            await self._admit(o.entry_id, o.request, takeover=True, owner=o.owner)
        if orphans:
            await self._flush()
            self._wake.set()

    async def _watchdog_loop(self) -> None:
        limit = self.cfg.request_timeout_s
        while not self._stopping:
            await self._sleep_while_running(min(0.1, limit / 4))
            now = time.monotonic()
            late = [
                (rid, live)
                for rid, live in self.requests.items()
                if live.progress is not None
                and now - live.progress > limit
                and not live.timed_out
                and not live.silent
                and self.sched.knows(rid)
            ]
            for rid, live in late:
                log.warning("request timed out", extra={"request_id": rid, "engine": self.id})
                live.timed_out = True
                self._count_abort("timeout")
                self._emit(self.sched.abort(rid, "timeout"))
            if late:
                try:
                    await self._flush()
                except Stopped:
                    return
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
