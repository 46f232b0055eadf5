"""The embedded server's store: :class:`~control.store.RedisStore`, with a step's hot work done
on the server's own objects.

Through fakeredis's client every command is packed, parsed, dispatched and converted in
Python, ~100 µs apiece here, and the fence's script calls three of them per request per step
from Lua: at 32 streams on the tiny model a step's flush took longer than the step
(bench/README.md). So two operations skip the command layer:

- :meth:`EmbeddedStore.fenced_append` does control/fence.py's checks and appends under the
  server's lock, with the server's stream objects' own methods (``XStream.next_id``, ``add``,
  ``irange``); what a final renews and acknowledges follows as commands;
- :meth:`EmbeddedStore.read`, the API's XREAD of many stories, reads them the same way and
  waits for a write on the database's change callbacks, as fakeredis's blocking reads do.

Everything they touch is a public name (``FakeServer.lock``, ``.dbs``, ``.config``,
``.connected``; ``fakeredis.model``'s stream classes), nothing is patched, and where a key is
absent or of another type, keyspace notifications are on, or the server's objects do not
behave as this module expects (:func:`direct_works`, checked once per server against the
commands: another fakeredis release), the operation goes to the commands, whose every reply
and error is fakeredis's own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Mapping, Sequence

import fakeredis
from fakeredis.model import StreamEntryKey, StreamRangeTest, XStream
from redis.exceptions import ConnectionError as RedisConnectionError

from control.fence import SEEN, Refused
from control.store import Append, Fenced, RedisStore

log = logging.getLogger("control.embedded")

_ALL = (StreamRangeTest.decode(b"-"), StreamRangeTest.decode(b"+"))


def _is_final(fields: Sequence[bytes]) -> bool:
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"type":
            return fields[i + 1] == b"final"
    return False


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

    def _db(self):
        """Database 0, its clock set (a key past its TTL reads as absent), under the lock."""
        db = self.server.dbs[0]
        db.time = time.time()
        return db

    def _stream(self, db, key: bytes) -> XStream | None | bool:
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

    def fenced(self, batch: Fenced, limits: tuple[int, int]) -> list[bytes] | Refused | None:
        """One batch through the fence, the lock held by the caller: as control/fence.py's
        script, less the renewals and ack of a final (the caller's, after)."""
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
            return []  # this batch is there already (control/fence.py)
        if tail and _is_final(tail[0][1]):
            return Refused("final", owner.decode(errors="replace"))
        ids = []
        for fields in encoded:
            entry = stream.next_id(None, True)
            if entry is None:
                break  # (an exhausted id space: the caller sees fewer ids than events)
            stream.add(fields, entry, *limits)
            ids.append(entry.encode())
            if fields[:2] == [b"type", b"final"]:
                break
        db.notify_watch(key)  # WATCHers, and readers blocked on the database
        return ids

    def scan(self, streams: Mapping[bytes, bytes], count: int | None) -> list | None:
        """XREAD's reply for ``streams`` now, under the lock; None: a key of another type or
        an id that does not parse (fakeredis says what is wrong)."""
        out = []
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
                    out.append([key, [(eid, dict(zip(f[0::2], f[1::2]))) for eid, f in got]])
        return out


def direct_works(server: fakeredis.FakeServer) -> bool:
    """Whether the direct operations give what the commands give on this fakeredis: a story
    appended both ways and read back both ways, on keys of this check's own."""
    client = fakeredis.FakeRedis(server=server)
    direct = _Direct(server)
    owner, story = "fd-embedded-check:owner", "fd-embedded-check:story"
    try:
        client.set(owner, "e#1")
        first = client.xadd(story, {"type": "accepted", "request_id": "r"})
        batch = Fenced(owner, story, "e#1", [{"type": "tokens", "n": "1"}, {"type": "final", "n": "2"}], 0)
        with server.lock:
            ids = direct.fenced(batch, direct._limits())
            again = direct.fenced(batch, direct._limits())
        with server.lock:
            after = direct.fenced(Fenced(owner, story, "e#1", [{"type": "tokens", "n": "3"}], 0), (100, 4096))
        want = [(first, {b"type": b"accepted", b"request_id": b"r"})]
        want += [
            (i, f)
            for i, f in zip(ids or [], [{b"type": b"tokens", b"n": b"1"}, {b"type": b"final", b"n": b"2"}])
        ]
        read = direct.scan({story.encode(): b"0-0"}, None)
        return (
            len(ids or []) == 2
            and again == []
            and after == Refused("final", "e#1")
            and client.xrange(story) == want
            and read == [[story.encode(), want]]
        )
    except Exception as e:
        log.warning("embedded store: direct path unusable on fakeredis %s: %s", fakeredis.__version__, e)
        return False
    finally:
        client.delete(owner, story)
        client.close()


class EmbeddedStore(RedisStore):
    """:class:`~control.store.RedisStore` on the embedded server's in-process client, with
    :meth:`fenced_append` and :meth:`read` done on the server's objects (see the module's
    docstring) where :func:`direct_works`; the commands otherwise."""

    def __init__(self, redis: Any, server: fakeredis.FakeServer, direct: bool):
        super().__init__(redis)
        self._direct = _Direct(server) if direct else None

    async def fenced_append(
        self, batches: Sequence[Fenced], plain: Sequence[Append] = ()
    ) -> list[Refused | None]:
        direct = self._direct
        if direct is None or not batches or not direct.usable():
            return await super().fenced_append(batches, plain)
        answers: list[Refused | None] = [None] * len(batches)
        left: list[int] = []  # batches the commands do
        limits = direct._limits()
        with direct.server.lock:
            for i, batch in enumerate(batches):
                got = direct.fenced(batch, limits)
                if got is None:
                    left.append(i)
                elif isinstance(got, Refused):
                    answers[i] = got
        if left:
            for i, why in zip(left, await super().fenced_append([batches[i] for i in left])):
                answers[i] = why
        # What the script does for its own batches, for those that got through here.
        skipped = set(left)
        through = [b for i, b in enumerate(batches) if i not in skipped and answers[i] is None]
        await self.after_fence(through, plain, own_ttl=True)
        return answers

    async def read(
        self, streams: Mapping[bytes | str, bytes], count: int | None, block_ms: int | None
    ) -> list:
        direct = self._direct
        if direct is None or not direct.usable():
            return await super().read(streams, count, block_ms)
        keyed = {k if isinstance(k, bytes) else k.encode(): v for k, v in streams.items()}
        got = direct.scan(keyed, count)
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
                got = direct.scan(keyed, count)  # (again: a write may have come in between)
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
