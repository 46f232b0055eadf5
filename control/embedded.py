"""The embedded control plane for ``fd serve``: a fakeredis server that also listens on TCP.

One :class:`fakeredis.FakeServer` holds the data. Two doors lead to it:

- a TCP listener (fakeredis' ``TcpFakeServer``, a thread per connection), so an operator can
  ``redis-cli -p <port> XADD fd:control '*' type abort request_id r1`` into a running
  ``fd serve`` exactly as into a real Redis;
- :meth:`EmbeddedRedis.client`, an in-process ``FakeAsyncRedis`` bound to the same server
  object. It skips the socket, the RESP round trip and the per-connection thread, and its
  blocking reads are woken by fakeredis' change callbacks instead of the TCP handler's 10 ms
  poll; see ``bench/bus.py`` for the measured difference. Writes through either door are seen
  by readers on the other (fakeredis wakes async waiters across threads).

The in-process door also skips fakeredis' generic command dispatch for the one command fd
sends most, ``XADD key * field value ...`` (a token event per request per step), and offers
``Bus.publish_many`` a direct append (``client.fd_append``) that skips redis-py's pipeline
for it too, ``Bus.publish_owned`` the fence's checks and appends (``client.fd_fenced_append``,
control/fence.py) without Lua, and the bus's store (``client.store()``, an
:class:`~control.embedded_store.EmbeddedStore`) the key operations of control/store.py, a
many-id abort's tombstones among them. All make the same change to the same data structures under the same lock, and
hand everything else to fakeredis (tests/test_embedded_xadd.py compares the two). They rely
on fakeredis internals, hence the pinned fakeredis version.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import threading
import time
from typing import Any, Callable

import redis.asyncio as aioredis
from fakeredis import FakeAsyncRedis, TcpFakeServer
from fakeredis._clients._async import FakeAsyncRedisConnection, FakeWriter
from fakeredis._clients._tcp_server import TCPFakeRequestHandler
from fakeredis._core._database import Item
from fakeredis._helpers import NoResponse
from fakeredis._socket import FakeSocket
from fakeredis._socket._async import AsyncFakeSocket
from fakeredis.model import _stream as fake_stream
from fakeredis.model._stream import MAX_KEY, StreamEntryKey, XStream
from redis.asyncio.client import Pipeline

from control.connect import MAX_CONNECTIONS, POOL_WAIT_S
from control.embedded_info import InfoCommand, ServerInfo, register
from control.embedded_store import EmbeddedStore
from control.fence import SEEN, Refused
from control.story import DONE, TAKEN, WRITTEN

log = logging.getLogger("control.embedded")


class _Fields(list):
    """One command, already split into its fields."""

    __slots__ = ()


class _DirectWriter(FakeWriter):
    def writelines(self, data) -> None:
        sock = self._socket
        if sock is None:
            return
        for chunk in data:
            if not isinstance(chunk, _Fields):
                sock.sendall(chunk)
            elif sock._paused:  # a blocking command holds the parser: queue behind it, in order
                sock.sendall(_resp(chunk))
            else:
                if not sock._server.connected or sock._killed:
                    raise sock._connection_error_class("Connection closed by the embedded server")
                if not _xadd(sock, chunk):
                    sock._process_command(list(chunk))


def _xadd(sock, fields: list[bytes]) -> bool:
    """``XADD key * field value ...`` (no trimming) from the in-process client, done by
    :func:`_append` instead of fakeredis' generic dispatch (name lookup, ACL, argument
    signature, a wrapper per key, RESP2 conversion), which cost more than the append itself.
    Anything else — another form, a transaction, CLIENT REPLY games — returns False: the
    generic path."""
    n = len(fields)
    if (
        n < 5
        or not n & 1
        or fields[2] != b"*"
        or fields[0] not in (b"XADD", b"xadd")
        or sock._queueing
        or sock._pubsub
        or sock._reply_off
        or sock._reply_skip
    ):
        return False
    entry = _append(sock._server, sock._db, fields[1], fields[3:], sock._stream_node_limits())
    if entry is None:
        return False
    sock.put_response(entry)
    return True


def _append(server, db, key: bytes, values, node_limits: tuple[int, int]) -> bytes | None:
    """Append one entry to the stream at ``key`` with a new id (``XADD key * ...``), the same
    steps as fakeredis' XADD and write-back: under the server lock, clocks set, the stream
    appended to (created if absent, its TTL kept), watchers and blocked readers notified.
    Returns the entry id, or None — nothing done — for what only fakeredis' own XADD does
    right (a key of another type, keyspace notifications on, exhausted ids)."""
    done = _append_after(server, db, key, values, node_limits)
    return None if done is None else done[0]


#: fakeredis' listpack size of a string element, remembered: an append sizes each of its ~16
#: fields, and they repeat (field names, event types, request ids, recent timestamps). It was
#: a sixth of the main thread's time per token at 32 streams (cProfile).
_lp_str_size = functools.lru_cache(maxsize=1 << 14)(fake_stream._lp_str_size)
_lp_int_size = fake_stream._lp_int_size


def _add(
    stream: XStream, fields: list[bytes], key: StreamEntryKey, node_max_entries: int, node_max_bytes: int
) -> None:
    """``XStream.add``, the same change to the same structures (nodes and their listpack
    sizes included: approximate trimming and XINFO read them), with the sizes of repeated
    strings remembered. tests/test_embedded_xadd.py compares the two."""
    names = fields[0::2]
    values = fields[1::2]
    nodes = stream._nodes
    node = nodes[-1] if nodes else None
    if node is not None:
        max_bytes = (
            node_max_bytes if 0 < node_max_bytes <= fake_stream._LP_MAX_SIZE else fake_stream._LP_MAX_SIZE
        )
        if node.lp_bytes + sum(map(len, fields)) >= max_bytes or (
            node_max_entries and node.live + node.deleted >= node_max_entries
        ):
            node = None
    if node is None:
        header = _lp_int_size(0) * 3 + _lp_int_size(len(names)) + sum(map(_lp_str_size, names))
        node = fake_stream._StreamNode(key, names, key, 0, 0, fake_stream._LP_EMPTY_SIZE + header)
        nodes.append(node)
    same = names == node.master_fields
    master = node.master_id
    size = (
        _lp_int_size(fake_stream._ENTRY_SAMEFIELDS if same else 0)
        + _lp_int_size(key.ts - master.ts)
        + _lp_int_size(key.seq - master.seq)
        + sum(map(_lp_str_size, values))
        + _lp_int_size(len(names) + 3 if same else 2 * len(names) + 4)
    )
    if not same:
        size += _lp_int_size(len(names)) + sum(map(_lp_str_size, names))
    node.lp_bytes += size
    node.set_counts(node.live + 1, node.deleted)
    node.last_id = key
    stream._ids.append(key)
    # Kept as a tuple of bytes, which the collector stops tracking, instead of fakeredis' list:
    # a long-running `fd serve` holds an hour of token events, and every full collection
    # walked each one (500k stored entries: 356 ms a collection).
    stream._values_dict[key] = tuple(fields)
    stream._entries_added += 1
    stream._last_id = key


def _append_after(
    server, db, key: bytes, values, node_limits: tuple[int, int]
) -> tuple[bytes, StreamEntryKey] | None:
    """:func:`_append`, also returning the id the stream ended at before the entry (a reader
    that has seen up to that id has seen everything before the new entry)."""
    if server.config.get(b"notify-keyspace-events"):
        return None
    with server.lock:
        now = time.time()
        for d in server.dbs.values():
            d.time = now
        return _append_locked(db, key, values, node_limits)


def _append_locked(
    db, key: bytes, values, node_limits: tuple[int, int]
) -> tuple[bytes, StreamEntryKey] | None:
    """:func:`_append_after`'s append, under the server lock the caller holds, its clocks set."""
    try:
        item = db[key]  # (an expired key is dropped here, as fakeredis does)
    except KeyError:
        item = None
    if item is not None and type(item.value) is not XStream:
        return None  # WRONGTYPE, said by the generic path
    stream = XStream() if item is None else item.value
    before = stream.last_id
    if before == MAX_KEY:
        return None
    entry = stream.next_id(None, True)
    if entry is None:
        return None
    _add(stream, values, entry, *node_limits)
    if item is None:
        db[key] = Item(stream)
    db.notify_watch(key)  # WATCHers, and readers blocked on the database
    return entry.encode(), before


class _Direct:
    """The in-process client's shortcuts for the bus's two bulk writes, done on the server's
    data under its lock instead of through redis-py's pipeline and fakeredis' dispatch:

    - :meth:`append` (the client's ``fd_append``): one stream entry of a flush, for
      ``Bus.publish_many`` — a step's ~33 token events were most of the engine loop's time
      outside the model;
    - :meth:`tombstones` (``fd_tombstones``, and :meth:`set_nx_get` for a claim's owner keys):
      ``SET owner aborted:<source> NX GET EX ttl`` and
      ``EXISTS req`` for each id of a many-id abort, for ``Bus.tombstone_many`` — 1,000 unknown
      ids were 2,000 commands on the loop the API answers on (83% of it while 1,000-id aborts
      came every 20 ms).

    Same data, same order, same wake-ups and WATCH invalidation; the same error as the
    client's own commands while the server is marked disconnected. ``None``: not done (a key
    of another type, keyspace notifications on): the caller takes the ordinary path."""

    def __init__(self, server, listeners: list[Callable[..., None]]):
        self._server = server
        self._listeners = listeners  # the server's: every in-process client's appends

    def _check(self) -> None:
        if not self._server.connected:
            from redis.exceptions import ConnectionError as RedisConnectionError

            raise RedisConnectionError("Connection closed by the embedded server")

    _names: dict[str, bytes] = {}  # field names, encoded once and shared by every entry

    def append(self, stream: str, fields: dict[str, str], event: Any = None) -> bytes | None:
        """``event``: what ``fields`` encode, handed with the new entry's id to the in-process
        listeners (:meth:`listen`) once it is written."""
        self._check()
        server = self._server
        values = self._encode(fields)
        limits = self._limits()
        key = stream.encode()
        done = _append_after(server, server.dbs[0], key, values, limits)
        if done is None:
            return None
        entry, before = done
        if event is not None:
            for listener in self._listeners:
                try:
                    listener(key, before, entry, event, fields)
                except Exception:  # a reader's bug must not cost the write
                    log.exception("in-process stream listener failed")
        return entry

    def _encode(self, fields: dict[str, str]) -> list[bytes]:
        """An entry's field names and values as the stream keeps them (names interned)."""
        names = self._names
        values = []
        for k, v in fields.items():
            kb = names.get(k)
            if kb is None:
                kb = names[k] = k.encode()
            values.append(kb)
            values.append(v.encode())
        return values

    def _batch(
        self, entries: list[tuple[dict[str, str], Any]]
    ) -> tuple[list[list[bytes]], tuple[int, int]] | None:
        """``entries`` encoded, and the stream node limits; None when keyspace notifications
        are on (which only the ordinary path sends)."""
        self._check()
        if self._server.config.get(b"notify-keyspace-events"):
            return None
        return [self._encode(fields) for fields, _ in entries], self._limits()

    def _limits(self) -> tuple[int, int]:
        cfg = self._server.config
        return (int(cfg.get(b"stream-node-max-entries", 100)), int(cfg.get(b"stream-node-max-bytes", 4096)))

    def fenced_append(
        self, owner_key: str, token: str, stream: str, entries: list[tuple[dict[str, str], Any]], ttl_s: int
    ) -> list[bytes] | Refused | None:
        """control/fence.py's script, done on the server's data under its lock (the client's
        ``fd_fenced_append``): ``entries`` (fields and the event they encode, in order) are
        appended to ``stream`` only if ``owner_key`` holds ``token`` and the stream's last
        entry is no final; a final ends the batch and renews both keys' TTL. Each appended
        entry is told to the in-process listeners, as :meth:`append` tells them. Returns the
        ids appended, :class:`Refused` (nothing appended), or None (nothing done: a key of
        another type, keyspace notifications on; the caller runs the script)."""
        batch = self._batch(entries)
        if batch is None:
            return None
        server, (encoded, limits) = self._server, batch
        key, okey = stream.encode(), owner_key.encode()
        done: list[tuple[bytes, StreamEntryKey, int]] = []
        with server.lock:
            db = self._db()
            owner = _value(db, okey)
            if owner is not None and type(owner) is not bytes:
                return None  # WRONGTYPE: the script says so
            if owner != token.encode():
                return Refused("owner", None if owner is None else owner.decode(errors="replace"))
            story = _value(db, key)
            if story is not None and type(story) is not XStream:
                return None
            if story is not None and story._ids:
                mine = tuple(_batch_last(encoded))
                if any(story._values_dict[i] == mine for i in story._ids[-SEEN:]):
                    return []  # this batch is there already (control/fence.py)
                if _is_final(story._values_dict[story._ids[-1]]):
                    return Refused("final", owner.decode(errors="replace"))
            ended = False
            for i, values in enumerate(encoded):
                got = _append_locked(db, key, values, limits)
                if got is None:  # (only an exhausted id space: nothing of this batch is lost
                    break  # silently, the caller sees fewer ids than events)
                done.append((got[0], got[1], i))
                if values[1] == b"final" and values[0] == b"type":
                    ended = True
                    break
            if ended and ttl_s > 0:
                self._expire_locked(db, [key, okey], ttl_s)
        self._tell(key, done, entries)
        return [entry for entry, _, _ in done]

    def start_story(self, stream: str, entries: list[tuple[dict[str, str], Any]], ttl_s: int) -> int | None:
        """control/story.py's script for the story (the client's ``fd_start_story``), under the
        server's lock: ``entries`` are appended to ``stream`` only if it has none yet, and it
        gets the TTL. Returns the script's answer (``story.WRITTEN``, ``DONE``, ``TAKEN``), or
        None with nothing done (a key of another type, keyspace notifications on)."""
        batch = self._batch(entries)
        if batch is None:
            return None
        server, (encoded, limits) = self._server, batch
        key = stream.encode()
        done: list[tuple[bytes, StreamEntryKey, int]] = []
        with server.lock:
            db = self._db()
            story = _value(db, key)
            if story is not None and type(story) is not XStream:
                return None
            if story is not None and story._ids:
                return DONE if story._values_dict[story._ids[0]] == tuple(encoded[0]) else TAKEN
            for i, values in enumerate(encoded):
                got = _append_locked(db, key, values, limits)
                if got is None:  # (only an exhausted id space)
                    break
                done.append((got[0], got[1], i))
            if ttl_s > 0:
                self._expire_locked(db, [key], ttl_s)
        self._tell(key, done, entries)
        return WRITTEN

    def _tell(
        self,
        key: bytes,
        done: list[tuple[bytes, StreamEntryKey, int]],
        entries: list[tuple[dict[str, str], Any]],
    ) -> None:
        for entry, before, i in done:
            fields, event = entries[i]
            if event is None:
                continue
            for listener in self._listeners:
                try:
                    listener(key, before, entry, event, fields)
                except Exception:  # a reader's bug must not cost the write
                    log.exception("in-process stream listener failed")

    def listen(self, listener: Callable[..., None]) -> Callable[[], None]:
        """Call ``listener(key, before, entry_id, event, fields)`` after each append made
        with an ``event`` by any in-process client of this server, on the appending thread
        (the event loop's: in-process clients are used there only); ``before`` is the id the
        stream ended at before it. Returns the function that stops it. Appends from the TCP
        door (redis-cli, other processes) are not told: readers still read those."""
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop

    def _db(self):
        """The database, its clock set (as fakeredis sets it before each command); under the
        server lock."""
        now = time.time()
        for d in self._server.dbs.values():
            d.time = now
        return self._server.dbs[0]

    def get(self, key: str) -> tuple[bytes | None] | None:
        """``GET key`` as ``(value,)`` (the client's ``fd_get``: an owner check on every
        request's way in); None for a key of another type, which the ordinary GET reports."""
        self._check()
        with self._server.lock:
            try:
                item = self._db()[key.encode()]  # (an expired key is dropped here)
            except KeyError:
                return (None,)
            return (item.value,) if type(item.value) is bytes else None

    def exists(self, key: str) -> bool:
        """``EXISTS key`` for one key (``fd_exists``)."""
        self._check()
        with self._server.lock:
            try:
                self._db()[key.encode()]
            except KeyError:
                return False
            return True

    def expire(self, keys: list[str], ttl_s: int) -> list[bool] | None:
        """``EXPIRE key ttl`` for each key (``fd_expire``: every new request's stream, every
        finished one's); None, with nothing done, when keyspace notifications are on."""
        self._check()
        server = self._server
        if server.config.get(b"notify-keyspace-events") or ttl_s <= 0:
            return None
        with server.lock:
            return self._expire_locked(self._db(), [key.encode() for key in keys], ttl_s)

    @staticmethod
    def _expire_locked(db, keys: list[bytes], ttl_s: int) -> list[bool]:
        out = []
        for kb in keys:
            try:
                item = db[kb]
            except KeyError:
                out.append(False)
                continue
            item.expireat = db.time + ttl_s
            db.schedule_expiry(kb, item.expireat)
            for sock in db._watches.get(kb, ()):  # a WATCH sees the key modified
                sock.notify_watch()
            out.append(True)
        return out

    def read_group(self, key: str, group: str, consumer: str, count: int | None) -> list | None:
        """``XREADGROUP GROUP group consumer [COUNT n] STREAMS key >`` without BLOCK (the
        client's ``fd_read_group``: an engine's claim, which the model waits for), in redis-py's
        reply shape. None, with nothing read: no such stream or group, or a key of another
        type — the ordinary XREADGROUP says what is wrong."""
        self._check()
        server = self._server
        kb = key.encode()
        with server.lock:
            try:
                item = self._db()[kb]
            except KeyError:
                return None
            stream = item.value
            if type(stream) is not XStream:
                return None
            grp = stream.group_get(group.encode())
            if grp is None:
                return None
            records = grp.group_read(consumer.encode(), b">", count, False)
        if not records:
            return []
        return [[kb, [(eid, dict(zip(f[0::2], f[1::2]))) for eid, f in records]]]

    def ack_delete(self, key: str, group: str, ids: list[bytes]) -> tuple[int, int] | None:
        """``XACK key group id...`` then ``XDEL key id...`` (``fd_ack_delete``: the requests a
        flush finished leave ``P:requests``); the two counts. None, with nothing done: a key of
        another type, or keyspace notifications on."""
        self._check()
        server = self._server
        if server.config.get(b"notify-keyspace-events"):
            return None
        kb = key.encode()
        with server.lock:
            db = self._db()
            try:
                item = db[kb]
            except KeyError:
                return 0, 0
            stream = item.value
            if type(stream) is not XStream:
                return None
            grp = stream.group_get(group.encode())
            acked = grp.ack(tuple(ids)) if grp is not None else 0
            deleted = stream.delete(list(ids))
            if deleted:
                db.notify_watch(kb)
        return acked, deleted

    def set_nx_get(self, keys: list[str], value: str, ttl_s: int) -> list[bytes | None] | None:
        """``SET key value NX GET EX ttl`` for each key (``fd_set_nx_get``: an engine owning
        the requests it claims, a burst of them at once): each key's old value, None where it
        was set."""
        res = self.tombstones(keys, value, ttl_s, None)
        return None if res is None else [old for old, _ in res]

    def tombstones(
        self, owner_keys: list[str], value: str, ttl_s: int, req_keys: list[str] | None
    ) -> list[tuple[bytes | None, bool]] | None:
        self._check()
        server = self._server
        if server.config.get(b"notify-keyspace-events") or ttl_s <= 0:
            return None
        db = server.dbs[0]
        val = value.encode()
        out: list[tuple[bytes | None, bool]] = []
        with server.lock:
            self._db()  # (the clock)
            keys = [key.encode() for key in owner_keys]
            for kb in keys:
                item = db._dict.get(kb)
                if item is not None and not db.expired(item) and type(item.value) is not bytes:
                    return None  # WRONGTYPE: the ordinary path says so (nothing written yet)
            for i, kb in enumerate(keys):
                try:
                    item = db[kb]  # (again: an id twice in one call sees its first tombstone)
                except KeyError:
                    item = None
                if item is None:  # NX: set, with its TTL; GET: there was nothing
                    new = Item(val)
                    new.expireat = db.time + ttl_s
                    db[kb] = new
                    for sock in db._watches.get(kb, ()):  # (notify_watch, but for the wake-up)
                        sock.notify_watch()
                    old = None
                else:
                    old = item.value
                out.append((old, req_keys is not None and req_keys[i].encode() in db))
            if any(old is None for old, _ in out):
                db.wake_all()  # blocked readers re-check once, not once a key
        return out


def _value(db, key: bytes):
    """A key's value, or None; under the server lock (an expired key is dropped here)."""
    try:
        return db[key].value
    except KeyError:
        return None


def _batch_last(encoded: list[list[bytes]]) -> list[bytes]:
    """The last entry a batch would append: its final, or its last event."""
    for values in encoded:
        if values[:2] == [b"type", b"final"]:
            return values
    return encoded[-1]


def _is_final(fields) -> bool:
    """Whether a stored entry (``name, value, ...``) is a ``final`` event."""
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"type":
            return fields[i + 1] == b"final"
    return False


_format_record = XStream.format_record


def _format_record_as_list(self, key):
    """fakeredis replies with a stream entry's stored fields as they are; ours are tuples
    (see :func:`_append`), and RESP2 replies take lists."""
    record = _format_record(self, key)
    if type(record[1]) is tuple:
        record[1] = list(record[1])
    return record


XStream.format_record = _format_record_as_list


def _resp(fields: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(fields)]
    for f in fields:
        out.append(b"$%d\r\n%s\r\n" % (len(f), f))
    return b"".join(out)


class _DirectSocket(InfoCommand, AsyncFakeSocket):
    """The in-process client's fake socket, with a cheaper wake-up of its blocking reads.

    fakeredis wakes a blocked ``XREAD``/``XREADGROUP`` through a change callback that runs on
    every write to the database, for every blocked reader, and always hops threads:
    ``loop.call_soon_threadsafe(event.set)`` writes the loop's self-pipe each time (an XADD
    pipeline of 32 tokens woke each blocked reader 32 times, two syscalls apiece). A write made
    on the reader's own loop thread (this process's engine and API, the usual case) sets the
    event directly, once; a write from another thread (the TCP door's handler threads) still
    goes through ``call_soon_threadsafe``. What wakes, and when, is unchanged.
    """

    def _blocking(self, timeout, func, shape=None):
        # As fakeredis' AsyncFakeSocket._blocking, but for the callback.
        loop = asyncio.get_running_loop()
        ret = func(True)
        if ret is not None or self._in_transaction:
            return ret if shape is None else shape(ret)
        event = asyncio.Event()
        loop_thread = threading.get_ident()

        def callback() -> None:
            if threading.get_ident() == loop_thread:
                if not event.is_set():
                    event.set()
            else:
                loop.call_soon_threadsafe(event.set)

        self._db.add_change_callback(callback)
        self._blocked = True
        self.pause()
        loop.create_task(self._async_blocking(timeout, func, event, callback, shape))
        return NoResponse()


class _DirectReader:
    """The in-process client's ``XREAD [COUNT n] [BLOCK ms] STREAMS key... id...`` for the API's
    stream multiplexer (its ``fd_xread``), read straight off the streams: fakeredis' XREAD
    parses its arguments, wraps every key and reshapes the reply on each call, and a blocked
    one runs twice per wake-up — the mux's read was the largest fakeredis cost left in
    ``fd serve``'s loop. Same entries, same order, same reply shape as redis-py's (keys and
    ids as bytes, fields a dict); a wake-up on any write to the database, as fakeredis does.
    ``None``: a key holds something else (the caller asks fakeredis, which says WRONGTYPE)."""

    def __init__(self, server):
        self._server = server

    def _scan(self, db, streams: dict[bytes, bytes], count: int | None):
        server = self._server
        out = []
        with server.lock:
            now = time.time()
            for d in server.dbs.values():
                d.time = now
            for key, after in streams.items():
                try:
                    item = db[key]
                except KeyError:
                    continue
                stream = item.value
                if type(stream) is not XStream:
                    return None
                ids = stream._ids
                if not ids:
                    continue
                ms, _, seq = after.partition(b"-")
                try:
                    after_key = StreamEntryKey(int(ms), int(seq or 0))
                except ValueError:
                    return None  # not an entry id: fakeredis says what is wrong with it
                start = bisect.bisect_right(ids, after_key)
                if start >= len(ids):
                    continue
                stop = len(ids) if not count else min(len(ids), start + count)
                values = stream._values_dict
                entries = []
                for k in ids[start:stop]:
                    f = values[k]
                    entries.append((k.encode(), dict(zip(f[0::2], f[1::2]))))
                out.append([key, entries])
        return out

    async def __call__(self, streams: dict[bytes, bytes], count: int | None = None, block: int | None = None):
        server = self._server
        if not server.connected:
            from redis.exceptions import ConnectionError as RedisConnectionError

            raise RedisConnectionError("Connection closed by the embedded server")
        db = server.dbs[0]
        res = self._scan(db, streams, count)
        if res or res is None or block is None:
            return res
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        loop_thread = threading.get_ident()

        def on_change() -> None:
            if threading.get_ident() == loop_thread:
                woken.set()
            else:
                loop.call_soon_threadsafe(woken.set)

        timer = loop.call_later(block / 1000, woken.set) if block else None
        with server.lock:  # (writers on the TCP door's threads walk the callbacks under it)
            db.add_change_callback(on_change)
        try:
            while True:
                res = self._scan(db, streams, count)  # (again: a write may have come in between)
                if res or res is None or (timer is not None and timer.when() <= loop.time()):
                    return res
                woken.clear()
                await woken.wait()
        finally:
            with server.lock:
                db.remove_change_callback(on_change)
            if timer is not None:
                timer.cancel()


class _DirectConnection(FakeAsyncRedisConnection):
    """The in-process client's connection: hands each command's fields straight to the fake
    server instead of packing RESP that fakeredis then re-parses.

    fakeredis parses a pipeline by slicing its input buffer once per field, which is quadratic
    in the pipeline's size: a 32-event step flush cost ~3.4 ms, more than the model step it
    overlaps (bench/engine.py). Commands, replies and ordering are unchanged; only the
    serialisation round trip inside one process is skipped.
    """

    async def _connect(self) -> None:
        await super()._connect()
        self._sock.__class__ = _DirectSocket  # same object, one method more of ours
        self._writer = _DirectWriter(self._sock)

    def pack_command(self, *args):
        if isinstance(args[0], str):
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        enc = self.encoder.encode
        return [_Fields(bytes(enc(a)) for a in args)]

    def pack_commands(self, commands):
        out: list = []
        for cmd in commands:
            out += self.pack_command(*cmd)
        return out


class _TcpSocket(InfoCommand, FakeSocket):
    """A TCP client's fake socket: fakeredis's, with ``INFO`` (control.embedded_info)."""


class _TcpHandler(TCPFakeRequestHandler):
    """fakeredis's handler of one TCP connection, whose socket answers ``INFO`` too."""

    def setup(self) -> None:
        super().setup()
        sock = self.current_client.get_socket()
        if type(sock) is FakeSocket:
            sock.__class__ = _TcpSocket  # same object, one command more


class _Pipeline(Pipeline):
    """A pipeline that hands its connection back without ``asyncio.shield``.

    redis-py shields the release so a second cancellation cannot split the pool's books; the
    shield is a task of its own, and the pipeline resumes three loop turns later. In
    ``fd serve`` a turn during a burst of arrivals is another request's parse: a submit's
    one pipeline took until the burst was over (32 requests: ~10 ms), and so did the
    engine's claim. This pool's release never suspends (an uncontended lock, a list append),
    so there is nothing for a cancellation to split."""

    async def reset(self) -> None:
        conn = None
        if not self.watching and self.connection is not None:
            conn, self.connection = self.connection, None
        await super().reset()
        if conn is not None:
            await self.connection_pool.release(conn)


class _Client(FakeAsyncRedis):
    """The in-process client: fakeredis' async client with this module's pipeline, and the
    store (:class:`control.embedded_store.EmbeddedStore`) that the bus uses on it."""

    _store: EmbeddedStore

    def store(self) -> EmbeddedStore:
        return self._store

    def pipeline(self, transaction: bool = True, shard_hint=None) -> Pipeline:
        return _Pipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class EmbeddedRedis:
    """In-process fakeredis server that also listens on ``host:port`` so redis-cli works."""

    #: How often keys past their TTL are removed. fakeredis drops an expired key only when it
    #: is touched or the keyspace is walked (KEYS, SCAN, DBSIZE); a finished request's stream
    #: is never touched again, so without this it stayed in memory for the life of `fd serve`.
    #: Redis runs the same kind of active expiry cycle (10 times a second, sampling).
    EXPIRE_EVERY_S = 1.0

    #: ``fd serve``'s default ``--request-ttl`` on this server: 10 minutes, not a real Redis's
    #: hour. A finished request's keys (its story, ~12 KB with a few hundred tokens, and its
    #: owner key) live in this process's memory for the TTL, in Python objects, with no
    #: ``maxmemory`` to bound them: at 100 requests/s an hour held ~4 GB, ten minutes hold
    #: ~0.7 GB, still time for a client to resume a stream, retrieve a response or go on from
    #: it (``previous_response_id``) shortly after.
    REQUEST_TTL_S = 600

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self._requested_port = port
        self.port = port
        self._tcp: TcpFakeServer | None = None
        self._thread: threading.Thread | None = None
        self._expirer: threading.Thread | None = None
        self._stopped = threading.Event()
        self._listeners: list[Callable[..., None]] = []  # see _Direct.listen

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def fake_server(self):
        if self._tcp is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return self._tcp.fake_server

    def start(self) -> None:
        if self._tcp is not None:
            return
        # Redis 7 semantics: what the bus is tested against on a real server too.
        self._tcp = TcpFakeServer((self.host, self._requested_port), server_version=(7, 0))
        self._tcp.RequestHandlerClass = _TcpHandler
        self.port = self._tcp.server_address[1]
        tcp = self._tcp
        register(ServerInfo(tcp.fake_server, self.port, lambda: len(tcp.clients)))
        self._thread = threading.Thread(
            target=self._tcp.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"embedded-redis:{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._stopped.clear()
        self._expirer = threading.Thread(
            target=self._expire_cycle,
            args=(self._tcp.fake_server,),
            name=f"embedded-redis-expiry:{self.port}",
            daemon=True,
        )
        self._expirer.start()

    def _expire_cycle(self, server) -> None:
        while not self._stopped.wait(self.EXPIRE_EVERY_S):
            with server.lock:
                now = time.time()
                for db in server.dbs.values():
                    db.time = now
                    db._remove_expired()  # (a heap of expiry times: pops only what is due)

    def stop(self) -> None:
        """Stop listening and close every TCP connection (their handlers poll a shutdown flag)."""
        tcp, self._tcp = self._tcp, None
        if tcp is None:
            return
        self._stopped.set()
        tcp.shutdown()
        tcp.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._expirer is not None:
            self._expirer.join(timeout=5)
            self._expirer = None

    def client(self) -> aioredis.Redis:
        """A client for code in this process, on the same data the TCP port serves."""
        # socket_timeout=None: with a timeout redis-py sends every command through
        # asyncio.wait_for, a Task per command; an in-process send cannot time out anyway.
        client = _Client(
            server=self.fake_server,
            decode_responses=False,
            protocol=2,
            socket_timeout=None,
            connection_class=_DirectConnection,
            connection_pool_class=aioredis.BlockingConnectionPool,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT_S,
        )
        direct = _Direct(self.fake_server, self._listeners)
        client._store = EmbeddedStore(client, direct)
        client.fd_append = direct.append
        client.fd_fenced_append = direct.fenced_append
        client.fd_start_story = direct.start_story
        client.fd_listen = direct.listen
        client.fd_tombstones = direct.tombstones
        client.fd_set_nx_get = direct.set_nx_get
        client.fd_read_group = direct.read_group
        client.fd_ack_delete = direct.ack_delete
        client.fd_get = direct.get
        client.fd_exists = direct.exists
        client.fd_expire = direct.expire
        client.fd_xread = _DirectReader(self.fake_server)
        return client

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
