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
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError

CONNECT_TIMEOUT_S = 5
HEALTH_CHECK_INTERVAL_S = 30
RETRIES = 6  # 50 ms doubling to a 2 s cap: a bit over 5 s of outage before an error surfaces
#: Connections per client. A burst of requests waits for a free connection instead of failing:
#: redis-py's default pool raises "Too many connections" at 100, which turned a burst of 128
#: streams into 503s (bench/abort.py).
MAX_CONNECTIONS = 256
POOL_WAIT_S = 30


def connect(url: str) -> aioredis.Redis:
    """A ``redis.asyncio`` client for ``url`` (``redis://``, ``rediss://``, ``user:pass@`` work).

    The connection is opened lazily, inside whatever event loop first uses the client.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S,
        decode_responses=False,
        protocol=2,
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), RETRIES),
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
    )
    return aioredis.Redis.from_pool(pool)
