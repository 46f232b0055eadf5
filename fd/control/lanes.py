"""Placement's keys: engines' lanes, their registry and their cards (DESIGN.md §4c).

A request the API places for an engine waits on that engine's lane (``P:lane:<engine>``, a
stream with no group) instead of on ``P:requests``. Nothing else about it changes: an engine
*takes* requests from a lane with one script that moves them onto ``P:requests`` and reads
them there through group ``engines`` in the same step, so from then on the request is an
ordinary ``P:requests`` entry (owner key, pending list, failover, drain hand-back, ack at its
final). The engine a lane is for takes from it when it can admit; any other engine that can
admit *steals* from it (the same script) once the lane's oldest request has waited longer
than its bound, or at once when the lane's engine is dead. A lane is therefore only a
preference about which engine pulls a request first, and a wrong or stale preference costs a
cache miss or the bound, never the request.

Every lane is registered in ``P:lanes`` (a set of engine ids) by the same script that appends
to it, so a lane with a request in it is always found; a lane is dropped from the registry only
by a script that finds it empty (the take of a dead engine's lane). The lanes, the registry and
``P:requests`` share the slot of ``P:requests``'s name (fd/control/keys.py), so each script
names keys of one slot on a Redis Cluster too.

A card (``P:card:<engine>``, a hash with the heartbeat's TTL) is what an engine tells the API
about itself for placement: its batch and KV pool, and the short ids of the blocks its prefix
cache holds (fd/control/prefix.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import ResponseError

from fd.control import prefix
from fd.control.entry_ids import entry_id_key
from fd.control.events import Request
from fd.control.keys import GROUP_ENGINES, Keys, valid_request_id
from fd.control.store import StreamEntry

#: KEYS: lane, registry. ARGV: engine, then the request's fields. Registers the lane before the
#: request is in it.
PLACE = """
redis.call('SADD', KEYS[2], ARGV[1])
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
"""

#: KEYS: P:requests, lane, registry. ARGV: group, consumer, count, the lane's engine, prune,
#: read. Reads new entries of P:requests for the consumer first (a hand-back, a request placed
#: for no engine); if fewer than ``count``, moves the lane's oldest requests onto P:requests
#: (their lane entry id in ``queued``: when they were accepted) and reads those. Without
#: ``read``, only moves them (all ``count``) for any engine to claim. With ``prune`` an emptied
#: lane leaves the registry. Returns the entries read, then P:requests' newest id.
TAKE = """
local n = tonumber(ARGV[3])
local out = {}
local function read(k)
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', k, 'STREAMS', KEYS[1], '>')
  if r then
    for _, e in ipairs(r[1][2]) do out[#out + 1] = e end
  end
end
if ARGV[6] == '1' then read(n) end
if #out < n then
  local moved = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', n - #out)
  for _, e in ipairs(moved) do
    local f = e[2]
    f[#f + 1] = 'queued'
    f[#f + 1] = e[1]
    redis.call('XADD', KEYS[1], '*', unpack(f))
    redis.call('XDEL', KEYS[2], e[1])
  end
  if #moved > 0 and ARGV[6] == '1' then read(#moved) end
  if ARGV[5] == '1' and redis.call('XLEN', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[2])
    redis.call('SREM', KEYS[3], ARGV[4])
  end
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
return {out, last[1] and last[1][1] or '0-0'}
"""

#: KEYS: lanes. Each one's oldest entry id (false: empty), then the server's TIME (s, us).
HEADS = """
local out = {}
for i, k in ipairs(KEYS) do
  local e = redis.call('XRANGE', k, '-', '+', 'COUNT', 1)
  out[i] = e[1] and e[1][1] or false
end
local t = redis.call('TIME')
out[#KEYS + 1] = t[1]
out[#KEYS + 2] = t[2]
return out
"""

CARD_VERSION = 1


class Placer(Protocol):
    """What chooses a new request's lane (an API's :class:`fd.api.placement.Placement`)."""

    def choose(self, request: Request) -> str | None:
        """The engine whose lane ``request`` waits on; None: ``P:requests``."""
        ...


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


@dataclass(frozen=True)
class Card:
    """An engine's placement card (``P:card:<engine>``)."""

    engine: str
    block_size: int
    running: int
    waiting: int
    blocks_free: int
    blocks_total: int
    max_seqs: int
    seq: int  # counts the card's writes: a new one says the load is fresh
    blocks: frozenset[int] = field(default_factory=frozenset)  # short ids of cached blocks
    lane: int = 0  # requests waiting on its lane when read (not written: the lane's length)

    @property
    def load(self) -> int:
        """Requests it runs, holds waiting, and has waiting on its lane."""
        return self.running + self.waiting + self.lane

    def fields(self) -> dict[str, str | bytes | int]:
        return {
            "v": CARD_VERSION,
            "block_size": self.block_size,
            "running": self.running,
            "waiting": self.waiting,
            "blocks_free": self.blocks_free,
            "blocks_total": self.blocks_total,
            "max_seqs": self.max_seqs,
            "seq": self.seq,
            "blocks": prefix.pack(self.blocks),
        }

    @classmethod
    def of(cls, engine: str, raw: Mapping[bytes, bytes], lane: int = 0) -> Card | None:
        """A card read back; None for one absent, of a newer format, or malformed (a count
        below zero, a block size or seat count below one: placement would divide by them)."""
        try:
            if int(raw[b"v"]) != CARD_VERSION:
                return None
            card = cls(
                engine=engine,
                block_size=int(raw[b"block_size"]),
                running=int(raw[b"running"]),
                waiting=int(raw[b"waiting"]),
                blocks_free=int(raw[b"blocks_free"]),
                blocks_total=int(raw[b"blocks_total"]),
                max_seqs=int(raw[b"max_seqs"]),
                seq=int(raw[b"seq"]),
                blocks=prefix.unpack(raw.get(b"blocks", b"")),
                lane=lane,
            )
        except (KeyError, ValueError):
            return None
        counts = (card.running, card.waiting, card.blocks_free, card.blocks_total, card.lane)
        if card.block_size < 1 or card.max_seqs < 1 or min(counts) < 0:
            return None
        return card


def _accepted_ms(entry_id: bytes | str, queued: bytes | str | None) -> int:
    """When a ``P:requests`` entry's request was accepted: its lane entry's millisecond where
    it came from a lane (``queued``), else its own."""
    if queued:
        try:
            return entry_id_key(queued)[0]
        except ValueError:
            pass  # (hand-typed: the entry's own time)
    return entry_id_key(entry_id)[0]


class Lanes:
    """Placement's reads and writes, part of :class:`fd.control.bus.Bus`, whose client and keys
    they use."""

    redis: Any
    keys: Keys
    _place_script: Any = None
    _take_script: Any = None
    _heads_script: Any = None

    async def decode_requests(self, entries: Iterable[StreamEntry]) -> list[tuple[bytes, Request]]:
        raise NotImplementedError  # (Bus's)

    async def ensure_group(self) -> None:
        raise NotImplementedError  # (Bus's)

    async def place(self, engine: str, request: Request) -> None:
        """Append ``request`` to ``engine``'s lane (registered first)."""
        if self._place_script is None:
            self._place_script = self.redis.register_script(PLACE)
        flat: list[str] = []
        for k, v in request.encode().items():
            flat += (k, v)
        await self._place_script(keys=[self.keys.lane(engine), self.keys.lanes], args=[engine, *flat])

    async def take(
        self, consumer: str, count: int, lane: str, prune: bool = False
    ) -> tuple[list[tuple[bytes, Request]], bytes]:
        """Up to ``count`` requests for ``consumer``: new ones on ``P:requests`` first, then
        ``lane``'s (that engine's lane: the consumer's own, or one it steals from), moved onto
        ``P:requests`` and read there. Also ``P:requests``' newest entry id (where a wait for
        new work starts, :meth:`wait_for_work`)."""
        if self._take_script is None:
            self._take_script = self.redis.register_script(TAKE)
        keys = [self.keys.requests, self.keys.lane(lane), self.keys.lanes]
        args = [GROUP_ENGINES, consumer, count, lane, "1" if prune else "0", "1"]
        try:
            entries, last = await self._take_script(keys=keys, args=args)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # The group vanished (FLUSHALL, a deleted stream): recreate it and take again.
            await self.ensure_group()
            entries, last = await self._take_script(keys=keys, args=args)
        got = [(_b(eid), _fields(raw)) for eid, raw in entries]
        return await self.decode_requests(got), _b(last)

    async def release_lane(self, engine: str) -> None:
        """``engine`` leaves placement (a drain, a stop): its card goes, so no API places for
        it again, and what waits on its lane moves onto ``P:requests`` for any engine."""
        await self.redis.delete(self.keys.card(engine))
        await self.drop_lane(engine)

    async def drop_lane(self, engine: str, page: int = 1000) -> None:
        """What waits on ``engine``'s lane moves onto ``P:requests`` for any engine, and the
        emptied lane leaves the registry (a dead engine's, a leaving one's)."""
        if self._take_script is None:
            self._take_script = self.redis.register_script(TAKE)
        keys = [self.keys.requests, self.keys.lane(engine), self.keys.lanes]
        for _ in range(100):  # (an API placing from a card read before it went: a few more)
            await self._take_script(keys=keys, args=[GROUP_ENGINES, engine, page, engine, "1", "0"])
            if not await self.redis.exists(self.keys.lane(engine)):
                return

    async def lane_heads(self, me: str) -> tuple[dict[str, bytes | None], int]:
        """Each registered lane's oldest request's entry id (None: empty), ``me``'s always,
        and the server's clock (ms), which made those ids: how long each has waited, whatever
        this host's clock says. While ``me`` is the only engine registered, one round trip
        and no clock (0)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(self.keys.lanes)
        pipe.xrange(self.keys.lane(me), count=1)
        members, mine = await pipe.execute()
        engines = sorted({_s(e) for e in members} | {me})
        if engines == [me]:
            return {me: _b(mine[0][0]) if mine else None}, 0
        if self._heads_script is None:
            self._heads_script = self.redis.register_script(HEADS)
        *heads, sec, usec = await self._heads_script(keys=[self.keys.lane(e) for e in engines])
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return {e: (_b(h) if h else None) for e, h in zip(engines, heads, strict=True)}, now_ms

    async def queued_until(self, until: bytes | str, page: int = 1000) -> list[tuple[bytes | None, str]]:
        """``(entry id, request id)`` of every entry on ``P:requests`` and on the lanes (entry
        None) accepted in or before the millisecond of entry id ``until`` (another stream's:
        an ``abort_all``'s on ``P:control``). Entries leave ``P:requests`` at their request's final, so these are the
        requests accepted by then that have not finished: unclaimed, claimed but not yet owned,
        or running. Entries without a valid request id are left to the claimers, which
        dead-letter them."""
        ms = entry_id_key(until)[0]
        out: list[tuple[bytes | None, str]] = []
        start = b"-"
        while True:
            # (a request taken from a lane after ``until`` has a newer entry: its ``queued``
            # says when it was accepted, so the whole stream is looked at)
            entries = await self.redis.xrange(self.keys.requests, min=start, max="+", count=page)
            for entry_id, fields in entries:
                raw = fields.get(b"request_id", fields.get("request_id"))
                rid = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                accepted_ms = _accepted_ms(entry_id, fields.get(b"queued", fields.get("queued")))
                if isinstance(rid, str) and valid_request_id(rid) and accepted_ms <= ms:
                    out.append((_b(entry_id), rid))
            if len(entries) < page:
                break
            start = b"(" + _b(entries[-1][0])
        # Those still waiting on a lane have no P:requests entry yet.
        out += [(None, rid) for rid in await self.lane_queue(ms) if valid_request_id(rid)]
        return out

    async def lane_queue(self, until_ms: int) -> list[str]:
        """The request ids of every lane entry added in or before millisecond ``until_ms``."""
        engines = [_s(e) for e in await self.redis.smembers(self.keys.lanes)]
        if not engines:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for e in engines:
            pipe.xrange(self.keys.lane(e), min="-", max=b"%d" % until_ms)
        out: list[str] = []
        for entries in await pipe.execute():
            for _, fields in entries:
                rid = fields.get(b"request_id")
                if isinstance(rid, bytes):
                    out.append(rid.decode(errors="replace"))
        return out

    async def wait_for_work(self, lane: str, after: bytes, block_ms: int) -> bytes:
        """Block until ``P:requests`` has an entry newer than ``after`` or ``lane`` has one (or
        ``block_ms`` passes); returns the newest ``P:requests`` id seen (``after`` if none)."""
        reply = await self.redis.xread(
            {self.keys.requests: after, self.keys.lane(lane): b"0-0"}, count=1, block=block_ms
        )
        for stream, entries in reply or ():
            if _s(stream) == self.keys.requests and entries:
                after = entries[-1][0]
        return after

    async def write_card(self, card: Card, ttl_s: int) -> None:
        key = self.keys.card(card.engine)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=card.fields())
        pipe.expire(key, ttl_s)
        pipe.sadd(self.keys.lanes, card.engine)
        await pipe.execute()

    async def read_cards(self) -> list[Card]:
        """The cards of the registered engines that have one now, each with its lane's length."""
        engines = sorted(_s(e) for e in await self.redis.smembers(self.keys.lanes))
        if not engines:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for e in engines:
            pipe.hgetall(self.keys.card(e))
            pipe.xlen(self.keys.lane(e))
        got = await pipe.execute()
        cards = [Card.of(e, raw, n) for e, raw, n in zip(engines, got[::2], got[1::2], strict=True) if raw]
        return [c for c in cards if c is not None]


def _fields(raw: Sequence[bytes | str]) -> dict[bytes, bytes]:
    """A script's flat ``[k, v, k, v, ...]`` as redis-py's field map."""
    it = iter(raw)
    return {
        (k if isinstance(k, bytes) else k.encode()): (v if isinstance(v, bytes) else v.encode())
        for k, v in zip(it, it, strict=True)
    }
