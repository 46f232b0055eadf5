"""The embedded server's store: :class:`~fd.control.store.RedisStore`, with a step's hot work done
on fakeredis's own objects, on the fakeredis releases that was verified on.

Through fakeredis's client every command is packed, parsed, dispatched and converted in
Python, ~100 µs apiece here, and the fence's script calls three of them per request per step
from Lua. On SmolLM2 (bench/README.md, 2026-12-07) ``fd serve`` with every operation through
the commands gave 18% / 32% / 38% less output tok/s at 1 / 8 / 32 streams than with these
(the one pair measured on a quiet machine; under other jobs' load the 32-stream figure still
favoured these in every pair). So these skip the command layer:

- :meth:`EmbeddedStore.fenced_append` does fd/control/fence.py's checks and appends under the
  server's lock, with the server's stream objects' own methods; what a final renews and
  acknowledges follows, by :meth:`append_many`;
- :meth:`EmbeddedStore.read`, the API's XREAD of many stories, reads them the same way and
  waits for a write on the database's change callbacks, as fakeredis's blocking reads do;
- :meth:`EmbeddedStore.read_group`, an engine's poll of ``P:requests``, answers "nothing
  new" from the stream's and the group's last ids, and reads through the commands otherwise;
- :meth:`EmbeddedStore.append_many`, plain appends to streams that exist (the API's aborts on
  ``P:control``, a hang-up's among them) with the same methods, the renewals of a final
  (``EXPIRE``) and its ``P:requests`` entry's ack (through the commands, a wave of 32 finals'
  acks held the flush, and so the next step, for 10-20 ms of loop turns); a stream to create
  goes to the commands;
- :meth:`EmbeddedStore.ack_delete` the same way;
- ``get``, ``exists`` and ``expire`` of keys that exist (an arrival's check of its id and of
  a tombstone), on the database's items.

What these append, they also tell the process's own readers (:meth:`EmbeddedStore.listen`,
:class:`AppendListeners`): ``fd serve``'s API takes its engine's events as the engine made
them, with the entry that came before each, instead of reading them back and decoding them.
A reader that is behind, or an entry appended any other way, is read.

None of this is fakeredis's documented API (that is the ``FakeServer``, ``FakeRedis`` and
``FakeAsyncRedis`` constructors and the Redis commands). What it touches: ``FakeServer``'s
``lock``, ``dbs``, ``config`` and ``connected``; a database (``fakeredis._core.Database``)'s
``time``, item lookup, ``has_watch``, ``notify_watch``, ``wake_all``, ``schedule_expiry`` and
``add_change_callback``/``remove_change_callback``; its items' ``value`` and ``expireat``;
``fakeredis.model``'s ``XStream`` (``next_id``, ``add``, ``irange``, ``trim``, ``delete``,
``last_item_key``, ``last_id``, ``group_get``), its groups' ``ack``, ``consumers`` and
``last_delivered_key``, ``StreamEntryKey`` (``parse_str``, ``encode``) and ``StreamRangeTest``
(its constructor, ``decode``). Nothing is patched. So the direct path runs only on a fakeredis release it was verified on
(:data:`VERIFIED_FAKEREDIS`: tests/integration/test_embedded_fast_path.py, every reply and the
data left equal to the commands'; tests/unit/test_embedded_version.py fails on any other
installed release, so an upgrade is looked at before it is listed); on any other, one log line
and every operation goes through fakeredis's client, as :class:`RedisStore` on any server.
Where a key is absent or of another type, or keyspace notifications are on, an operation goes
to the commands too, whose every reply and error is fakeredis's own.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import fakeredis
from fakeredis.model import StreamEntryKey, StreamRangeTest, XStream
from redis.exceptions import ConnectionError as RedisConnectionError

from fd.control.events import Event
from fd.control.fence import SEEN, Refused
from fd.control.store import Ack, Append, AppendListener, Fenced, RedisClient, RedisStore, StreamsReply

if TYPE_CHECKING:
    from fakeredis._core import Database

log = logging.getLogger("fd.control.embedded")

_ALL = (StreamRangeTest.decode(b"-"), StreamRangeTest.decode(b"+"))


def _is_final(fields: Sequence[bytes]) -> bool:
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"type":
            return fields[i + 1] == b"final"
    return False


#: ``(stream, before, entry id, event, fields)`` of an append to tell listeners of
_Told = tuple[bytes, bytes, bytes, Event, Mapping[str, str]]


class AppendListeners:
    """The readers in this process told of the server's in-process appends (one per server,
    shared by its clients' stores; the event loop's thread only)."""

    def __init__(self) -> None:
        self._listeners: list[AppendListener] = []

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def add(self, listener: AppendListener) -> Callable[[], None]:
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop

    def tell(self, told: Sequence[_Told]) -> None:
        """After the appends, out of the server's lock: a listener may publish in turn."""
        for item in told:
            for listener in list(self._listeners):
                try:
                    listener(*item)
                except Exception:  # a reader's bug must not cost the write
                    log.exception("in-process append listener failed")


class _Direct:
    """The two operations on one server's objects; None from either: not done here."""

    def __init__(self, server: fakeredis.FakeServer):
        self.server = server
        self._names: dict[str, bytes] = {}  # field names, encoded once

    def _encode(self, fields: Mapping[str, str]) -> list[bytes]:
        names = self._names
        out = []
        for k, v in fields.items():
            kb = names.get(k)
            if kb is None:
                kb = names[k] = k.encode()
            out.append(kb)
            out.append(v.encode())
        return out

    def _db(self) -> Database:
        """Database 0, its clock set (a key past its TTL reads as absent), under the lock."""
        db = self.server.dbs[0]
        db.time = time.time()
        return db

    def _stream(self, db: Database, key: bytes) -> XStream | None | Literal[False]:
        """The stream at ``key``; None when absent; False when it holds another type."""
        try:
            value = db[key].value
        except KeyError:
            return None
        return value if type(value) is XStream else False

    def _limits(self) -> tuple[int, int]:
        cfg = self.server.config
        return int(cfg.get(b"stream-node-max-entries", 100)), int(cfg.get(b"stream-node-max-bytes", 4096))

    def usable(self) -> bool:
        if not self.server.connected:
            raise RedisConnectionError("Connection closed by the embedded server")
        return not self.server.config.get(b"notify-keyspace-events")

    def fenced(
        self, batch: Fenced, limits: tuple[int, int], told: list[_Told] | None = None
    ) -> list[bytes] | Refused | None:
        """One batch through the fence, the lock held by the caller: as fd/control/fence.py's
        script, less the renewals and ack of a final (the caller's, after). Each event
        appended goes on ``told`` where given."""
        db = self._db()
        try:
            owner = db[batch.owner_key.encode()].value
        except KeyError:
            owner = None
        if owner is not None and type(owner) is not bytes:
            return None  # WRONGTYPE: the script says so
        if owner != batch.token.encode():
            return Refused("owner", None if owner is None else owner.decode(errors="replace"))
        key = batch.story.encode()
        stream = self._stream(db, key)
        if not stream:  # (absent: the script creates it; another type: the script says so)
            return None
        encoded = [self._encode(f) for f in batch.fields]
        last = next((e for e in encoded if e[:2] == [b"type", b"final"]), encoded[-1])
        tail = stream.irange(*_ALL, reverse=True, count=SEEN)
        if any(list(fields) == last for _, fields in tail):
            return []  # this batch is there already (fd/control/fence.py)
        if tail and _is_final(tail[0][1]):
            return Refused("final", owner.decode(errors="replace"))
        if batch.after and (not tail or list(tail[0][1]) != self._encode(batch.after)):
            return Refused("gap", owner.decode(errors="replace"))
        ids = []
        events = batch.events if told is not None else ()
        for i, fields in enumerate(encoded):
            entry = stream.next_id(None, True)
            if entry is None:
                break  # (an exhausted id space: the caller sees fewer ids than events)
            before = stream.last_item_key() if events else b""
            stream.add(fields, entry, *limits)
            ids.append(entry.encode())
            if events and told is not None:  # (events only where told is given)
                told.append((key, before, ids[-1], events[i], batch.fields[i]))
            if fields[:2] == [b"type", b"final"]:
                break
        if db.has_watch(key):
            db.notify_watch(key)  # (WATCHers; readers blocked on the database: the caller's wake_all)
        return ids

    def append(self, entry: Append, limits: tuple[int, int], told: list[_Told] | None = None) -> bytes | None:
        """``entry``'s XADD, the lock held by the caller, where its stream exists: its id
        (None: not done here, the commands create it). Its event goes on ``told`` where
        given."""
        db = self._db()
        key = entry.stream.encode()
        stream = self._stream(db, key)
        if not stream:
            return None
        at = stream.next_id(None, True)
        if at is None:
            return None  # (an exhausted id space: the commands say so)
        before = stream.last_item_key()
        stream.add(self._encode(entry.fields), at, *limits)
        if entry.maxlen:
            stream.trim(maxlen=entry.maxlen, approx=True)
        if db.has_watch(key):
            db.notify_watch(key)
        entry_id = at.encode()
        if told is not None and entry.event is not None:
            told.append((key, before, entry_id, entry.event, entry.fields))
        return entry_id

    def scan(self, streams: Mapping[bytes, bytes], count: int | None) -> StreamsReply | None:
        """XREAD's reply for ``streams`` now, under the lock; None: a key of another type or
        an id that does not parse (fakeredis says what is wrong)."""
        out: StreamsReply = []
        with self.server.lock:
            db = self._db()
            for key, after in streams.items():
                stream = self._stream(db, key)
                if stream is None:
                    continue
                if stream is False:
                    return None
                if stream.last_item_key() == after:
                    continue  # (read to its end already: most keys, on a wake-up for another's write)
                try:
                    start = StreamRangeTest(StreamEntryKey.parse_str(after), True)
                except Exception:
                    return None
                got = stream.irange(start, _ALL[1], count=count or None)
                if got:
                    out.append([key, [(eid, dict(zip(f[0::2], f[1::2], strict=False))) for eid, f in got]])
        return out

    def value(self, key: str) -> tuple[bool, bytes | None]:
        """``GET key``, the lock held by the caller: ``(True, value or None)``; ``(False, None)``
        where the key holds another type (the commands say WRONGTYPE)."""
        try:
            value = self._db()[key.encode()].value
        except KeyError:
            return True, None
        return (True, value) if type(value) is bytes else (False, None)

    def exists(self, key: str) -> bool:
        """``EXISTS key``, the lock held by the caller (a key past its TTL is absent)."""
        return key.encode() in self._db()

    def expire(self, key: str, ttl_s: int) -> bool:
        """``EXPIRE key ttl_s``, the lock held by the caller: False where not done here (a TTL
        that is not positive deletes the key: the commands do that)."""
        if ttl_s <= 0:
            return False
        db = self._db()
        k = key.encode()
        try:
            item = db[k]
        except KeyError:
            return True  # (EXPIRE of an absent key changes nothing)
        item.expireat = db.time + ttl_s
        db.schedule_expiry(k, item.expireat)
        if db.has_watch(k):
            db.notify_watch(k)
        return True

    def ack_delete(self, ack: Ack) -> bool:
        """``XACK`` then ``XDEL`` of ``ack``'s ids, the lock held by the caller, where its
        stream exists (False: not done here, the commands say what XACK says of the rest)."""
        db = self._db()
        key = ack.stream.encode()
        stream = self._stream(db, key)
        if not stream:
            return False
        group = stream.group_get(ack.group.encode())
        ids = [i if isinstance(i, bytes) else i.encode() for i in ack.ids]
        if group is not None:
            group.ack(tuple(ids))  # type: ignore[arg-type]  # (fakeredis types it tuple[bytes]: it takes any number)
        stream.delete(ids)
        if db.has_watch(key):
            db.notify_watch(key)
        return True

    def nothing_new(self, key: bytes, group: bytes, consumer: bytes) -> bool:
        """Whether ``XREADGROUP GROUP group consumer STREAMS key >`` finds nothing now: the
        group has read past the stream's last id and knows the consumer (so the read would
        change nothing but the consumer's seen-time, which fd does not use). False where
        unsure: the commands answer."""
        with self.server.lock:
            stream = self._stream(self._db(), key)
            if not stream:
                return False
            g = stream.group_get(group)
            return g is not None and consumer in g.consumers and g.last_delivered_key >= stream.last_id


#: The fakeredis releases the direct path was verified on (see the module's docstring): a new one
#: joins only once tests/integration/test_embedded_fast_path.py passes on it.
VERIFIED_FAKEREDIS = frozenset({"2.41.0"})


def fakeredis_version() -> str:
    """The installed fakeredis's version, as its package metadata says."""
    return importlib.metadata.version("fakeredis")


def direct_verified(version: str | None = None) -> bool:
    """Whether the direct path may run on fakeredis ``version`` (default: the installed one);
    where not, says so in one log line."""
    version = fakeredis_version() if version is None else version
    if version in VERIFIED_FAKEREDIS:
        return True
    log.warning(
        "embedded store: fakeredis %s is not a release its direct path was verified on (%s): "
        "every operation goes through fakeredis's commands (slower)",
        version,
        ", ".join(sorted(VERIFIED_FAKEREDIS)),
    )
    return False


class EmbeddedStore(RedisStore):
    """:class:`~fd.control.store.RedisStore` on the embedded server's in-process client, with
    :meth:`fenced_append`, :meth:`read`, an idle :meth:`read_group`, plain
    :meth:`append_many`, :meth:`ack_delete` and ``get``/``exists``/``expire`` done on the
    server's objects (see the module's docstring) where ``direct`` (the caller's
    :func:`direct_verified`); the commands otherwise. What it appends there it tells its
    :class:`AppendListeners`."""

    def __init__(
        self,
        redis: RedisClient,
        server: fakeredis.FakeServer,
        direct: bool,
        listeners: AppendListeners | None = None,
    ):
        super().__init__(redis)
        self._direct = _Direct(server) if direct else None
        self._listeners = listeners if listeners is not None else AppendListeners()

    def listen(self, listener: AppendListener) -> Callable[[], None] | None:
        # (appends through the commands, the TCP door's and this process's alike, are read)
        return self._listeners.add(listener) if self._direct is not None else None

    async def fenced_append(
        self, batches: Sequence[Fenced], plain: Sequence[Append] = ()
    ) -> list[Refused | None]:
        direct = self._direct
        if direct is None or not batches or not direct.usable():
            return await super().fenced_append(batches, plain)
        answers: list[Refused | None] = [None] * len(batches)
        left: list[int] = []  # batches the commands do
        limits = direct._limits()
        told: list[_Told] | None = [] if self._listeners else None
        with direct.server.lock:
            for i, batch in enumerate(batches):
                got = direct.fenced(batch, limits, told)
                if got is None:
                    left.append(i)
                elif isinstance(got, Refused):
                    answers[i] = got
            # (the journal's entry, and what else goes unfenced: after the stories, as the
            # script's pipeline sends it)
            done = 0
            while done < len(plain) and direct.append(plain[done], limits, told):
                done += 1
            plain = plain[done:]
            # Readers blocked on the database (the API's many-story read, XREAD BLOCK through
            # the commands or the TCP door) woken once for the lot, not once a story: each
            # wake-up reaches every blocked reader, and one on another thread costs a write
            # to its loop's self-pipe.
            direct.server.dbs[0].wake_all()
        if told:
            self._listeners.tell(told)
        if left:
            for i, why in zip(left, await super().fenced_append([batches[i] for i in left]), strict=False):
                answers[i] = why
        # What the script does for its own batches, for those that got through here.
        skipped = set(left)
        through = [b for i, b in enumerate(batches) if i not in skipped and answers[i] is None]
        await self.after_fence(through, plain, own_ttl=True)
        return answers

    async def append_many(
        self, entries: Sequence[Append], expire: Sequence[str] = (), ttl_s: int = 0, ack: Ack | None = None
    ) -> list[bytes]:
        # Plain appends (an abort on P:control, the API's and an operator's events), renewals
        # and acks (a final's) on the server's objects; a stream to create and whatever
        # follows it, by the commands, in the same order.
        direct = self._direct
        if direct is None or not (entries or expire or ack) or not direct.usable():
            return await super().append_many(entries, expire, ttl_s, ack)
        ids: list[bytes] = []
        left = list(expire)
        limits = direct._limits()
        told: list[_Told] | None = [] if self._listeners else None
        with direct.server.lock:
            for entry in entries:
                at = direct.append(entry, limits, told)
                if at is None:
                    break
                ids.append(at)
            if len(ids) == len(entries):
                left = [key for key in expire if not direct.expire(key, ttl_s)]
                if not left and ack is not None and direct.ack_delete(ack):
                    ack = None
            if ids:
                direct.server.dbs[0].wake_all()  # (blocked readers: see fenced_append)
        if told:
            self._listeners.tell(told)
        if len(ids) < len(entries) or left or ack is not None:
            ids += await super().append_many(entries[len(ids) :], left, ttl_s, ack)
        return ids

    async def ack_delete(self, stream: str, group: str, ids: Sequence[bytes]) -> None:
        direct = self._direct
        if direct is not None and ids and direct.usable():
            with direct.server.lock:
                if direct.ack_delete(Ack(stream, group, ids)):
                    return
        await super().ack_delete(stream, group, ids)

    async def get(self, key: str) -> bytes | None:
        direct = self._direct
        if direct is not None and direct.usable():
            with direct.server.lock:
                done, value = direct.value(key)
            if done:
                return value
        return await super().get(key)

    async def exists(self, key: str) -> bool:
        direct = self._direct
        if direct is not None and direct.usable():
            with direct.server.lock:
                return direct.exists(key)
        return await super().exists(key)

    async def expire(self, keys: Sequence[str], ttl_s: int) -> None:
        direct = self._direct
        if direct is None or not keys or not direct.usable():
            return await super().expire(keys, ttl_s)
        with direct.server.lock:  # (a TTL wakes no reader: WATCHers only, in expire())
            left = [key for key in keys if not direct.expire(key, ttl_s)]
        await super().expire(left, ttl_s)

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> StreamsReply:
        # An engine polls P:requests while it runs (fd/engine/node/admission.py), nearly always to
        # find nothing: that answer comes from the stream's and group's last ids here, not
        # from a command (~0.35 ms of the loop through fakeredis's command layer).
        direct = self._direct
        if (
            direct is not None
            and block_ms is None
            and direct.usable()
            and direct.nothing_new(stream.encode(), group.encode(), consumer.encode())
        ):
            return []
        return await super().read_group(stream, group, consumer, count, block_ms)

    async def read(
        self, streams: Mapping[bytes | str, bytes], count: int | None, block_ms: int | None
    ) -> StreamsReply:
        direct = self._direct
        if direct is None or not direct.usable():
            return await super().read(streams, count, block_ms)

        def keyed() -> dict[bytes, bytes]:
            # (each scan reads ``streams`` anew: a listener's reader moves its ids past the
            # entries it was told of while this read waits, so they are not read again)
            return {k if isinstance(k, bytes) else k.encode(): v for k, v in streams.items()}

        got = direct.scan(keyed(), count)
        if got is None:
            return await super().read(streams, count, block_ms)
        if got or block_ms is None:
            return got
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        loop_thread = threading.get_ident()

        def on_change() -> None:  # (on whichever thread wrote: the TCP door's are others)
            if threading.get_ident() == loop_thread:
                woken.set()
            else:
                loop.call_soon_threadsafe(woken.set)

        deadline = loop.time() + block_ms / 1000 if block_ms else None
        timer = loop.call_at(deadline, woken.set) if deadline is not None else None
        db = direct.server.dbs[0]
        with direct.server.lock:
            db.add_change_callback(on_change)
        try:
            while True:
                got = direct.scan(keyed(), count)  # (again: a write may have come in between)
                if got is None:
                    return await super().read(streams, count, None)
                if got or (deadline is not None and loop.time() >= deadline):
                    return got
                woken.clear()
                await woken.wait()
        finally:
            with direct.server.lock:
                db.remove_change_callback(on_change)
            if timer is not None:
                timer.cancel()
