"""What the bus asks of the data under it, as one declared interface, and its redis-py form.

:class:`Store` is every operation of :class:`fd.control.bus.Bus` whose form depends on the server
under it: appends (many at once, in order, with TTLs and acknowledgements after them), the
fence's and the story start's scripts, reads of many streams at once, the request queue's
group, owner keys and tombstones. Each method is whole (a many-key call is one round trip
where the server allows it). Commands that read the same on every server (``XRANGE``,
``HGETALL``, ...) the bus sends on its client as they are.

:class:`RedisStore` is the one implementation, over any redis-py asyncio client: a single
Redis, a Redis Cluster (whose non-transactional pipeline splits per slot; where the order
across slots matters it spends a second round trip), and the embedded server
(fd/control/embedded.py), whose in-process client is fakeredis's own ``FakeAsyncRedis`` on the
same server object as its TCP door; that client brings a subclass of it
(fd/control/embedded_store.py) which does a step's hot work on fakeredis's objects, on the
fakeredis releases that was verified on (the commands on any other).
tests/integration/test_store_contract.py runs the same contract on all of them.

Replies are redis-py's (bytes, ``decode_responses=False``): the bus decodes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from fd.control import fence
from fd.control import story as story_start
from fd.control.events import Event
from fd.control.fence import Refused
from fd.control.outage import is_outage, reason

log = logging.getLogger("fd.control.store")

#: A redis-py client (asyncio's ``Redis``, ``RedisCluster``, fakeredis's ``FakeAsyncRedis``; a
#: synchronous one where a check runs outside the loop) or a pipeline of one. redis-py types
#: its commands' replies as ``Awaitable[Any] | Any``, so the replies are unchecked whatever
#: the client: each caller reads them into its own types.
RedisClient: TypeAlias = Any
#: One stream entry of a read: its id and its fields (None: deleted while pending).
StreamEntry: TypeAlias = tuple[bytes, Mapping[bytes, bytes] | None]
#: ``XREAD``'s and ``XREADGROUP``'s reply as redis-py gives it: per stream a two-item list, its
#: key and its entries (``(entry id, fields)`` each); the server's reply, read by the bus.
StreamsReply: TypeAlias = list[list[Any]]

_FAKEREDIS_NO_STREAM = "The XGROUP subcommand requires the key to exist"


@dataclass(frozen=True, slots=True)
class Append:
    """One ``XADD stream * fields...``, capped at ``maxlen`` (approximately) when given;
    ``event``: the event ``fields`` encode, for a store that hands its appends to readers in
    its own process (:meth:`Store.listen`)."""

    stream: str
    fields: Mapping[str, str]
    maxlen: int | None = None
    event: Event | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    """``XACK stream group id...`` then ``XDEL stream id...``: entries done with for good."""

    stream: str
    group: str
    ids: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class Fenced:
    """One request's events of one step, appended to its story only while ``owner_key`` holds
    ``token`` and the story has no final (fd/control/fence.py). With a final, ``ack`` (its
    ``P:requests`` entry) is acknowledged and ``renew`` given ``ttl_s`` again, only if the
    events got through. ``events``: what ``fields`` encode, one each, as :class:`Append`'s."""

    owner_key: str
    story: str
    token: str
    fields: Sequence[Mapping[str, str]]
    ttl_s: int
    ack: Ack | None = None
    renew: Sequence[str] = field(default_factory=tuple)
    events: Sequence[Event] = ()
    after: Mapping[str, str] | None = None  # the writer's last event on the story (fd/control/fence.py)

    @property
    def ends(self) -> bool:
        """The batch has a final (nothing after it is written, as fd/control/fence.py's script)."""
        return any(f.get("type") == "final" for f in self.fields)


#: ``(stream, before, entry_id, event, fields)``: ``event`` was appended to ``stream`` as
#: ``entry_id``, encoded as ``fields``, right after the entry ``before`` (the stream's last id
#: then; ``0-0`` for none).
AppendListener = Callable[[bytes, bytes, bytes, Event, Mapping[str, str]], None]


class Store(Protocol):
    """The bus's operations on its server (see the module's docstring)."""

    def listen(self, listener: AppendListener) -> Callable[[], None] | None:
        """Have ``listener`` told of each event this process appends through the store, in the
        appending call (on the event loop), so a reader in the process takes it as it is
        instead of reading it back and decoding it; what other processes write is not told.
        The function that stops it; None where the store cannot say which entry came before
        (a server others write to as well: its readers read)."""

    async def append_many(
        self, entries: Sequence[Append], expire: Sequence[str] = (), ttl_s: int = 0, ack: Ack | None = None
    ) -> list[bytes]:
        """``entries`` in order, then ``EXPIRE key ttl_s`` of each of ``expire``, then
        ``ack``: one round trip where the server allows it; acks come last, so an entry is
        acknowledged only once what was written with it is there. The ids of ``entries``."""

    async def fenced_append(
        self, batches: Sequence[Fenced], plain: Sequence[Append] = ()
    ) -> list[Refused | None]:
        """Each batch through the fence, atomically per batch, and ``plain`` unfenced, in one
        round trip; then the acks and renewals of the batches that got through (inside their
        batch's script where the server allows it). Per batch: None, or why it was refused
        (nothing of it written)."""

    async def start_story(
        self,
        story: str,
        fields: Sequence[Mapping[str, str]],
        ttl_s: int,
        request: Append | None = None,
        enroll: tuple[str, str] | None = None,
    ) -> tuple[int, bool]:
        """fd/control/story.py's start: ``(TAKEN | WRITTEN | DONE, whether request was appended
        with it)``, and with the request ``enroll``'s ``(set, member)`` added (a lane to the
        registry). Where the server cannot take these keys in one script (a cluster) the
        request is left to the caller."""

    async def read(
        self, streams: Mapping[bytes | str, bytes], count: int | None, block_ms: int | None
    ) -> StreamsReply:
        """``XREAD [COUNT count] [BLOCK ms] STREAMS key... id...``, in redis-py's reply shape.
        A store that looks again while it blocks reads the ids in ``streams`` again: a
        listener's reader (:meth:`listen`) moves them past what it was told meanwhile."""

    async def get(self, key: str) -> bytes | None:
        """``GET key``."""

    async def exists(self, key: str) -> bool:
        """``EXISTS key`` for one key."""

    async def expire(self, keys: Sequence[str], ttl_s: int) -> None:
        """``EXPIRE key ttl_s`` for each key that exists."""

    async def set_nx_get(self, keys: Sequence[str], value: str, ttl_s: int) -> list[bytes | None]:
        """``SET key value NX GET EX ttl_s`` for each key: its old value, None where set."""

    async def tombstones(
        self, owner_keys: Sequence[str], value: str, ttl_s: int, req_keys: Sequence[str]
    ) -> list[tuple[bytes | None, bool]]:
        """:meth:`set_nx_get` of each owner key, each with ``EXISTS`` of its request's key,
        in order: ``(old value, request key exists)`` per pair."""

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> StreamsReply:
        """``XREADGROUP GROUP group consumer COUNT count [BLOCK ms] STREAMS stream >``, in
        redis-py's reply shape; ``block_ms=None`` does not block. Raises redis-py's
        ``ResponseError``, one that starts ``NOGROUP`` where the stream or the group is
        missing."""

    async def ack_delete(self, stream: str, group: str, ids: Sequence[bytes]) -> None:
        """``XACK stream group id...`` then ``XDEL stream id...``."""


@runtime_checkable
class HasStore(Protocol):
    """A client that brings a store of its own (the embedded server's in-process client,
    fd/control/embedded_store.py)."""

    def store(self) -> Store: ...


def store_for(redis: RedisClient) -> Store:
    """The store to use on ``redis``: its own where it brings one, else :class:`RedisStore`."""
    return redis.store() if isinstance(redis, HasStore) else RedisStore(redis)


def _xadd(client: RedisClient, entry: Append) -> Any:
    if entry.maxlen:
        return client.xadd(entry.stream, entry.fields, maxlen=entry.maxlen, approximate=True)
    return client.xadd(entry.stream, entry.fields)


def _refusal(e: Exception, command: str, key: str) -> Refused:
    """A command's error reply in a pipeline: raised where it is an outage (the caller rides
    it out and sends again, fd/control/outage.py), else logged with the command and key; the
    batch it was is refused for that reason alone (its request ends, the rest go on)."""
    if is_outage(e):
        raise e
    log.error("redis refused %s on %s: %s", command, key, reason(e))
    return Refused("error", None, reason(e))


def _ack(pipe: RedisClient, ack: Ack) -> None:
    pipe.xack(ack.stream, ack.group, *ack.ids)
    pipe.xdel(ack.stream, *ack.ids)


class RedisStore:
    """:class:`Store` over redis-py commands and scripts, on a single node or a Cluster."""

    def __init__(self, redis: RedisClient):
        self.redis = redis
        self.cluster = isinstance(redis, RedisCluster)
        self._fence_sha: str | None = None  # fd/control/fence.py's script, once loaded
        self._start_script: Any = None  # fd/control/story.py's (redis-py's Script), on first use

    def listen(self, listener: AppendListener) -> Callable[[], None] | None:
        return None  # (XADD's reply names the new entry, not the one before it)

    async def append_many(
        self, entries: Sequence[Append], expire: Sequence[str] = (), ttl_s: int = 0, ack: Ack | None = None
    ) -> list[bytes]:
        if len(entries) == 1 and not expire and ack is None:
            return [await _xadd(self.redis, entries[0])]
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            _xadd(pipe, entry)
        for key in expire:
            pipe.expire(key, ttl_s)
        if ack is not None and ack.ids and self.cluster and (entries or expire):
            # The acked stream may live on another node, and the cluster pipeline runs the
            # nodes' batches side by side: write first, then ack.
            written: list[bytes] = await pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
            _ack(pipe, ack)
            await pipe.execute()
            return written[: len(entries)]
        if ack is not None and ack.ids:
            _ack(pipe, ack)
        return (await pipe.execute())[: len(entries)] if len(pipe) else []

    async def fenced_append(
        self, batches: Sequence[Fenced], plain: Sequence[Append] = ()
    ) -> list[Refused | None]:
        if not batches:
            if plain:
                await self.append_many(plain)
            return []
        # On a single Redis a script may name keys of any slot: a final's ack and renewals
        # go inside its batch's script (fd/control/fence.py), so they happen only if it got
        # through, in the same call. A cluster's script names the request's two keys only.
        folded = [not self.cluster and b.ends for b in batches]
        refused = await self._scripts(batches, folded, plain)
        await self.after_fence(
            [b for b, fold, why in zip(batches, folded, refused, strict=False) if why is None and not fold]
        )
        return refused

    async def after_fence(
        self, through: Sequence[Fenced], plain: Sequence[Append] = (), own_ttl: bool = False
    ) -> None:
        """What the fence's script leaves to a second round trip, for batches that got
        through: their renewals and acks (``own_ttl``: a final's renewal of its own story's
        and owner key's TTL too, which the script does for its own), after ``plain``."""
        expire: list[str] = []
        acks: dict[tuple[str, str], list[bytes]] = {}
        for b in through:
            if own_ttl and b.ends and b.ttl_s > 0:
                expire += [b.story, b.owner_key]
            expire += b.renew
            if b.ack is not None:
                acks.setdefault((b.ack.stream, b.ack.group), []).extend(b.ack.ids)
        grouped = [Ack(stream, group, ids) for (stream, group), ids in acks.items()]
        if plain or expire or grouped:
            ttl = through[0].ttl_s if through else 0
            await self.append_many(list(plain), expire, ttl, grouped[0] if grouped else None)
        for ack in grouped[1:]:
            await self.ack_delete(ack.stream, ack.group, ack.ids)

    async def _scripts(
        self, batches: Sequence[Fenced], folded: Sequence[bool], plain: Sequence[Append]
    ) -> list[Refused | None]:
        """The fence's script for each batch (EVALSHA, loaded on a NOSCRIPT: a command that
        failed so did nothing, and only those are sent again), and ``plain``'s XADDs, in one
        pipeline."""
        if self._fence_sha is None:
            self._fence_sha = await self.redis.script_load(fence.SCRIPT)
        refused: list[Refused | None] = [None] * len(batches)
        todo = list(range(len(batches)))
        for _ in range(3):
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                b = batches[i]
                # KEYS[3] is the acked stream (the story itself stands in where there is no
                # ack: the script touches it only to ack), then the keys to renew.
                extra = [b.ack.stream if b.ack else b.story, *b.renew] if folded[i] else []
                ack = b.ack if folded[i] else None
                args = fence.script_args(
                    b.token,
                    b.ttl_s,
                    list(b.fields),
                    ack.ids[0] if ack else None,
                    ack.group if ack else "",
                    b.after,
                )
                # (execute_command: redis-py's cluster pipeline refuses its evalsha, but
                # routes the command by its first key, the request's slot)
                pipe.execute_command(
                    "EVALSHA", self._fence_sha, 2 + len(extra), b.owner_key, b.story, *extra, *args
                )
            for entry in plain:
                _xadd(pipe, entry)
            sent, plain = plain, ()
            results = await pipe.execute(raise_on_error=False)
            again = []
            for i, res in zip(todo, results, strict=False):
                if isinstance(res, NoScriptError):
                    again.append(i)
                elif isinstance(res, Exception):
                    refused[i] = _refusal(res, "fence", batches[i].story)
                else:
                    got = fence.script_result(res)
                    if isinstance(got, Refused):
                        refused[i] = got
            for res, entry in zip(results[len(todo) :], sent, strict=False):
                if isinstance(res, Exception):
                    _refusal(res, "XADD", entry.stream)
            if not again:
                return refused
            self._fence_sha = await self.redis.script_load(fence.SCRIPT)  # (flushed, or a new node)
            todo = again
        raise ResponseError("the fence's script could not be loaded")

    async def start_story(
        self,
        story: str,
        fields: Sequence[Mapping[str, str]],
        ttl_s: int,
        request: Append | None = None,
        enroll: tuple[str, str] | None = None,
    ) -> tuple[int, bool]:
        req = request if not self.cluster else None  # (a cluster's script takes the story alone)
        if self._start_script is None:
            self._start_script = self.redis.register_script(story_start.SCRIPT)
        keys = [story]
        if req is not None:
            keys.append(req.stream)
            if enroll is not None:
                keys.append(enroll[0])
        got = int(
            await self._start_script(
                keys=keys,
                args=story_start.script_args(
                    ttl_s,
                    list(fields),
                    dict(req.fields) if req is not None else None,
                    req.maxlen if req is not None else None,
                    enroll[1] if req is not None and enroll is not None else None,
                ),
            )
        )
        return got, req is not None

    async def read(
        self, streams: Mapping[bytes | str, bytes], count: int | None, block_ms: int | None
    ) -> StreamsReply:
        return await self.redis.xread(dict(streams), count=count, block=block_ms) or []

    async def get(self, key: str) -> bytes | None:
        value: bytes | None = await self.redis.get(key)
        return value

    async def exists(self, key: str) -> bool:
        return bool(await self.redis.exists(key))

    async def expire(self, keys: Sequence[str], ttl_s: int) -> None:
        if not keys:
            return
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.expire(key, ttl_s)
        await pipe.execute()

    async def set_nx_get(self, keys: Sequence[str], value: str, ttl_s: int) -> list[bytes | None]:
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, value, nx=True, ex=ttl_s, get=True)
        return list(await pipe.execute())

    async def tombstones(
        self, owner_keys: Sequence[str], value: str, ttl_s: int, req_keys: Sequence[str]
    ) -> list[tuple[bytes | None, bool]]:
        pipe = self.redis.pipeline(transaction=False)
        for owner_key, req_key in zip(owner_keys, req_keys, strict=False):
            pipe.set(owner_key, value, nx=True, ex=ttl_s, get=True)
            pipe.exists(req_key)
        res = await pipe.execute()
        return [(old, bool(exists)) for old, exists in zip(res[0::2], res[1::2], strict=False)]

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> StreamsReply:
        try:
            return (
                await self.redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms) or []
            )
        except ResponseError as e:
            # fakeredis (the embedded server, through either door) says a missing stream's
            # NOGROUP in other words; the bus recreates the group on NOGROUP alone.
            if not str(e).startswith(_FAKEREDIS_NO_STREAM):
                raise
            raise ResponseError(
                f"NOGROUP No such key '{stream}' or consumer group '{group}' in XREADGROUP with GROUP option"
            ) from e

    async def ack_delete(self, stream: str, group: str, ids: Sequence[bytes]) -> None:
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        _ack(pipe, Ack(stream, group, ids))
        await pipe.execute()
