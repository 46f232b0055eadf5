"""The event bus: every Redis command fd sends, behind names that say what they mean.

:class:`Bus` is a thin, stateless wrapper over one ``redis.asyncio`` client: publishing and
the fenced writes of an engine's step here, with the owner keys (control/ownership.py) and
the engines' registry (control/engines.py) as parts of it; :class:`control.mux.StreamMux` is
the one stateful reader, multiplexing many per-request streams for an API replica.

Rules every reader here follows (DESIGN.md §3, §6):

- Nothing that arrives on a stream can crash a reader. An entry that does not decode, or that
  decodes to an event that does not belong on that stream, is logged, copied to ``P:dead``
  with a ``reason``, acked where a consumer group applies, counted, and skipped
  (control/dead_letters.py).
- Blocking reads are never cancelled (fakeredis loses the reply of a cancelled blocking read);
  callers pass a short ``block_ms`` and loop on a stop flag.
- Stream keys and entry ids come back as ``bytes``; every last-id map is keyed by ``bytes``.
- Trimming is approximate (``MAXLEN ~``), which is about twice as fast as exact trimming.
  Per-request streams are never trimmed (the story must stay whole); they expire instead.

On a Redis Cluster (``connect("redis+cluster://...")``) every command here names keys of one
slot, or goes through redis-py's cluster pipeline, which splits by node and keeps the order of
commands within a node but not across nodes: where the order across slots matters (a story's
``accepted`` before its request; a final before the ack of its request) the bus spends a second
round trip. :class:`~control.mux.StreamMux` reads one slot per XREAD there (see its docstring).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from control import fence
from control import story as story_start
from control.dead_letters import DeadLetters
from control.endings import tombstone_story
from control.engines import EngineRegistry
from control.entry_ids import entry_id_key
from control.events import (
    CONTROL_TYPES,
    REQ_STREAM_TYPES,
    Abort,
    AbortAll,
    Accepted,
    Drain,
    Event,
    Final,
    Request,
)
from control.fence import Refused
from control.keys import (
    GROUP_ENGINES,
    Keys,
    choices_owner,
    is_tombstone,
    pending_tombstone_source,
    valid_request_id,
)
from control.ownership import Ownership
from control.store import Store, store_for

log = logging.getLogger("control.bus")


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def is_cluster(redis) -> bool:
    return isinstance(redis, RedisCluster)


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


class Bus(Ownership, EngineRegistry):
    """Typed access to fd's streams and keys for one Redis client and one key prefix.

    Its owner-key methods are :class:`~control.ownership.Ownership`'s and its engine-registry
    methods :class:`~control.engines.EngineRegistry`'s; what its readers cannot use goes to
    :attr:`dead` (:class:`~control.dead_letters.DeadLetters`)."""

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
        self.requests_maxlen = requests_maxlen
        self.control_maxlen = control_maxlen
        self.journal_maxlen = journal_maxlen
        #: ``P:dead``'s writer: what this bus's readers cannot use goes there
        self.dead = DeadLetters(redis, keys.dead, dead_maxlen)
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
            return self.dead.maxlen
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
        self, source_stream: str | bytes, entry_id: bytes | str | None, fields: Mapping, reason: str
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
            out += await self._requests_or_dead(entries)
        return out

    async def _requests_or_dead(self, entries: Iterable) -> list[tuple[bytes, Request]]:
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
                ev = await self.dead.decode_or_dead(self.keys.control, entry_id, fields, CONTROL_TYPES)
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
                ev = await self.dead.decode_or_dead(
                    self.keys.req(rid), entry_id, fields, REQ_STREAM_TYPES, rid
                )
            out.append(ev)
        return out
