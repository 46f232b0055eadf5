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
guess on every start. Likewise Redis Sentinel, ``redis+sentinel://host:26379/<service>``
(:func:`connect` says the rest): the client asks the sentinels where the service's primary is
and follows it when they fail it over.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, Connection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    ConnectionError,
    RedisError,
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
SENTINEL_PORT = 26379
#: How often a Sentinel client busy with commands asks a sentinel where the primary is.
MASTER_CHECK_S = 1.0

#: What a retried command returns
T = TypeVar("T")
#: redis-py's keyword options of a client and its pool, as its ``from_url`` takes them
ConnectionOptions: TypeAlias = dict[str, Any]

if TYPE_CHECKING:
    # (_Connection is a mixin over whichever connection class a URL picks: typed as the base
    # of them all, so its super() calls are checked against redis-py's)
    _ConnectionBase = AbstractConnection
else:
    _ConnectionBase = object


class _Retry(Retry):
    """Retries connection trouble, but not a refused login (redis-py's AuthenticationError is
    a ConnectionError, and retrying it only delays a wrong password's error by seconds) nor a
    timeout (see the module's docstring)."""

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(e: Exception) -> bool:
            if isinstance(e, (AuthenticationError, AuthenticationWrongNumberOfArgsError, TimeoutError)):
                return False
            return is_retryable(e) if is_retryable else True

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


class _Connection(_ConnectionBase):
    """fd's connection, over the URL's (TCP, TLS, unix, or a sentinel-managed one):

    - its write's timeout is ``asyncio.timeout``, not redis-py's ``asyncio.wait_for``: on
      Python 3.11 a cancel that arrives once the write has finished but before the waiting
      task resumes is swallowed by wait_for (it returns the result instead), and the cancelled
      task runs on as if never cancelled (an engine stopped by a cancel went on claiming and
      beating, a shutdown waited for it forever). A connect made on the way counts within the
      same bound.
    - a sentinel-managed one that lost its connection (a READONLY reply drops it) connects
      again through its pool's look-up of the primary, also when redis-py's retry of a command
      sends it again: redis-py reconnects there with the host and port it had."""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        timeout = self.socket_timeout
        if not timeout:
            await super().send_packed_command(command, check_health)
            return
        self.socket_timeout = None  # (so redis-py writes without its wait_for; the bound is here)
        try:
            async with asyncio.timeout(timeout):
                if not self.is_connected and isinstance(self, SentinelManagedConnection):
                    # (redis-py would reconnect to the address it had, the old primary's: a
                    # command retried after a READONLY met it again and again; redis-py #3874)
                    await self.connect()  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
                await super().send_packed_command(command, check_health)
        except builtins.TimeoutError:  # (redis-py disconnected on the cancel the timeout sent)
            raise TimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout


_CONNECTIONS: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _fd_connection(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    if cls not in _CONNECTIONS:
        # (a class made at run time, on the URL's own: what type() makes is one of cls's)
        _CONNECTIONS[cls] = cast(type[AbstractConnection], type(cls.__name__, (_Connection, cls), {}))
    return _CONNECTIONS[cls]


class _SentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's Sentinel pool (it asks the sentinels for the primary's address on every
    connect, and drops a connection whose server answers READONLY, or unblocks a blocking read
    with UNBLOCKED, as a replica does once failed over, so the retry connects to the new
    primary), blocking as :class:`_Pool`, and following the primary while it is busy: a
    failover an operator asks for (``SENTINEL FAILOVER``), or one of a primary that was only
    cut off, leaves the old primary up and taking writes until the sentinels turn it into a
    replica (some 10 s later), and those writes are lost then. So taking a connection for a
    command also starts a look-up of the primary, at most every :data:`MASTER_CHECK_S` and in
    the background (a slow sentinel delays no command); once it moved, idle connections close
    and busy ones close when they are given back, and the next commands connect to the new
    one. Measured (tests/integration/test_sentinel.py): a busy client leaves the old primary 0.1-2 s after
    the sentinels' switch; without the look-up it stayed on it until the sentinels demoted it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
        self._next_check = 0.0
        self._check: asyncio.Task[None] | None = None

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        now = time.monotonic()
        if now >= self._next_check and self._check is None:
            self._next_check = now + MASTER_CHECK_S
            self._check = asyncio.get_running_loop().create_task(self._follow_master())
        conn: AbstractConnection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
        return conn

    async def _follow_master(self) -> None:
        try:
            # (closes idle connections if it moved)
            address = await self.get_master_address()  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
            for conn in list(self._in_use_connections):
                assert isinstance(conn, Connection)  # (a sentinel's are TCP: SentinelManagedConnection)
                if conn.is_connected and (conn.host, conn.port) != address:
                    conn.mark_for_reconnect()  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
        except (RedisError, OSError):
            pass  # (no primary known now: the commands' own connects say so)
        finally:
            self._check = None

    async def aclose(self) -> None:
        if self._check is not None:
            self._check.cancel()
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # -> TLS


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
    -th concurrent command on one node raises ``MaxConnectionsError``), it retries
    ``RETRIES`` times at once, refreshing the slot map in between, with no backoff, timeouts
    included (a stalled node: up to ``RETRIES + 1`` timeouts); a refused login is not retried
    there either (it matches retryable errors by exact type).

    ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>]``
    (``rediss+sentinel://`` for TLS to the sentinels and the data nodes; the sentinels' port
    defaults to 26379) gives a client of the primary of Redis Sentinel's ``<service>``, through
    redis-py's Sentinel support, with the settings of a plain URL. The user and password are
    the data nodes' (the sentinels are asked without); the query takes redis-py's URL options
    (``?ssl_ca_certs=...``). The sentinels are asked in turn, each within the timeout and
    without retries (the next one is the retry).

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
    pooled = dict(timeout=POOL_WAIT_S, retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError])
    if sep and scheme.lower() in SENTINEL_SCHEMES:
        return _sentinel_client(url, SENTINEL_SCHEMES[scheme.lower()], rest, {**common, **pooled})
    pool = aioredis.BlockingConnectionPool.from_url(url, **common, **pooled)
    pool.connection_class = _fd_connection(pool.connection_class)  # (the URL's: TCP, TLS, unix)
    return aioredis.Redis.from_pool(pool)


def _sentinel_client(url: str, tls: bool, rest: str, kwargs: ConnectionOptions) -> aioredis.Redis:
    parts = urlsplit(f"//{rest}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    try:
        sentinels = [_host_port(h) for h in hosts.split(",") if h]
    except ValueError as e:
        raise ValueError(f"Redis URL {url!r}: {e}") from None
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not sentinels or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"Redis URL {url!r}: give redis+sentinel://host[:port][,host[:port]...]/<service>[/<db>]"
        )
    options = dict(parse_url(f"redis://x/?{parts.query}"))  # (the query's options, typed)
    options.pop("host")
    user, _, password = userinfo.partition(":")
    tls_options = {k: v for k, v in options.items() if k.startswith("ssl_")}
    manager = Sentinel(
        sentinels,
        sentinel_kwargs=dict(
            socket_timeout=kwargs["socket_timeout"],
            socket_connect_timeout=kwargs["socket_connect_timeout"],
            socket_keepalive=True,
            protocol=2,
            **(dict(ssl=True, **tls_options) if tls else {}),
        ),
    )
    base = SentinelManagedSSLConnection if tls else SentinelManagedConnection
    client: aioredis.Redis = manager.master_for(
        path[0],
        redis_class=aioredis.Redis,
        connection_pool_class=_SentinelPool,
        connection_class=_fd_connection(base),
        **{
            **kwargs,
            "username": unquote(user) or None,
            "password": unquote(password) or None,
            "db": int(path[1]) if len(path) == 2 else 0,
            **options,  # (the query's win, as in redis-py's own URLs)
        },
    )
    return client


def _host_port(text: str) -> tuple[str, int]:
    at = urlsplit(f"//{text}")
    if not at.hostname:
        raise ValueError(f"no host in {text!r}")
    return at.hostname, at.port or SENTINEL_PORT
