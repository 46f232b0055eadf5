"""Who owns a request: ``P:owner:{<id>}``, where the first writer wins.

An engine's claim writes its owner token (fd/control/fence.py fences its writes with it); an
abort that finds no owner writes a tombstone (``aborted:<source>``, fd/control/keys.py), which
no engine will run, and whoever finds the tombstone with the request's story in place flips
it to ``aborted-final`` (:meth:`Ownership.take_abort_story`) and writes the abort story
(fd.control.endings.tombstone_story): exactly one party does. A response of n > 1 choices is
marked ``choices=<n>`` the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import WatchError

from fd.control.keys import ABORT_WRITTEN, Keys, pending_tombstone_source, tombstone
from fd.control.store import Store


class Ownership:
    """The owner keys' reads and writes, part of :class:`fd.control.bus.Bus`, whose client,
    store, keys and request TTL they use."""

    redis: Any
    keys: Keys
    store: Store
    req_ttl_s: int

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
        out: list[tuple[bool, str | None]] = []
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

    async def take_abort_story(self, request_id: str, seen: list[str] | None = None) -> str | None:
        """Compare-and-set a pending tombstone to ``aborted-final``. Returns the abort's source
        when this caller won and so must write the request's abort story; None otherwise.

        ``seen``, kept by a caller across its retries of this call, holds the pending source
        once read. A retry that then finds ``aborted-final`` may be the retry of a flip that
        went through (its reply lost with a dropped connection): it returns the source too,
        since no one else would write the story. If another party flipped it in between, both
        write, and the fence keeps the first story's batch alone (nothing after a final)."""
        key = self.keys.owner(request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                cur = await pipe.get(key)
                source = pending_tombstone_source(cur.decode() if cur is not None else None)
                if source is not None and seen is not None and not seen:
                    seen.append(source)
                if source is None:
                    return seen[0] if seen and cur == ABORT_WRITTEN.encode() else None
                pipe.multi()
                pipe.set(key, ABORT_WRITTEN, ex=self.req_ttl_s)
                await pipe.execute()
                return source
            except WatchError:
                return None

    async def owner(self, request_id: str) -> str | None:
        v = await self.store.get(self.keys.owner(request_id))
        return v.decode() if v is not None else None
