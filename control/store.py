"""The key operations the bus makes on its store, as one declared interface.

:class:`Store` is what :class:`control.bus.Bus` asks of the data under it for owner keys,
tombstones, TTLs and the request queue's group: one method per operation, each whole (a
many-key call is one round trip). :class:`RedisStore` does them with redis-py commands on any
client (a single node or a Cluster; its non-transactional pipeline splits per slot), and
``control.embedded`` has the in-process one, which does them on the embedded server's data
directly and hands anything it cannot do to a :class:`RedisStore` on the same client. The bus
calls these methods and never probes its client for shortcuts.

Replies are redis-py's (bytes, ``decode_responses=False``): the bus decodes them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from redis.exceptions import ResponseError

_FAKEREDIS_NO_STREAM = "The XGROUP subcommand requires the key to exist"


class Store(Protocol):
    """What the bus needs of its store besides plain commands on its client."""

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
    ) -> list:
        """``XREADGROUP GROUP group consumer COUNT count [BLOCK ms] STREAMS stream >``, in
        redis-py's reply shape; ``block_ms=None`` does not block. Raises redis-py's
        ``ResponseError``, one that starts ``NOGROUP`` where the stream or the group is
        missing."""

    async def ack_delete(self, stream: str, group: str, ids: Sequence[bytes]) -> None:
        """``XACK stream group id...`` then ``XDEL stream id...``."""


@runtime_checkable
class HasStore(Protocol):
    """A client that brings its own :class:`Store` (the embedded server's in-process one)."""

    def store(self) -> Store: ...


def store_for(redis: Any) -> Store:
    """The store to use with ``redis``: its own if it brings one, else :class:`RedisStore`."""
    return redis.store() if isinstance(redis, HasStore) else RedisStore(redis)


class RedisStore:
    """:class:`Store` over redis-py commands, on a single node or a Cluster."""

    def __init__(self, redis: Any):
        self.redis = redis

    async def get(self, key: str) -> bytes | None:
        return await self.redis.get(key)

    async def exists(self, key: str) -> bool:
        return bool(await self.redis.exists(key))

    async def expire(self, keys: Sequence[str], ttl_s: int) -> None:
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
        for owner_key, req_key in zip(owner_keys, req_keys):
            pipe.set(owner_key, value, nx=True, ex=ttl_s, get=True)
            pipe.exists(req_key)
        res = await pipe.execute()
        return [(old, bool(exists)) for old, exists in zip(res[0::2], res[1::2])]

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> list:
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
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(stream, group, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()
