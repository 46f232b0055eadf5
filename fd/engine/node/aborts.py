"""Who handles an abort, and how it ends (DESIGN.md §4): every engine reads every abort, and
exactly one of them acts on each request.

- A request this engine knows (its scheduler has it, or will at the next step) is aborted
  here, through the engine core's inbox: at its next step the scheduler says when its blocks
  can go (stage 1 then; 2 and 3 once no step in flight holds it).
- Any other id races the claim with a tombstone (``SET P:owner:{id} aborted:<source> NX``).
  Winning means no engine ever prefills it; its story is written by whoever flips the tombstone
  first with its stream in place. Losing to an engine's token leaves it to that engine; to a
  response's ``choices=<n>`` mark, it becomes an abort of each choice.
- An abort of a request owned elsewhere is remembered (``dismiss``): if this engine later
  takes the request over, the abort still wins.

Also here, the two ways a request leaves this engine without its story's end being this
engine's to write or decide: the fence refusing its events (:meth:`Aborts.lose`), and the
watchdog's timeout, an abort whose ``final`` says ``error``. Counted once per request, where the
abort takes effect (``fd_abort_requests_total{source}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from fd.control.bus import Bus
from fd.control.endings import timeout_error, tombstone_story
from fd.control.entry_ids import entry_id_key
from fd.control.events import AbortAll, Event
from fd.control.fence import Refused
from fd.control.keys import ABORT_WRITTEN, choice_ids, is_tombstone, owner_choices, pending_tombstone_source
from fd.engine.node.engine_core import EngineCore
from fd.engine.node.publisher import Publisher
from fd.engine.node.redis_link import RedisLink
from fd.engine.node.request_table import RequestTable

# (its lines are the engine node's: operators filter on that name)
#: The abort source of a request whose story lost what the engine wrote
#: (:meth:`Aborts._lost_output`), and its error.
LOST = "lost"
LOST_OUTPUT = (
    "part of this request's output was lost by the control plane (Redis lost writes it had "
    "acknowledged: a failover to a replica that lacked them); it cannot be continued exactly"
)

log = logging.getLogger("fd.engine.node.node")

#: Tombstones laid per round trip for a many-id abort: small enough that the embedded server
#: (which runs a pipeline on the event loop it shares with the API) never stalls the API long.
#: `POST /v1/abort_requests` with 1,000 unknown ids, 50 calls 20 ms apart, in `fd serve`:
#: p99 24-37 ms with 32 a round trip, 3.8-5.3 ms with 8.
TOMBSTONE_BATCH = 8


class AbortCounter:
    """``fd_abort_requests_total{source}``: an abort counted once per request, where it takes
    effect (the engine core, when it applies one; a tombstone won; a story finished)."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self._counters: dict[str, Any] = {}

    def count(self, source: str, n: int = 1) -> None:
        if self.metrics is not None:
            counter = self._counters.get(source)
            if counter is None:  # (labels() is slow enough to show in a 1,000-id abort)
                counter = self._counters[source] = self.metrics.abort_requests_total.labels(source=source)
            counter.inc(n)


class Aborts:
    def __init__(
        self,
        engine_id: str,
        bus: Bus,
        core: EngineCore,
        requests: RequestTable,
        link: RedisLink,
        publisher: Publisher,
        emit: Callable[[list[Event]], None],
        counter: AbortCounter,
        tombstone_ttl_s: int,
    ) -> None:
        self.engine_id = engine_id
        self.bus = bus
        self.core = core  # a request it knows is aborted through its inbox, at its next step
        self.requests = requests
        self.link = link
        self.publisher = publisher
        self.emit = emit
        self.count = counter.count
        self.tombstone_ttl_s = tombstone_ttl_s
        self.fenced = 0  # requests dropped because the fence refused their events

    async def abort_all(self, ev: AbortAll, entry_id: bytes | None) -> None:
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
                if entry is not None:
                    entries[rid] = entry
        await self.abort(tuple(rids), ev.source, entries)

    async def abort(
        self, rids: tuple[str, ...], source: str, entries: Mapping[str, bytes] | None = None
    ) -> None:
        """``entries``: the ``P:requests`` entries of some of ``rids`` (``abort_all``'s scan):
        one whose tombstone this engine lays is acknowledged and deleted with its story, so no
        engine claims it only to find the tombstone."""
        unknown = []
        for rid in rids:
            if not self.core.knows(rid):
                unknown.append(rid)
            elif not self.requests.silent(rid):  # (handed back or lost: its new owner aborts it)
                self.core.abort(rid, source)
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
                "abort", lambda batch=batch: self.bus.tombstone_many(batch, source, self.tombstone_ttl_s)
            )
            await asyncio.sleep(0)  # an in-process Redis runs each batch on this loop: let others in
        choices: list[str] = []
        for rid, (won, owner, exists) in zip(unknown, results, strict=False):
            if won:
                self.count(source)
            if won or (exists and pending_tombstone_source(owner) is not None):
                # A tombstone still to flip whose story is in place, laid here or not: the
                # story's writer is whoever flips it, whoever laid it. (A SET NX that went
                # through but whose reply a dropped connection lost is retried, and finds the
                # tombstone: every engine then thought another had laid it, and none wrote it.)
                if exists and await self.write_tombstone_story(rid) and entries and rid in entries:
                    self.publisher.ack(rid, entries[rid])  # (after the story: one batch)
            elif (n := owner_choices(owner)) is not None:
                choices += choice_ids(rid, n)  # a response of n choices: abort each of them
            elif (
                owner is not None
                and owner == self.requests.tokens.get(rid)
                and self.core.knows(rid)
                and not self.requests.silent(rid)
            ):
                # This engine's claim won while the tombstones were on their way, and started
                # the request meanwhile: it is an abort of a known request now.
                self.core.abort(rid, source)
            elif not is_tombstone(owner):
                # Owned: by a live engine (which handles it), by a dead one or one handing it
                # back (whoever continues it must still abort it), or by this engine between
                # owning it and starting it. Remember it for the case this engine is the one.
                self.dismiss(rid, source)
        if choices:
            await self.abort(tuple(choices), source)

    async def write_tombstone_story(self, rid: str) -> bool:
        """Write the abort story of a request no engine ran, if this engine is the one that
        flips its tombstone to ``aborted-final`` (True then)."""
        seen: list[str] = []  # (across the retries: see Ownership.take_abort_story)
        source = await self.link.retry("abort", lambda: self.bus.take_abort_story(rid, seen))
        if source is None:
            return False
        self.requests.tokens[rid] = ABORT_WRITTEN  # (the fence lets the one who flipped it write)
        self.emit(tombstone_story(rid, source))
        return True

    def dismiss(self, rid: str, source: str) -> None:
        self.requests.dismiss(rid, source, time.monotonic(), self.tombstone_ttl_s)

    def lose(self, rid: str, why: Refused) -> None:
        """The fence refused this request's events, or its owner key moved on: another
        engine runs it (or it ended). Stop scheduling it, drop it in the runner, release its
        blocks, and write nothing more to its story."""
        if why.why == "gap":
            self._lost_output(rid)
            return
        if not self.requests.lose(rid):
            return  # (a flush made before it was dropped, refused too)
        self.fenced += 1
        if why.error is not None:
            log.error(
                "redis refused the request's events; dropping it",
                extra={"request_id": rid, "engine": self.engine_id, "error": why.error},
            )
        else:
            log.warning(
                "fenced: not the owner any more; dropping",
                extra={"request_id": rid, "engine": self.engine_id, "owner": why.owner, "why": why.why},
            )
        live = self.requests.get(rid)
        if live is not None and not live.silent and self.core.knows(rid):
            live.silent = True
            self.core.abort(rid, "engine", counted=False)

    def _lost_output(self, rid: str) -> None:
        """Its story lacks events this engine wrote (fd/control/fence.py's gap: a Redis failover
        lost them): what its client saw can no longer be continued exactly, so it ends with
        an error, through the abort stages, while this engine still owns it."""
        live = self.requests.get(rid)
        if live is None or live.silent or not self.core.knows(rid):
            return
        log.error(
            "the request's story lost events this engine wrote (a Redis failover?); ending it",
            extra={"request_id": rid, "engine": self.engine_id},
        )
        self.core.abort(rid, LOST, LOST_OUTPUT)

    async def watch_timeouts(
        self, limit_s: float, sleep: Callable[[float], Any], stopping: Callable[[], bool]
    ) -> None:
        """Abort each request with no new token for ``limit_s`` (``source=timeout``), as a
        failure: the scheduler ends it with ``final finish_reason=error`` saying why."""
        while not stopping():
            await sleep(min(0.1, limit_s / 4))
            now = time.monotonic()
            late = [
                (rid, live)
                for rid, live in self.requests.items()
                if live.progress is not None
                and now - live.progress > limit_s
                and not live.timed_out
                and not live.silent
                and self.core.knows(rid)
            ]
            for rid, live in late:
                log.warning("request timed out", extra={"request_id": rid, "engine": self.engine_id})
                live.timed_out = True
                self.core.abort(rid, "timeout", timeout_error(limit_s))
