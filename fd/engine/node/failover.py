"""Taking over the requests of an engine that died, and handing requests back on a drain.

Who runs a request is decided by ``P:owner:{id}`` alone, never by the consumer group's pending
list: a pending entry only says some engine once read it. So an engine looks for orphans in
the pending list (entries idle for a while) and takes over one only when its owner is gone:
no owner key, an owner whose heartbeat hash ``P:engine:<id>`` has expired, or itself in an
earlier life. It never takes a request from an engine that is alive.

The takeover is a compare-and-set of the owner key (WATCH/MULTI): of two live engines that both
saw the owner dead, exactly one moves the key from the dead owner's token to a token of its own
with the next attempt (fd/control/fence.py), which from then on fences the old owner's writes. The winner reads the request's story to learn
what the dead engine already published (tokens, claims, an abort it noted, a final) and
continues from there; see :class:`History`.

A drain hands requests back the other way: the draining engine releases the owner key (again
compare-and-set: only if it is still the owner) and re-queues the request on ``P:requests``
with ``resume`` set, so any engine claims it at once and continues from its stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from fd.control.bad_event import BadEvent
from fd.control.bus import Bus
from fd.control.events import (
    AbortRequested,
    BlocksReleased,
    Claimed,
    Drained,
    Event,
    Final,
    Preempted,
    Request,
    Tokens,
    decode,
)
from fd.control.keys import is_tombstone, owner_engine
from fd.engine.node.redis_link import RedisLink

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


@dataclass
class History:
    """What a request's stream says about it when an engine (re)starts it."""

    tokens: list[int] = field(default_factory=list)  # generated and published, in order
    text: str = ""  # the text published with them
    claims: int = 0  # `claimed` events: one per engine that started it
    attempt: int = 0  # the greatest attempt claimed (the owner token's, fd.control.keys.owner_token)
    handbacks: int = 0  # `preempted handback=1`: starts that ended in a drain, not a failure
    final: bool = False
    noted: set[str] = field(default_factory=set)  # abort stages already on the stream
    abort_source: str | None = None  # the source of the abort noted on it

    @property
    def failures(self) -> int:
        return self.claims - self.handbacks

    @classmethod
    def of(cls, events: list[Event]) -> History:
        h = cls()
        for ev in events:
            if isinstance(ev, Tokens):
                h.tokens.extend(ev.token_ids)
                h.text += ev.text
            elif isinstance(ev, Claimed):
                h.claims += 1
                h.attempt = max(h.attempt, ev.attempt)
            elif isinstance(ev, Preempted) and ev.handback:
                h.handbacks += 1
            elif isinstance(ev, Final):
                h.final = True
            elif isinstance(ev, (AbortRequested, Drained, BlocksReleased)):
                h.noted.add(ev.TYPE)
                if isinstance(ev, AbortRequested):
                    h.abort_source = ev.source
        return h


@dataclass
class Orphan:
    entry_id: bytes
    request: Request
    owner: str | None  # the owner key's value when found: the takeover's expected value


class OrphanFinder:
    """Finds pending requests whose owner is gone. Remembers which entry holds which request
    (entry ids never change), so a scan costs three round trips however long requests run."""

    def __init__(self, bus: Bus, engine_id: str, min_idle_ms: int):
        self.bus = bus
        self.id = engine_id
        self.min_idle_ms = min_idle_ms
        self._requests: dict[bytes, Request | None] = {}
        self._bad: dict[bytes, Any] = {}  # the fields of those that do not decode to a request

    async def scan(
        self, count: int, mine: Any
    ) -> tuple[list[Orphan], list[tuple[bytes, Any]], list[tuple[bytes, str]]]:
        """``(orphans, (entry, fields)s to ack, tombstoned (entry, request id)s to finish and
        ack)``; an entry's fields are those of one that does not decode (to dead-letter: the
        engine that read it died, or Redis failed its dead letter, before one was written),
        None for one deleted; ``mine(request_id)`` says this engine runs it now."""
        bus = self.bus
        ids = await bus.pending_requests(self.min_idle_ms, max(count, 1) * 4 + 16)
        live_ids = set(ids)
        for eid in [e for e in self._requests if e not in live_ids]:
            del self._requests[eid]
            self._bad.pop(eid, None)
        unknown = [eid for eid in ids if eid not in self._requests]
        for eid, rows in zip(unknown, await bus.request_entries(unknown), strict=False):
            self._requests[eid] = _request_of(rows)
            if rows and self._requests[eid] is None:
                self._bad[eid] = rows[0][1]
        drop: list[tuple[bytes, Any]] = []
        cands: list[tuple[bytes, Request]] = []
        for eid in ids:
            req = self._requests.get(eid)
            if req is None:
                drop.append((eid, self._bad.get(eid)))  # nobody can ever run it
            elif not mine(req.request_id):
                cands.append((eid, req))
        if not cands:
            return [], drop, []
        owners = await bus.owners([req.request_id for _, req in cands])
        engines = [owner_engine(o) for o in owners]
        others = sorted(
            {e for o, e in zip(owners, engines, strict=False) if e and e != self.id and not is_tombstone(o)}
        )
        alive = await bus.engines_alive(others)
        found: list[Orphan] = []
        aborted: list[tuple[bytes, str]] = []
        for (eid, req), owner, engine in zip(cands, owners, engines, strict=False):
            if is_tombstone(owner):
                aborted.append((eid, req.request_id))  # an abort won: finish its story, ack
            elif owner is None or engine == self.id or not alive.get(engine, False):
                found.append(Orphan(eid, req, owner))
            if len(found) >= count:
                break
        return found, drop, aborted


def _request_of(rows) -> Request | None:
    if not rows:
        return None
    entry_id, fields = rows[0]
    try:
        ev = decode(fields, entry_id)
    except BadEvent:
        return None
    return ev if isinstance(ev, Request) else None


async def take_entry(bus: Bus, entry_id: bytes, consumer: str) -> None:
    """Move a pending entry to ``consumer``: it shows who runs it now, and its idle time starts
    over, so peers do not look at it again until this engine, too, goes quiet."""
    await bus.move_pending_request(entry_id, consumer)


async def hand_back(
    bus: Bus, link: RedisLink, engine_id: str, back: list[tuple[str, bytes, Request, str]]
) -> int:
    """A drain's hand-back, once its notes are out: for each ``(request id, P:requests entry,
    request, owner token)`` the owner key is released (compare-and-set: only if still this
    engine's), then the request re-queued with ``resume`` set and its old entry acknowledged.
    How many went back."""
    n = 0
    for rid, entry, req, token in back:
        # The owner key goes before the request is re-queued: a claimer must find it free.
        released = await link.retry(
            "hand back", lambda rid=rid, token=token: bus.cas_owner(rid, token, None, bus.req_ttl_s)
        )
        if not released:
            continue  # no longer ours (taken over meanwhile): nothing to hand back
        await link.retry(
            "hand back",
            lambda req=req, entry=entry: bus.publish_many(
                [(bus.keys.requests, replace(req, resume=True, ts=0))], ack=[entry]
            ),
        )
        n += 1
        log.info("handed back", extra={"request_id": rid, "engine": engine_id})
    return n
