"""How a request becomes this engine's: claimed from ``P:requests`` (pull-based: only as many
as the scheduler can admit now, so what this engine cannot start soon stays in Redis for
another), owned with an owner token of a new attempt (``SET P:owner:{id} NX``, or a
compare-and-set for a takeover, DESIGN.md §4b), checked, and started in the scheduler.

Owning decides the claim-versus-abort race: a claim that meets a tombstone never prefills the
request (and may be the one that writes its abort story). Starting is synchronous, so no abort
can slip in between the checks and ``Scheduler.add``; an abort that came while no live engine
ran the request (remembered as dismissed, or already on its story) ends it there instead.

With an API in this process that says when it submits (``fd serve``), the engine claims when
told so, and otherwise polls every ``CLAIM_POLL_S`` (for requests from anywhere else) rather
than before every step or in a blocking read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fd.control.bus import Bus
from fd.control.endings import ABORT_REQUESTED, abort_story, error_final, usage
from fd.control.events import Claimed, Event, Request, Tokens
from fd.control.guided import GuidedError
from fd.control.guided import check as check_guided
from fd.control.keys import is_tombstone, owner_attempt, owner_engine, owner_token
from fd.engine.core.adapters import Adapters
from fd.engine.core.detokenizer import IncrementalDetokenizer
from fd.engine.node import failover
from fd.engine.node.aborts import LOST, LOST_OUTPUT, Aborts
from fd.engine.node.engine_core import EngineCore
from fd.engine.node.failover import History
from fd.engine.node.lanes import LaneClaims
from fd.engine.node.node_config import EngineConfig
from fd.engine.node.publisher import Publisher
from fd.engine.node.redis_link import RETRYABLE, RedisLink
from fd.engine.node.request_table import RequestTable

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")

#: With an API in the same process announcing its requests (``fd serve``), a running engine
#: still asks ``P:requests`` this often for requests from anywhere else (another API node,
#: ``redis-cli``), instead of before every step (8% of the loop at 8 streams).
CLAIM_POLL_S = 0.01


def _wake_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Admission:
    def __init__(
        self,
        cfg: EngineConfig,
        bus: Bus,
        core: EngineCore,
        requests: RequestTable,
        link: RedisLink,
        publisher: Publisher,
        emit: Callable[[list[Event]], None],
        aborts: Aborts,
        adapters: Adapters,
        tokenizer: Any,
        closed: Callable[[], bool],
        lanes: LaneClaims,
    ) -> None:
        self.cfg = cfg
        self.engine_id = cfg.engine_id
        self.bus = bus
        self.core = core  # a request starts in its inbox (EngineCore.arrive)
        self.requests = requests
        self.link = link
        self.publisher = publisher
        self.emit = emit
        self.aborts = aborts
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.closed = closed  # draining or stopping: nothing new is claimed
        self.lanes = lanes  # where to claim from (placement's lanes, or P:requests)
        self.arrivals_told = False  # an API in this process says when it submits (fd serve)
        self.arrived = False
        self._idle: asyncio.Future | None = None  # the step loop waits for an arrival on it
        self._last_claim = 0.0
        self.taken_over = 0  # requests continued from a dead engine

    # ------------------------------------------------------------------ arrivals

    def announced(self) -> None:
        """This process's API put requests on ``P:requests`` (``fd serve``)."""
        self.arrivals_told = True
        self.arrived = True
        self.wake_idle()

    def wake_idle(self) -> None:
        if self._idle is not None:
            _wake_up(self._idle)

    async def await_arrival(self, loop: asyncio.AbstractEventLoop) -> None:
        """Idle, with an API in this process that says when it submits: wait for that (or
        ``CLAIM_POLL_S``, for requests from anywhere else) instead of in a blocking read."""
        if self.arrived or self.closed():
            return
        self._idle = fut = loop.create_future()
        timer = loop.call_later(CLAIM_POLL_S, _wake_up, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._idle = None

    # ------------------------------------------------------------------ claiming

    async def claim(self, block: bool) -> int:
        """Take as many requests as the scheduler can admit now: from ``P:requests``, and from
        placement's lanes (fd/engine/node/lanes.py)."""
        if self.closed():
            return 0
        n = self.core.can_admit()
        if n <= 0:
            if block:
                await asyncio.sleep(self.cfg.claim_block_ms / 1000)
            return 0
        if not block and self.arrivals_told:
            now = time.monotonic()
            if not self.arrived and now - self._last_claim < CLAIM_POLL_S:
                return 0  # nothing announced, and asked a moment ago
            self._last_claim = now
        self.arrived = False
        try:
            got = await self.lanes.claim(n, self.cfg.claim_block_ms if block else None)
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
            self.arrived = True
        # New requests are owned in one round trip (SET NX for all), not one each: a burst of
        # arrivals reaches its first step sooner.
        owned: dict[str, tuple[bool, str | None]] = {}
        fresh = [req.request_id for _, req in got if not req.resume]
        if len(fresh) > 1:
            try:
                token = owner_token(self.engine_id, 1)
                owned = dict(
                    zip(fresh, await self.bus.try_own_many(fresh, token, self.bus.req_ttl_s), strict=False)
                )
            except RETRYABLE as e:
                self.link.failed("claim", e)  # (then each is owned on its own below)
        for entry_id, req in got:
            await self.admit(entry_id, req, owned=owned.get(req.request_id))
        return len(got)

    async def admit(
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
        if rid in self.requests.admitting or self.core.knows(rid) or live is not None:
            if live is not None and live.entry != entry_id and not takeover:
                await self.ack_copy(entry_id, rid)
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

    async def _story(self, rid: str) -> History:
        return History.of([ev for _, ev in await self.bus.read_req(rid)])

    async def _own(
        self,
        entry_id: bytes,
        req: Request,
        takeover: bool,
        owner: str | None,
        owned: tuple[bool, str | None] | None = None,
    ) -> tuple[History, str] | None:
        """Take the owner key with a token of a new attempt (fd.control.keys.owner_token), and
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
                last = (await self._story(rid)).attempt
            token = owner_token(self.engine_id, last + 1)
            if not await self.bus.cas_owner(rid, owner, token, ttl):
                return None  # another engine was faster, or an abort won
            await failover.take_entry(self.bus, entry_id, self.engine_id)
        else:
            if req.resume:
                token = owner_token(self.engine_id, (await self._story(rid)).attempt + 1)
                owned = None
            else:
                token = owner_token(self.engine_id, 1)  # a new request: the first grant
            won, current = owned if owned is not None else await self.bus.try_own(rid, token, ttl)
            if not won and current == token:
                # A retried SET NX that had in fact got through, or a second entry of a
                # request this engine already ran (an XADD sent twice, one written by hand):
                # the story says which.
                if (await self._story(rid)).final:
                    await self.ack_copy(entry_id, rid)
                    return None
            elif not won:
                log.info("claim lost", extra={"request_id": rid, "owner": current})
                if owner_attempt(current) is not None:  # an engine's token
                    # A peer owns it: it took this entry over while this engine sat between
                    # reading it and owning it (paused, or its SET NX late), or it runs the
                    # request under another entry. Either way the entry is the owner's now:
                    # acknowledged here, it would leave the pending list, and once that owner
                    # died no failover scan could find the request again.
                    await failover.take_entry(self.bus, entry_id, owner_engine(current))
                    return None
                # An abort got here first (tombstone): the request is never prefilled. Its
                # story is written by whoever flips the tombstone first, maybe this engine.
                if is_tombstone(current):
                    await self.aborts.write_tombstone_story(rid)
                    await self.publisher.flush()
                await self.bus.ack_request(entry_id)
                return None
        if not (takeover or req.resume):
            return History(), token
        hist = await self._story(rid)
        if hist.final:  # it had finished; only the ack was missing
            await self.bus.ack_request(entry_id)
            return None
        return hist, token

    async def ack_copy(self, entry_id: bytes, rid: str) -> None:
        """A second ``P:requests`` entry of a request this engine runs or finished: nothing
        to run, so it leaves the stream (else it stays pending on this live engine, which the
        failover scan never takes from, until the owner key expires)."""
        log.warning(
            "a second entry of the request; acknowledged", extra={"request_id": rid, "engine": self.engine_id}
        )
        try:
            await self.bus.ack_request(entry_id)
        except RETRYABLE as e:  # (still pending: the next look at it acks it)
            self.link.failed("claim", e)

    # ------------------------------------------------------------------ starting

    def _refusal(self, req: Request, hist: History) -> str | None:
        """Why this engine cannot run the request at all (it ends with an error), or None."""
        if hist.failures >= self.cfg.max_attempts:
            msg = f"request failed on {hist.failures} engine(s); giving up after max_attempts={self.cfg.max_attempts}"
            log.warning(msg, extra={"request_id": req.request_id, "engine": self.engine_id})
            return msg
        sp = req.data.sampling
        if sp.lora and sp.lora not in self.adapters.ready:
            return f"this engine has no LoRA adapter {sp.lora!r} (see --lora-modules)"
        if sp.guided:  # (the API checked it; a hand-written request may not have been)
            try:
                check_guided(sp.guided)
            except GuidedError as e:
                return f"sampling.guided does not compile: {e}"
        return None

    def _start(self, entry_id: bytes, req: Request, hist: History, token: str) -> None:
        """Synchronous, so no abort can slip in between the checks and ``core.arrive``."""
        rid, data = req.request_id, req.data
        live = self.requests.add(rid, entry_id, req, token, time.monotonic())
        used = usage(len(data.prompt_token_ids), len(hist.tokens))
        step = self.core.sched.step
        dismissed = self.requests.take_dismissed(rid)
        if dismissed is not None or ABORT_REQUESTED in hist.noted:
            # Aborted while no live engine ran it (its owner had died, or was handing it back):
            # finish the abort's story, never run it.
            source = dismissed if dismissed is not None else hist.abort_source or "engine"
            self.aborts.count(source)
            error = LOST_OUTPUT if source == LOST else None  # (its output lost: a failure)
            self.emit(abort_story(rid, source, used, step=step, noted=hist.noted, error=error))
            return
        refused = self._refusal(req, hist)
        if refused is not None:
            self.emit([error_final(rid, used, refused, step=step)])
            return
        sp = data.sampling
        detok = IncrementalDetokenizer.for_request(self.tokenizer, sp, self.core.sched.config.eos_token_ids)
        tail = ""
        if hist.tokens:
            # Prime it with what the client already has, so text deltas continue exactly; text
            # the dead engine held back (a partial character, a possible stop-string prefix)
            # and never published is the difference, and goes out first.
            primed, _ = detok.push(hist.tokens)
            if primed.startswith(hist.text):
                tail = primed[len(hist.text) :]
        live.detok = detok
        live.emitted = len(hist.tokens)
        if sp.prompt_logprobs is not None and not hist.tokens:  # (a takeover: shown already)
            live.prompt_lp = {}
        live.progress = time.monotonic()
        if hist.claims:
            self.taken_over += 1
        evs: list[Event] = [Claimed(request_id=rid, engine=self.engine_id, attempt=owner_attempt(token))]
        if tail:
            evs.append(Tokens(request_id=rid, token_ids=(), text=tail, step=step, pos=live.emitted))
        self.emit(evs)
        self.requests.unannounced.add(rid)
        self.core.arrive(rid, data, tuple(hist.tokens))
