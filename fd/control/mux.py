"""The stream multiplexer: one API replica's reader of many per-request streams.

:class:`StreamMux` reads every ``P:req:<id>`` the replica's handlers wait on with a few
blocking XREADs (one per shard) instead of one per request, and hands each entry to the
:class:`Subscription` of every handler of that request. It follows the bus's rules for
readers (fd/control/bus.py): an entry that does not decode, or does not belong on its stream, is
dead-lettered and skipped; blocking reads are never cancelled; entry ids are ``bytes``.

Where the store tells the process's readers of its own appends (:meth:`fd.control.store.Store.listen`:
the embedded server, where ``fd serve``'s engine publishes), a subscription that has seen
every entry before one takes it as the engine made it, and its shard's read moves past it: a
step's tokens cost no read and no decode. Anything else comes by the reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio.sentinel import SentinelConnectionPool
from redis.crc import key_slot

from fd.control.bad_event import BadEvent
from fd.control.bus import Bus
from fd.control.dead_letters import check_event
from fd.control.entry_ids import entry_id_key, normal_entry_id
from fd.control.events import REQ_STREAM_TYPES, Event, Final, decode
from fd.control.keys import Keys, valid_request_id
from fd.control.outage import REDIS_FAILURES, is_outage, kind, reason
from fd.control.store import RedisClient, StreamEntry
from fd.control.subscription import _NOTHING, MuxStopped, StoryLost, StoryRewound, Subscription

__all__ = ["MuxStopped", "StoryLost", "StoryRewound", "StreamMux", "Subscription"]

# (the bus's logger: the mux is the bus's reader, and operators filter its warnings as the bus's)
log = logging.getLogger("fd.control.bus")


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


class _ReadGate:
    """At most ``n`` blocking reads at once (cluster only), and whether anyone waits for one."""

    def __init__(self, n: int):
        self._sem = asyncio.Semaphore(n)
        self.waiting = 0

    async def __aenter__(self) -> None:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1

    async def __aexit__(self, *exc: object) -> None:
        self._sem.release()

    def full(self) -> bool:
        return self._sem.locked()


class _Shard:
    """Up to ``shard_size`` request streams read by one blocking XREAD loop, plus a doorbell.

    On a cluster a shard holds the streams of one slot (``slot``), its doorbell is tagged into
    that slot, and it retires once it has nothing left to watch."""

    def __init__(self, mux: StreamMux, index: int, slot: int | None = None, tag: str = ""):
        self.mux = mux
        self.slot = slot
        name = f"{mux.reader_id}.{index}"
        self.wake_key = _b(mux.keys.wake(name) if slot is None else mux.keys.wake_in_slot(name, tag))
        self.subs: dict[bytes, list[Subscription]] = {}
        self.blocked = False  # inside a blocking XREAD whose key list is already sent
        self.rang = False  # a wake-up is already on its way for this blocking read
        self.rung = False  # the doorbell stream exists (cluster shards delete it on retiring)
        self.long = False  # the current read blocks for the full block_ms
        self.task: asyncio.Task[None] | None = None
        self.wake_last = b"0-0"
        self.reading: dict[bytes | str, bytes] | None = None  # the ids the read in progress reads after
        self.next_look = 0.0  # when to look for stories that disappeared (loop time)
        self.missing: dict[bytes, int] = {}  # looks in a row that found a story gone
        #: looks in a row that found a story without the last entry a subscription read
        self.rewound: dict[tuple[bytes, bytes], int] = {}

    def add(self, sub: Subscription) -> bool:
        """Add; True when the reader is blocked on a key list without it and must be woken."""
        self.subs.setdefault(sub.key, []).append(sub)
        if self.blocked and not self.rang:
            self.rang = True
            return True
        return False

    def remove(self, sub: Subscription) -> None:
        subs = self.subs.get(sub.key)
        if subs and sub in subs:
            subs.remove(sub)
            if not subs:
                del self.subs[sub.key]

    async def run(self) -> None:
        mux, redis = self.mux, self.mux.redis
        backoff = 0.05
        failing: str | None = None  # the kind of failure reads meet now (logged once)
        # Only doorbells rung from now on matter. A cluster shard's doorbell is new (its index
        # is unique in this mux), so it skips the look-up: at worst a stale doorbell of an
        # earlier process with the same reader id costs one spurious wake-up.
        first = self.slot is None
        while not mux._stopping:
            if self.slot is not None and not self.subs:
                await self._retire()
                return
            try:
                if first:
                    last = await redis.xrevrange(self.wake_key, count=1)
                    self.wake_last = last[0][0] if last else b"0-0"
                    first = False
                if asyncio.get_running_loop().time() >= self.next_look:
                    await self._look_for_lost()
                if mux._gate_full():
                    await mux._cut_one_read_short()
                async with mux._gate:
                    if mux._stopping or (self.slot is not None and not self.subs):
                        continue
                    streams: dict[bytes | str, bytes] = {self.wake_key: self.wake_last}
                    for key, subs in self.subs.items():
                        streams[key] = min(subs, key=lambda s: s._last).last_id
                    # Others queue for a read: hold it briefly, so the readers take turns.
                    block = min(mux.block_ms, mux.CONTENDED_BLOCK_MS) if mux._gate_waiting() else mux.block_ms
                    self.long = block > mux.CONTENDED_BLOCK_MS
                    self.blocked, self.rang = True, False
                    self.reading = streams
                    try:
                        resp = await mux._bus.store.read(streams, mux.count, block)
                    finally:
                        self.blocked = False
                        self.reading = None
                mux.wakeups += 1
                for key, entries in resp or ():
                    if key == self.wake_key:
                        self.wake_last = entries[-1][0]
                    else:
                        await self._dispatch(key, entries, streams[key])
                if failing is not None:
                    log.info("stream mux %s: reading again", mux.reader_id)
                    failing = None
                backoff = 0.05
            except REDIS_FAILURES as e:
                if kind(e) != failing:  # one line an outage (and one if its kind changes)
                    failing = kind(e)
                    log.warning("stream mux %s: %s; retrying", mux.reader_id, reason(e))
                if not is_outage(e):  # (WRONGTYPE: a story overwritten by another type)
                    self.next_look = 0.0
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug: keep the other subscriptions alive
                log.exception("stream mux %s: reader failed; retrying", mux.reader_id)
                await asyncio.sleep(0.1)

    async def _look_for_lost(self) -> None:
        """End the subscriptions whose story is gone (:class:`StoryLost`), or lacks the last
        entry they read (:class:`StoryRewound`). A blocking read of a key that does not exist
        just waits, so without this look a client whose story went with an emptied Redis would
        wait for ever. Only a story known to have been written counts
        (:attr:`Subscription.armed`): one subscribed before its request was submitted may not
        exist yet. A story is lost when two looks in a row find it gone; one of another type
        at once.

        The entry check is for a failover's split: a reader that read entries the old primary
        took after the promotion (lost with it) reads the new primary's story after the last
        of them, and what the new primary's writers appended meanwhile has lower ids: the
        read would wait for ever, with the story's final in place. Two looks in a row, as
        for a gone story."""
        mux = self.mux
        self.next_look = asyncio.get_running_loop().time() + mux.lost_look_s
        keys = list(self.subs)
        if not keys:
            return
        pipe = mux.redis.pipeline(transaction=False)
        sentinel = mux.check_role and isinstance(
            getattr(mux.redis, "connection_pool", None), SentinelConnectionPool
        )
        if sentinel:
            pipe.execute_command("ROLE")
        for key in keys:
            pipe.type(key)
        # the last entry each subscription read, where it read one (from this server, or
        # another before a failover)
        read = [
            (key, last) for key in keys for last in {s.last_id for s in self.subs[key] if s._last > _NOTHING}
        ]
        for key, last in read:
            pipe.xrange(key, last, last, count=1)
        types = await pipe.execute(raise_on_error=False)
        found = types[len(types) - len(read) :]
        del types[len(types) - len(read) :]
        for t in types[1 if sentinel else 0 :]:
            if isinstance(t, Exception):
                raise t  # (an outage, as a read's: the shard's loop rides it out)
        if sentinel:
            role = types.pop(0)
            if isinstance(role, Exception):  # (ROLE refused, by an ACL say: no more asking)
                mux.check_role = False
                log.warning(
                    "stream mux %s: ROLE refused (%s); not checking the server's role", mux.reader_id, role
                )
            elif _b(role[0]) != b"master":
                # A Sentinel failover demoted the server these connections were made to; reads
                # there still answer, from its own past, so nothing would move this reader
                # to the new primary and its clients would wait for ever (a story begun on the
                # new primary looks gone from here). Reconnect: new connections ask the
                # sentinels where the primary is.
                log.warning(
                    "stream mux %s: reading from a %s, not the primary; reconnecting",
                    mux.reader_id,
                    _b(role[0]).decode(),
                )
                await mux.redis.connection_pool.disconnect()
                self.missing.clear()
                return
        for key in [k for k in self.missing if k not in self.subs]:
            del self.missing[key]
        stream_keys = {key for key, t in zip(keys, types, strict=False) if _b(t) == b"stream"}
        self._look_for_rewound(read, found, stream_keys)
        for key, key_type in zip(keys, types, strict=False):
            key_type = _b(key_type)
            if key_type == b"stream":
                self.missing.pop(key, None)
                continue
            subs = self.subs.get(key, [])
            # (a key of another type is gone too, and would fail every read of the shard)
            if key_type == b"none":
                if not any(s.armed or s._last > _NOTHING for s in subs):
                    continue
                # Gone at two looks in a row: while clients move to a promoted replica, a look
                # may ask the old primary about a story just started on the new one.
                self.missing[key] = self.missing.get(key, 0) + 1
                if self.missing[key] < 2:
                    continue
            self.missing.pop(key, None)
            del self.subs[key]
            if mux._where.get(key) is self:
                del mux._where[key]
            log.warning(
                "stream mux %s: story %s is gone (%s); ending its stream", mux.reader_id, key, key_type
            )
            mux.lost += 1
            for sub in subs:
                sub._end(StoryLost(sub.request_id))

    def _look_for_rewound(
        self, read: list[tuple[bytes, bytes]], found: list[Any], stream_keys: set[bytes]
    ) -> None:
        """End the subscriptions of a story in place whose last read entry is not in it
        (``found``: XRANGE's answer for each of ``read``) at two looks in a row."""
        for (key, _), got in zip(read, found, strict=True):
            if isinstance(got, Exception) and key in stream_keys:
                raise got  # (an outage; on a key of another type, the type's look ends it)
        rewound = {
            (key, last)
            for (key, last), got in zip(read, found, strict=True)
            if key in stream_keys and not got
        }
        for k in [k for k in self.rewound if k not in rewound]:
            del self.rewound[k]
        mux = self.mux
        for key, last in rewound:
            self.rewound[(key, last)] = self.rewound.get((key, last), 0) + 1
            if self.rewound[(key, last)] < 2:
                continue
            del self.rewound[(key, last)]
            subs = self.subs.get(key, [])
            gone = [s for s in subs if s.last_id == last]
            log.warning(
                "stream mux %s: story %s lacks entry %s, read before (a failover lost it); ending its stream",
                mux.reader_id,
                key,
                last,
            )
            for sub in gone:
                subs.remove(sub)
                mux.lost += 1
                sub._end(StoryRewound(sub.request_id))
            if not subs:
                self.subs.pop(key, None)
                if mux._where.get(key) is self:
                    del mux._where[key]

    async def _retire(self) -> None:
        """Cluster only: stop reading a slot with nothing left to watch. Synchronously
        unlisted first, so a new subscription to this slot gets a fresh shard."""
        mux = self.mux
        if self.slot is not None and mux._by_slot.get(self.slot) is self:
            del mux._by_slot[self.slot]
        if self.rung:
            try:
                await mux.redis.delete(self.wake_key)
            except REDIS_FAILURES as e:
                log.warning("stream mux %s: could not delete a doorbell: %s", mux.reader_id, e)
        if self in mux._shards:
            mux._shards.remove(self)

    async def _dispatch(self, key: bytes, entries: Sequence[StreamEntry], after: bytes) -> None:
        """Hand a read's ``entries`` (those after ``after``) to the key's subscriptions. One
        that was added during the read with an earlier ``after`` (a resume) takes none of
        them: it would skip what lies between; the next read starts from it."""
        subs = self.subs.get(key)
        if not subs:
            return  # unsubscribed while the read was in flight
        floor = entry_id_key(after)
        subs = [s for s in subs if s._last >= floor]
        if not subs:
            return
        everyone = len(subs) == len(self.subs[key])
        rid = subs[0].request_id
        for entry_id, fields in entries:
            idk = entry_id_key(entry_id)
            if all(sub._last >= idk for sub in subs):
                continue  # (told of it while the read waited: StreamMux._told)
            # A good entry costs no coroutine; a bad one (or a deleted one: no fields) goes the
            # long way, which dead-letters it.
            ev = None
            if fields is not None:
                try:  # noqa: SIM105 (per event read: suppress() costs more)
                    ev = check_event(key, decode(fields, entry_id), REQ_STREAM_TYPES, rid)
                except BadEvent:
                    pass
            if ev is None:
                ev = await self.mux._bus.dead.decode_or_dead(key, entry_id, fields, REQ_STREAM_TYPES, rid)
            for sub in list(subs):
                if ev is None:  # skipped, but never read again
                    if idk > sub._last:
                        sub._last, sub.last_id = idk, entry_id
                    continue
                sub._offer(entry_id, idk, ev)
                self.mux.events += 1
            if isinstance(ev, Final):
                if everyone:
                    self.subs.pop(key, None)
                    self.mux._where.pop(key, None)
                return


class StreamMux:
    """One per API replica: a multiplexed reader of many ``P:req:<id>`` streams.

    Each shard (at most ``shard_size`` keys, DESIGN §6: one XREAD over 1,000 keys costs ~2 ms
    of client time per wake-up) runs one blocking XREAD loop on its own pooled connection. A
    subscription added while its shard is blocked rings the shard's doorbell stream
    (``keys.wake("<reader_id>.<shard>")``, at most one XADD per blocking read) so the read
    returns at once. Blocking reads are never cancelled: :meth:`stop` sets a flag and rings
    the doorbells, so readers return promptly (at worst after ``block_ms``).

    On a Redis Cluster one XREAD may name keys of one slot only, so a shard is one slot: the
    streams of the requests whose ids hash there, and a doorbell tagged into the same slot
    (``keys.wake_in_slot``). With 16,384 slots that is in effect one blocking XREAD, and one
    pooled connection, per live request; shards retire when their slot has nothing left to
    watch. At most ``cluster_readers`` reads block at once (the cluster client's pool raises
    instead of waiting past ``MAX_CONNECTIONS`` per node); while others wait for a turn, a
    reader blocks at most ``CONTENDED_BLOCK_MS``, so beyond ``cluster_readers`` live requests
    an event can wait a few such turns, and each turn is a round trip.

    Several subscriptions of one request share the shard's key; each gets the entries after
    its own ``after``. A subscription made past the request's ``final`` waits for events that
    never come: resume from an entry id the caller has seen, not beyond.
    """

    WAKE_MAXLEN = 16

    #: BLOCK of a cluster reader while other readers wait for a turn (see the class docstring).
    CONTENDED_BLOCK_MS = 50

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        reader_id: str,
        *,
        shard_size: int = 256,
        block_ms: int = 1000,
        count: int = 1000,
        cluster_readers: int = 128,
        lost_look_s: float = 2.0,
    ):
        self.redis = redis
        self.keys = keys
        self.reader_id = reader_id
        self.shard_size = shard_size
        self.block_ms = block_ms
        self.count = count
        self._bus = Bus(redis, keys)
        self.cluster = self._bus.cluster
        self._shards: list[_Shard] = []
        self._where: dict[bytes, _Shard] = {}
        self._by_slot: dict[int, _Shard] = {}  # cluster only
        self._next_index = 0
        self._gate = _ReadGate(cluster_readers) if self.cluster else contextlib.nullcontext()
        self._started = False
        self._stopping = False
        self.wakeups = 0  # XREAD returns, all shards: the bench's fan-in figure
        self.events = 0  # events delivered to subscriptions
        self.told = 0  # of those, the ones taken as the store told them (no read, no decode)
        #: How often each shard looks for stories that disappeared (one pipelined TYPE of its
        #: keys): a client's stream whose story went ends within twice this plus ``block_ms``.
        self.lost_look_s = lost_look_s
        # Under Sentinel, each look asks the server its role (see _Shard._look_for_lost)
        self.check_role = True
        self.lost = 0  # subscribed stories found gone
        self._unlisten: Callable[[], None] | None = None
        self._in_process = False  # take this process's appends as told (hear_in_process)
        self._rings: set[asyncio.Task[None]] = set()  # doorbells on their way (subscribe)
        self._thread: int | None = None  # the event loop's, where the store's tellings count

    @property
    def dead_letters(self) -> int:
        return self._bus.dead_letters

    @property
    def started(self) -> bool:
        """:meth:`start` was called and :meth:`stop` has not finished."""
        return self._started

    @property
    def on_dead_letter(self) -> Callable[[], Any] | None:
        """Called once per dead letter the mux's reads write (its bus's hook)."""
        return self._bus.on_dead_letter

    @on_dead_letter.setter
    def on_dead_letter(self, hook: Callable[[], Any] | None) -> None:
        self._bus.on_dead_letter = hook

    def _gate_waiting(self) -> bool:
        return isinstance(self._gate, _ReadGate) and self._gate.waiting > 0

    def _gate_full(self) -> bool:
        return isinstance(self._gate, _ReadGate) and self._gate.full()

    async def _cut_one_read_short(self) -> None:
        """About to queue for a read: ring one reader parked in a full-length BLOCK, which then
        comes back and takes turns with short ones. One doorbell per queued reader at most."""
        for shard in self._shards:
            if shard.blocked and shard.long and not shard.rang:
                shard.rang = True
                await self._ring(shard)
                return

    async def start(self) -> None:
        if self._started:
            return
        self._started, self._stopping = True, False
        self._thread = threading.get_ident()
        if self._in_process:
            self._unlisten = self._bus.store.listen(self._told)
        for shard in self._shards:
            self._launch(shard)

    def _launch(self, shard: _Shard) -> None:
        shard.task = asyncio.get_running_loop().create_task(
            shard.run(), name=f"stream-mux:{self.reader_id}:{shard.wake_key.decode()}"
        )

    async def stop(self) -> None:
        """Stop reading; open subscriptions raise :class:`MuxStopped`."""
        if not self._started:
            return
        self._stopping = True
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        for shard in list(self._shards):  # blocked readers return now, not after BLOCK
            if shard.blocked and not shard.rang:
                shard.rang = True
                await self._ring(shard)
        await asyncio.gather(*self._rings, return_exceptions=True)
        tasks = [s.task for s in self._shards if s.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for shard in self._shards:
            shard.task = None
            for subs in shard.subs.values():
                for sub in subs:
                    sub._end(MuxStopped(f"stream mux {self.reader_id} stopped"))
            shard.subs.clear()
        self._where.clear()
        self._by_slot.clear()
        if self._shards:
            try:
                await self.redis.delete(*[s.wake_key for s in self._shards])
            except REDIS_FAILURES as e:
                log.warning("stream mux %s: could not delete doorbells: %s", self.reader_id, e)
        self._shards.clear()
        self._started = False

    def hear_in_process(self) -> bool:
        """Take the events this process's own writers append (``fd serve``'s engine) as they
        append them, where the store can tell (the embedded server's: :meth:`Store.listen
        <fd.control.store.Store.listen>`), instead of reading them back; True if it can. Part
        of the one in-process shortcut, wired by :func:`fd.compose.join_in_process` alone.
        Each event still reaches a subscription once: told, or read."""
        self._in_process = True
        if self._started and self._unlisten is None:
            self._thread = threading.get_ident()
            self._unlisten = self._bus.store.listen(self._told)
        return self._unlisten is not None

    def _told(self, key: bytes, before: bytes, entry_id: bytes, ev: Event, fields: Mapping[str, str]) -> None:
        """An entry this process appended (:meth:`fd.control.store.Store.listen`), handed as it is
        to each subscription that has seen every entry up to ``before``. One behind, or new,
        gets it from its shard's next read; the read in progress moves past it for those
        that took it, so nothing comes twice or is skipped."""
        shard = self._where.get(key)
        if shard is None or self._stopping or threading.get_ident() != self._thread:
            return
        subs = shard.subs.get(key)
        if not subs:
            return
        floor = entry_id_key(before)
        takers = [sub for sub in subs if not sub._ended and sub._last == floor]
        if not takers:
            return
        rid = subs[0].request_id
        if not isinstance(ev, REQ_STREAM_TYPES) or getattr(ev, "request_id", rid) != rid:
            return  # (the read dead-letters it)
        if not ev.ts:  # as a read decodes it: stamped when it was encoded
            ev = dataclasses.replace(ev, ts=int(fields["ts"]))
        idk = entry_id_key(entry_id)
        for sub in takers:
            sub._offer(entry_id, idk, ev)
        self.events += len(takers)
        self.told += len(takers)
        reading = shard.reading
        if reading is not None and key in reading:
            reading[key] = min(subs, key=lambda s: s._last).last_id
        if isinstance(ev, Final) and len(takers) == len(subs):
            del shard.subs[key]
            self._where.pop(key, None)

    async def subscribe(self, request_id: str, after: bytes | str = b"0") -> Subscription:
        """Events of ``request_id`` after entry ``after`` (exclusive; ``0`` = from the start)."""
        if not self._started or self._stopping:
            raise MuxStopped(f"stream mux {self.reader_id} is not running")
        if not valid_request_id(request_id):
            raise ValueError(f"invalid request id {request_id!r}")
        key = _b(self.keys.req(request_id))
        sub = Subscription(self, request_id, key, normal_entry_id(after))
        shard = self._where.get(key) or self._pick_shard(key, request_id)
        self._where[key] = shard
        if shard.add(sub):
            # Not awaited: the request's own first command must be what meets a stalled
            # Redis (its 503 within one --redis-timeout, not after the doorbell's too); a
            # doorbell that fails is a read returning after its BLOCK, late, not lost.
            ring = asyncio.get_running_loop().create_task(self._ring(shard))
            self._rings.add(ring)
            ring.add_done_callback(self._rings.discard)
        return sub

    async def _ring(self, shard: _Shard) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(shard.wake_key, {b"w": b"1"}, maxlen=self.WAKE_MAXLEN, approximate=False)
            pipe.expire(shard.wake_key, 86400)  # a crashed replica leaves no doorbell behind
            shard.rung = True
            await pipe.execute()
        except REDIS_FAILURES as e:
            # The reader still returns after its BLOCK timeout: late, not lost.
            shard.rang = False
            log.warning("stream mux %s: doorbell failed: %s", self.reader_id, e)

    def _pick_shard(self, key: bytes, request_id: str) -> _Shard:
        if self.cluster:  # one XREAD may name keys of one slot only
            slot = key_slot(key)
            shard = self._by_slot.get(slot)
            if shard is None:
                shard = self._by_slot[slot] = _Shard(self, self._next_index, slot, request_id)
                self._next_index += 1
                self._shards.append(shard)
                if self._started:
                    self._launch(shard)
            return shard
        live = [s for s in self._shards if len(s.subs) < self.shard_size]
        if live:
            return min(live, key=lambda s: len(s.subs))
        shard = _Shard(self, len(self._shards))
        self._shards.append(shard)
        if self._started:
            self._launch(shard)
        return shard

    def _unsubscribe(self, sub: Subscription) -> None:
        shard = self._where.get(sub.key)
        if shard is None:
            return
        shard.remove(sub)
        if sub.key not in shard.subs:
            self._where.pop(sub.key, None)
