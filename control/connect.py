"""One way to open a Redis connection, with the settings the bus depends on.

Why these settings (DESIGN.md §6):

- ``socket_timeout=None``: the bus parks in blocking ``XREAD``/``XREADGROUP`` calls. A client
  read timeout shorter than ``BLOCK`` makes redis-py give up on a healthy connection and retry
  the read, so blocking reads must never time out on the client side.
- ``protocol=2``: redis-py 8 speaks RESP3 by default; RESP2 is what redis-cli, Redis 7.0 and
  the embedded server speak out of the box, and it saves the ``HELLO`` round trip per
  connection. Every reply shape the bus parses is then the same on every server.
- retries with exponential backoff on connection errors, so a Redis restart or failover is a
  pause, not a crash. A retried ``XADD`` may be written twice and a retried ``XREADGROUP`` may
  leave entries pending; readers tolerate both (pending entries are reclaimed by autoclaim).

Redis Cluster is chosen by the URL scheme, ``redis+cluster://`` (``rediss+cluster://`` for TLS),
not by probing: the caller knows what it deployed, and a probe would cost a round trip and a
guess on every start.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (AuthenticationError, AuthenticationWrongNumberOfArgsError,
                              BusyLoadingError, ConnectionError, TimeoutError)

CONNECT_TIMEOUT_S = 5
HEALTH_CHECK_INTERVAL_S = 30
RETRIES = 6  # 50 ms doubling to a 2 s cap: a bit over 5 s of outage before an error surfaces
#: Connections per client. A burst of requests waits for a free connection instead of failing:
#: redis-py's default pool raises "Too many connections" at 100, which turned a burst of 128
#: streams into 503s (bench/abort.py).
MAX_CONNECTIONS = 256
POOL_WAIT_S = 30


class _Retry(Retry):
    """Retries connection trouble, but not a refused login: redis-py's AuthenticationError is
    a ConnectionError, and retrying it only delays a wrong password's error by seconds."""

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(e: Exception) -> bool:
            if isinstance(e, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
                return False
            return is_retryable(e) if is_retryable else True

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def connect(url: str) -> aioredis.Redis | aioredis.RedisCluster:
    """A ``redis.asyncio`` client for ``url`` (``redis://``, ``rediss://``, ``user:pass@`` work).

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives a ``RedisCluster`` that
    discovers the other nodes from ``host:port``, with the same settings where redis-py's
    cluster client has them: no socket timeout, RESP2, ``MAX_CONNECTIONS`` per node. Two
    differences to know: its pool does not wait for a free connection (the ``MAX_CONNECTIONS + 1``
    -th concurrent command on one node raises ``MaxConnectionsError``), and it retries
    ``RETRIES`` times at once, refreshing the slot map in between, with no backoff; a refused
    login is not retried there either (it matches retryable errors by exact type).

    The connection is opened lazily, inside whatever event loop first uses the client.
    """
    common = dict(
        max_connections=MAX_CONNECTIONS,
        decode_responses=False,
        protocol=2,
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=_Retry(ExponentialBackoff(cap=2.0, base=0.05), RETRIES),
    )
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in CLUSTER_SCHEMES:
        return aioredis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", **common)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, timeout=POOL_WAIT_S, retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        **common)
    return aioredis.Redis.from_pool(pool)
