"""One way to open a Redis connection, with the settings the bus depends on.

Why these settings (DESIGN.md §6):

- a socket timeout (``timeout_s``; ``--redis-timeout``, ``FD_REDIS_TIMEOUT``, default 5 s) on
  every read and on connecting: a Redis that stops answering (a paused process, a stalled
  host) while its socket stays open is an error within that time (the API's 503), not a
  request that hangs until it answers again. It must be longer than any ``BLOCK`` fd sends
  (the longest is the API's stream reader, 1 s), or redis-py gives up on a healthy blocking
  read: :data:`MIN_TIMEOUT_S`. It bounds a wait for Redis's reply, never a client's stream:
  a token stream's gaps are blocking reads that come back empty and are sent again.
- ``protocol=2``: redis-py 8 speaks RESP3 by default; RESP2 is what redis-cli, Redis 7.0 and
  the embedded server speak out of the box, and it saves the ``HELLO`` round trip per
  connection. Every reply shape the bus parses is then the same on every server.
- retries with exponential backoff on connection errors, so a Redis restart or failover is a
  pause, not a crash. A retried ``XADD`` may be written twice and a retried ``XREADGROUP`` may
  leave entries pending; readers tolerate both (pending entries are reclaimed by autoclaim).
  A timeout is not retried: a server that did not answer in ``timeout_s`` will not answer a
  reconnect sooner, and six more tries would make the bound seven times as long.

Redis Cluster is chosen by the URL scheme, ``redis+cluster://`` (``rediss+cluster://`` for TLS),
not by probing: the caller knows what it deployed, and a probe would cost a round trip and a
guess on every start.
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    ConnectionError,
    TimeoutError,
)

#: Seconds a connect or a reply may take before the command fails (``--redis-timeout``).
DEFAULT_TIMEOUT_S = 5.0
TIMEOUT_ENV = "FD_REDIS_TIMEOUT"
#: Above the longest ``BLOCK`` fd sends (``StreamMux.block_ms``, 1 s), with room for the reply.
MIN_TIMEOUT_S = 2.0
HEALTH_CHECK_INTERVAL_S = 30
RETRIES = 6  # 50 ms doubling to a 2 s cap: a bit over 5 s of outage before an error surfaces
#: Connections per client. A burst of requests waits for a free connection instead of failing:
#: redis-py's default pool raises "Too many connections" at 100, which turned a burst of 128
#: streams into 503s (bench/abort.py).
MAX_CONNECTIONS = 256
POOL_WAIT_S = 30


class _Retry(Retry):
    """Retries connection trouble, but not a refused login (redis-py's AuthenticationError is
    a ConnectionError, and retrying it only delays a wrong password's error by seconds) nor a
    timeout (see the module's docstring)."""

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(e: Exception) -> bool:
            if isinstance(e, (AuthenticationError, AuthenticationWrongNumberOfArgsError, TimeoutError)):
                return False
            return is_retryable(e) if is_retryable else True

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


class _CancellableWrites:
    """A connection whose write's timeout is ``asyncio.timeout``, not redis-py's
    ``asyncio.wait_for``: on Python 3.11 a cancel that arrives once the write has finished but
    before the waiting task resumes is swallowed by wait_for (it returns the result instead),
    and the cancelled task runs on as if never cancelled (an engine stopped by a cancel went
    on claiming and beating, a shutdown waited for it forever). A connect made on the way
    counts within the same bound."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout:
            return await super().send_packed_command(command, check_health)
        self.socket_timeout = None  # (so redis-py writes without its wait_for; the bound is here)
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)
        except asyncio.TimeoutError:  # (redis-py disconnected on the cancel the timeout sent)
            raise TimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout


_CANCELLABLE: dict[type, type] = {}


def _cancellable(cls: type) -> type:
    if cls not in _CANCELLABLE:
        _CANCELLABLE[cls] = type(cls.__name__, (_CancellableWrites, cls), {})
    return _CANCELLABLE[cls]


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def redis_timeout(value: float | str | None = None) -> float:
    """The socket timeout to use: ``value``, else ``$FD_REDIS_TIMEOUT``, else 5 s; a
    ValueError for one that is not a number of seconds of at least :data:`MIN_TIMEOUT_S`."""
    if value is None:
        value = os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"Redis timeout {value!r}: not a number of seconds") from None
    if not seconds >= MIN_TIMEOUT_S or seconds == float("inf"):
        raise ValueError(
            f"Redis timeout {value!r}: give at least {MIN_TIMEOUT_S:g} s (longer "
            "than the 1 s blocking reads fd sends)"
        )
    return seconds


def connect(url: str, timeout_s: float | None = None) -> aioredis.Redis | aioredis.RedisCluster:
    """A ``redis.asyncio`` client for ``url`` (``redis://``, ``rediss://``, ``user:pass@`` work).

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives a ``RedisCluster`` that
    discovers the other nodes from ``host:port``, with the same settings where redis-py's
    cluster client has them: the socket timeout, RESP2, ``MAX_CONNECTIONS`` per node. Two
    differences to know: its pool does not wait for a free connection (the ``MAX_CONNECTIONS + 1``
    -th concurrent command on one node raises ``MaxConnectionsError``), and it retries
    ``RETRIES`` times at once, refreshing the slot map in between, with no backoff, timeouts
    included (a stalled node: up to ``RETRIES + 1`` timeouts); a refused login is not retried
    there either (it matches retryable errors by exact type).

    ``timeout_s``: the socket and connect timeout (:func:`redis_timeout`).

    The connection is opened lazily, inside whatever event loop first uses the client.
    """
    timeout_s = redis_timeout(timeout_s)
    common = dict(
        max_connections=MAX_CONNECTIONS,
        decode_responses=False,
        protocol=2,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=_Retry(ExponentialBackoff(cap=2.0, base=0.05), RETRIES),
    )
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in CLUSTER_SCHEMES:
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", **common)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, timeout=POOL_WAIT_S, retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError], **common
    )
    pool.connection_class = _cancellable(pool.connection_class)  # (the URL's: TCP, TLS, unix)
    return aioredis.Redis.from_pool(pool)
