"""The engine node's view of Redis: whether its calls are getting through, and retrying the
ones that must (DESIGN.md §1: Redis going away is a pause, not an end).

Every loop of the node shares one :class:`RedisLink`, so an outage seen by any of them is one
outage: it is logged when it starts (and when Redis's reason changes) and when it ends, not once
per retry, and the failover waits until calls have been succeeding for a while
(:attr:`RedisLink.ok_since`) before peers look dead. An outage is a lost connection or an
error reply that says "not now" (fd/control/outage.py): out of memory, a read-only replica, a
failed save, a busy script, a load in progress. Any other error reply is about the command: it
is logged with the command, at most once a minute per kind, and the caller goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fd.control.outage import REDIS_FAILURES, is_outage, kind, reason

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")

#: What a Redis call may raise that the engine rides out (see :meth:`RedisLink.failed`).
RETRYABLE = REDIS_FAILURES
#: A refusal's log line is repeated at most this often (the caller retries it meanwhile).
REFUSAL_LOG_S = 60.0

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
        self.outage: str | None = None  # why calls fail now (the last failure's reason)
        self._outage_started = 0.0
        self._outage_errors = 0
        self._outage_kind: str | None = None  # (fd.control.outage.kind) of the outage logged
        self._refusals: dict[tuple[str, str], float] = {}  # (what, kind) -> when last logged

    def ok(self) -> None:
        """A Redis call got through."""
        if self.ok_since is None:
            self.ok_since = time.monotonic()
            log.info(
                "control plane reachable again after %.1f s (%d failed calls retried)",
                self.ok_since - self._outage_started,
                self._outage_errors,
                extra={"engine": self.engine_id},
            )
            self.outage = self._outage_kind = None

    def failed(self, what: str, e: BaseException) -> None:
        """A Redis call failed with one of :data:`RETRYABLE`; the caller retries (an outage)
        or goes on without it (a refusal of the command, logged with it)."""
        if not is_outage(e):
            self.refused(what, e)
            return
        self.errors += 1
        why = reason(e)
        if self.ok_since is not None:
            self._outage_started = time.monotonic()
            self._outage_errors = 0
        self.ok_since = None
        self._outage_errors += 1
        self.outage = why
        if kind(e) != self._outage_kind:  # one line an outage (and one if its kind changes)
            self._outage_kind = kind(e)
            log.warning("redis unavailable (%s): %s; retrying", what, why, extra={"engine": self.engine_id})

    def refused(self, what: str, e: BaseException) -> None:
        """Redis refused a command for a reason of the command's own (fd/control/outage.py)."""
        self.errors += 1
        kind = str(e).split(" ", 1)[0]
        now = time.monotonic()
        if now - self._refusals.get((what, kind), -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._refusals[(what, kind)] = now
            log.error("redis refused %s: %s", what, reason(e), extra={"engine": self.engine_id})

    async def retry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` until it gets through, backing off through an outage; gives up when
        stopping, and on a refusal of the command (logged, then raised: the same command
        gets the same answer)."""
        backoff = self.backoff_s
        while True:
            try:
                out = await fn()
                self.ok()
                return out
            except RETRYABLE as e:
                self.failed(what, e)
                if not is_outage(e):
                    raise
                if self.stopping():
                    raise Stopped(what) from e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def pause(self, backoff: float) -> float:
        """Wait ``backoff`` after a failure; the next wait."""
        await asyncio.sleep(backoff)
        return min(backoff * 2, self.backoff_max_s)
