"""The engine node's view of Redis: whether its calls are getting through, and retrying the
ones that must (DESIGN.md §1: Redis going away is a pause, not an end).

Every loop of the node shares one :class:`RedisLink`, so an outage seen by any of them is one
outage: it is logged once a second, not once per retry, and the failover waits until calls
have been succeeding for a while (:attr:`RedisLink.ok_since`) before peers look dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("engine.node")

#: What a lost or restarting Redis raises (BusyLoadingError is a ConnectionError).
RETRYABLE = (RedisConnectionError, RedisTimeoutError, OSError)

T = TypeVar("T")


class Stopped(Exception):
    """A Redis call was abandoned because the engine is stopping."""


class RedisLink:
    def __init__(
        self,
        engine_id: str,
        backoff_s: float,
        backoff_max_s: float,
        stopping: Callable[[], bool],
    ) -> None:
        self.engine_id = engine_id
        self.backoff_s = backoff_s  # first wait after a Redis error, doubling ...
        self.backoff_max_s = backoff_max_s  # ... up to this
        self.stopping = stopping
        self.errors = 0  # Redis calls that failed and were retried
        # Since when Redis calls have been succeeding (0: since forever; None: they fail
        # now). After an outage the failover waits a heartbeat TTL, so live peers can renew
        # heartbeats that expired while nobody could write them, before their requests look
        # orphaned.
        self.ok_since: float | None = 0.0
        self._last_error_log = 0.0

    def ok(self) -> None:
        """A Redis call got through."""
        if self.ok_since is None:
            self.ok_since = time.monotonic()
            log.info("control plane reachable again", extra={"engine": self.engine_id})

    def failed(self, what: str, e: BaseException) -> None:
        """A Redis call failed with one of :data:`RETRYABLE`; the caller retries."""
        self.ok_since = None
        self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 1.0:  # one line a second, not one per retry
            self._last_error_log = now
            log.warning("redis unavailable (%s): %s; retrying", what, e, extra={"engine": self.engine_id})

    async def retry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` until it gets through, backing off; gives up only when stopping."""
        backoff = self.backoff_s
        while True:
            try:
                out = await fn()
                self.ok()
                return out
            except RETRYABLE as e:
                self.failed(what, e)
                if self.stopping():
                    raise Stopped(what) from e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def pause(self, backoff: float) -> float:
        """Wait ``backoff`` after a failure; the next wait."""
        await asyncio.sleep(backoff)
        return min(backoff * 2, self.backoff_max_s)
