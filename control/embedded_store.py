"""The embedded server's :class:`~control.store.Store` for its in-process client.

Each operation is done on the server's data under its lock by ``control.embedded``'s direct
methods, which skip redis-py's pipeline and fakeredis' command dispatch: an engine's claim and
owner keys, a many-id abort's tombstones (1,000 unknown ids were 2,000 commands on the loop
the API answers on), a request's owner check and TTLs. Where a direct method declines (it
returns None: a key of another type, keyspace notifications on, a blocking read, no such
group) the same operation goes to :class:`~control.store.RedisStore` on the same client, so
every error and notification is fakeredis' own.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from control.store import RedisStore


class Direct(Protocol):
    """The embedded server's direct operations (``control.embedded``); None: not done."""

    def get(self, key: str) -> tuple[bytes | None] | None: ...

    def exists(self, key: str) -> bool: ...

    def expire(self, keys: list[str], ttl_s: int) -> list[bool] | None: ...

    def set_nx_get(self, keys: list[str], value: str, ttl_s: int) -> list[bytes | None] | None: ...

    def tombstones(
        self, owner_keys: list[str], value: str, ttl_s: int, req_keys: list[str] | None
    ) -> list[tuple[bytes | None, bool]] | None: ...

    def read_group(self, key: str, group: str, consumer: str, count: int | None) -> list | None: ...

    def ack_delete(self, key: str, group: str, ids: list[bytes]) -> tuple[int, int] | None: ...


class EmbeddedStore:
    """:class:`~control.store.Store` on the embedded server: direct, else by commands."""

    def __init__(self, redis: Any, direct: Direct):
        self._direct = direct
        self._commands = RedisStore(redis)

    async def get(self, key: str) -> bytes | None:
        got = self._direct.get(key)
        return got[0] if got is not None else await self._commands.get(key)

    async def exists(self, key: str) -> bool:
        return self._direct.exists(key)

    async def expire(self, keys: Sequence[str], ttl_s: int) -> None:
        if self._direct.expire(list(keys), ttl_s) is None:
            await self._commands.expire(keys, ttl_s)

    async def set_nx_get(self, keys: Sequence[str], value: str, ttl_s: int) -> list[bytes | None]:
        olds = self._direct.set_nx_get(list(keys), value, ttl_s)
        return olds if olds is not None else await self._commands.set_nx_get(keys, value, ttl_s)

    async def tombstones(
        self, owner_keys: Sequence[str], value: str, ttl_s: int, req_keys: Sequence[str]
    ) -> list[tuple[bytes | None, bool]]:
        res = self._direct.tombstones(list(owner_keys), value, ttl_s, list(req_keys))
        if res is not None:
            return res
        return await self._commands.tombstones(owner_keys, value, ttl_s, req_keys)

    async def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> list:
        if block_ms is None:  # (a blocking read waits in fakeredis, woken by its writes)
            resp = self._direct.read_group(stream, group, consumer, count)
            if resp is not None:
                return resp
        return await self._commands.read_group(stream, group, consumer, count, block_ms)

    async def ack_delete(self, stream: str, group: str, ids: Sequence[bytes]) -> None:
        if self._direct.ack_delete(stream, group, list(ids)) is None:
            await self._commands.ack_delete(stream, group, ids)
