"""The event bus: every Redis command fd sends, behind names that say what they mean.

:class:`Bus` is a thin, stateless wrapper over one ``redis.asyncio`` client: publishing and
the fenced writes of an engine's step here, with the owner keys (fd/control/ownership.py) and
the engines' registry (fd/control/engines.py) as parts of it; :class:`fd.control.mux.StreamMux` is
the one stateful reader, multiplexing many per-request streams for an API replica.

Rules every reader here follows (DESIGN.md §3, §6):

- Nothing that arrives on a stream can crash a reader. An entry that does not decode, or that
  decodes to an event that does not belong on that stream, is logged, copied to ``P:dead``
  with a ``reason``, acked where a consumer group applies, counted, and skipped
  (fd/control/dead_letters.py).
- Blocking reads are never cancelled (fakeredis loses the reply of a cancelled blocking read);
  callers pass a short ``block_ms`` and loop on a stop flag.
- Stream keys and entry ids come back as ``bytes``; every last-id map is keyed by ``bytes``.
- Trimming is approximate (``MAXLEN ~``), which is about twice as fast as exact trimming.
  Per-request streams are never trimmed (the story must stay whole); they expire instead.

On a Redis Cluster (``connect("redis+cluster://...")``) every command here names keys of one
slot, or goes through redis-py's cluster pipeline, which splits by node and keeps the order of
commands within a node but not across nodes: where the order across slots matters (a story's
``accepted`` before its request; a final before the ack of its request) the bus spends a second
round trip. :class:`~fd.control.mux.StreamMux` reads one slot per XREAD there (see its docstring).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError, WatchError

from fd.control import story as story_start
from fd.control.bad_event import BadEvent
from fd.control.dead_letters import DeadLetters, check_event
from fd.control.endings import tombstone_story
from fd.control.engines import EngineRegistry
from fd.control.events import (
    CONTROL_TYPES,
    LIFECYCLE_TYPES,
    REQ_STREAM_TYPES,
    Accepted,
    ControlEvent,
    Event,
    JsonObject,
    LifecycleEvent,
    RawFields,
    Request,
    RequestAccepted,
    decode,
)
from fd.control.fence import Refused
from fd.control.keys import (
    GROUP_ENGINES,
    Keys,
    choices_owner,
    is_tombstone,
    pending_tombstone_source,
)
from fd.control.lanes import Lanes, Placer
from fd.control.outage import REDIS_FAILURES
from fd.control.ownership import Ownership
from fd.control.store import Ack, Append, Fenced, RedisClient, Store, StreamEntry, store_for

log = logging.getLogger("fd.control.bus")


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def is_cluster(redis: RedisClient) -> bool:
    return isinstance(redis, RedisCluster)


def _text(x: bytes | str | None) -> str | None:
    return x.decode() if isinstance(x, bytes) else x


async def compare_and_set(
    redis: RedisClient, key: str, expected: str | None, new: str | None, ttl_s: int
) -> bool:
    """Set ``key`` to ``new`` for ``ttl_s`` (or, with ``new=None``, delete it) only if it still
    holds ``expected`` (``None``: absent): WATCH, GET, then MULTI/EXEC, so of callers that read
    the same value exactly one makes the change. True when this call made it.
    :meth:`Bus.cas_owner` on an owner key."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(key)
            cur = _text(await pipe.get(key))
            if cur != expected:
                return False
            pipe.multi()
            if new is None:
                pipe.delete(key)
            else:
                pipe.set(key, new, ex=ttl_s)
            await pipe.execute()
            return True
        except WatchError:  # the key changed after the GET: someone else's change won
            return False


#: How long a finished request's story (``P:req``), owner key and conversation are kept, by
#: default (``--request-ttl``): a late abort of it stays a no-op, and any replica can replay or
#: retrieve it, for this long.
REQUEST_TTL_S = 3600
#: How long an abort's tombstone for a request no engine had (``--tombstone-ttl``) waits for
#: that request: one that arrives later than this runs.
TOMBSTONE_TTL_S = 600
#: ``P:lifecycle``'s approximate cap: a watcher that falls further behind reads from the oldest
#: entry left (about 10-20 MB of Redis memory at this cap).
LIFECYCLE_MAXLEN = 100_000


class Bus(Ownership, EngineRegistry, Lanes):
    """Typed access to fd's streams and keys for one Redis client and one key prefix.

    Its owner-key methods are :class:`~fd.control.ownership.Ownership`'s and its engine-registry
    methods :class:`~fd.control.engines.EngineRegistry`'s; what its readers cannot use goes to
    :attr:`dead` (:class:`~fd.control.dead_letters.DeadLetters`)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        *,
        req_ttl_s: int = REQUEST_TTL_S,
        dead_maxlen: int = 10_000,
        requests_maxlen: int | None = None,
        control_maxlen: int = 10_000,
        journal_maxlen: int = 10_000,
        lifecycle_maxlen: int = LIFECYCLE_MAXLEN,
    ):
        self.redis = redis
        self.keys = keys
        self.req_ttl_s = req_ttl_s
        self.requests_maxlen = requests_maxlen
        self.control_maxlen = control_maxlen
        self.journal_maxlen = journal_maxlen
        self.lifecycle_maxlen = lifecycle_maxlen
        #: ``P:dead``'s writer: what this bus's readers cannot use goes there
        self.dead = DeadLetters(redis, keys.dead, dead_maxlen)
        self._journal_head = f"{keys.prefix}:journal:"
        self.cluster = is_cluster(redis)
        #: The operations whose form depends on the server (fd/control/store.py): the client's
        #: own store where it brings one (the embedded server's), else redis-py's.
        self.store: Store = store_for(redis)
        #: In-process claimers of ``P:requests``, called once a publish has put requests there
        #: (so ``fd serve``'s engine need not poll it every step).
        self.local_requests: list[Callable[[], None]] = []
        #: An API's placement (fd/api/placement.py): the engine whose lane a request it
        #: submits waits on; None (or its None): ``P:requests``.
        self.placer: Placer | None = None

    # ------------------------------------------------------------------ publishing

    def maxlen(self, stream: str) -> int | None:
        """The approximate length cap of a stream family; ``None`` (never trim) for the rest."""
        if stream == self.keys.requests:
            return self.requests_maxlen
        if stream == self.keys.control:
            return self.control_maxlen
        if stream == self.keys.dead:
            return self.dead.maxlen
        if stream.startswith(self._journal_head):
            return self.journal_maxlen
        if stream == self.keys.lifecycle:
            return self.lifecycle_maxlen
        return None

    def _append(self, stream: str, event: Event) -> Append:
        return Append(stream, event.encode(), self.maxlen(stream), event)

    def _tell_arrivals(self) -> None:
        for sink in self.local_requests:
            try:
                sink()
            except Exception:
                log.exception("in-process request claimer failed")

    async def publish(self, stream: str, event: Event) -> bytes:
        (entry,) = await self.store.append_many([self._append(stream, event)])
        if self.local_requests and stream == self.keys.requests:
            self._tell_arrivals()
        return entry

    async def publish_many(
        self, items: Sequence[tuple[str, Event]], expire: Sequence[str] = (), ack: Sequence[bytes] = ()
    ) -> list[bytes]:
        """All of ``items`` (then an EXPIRE of each key in ``expire``, then an XACK and XDEL of
        each ``P:requests`` entry in ``ack``) in one round trip, in order. Acks come last so a
        request is acknowledged only once its final is written; a finished request leaves
        ``P:requests`` altogether, so the stream holds only work not yet done and needs no
        MAXLEN (which would drop unclaimed requests)."""
        if not items and not expire and not ack:
            return []
        entries = await self.store.append_many(
            [self._append(stream, event) for stream, event in items],
            expire,
            self.req_ttl_s,
            Ack(self.keys.requests, GROUP_ENGINES, list(ack)) if ack else None,
        )
        if self.local_requests and any(stream == self.keys.requests for stream, _ in items):
            self._tell_arrivals()  # written now: a claim finds them
        return entries

    async def publish_owned(
        self,
        items: Sequence[tuple[str, Event]],
        owners: Mapping[str, str],
        expire: Sequence[tuple[str, str]] = (),
        ack: Sequence[tuple[str, bytes]] = (),
        last: dict[str, Mapping[str, str]] | None = None,
    ) -> dict[str, Refused]:
        """An engine's flush: :meth:`publish_many`, with every event on a request's story
        appended through the fence (fd/control/fence.py): only while ``P:owner:{id}`` holds
        ``owners[id]`` (the writer's owner token) and the story has no final yet, each
        request's events in one atomic call, all pipelined in one round trip. A story event
        whose request has no token in ``owners`` is refused too (never written unfenced).

        ``expire`` and ``ack`` are ``(request id, key or P:requests entry)``, done only for
        requests whose events got through, so an engine never acknowledges the entry of a
        request another engine now runs (:meth:`fd.control.store.Store.fenced_append`). The
        final's renewal of the story's and owner key's own TTL is the fence's.

        ``last``: request id -> the writer's last event on its story (encoded), which the
        fence finds the story's last entry or refuses the batch (``gap``); updated here for
        the batches that got through. A request not in it is not checked.

        Returns the requests refused (request id -> why); nothing of theirs was written."""
        keys = self.keys
        groups: dict[str, list[Event]] = {}
        plain: list[Append] = []
        for stream, ev in items:
            rid = getattr(ev, "request_id", None)
            if rid is not None and stream == keys.req(rid):
                groups.setdefault(rid, []).append(ev)
            else:
                plain.append(self._append(stream, ev))
        renew: dict[str, list[str]] = {}
        for rid, key in expire:
            renew.setdefault(rid, []).append(key)
        acks = dict(ack)
        refused: dict[str, Refused] = {}
        batches: list[Fenced] = []
        fenced: list[str] = []  # the request of each batch
        for rid, evs in groups.items():
            token = owners.get(rid)
            if token is None:
                log.error("refused to write %d event(s) of %s without an owner token", len(evs), rid)
                refused[rid] = Refused("owner", None)
                continue
            entry = acks.get(rid)
            fenced.append(rid)
            batches.append(
                Fenced(
                    keys.owner(rid),
                    keys.req(rid),
                    token,
                    [ev.encode() for ev in evs],
                    self.req_ttl_s,
                    Ack(keys.requests, GROUP_ENGINES, [entry]) if entry is not None else None,
                    renew.get(rid, ()),
                    evs,
                    last.get(rid) if last is not None else None,
                )
            )
        answers = await self.store.fenced_append(batches, plain)
        for rid, batch, why in zip(fenced, batches, answers, strict=False):
            if why is not None:
                refused[rid] = why
            elif last is not None:
                last[rid] = batch.fields[-1]
        # A request with acks or renewals but no events this flush (its final went earlier).
        rest_expire = [key for rid, key in expire if rid not in groups and rid not in refused]
        rest_ack = [entry for rid, entry in ack if rid not in groups and rid not in refused]
        if rest_expire or rest_ack:
            await self.publish_many([], expire=rest_expire, ack=rest_ack)
        return refused

    async def submit(self, request: Request, accepted: Accepted) -> bool:
        """Accept a request: its story starts (``accepted``) before any engine can claim it.

        The story starts exactly once (fd/control/story.py): a resend of this start (a connection
        lost after Redis ran it) writes nothing again, and an id whose story is another
        request's raises :class:`~fd.control.story.IdTaken`, with nothing written. The request
        stream also gets the TTL now, so the story of a request no engine ever finishes does
        not stay in Redis forever; the final event renews it.

        Where :attr:`placer` names an engine, the request waits on that engine's lane
        (fd/control/lanes.py) instead of on ``P:requests``, after its story started.

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
        lane = self.placer.choose(request) if self.placer is not None else None
        await self._start_story(rid, [accepted], request, lane)
        await self._note_accepted(accepted, lane)
        return True

    async def _note_accepted(self, accepted: Accepted, lane: str | None) -> None:
        """``request_accepted`` on ``P:lifecycle``. The request is in already: a failed note
        costs a watcher one milestone, never the request."""
        ev = RequestAccepted(
            request_id=accepted.request_id,
            api=accepted.api,
            endpoint=accepted.endpoint,
            prompt_tokens=accepted.prompt_tokens,
            lane=lane,
        )
        try:
            await self.store.append_many([self._append(self.keys.lifecycle, ev)])
        except REDIS_FAILURES as e:
            log.warning("could not note request_accepted of %s: %s", accepted.request_id, e)

    async def _start_story(
        self, rid: str, events: Sequence[Event], request: Request | None = None, lane: str | None = None
    ) -> None:
        """fd/control/story.py's start of ``rid``'s story with ``events``, then ``request`` on
        ``P:requests`` or on ``lane``'s lane (registered): in one script on a single Redis,
        the request after the story otherwise (a cluster's other slot)."""
        stream = self.keys.requests if lane is None else self.keys.lane(lane)
        got, queued = await self.store.start_story(
            self.keys.req(rid),
            [ev.encode() for ev in events],
            self.req_ttl_s,
            self._append(stream, request) if request is not None else None,
            (self.keys.lanes, lane) if lane is not None else None,
        )
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
            if lane is not None:
                await self.place(lane, request)
                self._tell_arrivals()
            else:
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

    @property
    def dead_letters(self) -> int:
        """Dead letters this bus wrote."""
        return self.dead.count

    @property
    def on_dead_letter(self) -> Callable[[], Any] | None:
        """Called once per dead letter written (e.g. a Prometheus counter's ``inc``)."""
        return self.dead.on_write

    @on_dead_letter.setter
    def on_dead_letter(self, hook: Callable[[], Any] | None) -> None:
        self.dead.on_write = hook

    async def dead_letter(
        self, source_stream: str | bytes, entry_id: bytes | str | None, fields: RawFields, reason: str
    ) -> None:
        """Copy a rejected entry to ``P:dead`` with why, and count it."""
        await self.dead.write(source_stream, entry_id, fields, reason)

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
            out += await self.decode_requests(entries)
        return out

    async def decode_requests(self, entries: Iterable[StreamEntry]) -> list[tuple[bytes, Request]]:
        """``(entry id, request)`` of each ``P:requests`` entry that decodes to a request; one
        that does not (or was deleted while pending) goes to ``P:dead`` and is acknowledged and
        removed, so no claimer reads it again."""
        out = []
        for entry_id, fields in entries:
            ev = await self.dead.decode_or_dead(self.keys.requests, entry_id, fields, (Request,))
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
            out += await self.decode_requests(entries)
            if _b(cursor) == b"0-0":
                break
        return out

    # ------------------------------------------------------------------ control (broadcast)

    async def control_cursor(self) -> bytes:
        last = await self.redis.xrevrange(self.keys.control, count=1)
        return last[0][0] if last else b"0-0"

    async def read_control(
        self, cursor: bytes | str, block_ms: int | None, count: int = 1000
    ) -> tuple[bytes, list[tuple[bytes, ControlEvent]]]:
        """Control events after ``cursor``, and the cursor to read from next."""
        at = _b(cursor)
        resp = await self.redis.xread({self.keys.control: at}, count=count, block=block_ms)
        out: list[tuple[bytes, ControlEvent]] = []
        for _stream, entries in resp or ():
            for entry_id, fields in entries:
                at = entry_id
                ev = await self.dead.decode_or_dead(self.keys.control, entry_id, fields, CONTROL_TYPES)
                if ev is not None:
                    out.append((entry_id, ev))
        return at, out

    async def read_lifecycle(
        self, cursor: bytes | str, block_ms: int | None, count: int = 1000
    ) -> tuple[bytes, list[tuple[bytes, LifecycleEvent]]]:
        """``P:lifecycle``'s events after ``cursor`` (``$``: only those to come), and the cursor
        to read from next."""
        at = _b(cursor)
        if at == b"$":  # (XREAD's "$" is resolved once, here: the next read goes on from it)
            last = await self.redis.xrevrange(self.keys.lifecycle, count=1)
            at = _b(last[0][0]) if last else b"0-0"
        resp = await self.redis.xread({self.keys.lifecycle: at}, count=count, block=block_ms)
        out: list[tuple[bytes, LifecycleEvent]] = []
        for _stream, entries in resp or ():
            for entry_id, fields in entries:
                at = _b(entry_id)
                # A type or field this release does not know is a later writer's (the stream is
                # versioned, and has many readers): skipped, not a dead letter from each reader.
                try:
                    ev = check_event(self.keys.lifecycle, decode(fields, entry_id), LIFECYCLE_TYPES)
                except BadEvent:
                    continue
                out.append((at, ev))
        return at, out

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
                    ev = await self.dead.decode_or_dead(key, entry_id, fields, REQ_STREAM_TYPES, request_id)
                    if ev is not None:
                        out.append((entry_id, ev))
            if out or not resp or deadline is None:
                return out
            # Only junk arrived. A blocking caller would come straight back with the same
            # ``after`` and get the same junk at once: wait on past it here instead.
            block_ms = int((deadline - time.monotonic()) * 1000)
            if block_ms <= 0:
                return []

    async def renew(self, keys: Sequence[str]) -> None:
        """Give each of ``keys`` (that exists) the request TTL again, in one round trip."""
        await self.store.expire(keys, self.req_ttl_s)

    async def save_conversation(self, request_id: str, items: list[JsonObject]) -> None:
        await self.redis.set(self.keys.conversation(request_id), orjson.dumps(items), ex=self.req_ttl_s)

    async def conversation(self, request_id: str) -> list[JsonObject] | None:
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
        for rid, entries in zip(request_ids, await pipe.execute(), strict=False):
            ev = None
            for entry_id, fields in entries or ():
                ev = await self.dead.decode_or_dead(
                    self.keys.req(rid), entry_id, fields, REQ_STREAM_TYPES, rid
                )
            out.append(ev)
        return out

    # ------------------------------------------------------------------ an engine's failover

    async def cas_owner(self, request_id: str, expected: str | None, new: str | None, ttl_s: int) -> bool:
        """Move ``P:owner:{id}`` from ``expected`` (``None``: absent) to ``new`` with ``ttl_s``
        (``new=None``: delete it) only if it still holds ``expected``
        (:func:`compare_and_set`): a takeover from a dead owner, or a drain's release of its
        own. Of two engines that saw the same owner exactly one wins. True when this call
        made the change."""
        return await compare_and_set(self.redis, self.keys.owner(request_id), expected, new, ttl_s)

    async def pending_requests(self, min_idle_ms: int, count: int) -> list[bytes]:
        """The entry ids of up to ``count`` entries of ``P:requests`` that a consumer read and
        has not acknowledged for ``min_idle_ms`` or longer, oldest first (``XPENDING ... IDLE``):
        failover's candidates, whose owner keys then say whether anyone still runs them."""
        pending = await self.redis.xpending_range(
            self.keys.requests, GROUP_ENGINES, min="-", max="+", count=count, idle=min_idle_ms
        )
        return [p["message_id"] for p in pending]

    async def request_entries(self, entry_ids: Sequence[bytes]) -> list[list[StreamEntry]]:
        """Each ``P:requests`` entry as ``XRANGE id id`` gives it (``[]``: no longer there), in
        one round trip."""
        if not entry_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for eid in entry_ids:
            pipe.xrange(self.keys.requests, min=eid, max=eid)
        return list(await pipe.execute())

    async def owners(self, request_ids: Sequence[str]) -> list[str | None]:
        """Each request's owner key (an owner token, a tombstone, ...; None: absent), in one
        round trip; the first error reply raises, as a pipeline's does."""
        if not request_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.get(self.keys.owner(rid))
        return [_text(o) for o in await pipe.execute()]

    async def owners_or_errors(self, request_ids: Sequence[str]) -> list[str | None | Exception]:
        """:meth:`owners`, with an error reply kept as that key's result instead of raised
        (``raise_on_error=False``): a key of another type costs its own request alone. A lost
        connection still raises."""
        if not request_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.get(self.keys.owner(rid))
        replies = await pipe.execute(raise_on_error=False)
        return [o if isinstance(o, Exception) else _text(o) for o in replies]

    async def engines_alive(self, engine_ids: Sequence[str]) -> dict[str, bool]:
        """Whether each engine's heartbeat hash ``P:engine:<id>`` exists (an engine whose hash
        expired or was deleted is dead), in one round trip."""
        if not engine_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for eid in engine_ids:
            pipe.exists(self.keys.engine(eid))
        return {eid: bool(n) for eid, n in zip(engine_ids, await pipe.execute(), strict=False)}

    async def move_pending_request(self, entry_id: bytes, consumer: str) -> None:
        """Move a pending ``P:requests`` entry to ``consumer`` (``XCLAIM ... 0 JUSTID``): it
        shows who runs it now, and its idle time starts over."""
        await self.redis.xclaim(
            self.keys.requests, GROUP_ENGINES, consumer, min_idle_time=0, message_ids=[entry_id], justid=True
        )

    async def delete_heartbeat(self, engine_id: str) -> None:
        """Delete the engine's heartbeat hash ``P:engine:<id>``: peers count it dead at once."""
        await self.redis.delete(self.keys.engine(engine_id))

    async def tails(self, lengths: Mapping[str, int]) -> dict[str, list[dict[str, str]]]:
        """The fields of the last ``n`` entries of each stream, oldest first, decoded
        (``XREVRANGE stream + - COUNT n`` each), in one round trip: what of a batch cut off
        by a lost connection is on its streams already."""
        if not lengths:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for stream, n in lengths.items():
            pipe.xrevrange(stream, count=n)
        out: dict[str, list[dict[str, str]]] = {}
        for stream, tail in zip(lengths, await pipe.execute(), strict=False):
            out[stream] = [
                {_b(k).decode(): _b(v).decode() for k, v in fields.items()} for _, fields in reversed(tail)
            ]
        return out

    # ------------------------------------------------------------------ journals

    async def journal_page(self, key: str, start: bytes | str, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries of the journal stream ``key`` (``P:journal:<engine>``) from
        ``start`` on (an ``XRANGE`` bound: ``-``, an id, or ``(`` and an id to start after it)."""
        return list(await self.redis.xrange(key, min=start, max="+", count=count))

    async def journal_engines(self) -> list[str]:
        """The engine ids that have a journal under this prefix (``SCAN`` for
        ``P:journal:*``), sorted."""
        head = len(self.keys.journal(""))
        names = set()
        async for k in self.redis.scan_iter(match=self.keys.journal("*"), count=1000):
            names.add(_b(k).decode()[head:])
        return sorted(names)

    async def aclose(self) -> None:
        """Close the client under this bus, for a caller that made the client for it alone."""
        await self.redis.aclose()
