"""The event bus: every Redis command fd sends, behind names that say what they mean.

:class:`Bus` is a thin, stateless wrapper over one ``redis.asyncio`` client; :class:`StreamMux`
is the one stateful reader, multiplexing many per-request streams for an API replica.

Rules every reader here follows (DESIGN.md §3, §6):

- Nothing that arrives on a stream can crash a reader. An entry that does not decode, or that
  decodes to an event that does not belong on that stream, is logged, copied to ``P:dead``
  with a ``reason``, acked where a consumer group applies, counted, and skipped.
- Blocking reads are never cancelled (fakeredis loses the reply of a cancelled blocking read);
  callers pass a short ``block_ms`` and loop on a stop flag.
- Stream keys and entry ids come back as ``bytes``; every last-id map is keyed by ``bytes``.
- Trimming is approximate (``MAXLEN ~``), which is about twice as fast as exact trimming.
  Per-request streams are never trimmed (the story must stay whole); they expire instead.

On a Redis Cluster (``connect("redis+cluster://...")``) every command here names keys of one
slot, or goes through redis-py's cluster pipeline, which splits by node and keeps the order of
commands within a node but not across nodes: where the order across slots matters (a story's
``accepted`` before its request; a final before the ack of its request) the bus spends a second
round trip. :class:`StreamMux` reads one slot per XREAD there (see its docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable, Mapping, Sequence

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from control import fence
from control import story as story_start
from control.events import (
    CONTROL_TYPES,
    REQ_STREAM_TYPES,
    Abort,
    AbortAll,
    Accepted,
    BadEvent,
    Drain,
    Event,
    Final,
    Request,
    decode,
    tombstone_story,
)
from control.fence import Refused
from control.keys import (
    ABORT_WRITTEN,
    GROUP_ENGINES,
    Keys,
    choices_owner,
    is_tombstone,
    pending_tombstone_source,
    tombstone,
    valid_request_id,
)
from control.store import Store, store_for

log = logging.getLogger("control.bus")

#: Dead letters keep at most this much of each original field: enough to see what went
#: wrong, without letting an oversize junk entry be copied whole into P:dead.
DEAD_FIELD_KEEP_BYTES = 64 * 1024
_DEAD_RESERVED = (b"reason", b"stream", b"entry_id")
DEAD_SEEN_MAX = 4096


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def entry_id_key(entry_id: bytes | str) -> tuple[int, int]:
    """Stream entry ids as sortable numbers (``b"12-3"`` -> ``(12, 3)``; ``"12"`` -> ``(12, 0)``)."""
    ms, _, seq = _b(entry_id).partition(b"-")
    return int(ms), int(seq or 0)


def _normal_id(entry_id: bytes | str) -> bytes:
    try:
        ms, seq = entry_id_key(entry_id)
    except ValueError:
        raise ValueError(f"not a stream entry id: {entry_id!r}") from None
    return b"%d-%d" % (ms, seq)


def is_cluster(redis) -> bool:
    return isinstance(redis, RedisCluster)


def check_event(
    stream: str | bytes, ev: Event, allowed: tuple[type, ...], request_id: str | None = None
) -> Event:
    """Reject an event that decoded fine but has no business on this stream."""
    if not isinstance(ev, allowed):
        raise BadEvent(f"event type {ev.TYPE!r} does not belong on {_b(stream).decode()}", "type")
    if request_id is not None and getattr(ev, "request_id", request_id) != request_id:
        raise BadEvent(f"event for {ev.request_id!r} on the stream of {request_id!r}", "request_id")
    return ev


#: How long a finished request's story (``P:req``), owner key and conversation are kept, by
#: default (``--request-ttl``): a late abort of it stays a no-op, and any replica can replay or
#: retrieve it, for this long.
REQUEST_TTL_S = 3600
#: How long an abort's tombstone for a request no engine had (``--tombstone-ttl``) waits for
#: that request: one that arrives later than this runs.
TOMBSTONE_TTL_S = 600


#: On the embedded server's in-process client a capped stream (journal, control, dead letters)
#: is appended to without MAXLEN and trimmed (``XTRIM MAXLEN ~``) once every this many entries.
TRIM_EVERY = 256


class Bus:
    """Typed access to fd's streams and keys for one Redis client and one key prefix."""

    def __init__(
        self,
        redis,
        keys: Keys,
        *,
        req_ttl_s: int = REQUEST_TTL_S,
        dead_maxlen: int = 10_000,
        requests_maxlen: int | None = None,
        control_maxlen: int = 10_000,
        journal_maxlen: int = 10_000,
    ):
        self.redis = redis
        self.keys = keys
        self.req_ttl_s = req_ttl_s
        self.dead_maxlen = dead_maxlen
        self.requests_maxlen = requests_maxlen
        self.control_maxlen = control_maxlen
        self.journal_maxlen = journal_maxlen
        self.dead_letters = 0
        #: called once per dead letter written (e.g. a Prometheus counter's ``inc``)
        self.on_dead_letter: Callable[[], Any] | None = None
        self._dead_seen: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self._journal_head = f"{keys.prefix}:journal:"
        self.cluster = is_cluster(redis)
        #: The key operations (owner keys, tombstones, TTLs, the request group): the client's
        #: own store where it brings one (the embedded server's in-process client), else
        #: redis-py commands on it.
        self.store: Store = store_for(redis)
        #: In-process readers of ``P:control`` (``fd serve``: the engine beside this API), told
        #: of each control event this bus publishes as it is published, a few event-loop turns
        #: before their XREAD would bring it. The event is still written: it is the record, and
        #: every other reader's source. Readers must take it twice (once more from the stream).
        self.local_control: list[Callable[[Event], None]] = []
        #: In-process claimers of ``P:requests``, called once a publish has put requests there
        #: (so ``fd serve``'s engine need not poll it every step).
        self.local_requests: list[Callable[[], None]] = []
        self._appends: dict[str, int] = {}  # capped stream -> direct appends (see TRIM_EVERY)
        self._fence_sha: str | None = None  # control/fence.py's script, once loaded
        self._start_script: Any = None  # control/story.py's (redis-py's Script), registered on first use

    # ------------------------------------------------------------------ publishing

    def maxlen(self, stream: str) -> int | None:
        """The approximate length cap of a stream family; ``None`` (never trim) for the rest."""
        if stream == self.keys.requests:
            return self.requests_maxlen
        if stream == self.keys.control:
            return self.control_maxlen
        if stream == self.keys.dead:
            return self.dead_maxlen
        if stream.startswith(self._journal_head):
            return self.journal_maxlen
        return None

    def _xadd(self, client, stream: str, fields: Mapping) -> Any:
        cap = self.maxlen(stream)
        return (
            client.xadd(stream, fields, maxlen=cap, approximate=True) if cap else client.xadd(stream, fields)
        )

    def tell_local(self, stream: str, event: Event) -> None:
        """Tell the in-process readers of ``stream`` (``P:control`` only) of ``event`` now."""
        if stream == self.keys.control:
            for sink in self.local_control:
                try:
                    sink(event)
                except Exception:  # a reader's bug must not cost the publish
                    log.exception("in-process control reader failed")

    def _tell_arrivals(self) -> None:
        for sink in self.local_requests:
            try:
                sink()
            except Exception:
                log.exception("in-process request claimer failed")

    def _append_direct(
        self, append, stream: str, event: Event, fields: dict[str, str], trims: list[tuple[str, int]]
    ) -> bytes | None:
        """The embedded in-process client's direct append (see :meth:`publish_many`); a capped
        stream is noted in ``trims`` once every ``TRIM_EVERY`` entries. The event goes with
        its fields: an in-process stream reader takes it as it is (:meth:`StreamMux._local`)."""
        entry = append(stream, fields, event)
        if entry is not None:
            cap = self.maxlen(stream)
            if cap:
                n = self._appends[stream] = self._appends.get(stream, 0) + 1
                if n % TRIM_EVERY == 0:
                    trims.append((stream, cap))
        return entry

    async def publish(self, stream: str, event: Event, *, tell_local: bool = True) -> bytes:
        if tell_local and self.local_control:
            self.tell_local(stream, event)
        append = getattr(self.redis, "fd_append", None)
        entry = None
        if append is not None:
            trims: list[tuple[str, int]] = []
            entry = self._append_direct(append, stream, event, event.encode(), trims)
            for key, cap in trims:
                await self.redis.xtrim(key, maxlen=cap, approximate=True)
        if entry is None:
            entry = await self._xadd(self.redis, stream, event.encode())
        if self.local_requests and stream == self.keys.requests:
            self._tell_arrivals()
        return entry

    async def publish_many(
        self, items: Sequence[tuple[str, Event]], expire: Sequence[str] = (), ack: Sequence[bytes] = ()
    ) -> list[bytes]:
        """All of ``items`` (then an EXPIRE of each key in ``expire``, then an XACK of each
        ``P:requests`` entry in ``ack``) in one round trip, in order. Acks come last so a request
        is acknowledged only once its final is written."""
        if not items and not expire and not ack:
            return []
        pipe = self.redis.pipeline(transaction=False)
        # The embedded server's in-process client appends entries directly, in order, until
        # the first one it cannot (then the pipeline takes the rest, so nothing is reordered).
        # A capped stream is trimmed (XTRIM MAXLEN ~) every TRIM_EVERY entries there, not by a
        # MAXLEN on each.
        append = getattr(self.redis, "fd_append", None)
        direct: list[bytes] = []
        trims: list[tuple[str, int]] = []
        for stream, event in items:
            if self.local_control:
                self.tell_local(stream, event)
            fields = event.encode()
            if append is not None:
                entry = self._append_direct(append, stream, event, fields, trims)
                if entry is not None:
                    direct.append(entry)
                    continue
                append = None
            self._xadd(pipe, stream, fields)
        if expire and append is not None and len(pipe) == 0:
            # every item went directly: the TTLs can too, after them
            if self.redis.fd_expire(list(expire), self.req_ttl_s) is not None:
                expire = ()
        for key in expire:
            pipe.expire(key, self.req_ttl_s)
        if ack and self.cluster and (items or expire):
            # P:requests may live on another node than the finals, and the cluster pipeline
            # runs the nodes' batches side by side: write first, then ack.
            results = await pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
        else:
            results = None
        if (
            ack
            and append is not None
            and len(pipe) == 0
            and self.redis.fd_ack_delete(self.keys.requests, GROUP_ENGINES, list(ack)) is not None
        ):
            ack = ()  # every item went directly: so did the acks, after them
        if ack:
            # A finished request leaves P:requests altogether, so the stream holds only work
            # not yet done and needs no MAXLEN (which would drop unclaimed requests).
            pipe.xack(self.keys.requests, GROUP_ENGINES, *ack)
            pipe.xdel(self.keys.requests, *ack)
        for stream, cap in trims:  # (last: the results of the items come first)
            pipe.xtrim(stream, maxlen=cap, approximate=True)
        tail = await pipe.execute() if len(pipe) else []
        if self.local_requests and any(stream == self.keys.requests for stream, _ in items):
            self._tell_arrivals()  # written now: a claim finds them
        return (direct + (results if results is not None else tail))[: len(items)]

    async def publish_owned(
        self,
        items: Sequence[tuple[str, Event]],
        owners: Mapping[str, str],
        expire: Sequence[tuple[str, str]] = (),
        ack: Sequence[tuple[str, bytes]] = (),
    ) -> dict[str, Refused]:
        """An engine's flush: :meth:`publish_many`, with every event on a request's story
        appended through the fence (control/fence.py): only while ``P:owner:{id}`` holds
        ``owners[id]`` (the writer's owner token) and the story has no final yet, each
        request's events in one atomic call, all pipelined in one round trip. A story event
        whose request has no token in ``owners`` is refused too (never written unfenced).

        ``expire`` and ``ack`` are ``(request id, key or P:requests entry)``, done only for
        requests whose events got through, so an engine never acknowledges the entry of a
        request another engine now runs: with the final, inside the fence, on a single Redis;
        after the events otherwise (the cluster's other slots; the embedded server, where it
        costs no round trip). The final's renewal of the story's and owner key's own TTL is
        the fence's.

        Returns the requests refused (request id -> why); nothing of theirs was written."""
        keys = self.keys
        groups: dict[str, list[tuple[str, Event]]] = {}
        plain: list[tuple[str, Event]] = []
        for stream, ev in items:
            rid = getattr(ev, "request_id", None)
            if rid is not None and stream == keys.req(rid):
                groups.setdefault(rid, []).append((stream, ev))
            else:
                plain.append((stream, ev))
        refused: dict[str, Refused] = {}
        fenced = getattr(self.redis, "fd_fenced_append", None)  # the embedded in-process client
        scripted: list[tuple[str, list[dict[str, str]]]] = []
        for rid, evs in groups.items():
            token = owners.get(rid)
            if token is None:
                log.error("refused to write %d event(s) of %s without an owner token", len(evs), rid)
                refused[rid] = Refused("owner", None)
                continue
            fields = [ev.encode() for _, ev in evs]
            got = None
            if fenced is not None:
                got = fenced(
                    keys.owner(rid),
                    token,
                    keys.req(rid),
                    [(f, ev) for f, (_, ev) in zip(fields, evs)],
                    self.req_ttl_s,
                )
            if got is None:
                scripted.append((rid, fields))
            elif isinstance(got, Refused):
                refused[rid] = got
        folded: set[str] = set()
        if scripted:
            if not self.cluster:  # a final's ack and renewals go with it (see control/fence.py)
                folded = {rid for rid, fields in scripted if fields[-1].get("type") == Final.TYPE}
            refused.update(await self._fenced_pipeline(scripted, owners, plain, folded, expire, ack))
        elif plain:
            await self.publish_many(plain)
        later_expire = [key for rid, key in expire if rid not in refused and rid not in folded]
        later_ack = [entry for rid, entry in ack if rid not in refused and rid not in folded]
        if later_expire or later_ack:
            await self.publish_many([], expire=later_expire, ack=later_ack)
        return refused

    async def _fenced_pipeline(
        self,
        scripted,
        owners: Mapping[str, str],
        plain: Sequence[tuple[str, Event]],
        folded: set[str],
        expire: Sequence[tuple[str, str]],
        ack: Sequence[tuple[str, bytes]],
    ) -> dict[str, Refused]:
        """The fence's script for each request (EVALSHA, loaded on a NOSCRIPT: a command that
        failed so did nothing, and only those are sent again), and ``plain``'s XADDs, in one
        pipeline; ``folded``: the requests whose ack and renewals go in their script."""
        acks = {rid: entry for rid, entry in ack if rid in folded}
        renew: dict[str, list[str]] = {}
        for rid, key in expire:
            if rid in folded:
                renew.setdefault(rid, []).append(key)
        if self._fence_sha is None:
            self._fence_sha = await self.redis.script_load(fence.SCRIPT)
        refused: dict[str, Refused] = {}
        todo = scripted
        for _ in range(3):
            pipe = self.redis.pipeline(transaction=False)
            for rid, fields in todo:
                extra = [self.keys.requests, *renew.get(rid, ())] if rid in folded else []
                args = fence.script_args(owners[rid], self.req_ttl_s, fields, acks.get(rid), GROUP_ENGINES)
                # (execute_command: redis-py's cluster pipeline refuses its evalsha, but
                # routes the command by its first key, the request's slot)
                pipe.execute_command(
                    "EVALSHA",
                    self._fence_sha,
                    2 + len(extra),
                    self.keys.owner(rid),
                    self.keys.req(rid),
                    *extra,
                    *args,
                )
            for stream, ev in plain:
                self._xadd(pipe, stream, ev.encode())
            plain = ()
            results = await pipe.execute(raise_on_error=False)
            again = []
            for item, res in zip(todo, results):
                if isinstance(res, NoScriptError):
                    again.append(item)
                elif isinstance(res, Exception):
                    raise res
                else:
                    got = fence.script_result(res)
                    if isinstance(got, Refused):
                        refused[item[0]] = got
            for res in results[len(todo) :]:
                if isinstance(res, Exception):
                    raise res
            if not again:
                return refused
            self._fence_sha = await self.redis.script_load(fence.SCRIPT)  # (flushed, or a new node)
            todo = again
        raise ResponseError("the fence's script could not be loaded")

    async def submit(self, request: Request, accepted: Accepted) -> bool:
        """Accept a request: its story starts (``accepted``) before any engine can claim it.

        The story starts exactly once (control/story.py): a resend of this start (a connection
        lost after Redis ran it) writes nothing again, and an id whose story is another
        request's raises :class:`~control.story.IdTaken`, with nothing written. The request
        stream also gets the TTL now, so the story of a request no engine ever finishes does
        not stay in Redis forever; the final event renews it.

        Returns False, writing no request, when an abort for this id already won (a tombstone):
        its story is the abort's, from ``accepted`` to ``final``, and nothing may follow a final.
        """
        rid = request.request_id
        if is_tombstone(await self.owner(rid)):
            # The abort overtook its request. Its story starts here, with `accepted`, unless
            # someone already wrote it.
            source = await self.take_abort_story(rid)
            if source is not None:
                with contextlib.suppress(story_start.IdTaken):  # (written by whoever flipped it)
                    await self._start_story(rid, [accepted, *tombstone_story(rid, source)])
            return False
        await self._start_story(rid, [accepted], request)
        return True

    async def _start_story(self, rid: str, events: Sequence[Event], request: Request | None = None) -> None:
        """control/story.py's start of ``rid``'s story with ``events``, then ``request`` on
        ``P:requests``: in one script on a single Redis, the request after the story otherwise
        (a cluster's other slot; the embedded server, which appends it directly)."""
        story = self.keys.req(rid)
        fields = [ev.encode() for ev in events]
        start = getattr(self.redis, "fd_start_story", None)  # the embedded in-process client
        got = start(story, list(zip(fields, events)), self.req_ttl_s) if start is not None else None
        queued = False
        if got is None:
            with_request = request is not None and not self.cluster
            if self._start_script is None:
                self._start_script = self.redis.register_script(story_start.SCRIPT)
            got = int(
                await self._start_script(
                    keys=[story, self.keys.requests] if with_request else [story],
                    args=story_start.script_args(
                        self.req_ttl_s,
                        fields,
                        request.encode() if with_request else None,
                        self.maxlen(self.keys.requests),
                    ),
                )
            )
            queued = with_request
        if got == story_start.TAKEN:
            raise story_start.IdTaken(rid)
        if request is None:
            return
        if queued:
            if self.local_requests:
                self._tell_arrivals()
        elif got == story_start.WRITTEN or self.cluster:
            # (on a cluster the story's script ran alone, resent or not: the request is still
            # to write; elsewhere a start found done was done with its request)
            await self.publish(self.keys.requests, request)

    async def submit_choices(self, accepted: Accepted, choices: Sequence[tuple[Request, Accepted]]) -> bool:
        """Accept a response of n > 1 choices: its id is marked ``choices=<n>`` in
        ``P:owner`` (an engine's abort of the id meets the mark and aborts each choice), its
        story gets ``accepted`` (with ``choices``), then each choice is submitted as a request
        of its own. Returns False, writing nothing, if the id is taken by another
        request; an abort that overtook the id aborts every choice before it runs."""
        rid = accepted.request_id
        won, current = await self.try_own(rid, choices_owner(len(choices)), self.req_ttl_s)
        if not won and not is_tombstone(current):
            return False
        await self._start_story(rid, [accepted])
        if not won:  # the abort came first: each choice meets its tombstone at submit
            source = pending_tombstone_source(current) or "redis"
            await self.tombstone_many([req.request_id for req, _ in choices], source, self.req_ttl_s)
        for req, acc in choices:
            await self.submit(req, acc)
        return True

    # ------------------------------------------------------------------ dead letters

    async def dead_letter(
        self, source_stream: str | bytes, entry_id: bytes | str | None, fields: Mapping, reason: str
    ) -> None:
        """Copy a rejected entry to ``P:dead`` with why, and count it."""
        stream = _b(source_stream)
        eid = _b(entry_id) if entry_id is not None else b""
        # Readers without a cursor of their own (read_req) see a bad entry again on every
        # re-read; one dead letter per entry is enough.
        if eid and (stream, eid) in self._dead_seen:
            return
        log.warning(
            "dead letter: %s %s: %s",
            stream.decode(errors="replace"),
            eid.decode(errors="replace") or "-",
            reason,
        )
        out: dict[bytes, bytes] = {b"reason": _b(reason), b"stream": stream, b"entry_id": eid}
        truncated = []
        for k, v in (fields or {}).items():
            name = _b(k) if isinstance(k, (bytes, str)) else str(k).encode()
            value = v if isinstance(v, bytes) else str(v).encode()
            if name in _DEAD_RESERVED or name.startswith(b"orig."):
                name = b"orig." + name
            if len(value) > DEAD_FIELD_KEEP_BYTES:
                value = value[:DEAD_FIELD_KEEP_BYTES]
                truncated.append(name)
            out[name] = value
        if truncated:
            out[b"truncated"] = b",".join(truncated)
        await self.redis.xadd(self.keys.dead, out, maxlen=self.dead_maxlen, approximate=True)
        # Seen only once written: an XADD that failed (Redis stalled, a connection killed)
        # leaves a P:requests entry pending, and whoever claims it back writes the letter then.
        if eid:
            self._dead_seen[(stream, eid)] = None
            if len(self._dead_seen) > DEAD_SEEN_MAX:
                self._dead_seen.popitem(last=False)
        self.dead_letters += 1
        if self.on_dead_letter is not None:
            self.on_dead_letter()

    async def _decode_or_dead(
        self,
        stream: str | bytes,
        entry_id: bytes,
        fields: Mapping | None,
        allowed: tuple[type, ...],
        request_id: str | None = None,
    ) -> Event | None:
        if fields is None:  # an entry trimmed or deleted while pending
            await self.dead_letter(stream, entry_id, {}, "entry deleted from the stream while pending")
            return None
        try:
            return check_event(stream, decode(fields, entry_id), allowed, request_id)
        except BadEvent as e:
            await self.dead_letter(stream, entry_id, fields, str(e))
            return None

    # ------------------------------------------------------------------ requests (group)

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.requests, GROUP_ENGINES, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def claim_requests(
        self, consumer: str, count: int, block_ms: int | None
    ) -> list[tuple[bytes, Request]]:
        """Up to ``count`` new requests for ``consumer``; ``block_ms=None`` does not block."""
        try:
            resp = await self.store.read_group(self.keys.requests, GROUP_ENGINES, consumer, count, block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # The group vanished (FLUSHALL, a deleted stream): recreate it and read again.
            await self.ensure_group()
            resp = await self.store.read_group(self.keys.requests, GROUP_ENGINES, consumer, count, block_ms)
        out: list[tuple[bytes, Request]] = []
        for _stream, entries in resp:
            out += await self._requests_or_dead(entries)
        return out

    async def _requests_or_dead(self, entries: Iterable) -> list[tuple[bytes, Request]]:
        out = []
        for entry_id, fields in entries:
            ev = await self._decode_or_dead(self.keys.requests, entry_id, fields, (Request,))
            if ev is None:
                await self.ack_request(entry_id)
            else:
                out.append((entry_id, ev))
        return out

    async def ack_request(self, entry_id: bytes) -> None:
        """Done with a request entry: acknowledged and removed (see :meth:`publish_many`)."""
        await self.store.ack_delete(self.keys.requests, GROUP_ENGINES, [entry_id])

    async def autoclaim(
        self, consumer: str, min_idle_ms: int, count: int = 100
    ) -> list[tuple[bytes, Request]]:
        """Take over requests another consumer read but did not ack for ``min_idle_ms``."""
        out: list[tuple[bytes, Request]] = []
        cursor = b"0-0"
        while len(out) < count:
            resp = await self.redis.xautoclaim(
                self.keys.requests,
                GROUP_ENGINES,
                consumer,
                min_idle_ms,
                start_id=cursor,
                count=count - len(out),
            )
            cursor, entries = resp[0], resp[1]
            # Redis >= 7 drops ids of entries trimmed while pending from the PEL and lists them.
            for gone in resp[2] if len(resp) > 2 else ():
                await self.dead_letter(
                    self.keys.requests, gone, {}, "request trimmed from the stream while pending"
                )
            out += await self._requests_or_dead(entries)
            if _b(cursor) == b"0-0":
                break
        return out

    async def queued_until(self, until: bytes | str, page: int = 1000) -> list[tuple[bytes, str]]:
        """``(entry id, request id)`` of every entry on ``P:requests`` added in or before the
        millisecond of entry id ``until`` (another stream's: an ``abort_all``'s on
        ``P:control``). Entries leave ``P:requests`` at their request's final, so these are the
        requests accepted by then that have not finished: unclaimed, claimed but not yet owned,
        or running. Entries without a valid request id are left to the claimers, which
        dead-letter them."""
        end = b"%d" % entry_id_key(until)[0]  # (XRANGE's end `<ms>` takes every seq of that ms)
        out: list[tuple[bytes, str]] = []
        start = b"-"
        while True:
            entries = await self.redis.xrange(self.keys.requests, min=start, max=end, count=page)
            for entry_id, fields in entries:
                raw = fields.get(b"request_id", fields.get("request_id"))
                rid = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                if isinstance(rid, str) and valid_request_id(rid):
                    out.append((_b(entry_id), rid))
            if len(entries) < page:
                return out
            start = b"(" + _b(entries[-1][0])

    # ------------------------------------------------------------------ control (broadcast)

    async def control_cursor(self) -> bytes:
        last = await self.redis.xrevrange(self.keys.control, count=1)
        return last[0][0] if last else b"0-0"

    async def read_control(
        self, cursor: bytes | str, block_ms: int | None, count: int = 1000
    ) -> tuple[bytes, list[tuple[bytes, Abort | AbortAll | Drain]]]:
        """Control events after ``cursor``, and the cursor to read from next."""
        cursor = _b(cursor)
        resp = await self.redis.xread({self.keys.control: cursor}, count=count, block=block_ms)
        out = []
        for _stream, entries in resp or ():
            for entry_id, fields in entries:
                cursor = entry_id
                ev = await self._decode_or_dead(self.keys.control, entry_id, fields, CONTROL_TYPES)
                if ev is not None:
                    out.append((entry_id, ev))
        return cursor, out

    # ------------------------------------------------------------------ one request

    async def read_req(
        self, request_id: str, after: bytes | str = b"0", block_ms: int | None = None
    ) -> list[tuple[bytes, Event]]:
        """The request's events after ``after`` (exclusive), in order."""
        key = self.keys.req(request_id)
        after = _b(after)
        deadline = None if not block_ms else time.monotonic() + block_ms / 1000
        while True:
            resp = await self.redis.xread({key: after}, block=block_ms)
            out = []
            for _stream, entries in resp or ():
                for entry_id, fields in entries:
                    after = entry_id
                    ev = await self._decode_or_dead(key, entry_id, fields, REQ_STREAM_TYPES, request_id)
                    if ev is not None:
                        out.append((entry_id, ev))
            if out or not resp or deadline is None:
                return out
            # Only junk arrived. A blocking caller would come straight back with the same
            # ``after`` and get the same junk at once: wait on past it here instead.
            block_ms = int((deadline - time.monotonic()) * 1000)
            if block_ms <= 0:
                return []

    async def try_own(self, request_id: str, owner: str, ttl_s: int) -> tuple[bool, str | None]:
        """First writer wins the request (an engine's claim, or the abort path's tombstone)."""
        key = self.keys.owner(request_id)
        if await self.redis.set(key, owner, nx=True, ex=ttl_s):
            return True, owner
        current = await self.redis.get(key)
        return False, current.decode() if current is not None else None

    async def try_own_many(
        self, request_ids: Sequence[str], owner: str, ttl_s: int
    ) -> list[tuple[bool, str | None]]:
        """:meth:`try_own` for many ids in one round trip (``SET NX GET``, Redis >= 7.0): an
        abort of 1,000 queued ids must not cost 1,000 round trips on the engine's loop."""
        if not request_ids:
            return []
        olds = await self.store.set_nx_get([self.keys.owner(r) for r in request_ids], owner, ttl_s)
        out = []
        for old in olds:
            out.append((True, owner) if old is None else (False, old.decode()))
        return out

    async def tombstone_many(
        self, request_ids: Sequence[str], source: str, ttl_s: int
    ) -> list[tuple[bool, str | None, bool]]:
        """Lay abort tombstones (``SET P:owner:{id} aborted:<source> NX GET``) and look for
        each request's stream, all in one round trip: ``(won, current owner, stream exists)``."""
        if not request_ids:
            return []
        value = tombstone(source)
        res = await self.store.tombstones(
            [self.keys.owner(r) for r in request_ids], value, ttl_s, [self.keys.req(r) for r in request_ids]
        )
        return [(old is None, value if old is None else old.decode(), exists) for old, exists in res]

    async def take_abort_story(self, request_id: str) -> str | None:
        """Compare-and-set a pending tombstone to ``aborted-final``. Returns the abort's source
        when this caller won and so must write the request's abort story; None otherwise."""
        key = self.keys.owner(request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                cur = await pipe.get(key)
                source = pending_tombstone_source(cur.decode() if cur is not None else None)
                if source is None:
                    return None
                pipe.multi()
                pipe.set(key, ABORT_WRITTEN, ex=self.req_ttl_s)
                await pipe.execute()
                return source
            except WatchError:
                return None

    async def owner(self, request_id: str) -> str | None:
        v = await self.store.get(self.keys.owner(request_id))
        return v.decode() if v is not None else None

    async def renew(self, keys: Sequence[str]) -> None:
        """Give each of ``keys`` (that exists) the request TTL again, in one round trip."""
        await self.store.expire(keys, self.req_ttl_s)

    async def save_conversation(self, request_id: str, items: list) -> None:
        await self.redis.set(self.keys.conversation(request_id), orjson.dumps(items), ex=self.req_ttl_s)

    async def conversation(self, request_id: str) -> list | None:
        """What :meth:`save_conversation` kept, or None (never kept, or expired)."""
        raw = await self.redis.get(self.keys.conversation(request_id))
        return None if raw is None else orjson.loads(raw)

    async def request_exists(self, request_id: str) -> bool:
        """Whether ``P:req:<id>`` exists (a request id already taken)."""
        return await self.store.exists(self.keys.req(request_id))

    async def first_events(self, request_ids: Sequence[str]) -> list[Event | None]:
        """Each request's first event (its ``accepted``, which says whose it is), or None for
        no story, in one round trip: an API replica checks a many-id abort's ids with it."""
        if not request_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.xrange(self.keys.req(rid), count=1)
        out: list[Event | None] = []
        for rid, entries in zip(request_ids, await pipe.execute()):
            ev = None
            for entry_id, fields in entries or ():
                ev = await self._decode_or_dead(self.keys.req(rid), entry_id, fields, REQ_STREAM_TYPES, rid)
            out.append(ev)
        return out

    # ------------------------------------------------------------------ engines

    async def heartbeat(self, engine_id: str, fields: Mapping[str, str | int | float], ttl_s: int) -> None:
        key = self.keys.engine(engine_id)
        pipe = self.redis.pipeline(transaction=False)
        if fields:
            pipe.hset(key, mapping=dict(fields))
        pipe.expire(key, ttl_s)
        await pipe.execute()

    @staticmethod
    def lora_fields(ready: Iterable[str], errors: Mapping[str, str]) -> dict[str, str]:
        """An engine's heartbeat fields for its LoRA adapters: ``loras`` (the names it serves,
        comma-separated) and ``lora_errors`` (JSON, the loads that failed; "" for none)."""
        return {
            "loras": ",".join(sorted(ready)),
            "lora_errors": orjson.dumps(dict(errors)).decode() if errors else "",
        }

    @staticmethod
    def lora_state(heartbeat: Mapping[str, str]) -> tuple[set[str], dict[str, str]]:
        """:meth:`lora_fields` read back from a heartbeat (an engine of an earlier release: none)."""
        ready = {n for n in heartbeat.get("loras", "").split(",") if n}
        try:
            errors = orjson.loads(heartbeat["lora_errors"]) if heartbeat.get("lora_errors") else {}
        except orjson.JSONDecodeError:
            errors = {}
        return ready, errors if isinstance(errors, dict) else {}

    async def register_lora(self, name: str, path: str) -> bool:
        """Add a run-time LoRA adapter to ``P:loras``; False if the name is taken."""
        return bool(await self.redis.hsetnx(self.keys.loras, name, path))

    async def forget_lora(self, name: str) -> bool:
        return bool(await self.redis.hdel(self.keys.loras, name))

    async def loras(self) -> dict[str, str]:
        """The run-time LoRA adapters, name -> path."""
        got = await self.redis.hgetall(self.keys.loras)
        return {_b(k).decode(): _b(v).decode() for k, v in got.items()}

    async def engines(self) -> dict[str, dict[str, str]]:
        """Every engine with a live heartbeat, by id."""
        keys = [k async for k in self.redis.scan_iter(match=self.keys.engine_pattern(), count=1000)]
        if not keys:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        head = len(self.keys.engine(""))
        out = {}
        for k, h in zip(keys, await pipe.execute()):
            if h:  # expired between SCAN and HGETALL
                out[_b(k)[head:].decode()] = {
                    _b(a).decode(errors="replace"): _b(b).decode(errors="replace") for a, b in h.items()
                }
        return out


# ====================================================================== StreamMux


class MuxStopped(RuntimeError):
    """The multiplexer stopped before this subscription saw its ``final``."""


_END = object()


class Subscription:
    """One reader's view of one request's stream: ``(entry_id, event)`` in order, ending after
    ``final``. Iterate it with ``async for``; :meth:`close` to stop early.

    A consumer that writes what it gets somewhere (the API's SSE streams) can instead take
    everything delivered so far at once: ``await sub.ready(timeout)``, then
    :meth:`take_ready`, so one wake-up that brought several entries costs one write, and
    waiting costs no task per entry."""

    def __init__(self, mux: "StreamMux", request_id: str, key: bytes, after: bytes):
        self.request_id = request_id
        self.key = key
        self.last_id = after
        self._last = entry_id_key(after)
        self._mux = mux
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._quiet_until: float | None = None  # ready(timeout): when the wait gives up (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._ended = False  # nothing more will be queued
        self._closed = False  # the consumer saw the end
        #: called whenever something is delivered: one consumer waiting on many subscriptions
        #: (a response of n choices) waits on one event instead of a task per subscription
        self.on_put: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """The consumer has seen the end (after ``final``, a stop, or :meth:`close`)."""
        return self._closed

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> tuple[bytes, Event]:
        if self._closed:
            raise StopAsyncIteration
        while not self._items:
            await self.ready()
        item = self._items.popleft()
        if item is _END:
            self._finish()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        return item

    async def ready(self, timeout: float | None = None) -> bool:
        """Wait until something is delivered (True; also at the end) or ``timeout`` seconds
        pass without anything (False)."""
        if self._items or self._closed:
            return True
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        if timeout is None:
            self._quiet_until = None
        else:
            # One timer per quiet spell, not one per entry: it re-arms itself while entries
            # keep coming, and fires only once nothing came for ``timeout`` seconds.
            self._quiet_until = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._quiet_until, self._quiet)
        try:
            return await fut
        finally:
            self._waiter = None

    def _quiet(self) -> None:
        self._timer = None
        fut = self._waiter
        if fut is None or fut.done() or self._closed or self._quiet_until is None:
            return
        loop = fut.get_loop()
        if loop.time() >= self._quiet_until:
            fut.set_result(False)
        else:
            self._timer = loop.call_at(self._quiet_until, self._quiet)

    def take_ready(self) -> list[tuple[bytes, Event]]:
        """Every ``(entry_id, event)`` delivered and not yet taken, without waiting. Empty
        once the consumer has seen the end (check :attr:`done`); raises what stopped the
        mux once everything before it was taken."""
        out = []
        items = self._items
        while items:
            item = items[0]
            if item is _END or isinstance(item, BaseException):
                if out:
                    break
                items.popleft()
                self._finish()
                if item is _END:
                    break
                raise item
            out.append(items.popleft())
        return out

    def _finish(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def close(self) -> None:
        if not self._ended:
            self._mux._unsubscribe(self)
            self._end(_END)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- called by the mux
    def _put(self, item) -> None:
        self._items.append(item)
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(True)
        if self.on_put is not None:
            self.on_put()

    def _offer(self, entry_id: bytes, idk: tuple[int, int], ev: Event) -> None:
        if self._ended or idk <= self._last:
            return
        self._last = idk
        self.last_id = entry_id
        self._put((entry_id, ev))
        if isinstance(ev, Final):
            self._end(_END)

    def _end(self, item) -> None:
        if not self._ended:
            self._ended = True
            self._put(item)


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

    async def __aexit__(self, *exc) -> None:
        self._sem.release()

    def full(self) -> bool:
        return self._sem.locked()


class _Shard:
    """Up to ``shard_size`` request streams read by one blocking XREAD loop, plus a doorbell.

    On a cluster a shard holds the streams of one slot (``slot``), its doorbell is tagged into
    that slot, and it retires once it has nothing left to watch."""

    def __init__(self, mux: "StreamMux", index: int, slot: int | None = None, tag: str = ""):
        self.mux = mux
        self.slot = slot
        name = f"{mux.reader_id}.{index}"
        self.wake_key = _b(mux.keys.wake(name) if slot is None else mux.keys.wake_in_slot(name, tag))
        self.subs: dict[bytes, list[Subscription]] = {}
        self.blocked = False  # inside a blocking XREAD whose key list is already sent
        self.rang = False  # a wake-up is already on its way for this blocking read
        self.rung = False  # the doorbell stream exists (cluster shards delete it on retiring)
        self.long = False  # the current read blocks for the full block_ms
        self.task: asyncio.Task | None = None
        self.wake_last = b"0-0"
        # The keys and ids of the read in progress on the embedded server's direct reader,
        # which re-scans this dict on each wake-up: entries handed over in-process move it.
        self.reading: dict[bytes, bytes] | None = None

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
                if mux._gate_full():
                    await mux._cut_one_read_short()
                async with mux._gate:
                    if mux._stopping or (self.slot is not None and not self.subs):
                        continue
                    streams = {self.wake_key: self.wake_last}
                    for key, subs in self.subs.items():
                        streams[key] = min(subs, key=lambda s: s._last).last_id
                    # Others queue for a read: hold it briefly, so the readers take turns.
                    block = min(mux.block_ms, mux.CONTENDED_BLOCK_MS) if mux._gate_waiting() else mux.block_ms
                    self.long = block > mux.CONTENDED_BLOCK_MS
                    self.blocked, self.rang = True, False
                    try:
                        # (the embedded server's in-process client reads directly; None: ask it)
                        direct = getattr(redis, "fd_xread", None)
                        if direct is not None:
                            self.reading = streams
                        resp = None if direct is None else await direct(streams, mux.count, block)
                        if resp is None:
                            self.reading = None
                            resp = await redis.xread(streams, count=mux.count, block=block)
                    finally:
                        self.blocked = False
                        self.reading = None
                mux.wakeups += 1
                for key, entries in resp or ():
                    if key == self.wake_key:
                        self.wake_last = entries[-1][0]
                    else:
                        await self._dispatch(key, entries, streams[key])
                backoff = 0.05
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                log.warning("stream mux %s: %s; retrying in %.2fs", mux.reader_id, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # a bug: keep the other subscriptions alive
                log.exception("stream mux %s: reader failed; retrying", mux.reader_id)
                await asyncio.sleep(0.1)

    async def _retire(self) -> None:
        """Cluster only: stop reading a slot with nothing left to watch. Synchronously
        unlisted first, so a new subscription to this slot gets a fresh shard."""
        mux = self.mux
        if mux._by_slot.get(self.slot) is self:
            del mux._by_slot[self.slot]
        if self.rung:
            try:
                await mux.redis.delete(self.wake_key)
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                log.warning("stream mux %s: could not delete a doorbell: %s", mux.reader_id, e)
        if self in mux._shards:
            mux._shards.remove(self)

    async def _dispatch(self, key: bytes, entries: list, after: bytes) -> None:
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
            # A good entry costs no coroutine; a bad one (or a deleted one: no fields) goes the
            # long way, which dead-letters it.
            ev = None
            if fields is not None:
                try:
                    ev = check_event(key, decode(fields, entry_id), REQ_STREAM_TYPES, rid)
                except BadEvent:
                    pass
            if ev is None:
                ev = await self.mux._bus._decode_or_dead(key, entry_id, fields, REQ_STREAM_TYPES, rid)
            idk = entry_id_key(entry_id)
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
        redis,
        keys: Keys,
        reader_id: str,
        *,
        shard_size: int = 256,
        block_ms: int = 1000,
        count: int = 1000,
        cluster_readers: int = 128,
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
        self._rings = 0
        self._unlisten: Callable[[], None] | None = None

    @property
    def dead_letters(self) -> int:
        return self._bus.dead_letters

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
        listen = getattr(self.redis, "fd_listen", None)  # the embedded in-process client
        if listen is not None:
            self._unlisten = listen(self._local)
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
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                log.warning("stream mux %s: could not delete doorbells: %s", self.reader_id, e)
        self._shards.clear()
        self._started = False

    def _local(
        self, key: bytes, before: tuple[int, int], entry_id: bytes, ev: Event, fields: Mapping[str, str]
    ) -> None:
        """An entry written by this process (the embedded server's listener; ``fd serve``'s
        engine publishing a step): handed as it is to each subscription that has seen every
        entry up to ``before``, instead of being read back and decoded (the read and decode of
        a step's tokens were a fifth of the loop's time at 32 streams). Any other
        subscription (behind, or new) gets it from the read as before; the read in progress
        moves past it for the ones that took it, so nothing comes twice or is skipped."""
        shard = self._where.get(key)
        subs = None if shard is None or self._stopping else shard.subs.get(key)
        if not subs:
            return
        taken = 0
        idk = None
        for sub in subs:
            if sub._ended or sub._last != before:
                continue
            if idk is None:
                idk = entry_id_key(entry_id)
                if not ev.ts:  # as a reader decodes it: stamped when it was encoded
                    ev = dataclasses.replace(ev, ts=int(fields["ts"]))
            sub._offer(entry_id, idk, ev)
            self.events += 1
            taken += 1
        if not taken:
            return
        reading = shard.reading
        if reading is not None and key in reading:
            reading[key] = min(subs, key=lambda s: s._last).last_id
        if isinstance(ev, Final) and taken == len(subs):
            shard.subs.pop(key, None)
            self._where.pop(key, None)

    async def subscribe(self, request_id: str, after: bytes | str = b"0") -> Subscription:
        """Events of ``request_id`` after entry ``after`` (exclusive; ``0`` = from the start)."""
        if not self._started or self._stopping:
            raise MuxStopped(f"stream mux {self.reader_id} is not running")
        if not valid_request_id(request_id):
            raise ValueError(f"invalid request id {request_id!r}")
        key = _b(self.keys.req(request_id))
        sub = Subscription(self, request_id, key, _normal_id(after))
        shard = self._where.get(key) or self._pick_shard(key, request_id)
        self._where[key] = shard
        if shard.add(sub):
            await self._ring(shard)
        return sub

    async def _ring(self, shard: _Shard) -> None:
        try:
            append = getattr(self.redis, "fd_append", None)  # the embedded in-process client
            wake = shard.wake_key.decode()
            if append is not None and append(wake, {"w": "1"}) is not None:
                shard.rung = True
                self.redis.fd_expire([wake], 86400)
                self._rings += 1
                if self._rings % self.WAKE_MAXLEN == 0:  # (capped here, not on each XADD)
                    await self.redis.xtrim(shard.wake_key, maxlen=self.WAKE_MAXLEN, approximate=False)
                return
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(shard.wake_key, {b"w": b"1"}, maxlen=self.WAKE_MAXLEN, approximate=True)
            pipe.expire(shard.wake_key, 86400)  # a crashed replica leaves no doorbell behind
            shard.rung = True
            await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
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
