"""Which failures of a Redis call are an outage to ride out, and which are about one command.

Redis says "not now" in two ways: by going away (a refused or dropped connection, a timeout)
and by replying with an error while it stays up. The replies below are the second kind: the
server is alive but will not take this command now (out of memory under ``noeviction``, a
replica after a failover, a failed RDB save, a long script, an AOF being loaded, a cluster
that lost a slot, a script cache emptied by a restart). Each passes by itself or by an
operator's hand, and nothing about the command was wrong, so every node treats them as it
treats a lost connection: keep its state, retry in order with backoff, say so once.

Any other error reply (``WRONGTYPE`` on a key an operator overwrote, a command the server does
not know) is about the command, not the server: retrying it gets the same answer. Those are
refusals, logged with the command, and they end only the request they concern.
"""

from __future__ import annotations

from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: The error replies redis-py has a class for (it strips their prefix from the message).
_NOT_NOW_TYPES = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    ClusterDownError,  # MASTERDOWN too (a subclass)
    TryAgainError,
    NoScriptError,
)
#: Their prefixes as a server sends them (a script's error keeps its command's prefix), and
#: those redis-py has no class for.
_NOT_NOW_PREFIXES = (
    "MISCONF",  # a failed RDB save with stop-writes-on-bgsave-error
    "BUSY",  # a script past busy-reply-threshold
    "NOREPLICAS",  # min-replicas-to-write not met
    "UNBLOCKED",  # a blocked read cut when the server turns replica
    "LOADING",
    "READONLY",
    "OOM",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "MASTERDOWN",
)

#: What to catch around a Redis call; :func:`is_outage` then says which of the two it is.
REDIS_FAILURES = (RedisError, OSError)


def is_outage(e: BaseException) -> bool:
    """Whether ``e`` says the server cannot take commands now (gone, stalled, or replying
    "not now"), not that the command was wrong."""
    if isinstance(e, (RedisConnectionError, RedisTimeoutError, OSError, _NOT_NOW_TYPES)):
        return True
    if isinstance(e, ResponseError):
        return str(e).split(" ", 1)[0] in _NOT_NOW_PREFIXES
    return False


def reason(e: BaseException) -> str:
    """A short line for logs and ``/health``: the reply's class and text."""
    text = str(e) or type(e).__name__
    codes: dict[type[BaseException], str] = {
        OutOfMemoryError: "OOM",
        ReadOnlyError: "READONLY",
        BusyLoadingError: "LOADING",
        TryAgainError: "TRYAGAIN",
        NoScriptError: "NOSCRIPT",
    }
    code = codes.get(type(e))
    if code is None and isinstance(e, ClusterDownError):
        code = "CLUSTERDOWN"
    return f"{code} {text}" if code and not text.startswith(code) else text


def kind(e: BaseException) -> str:
    """What sort of failure ``e`` is, the same for every command it meets: the reply's code
    (``OOM``, ``READONLY``, ...) or the exception's class. An outage is logged once a kind."""
    code = reason(e).split(" ", 1)[0]
    return code if code.isupper() else type(e).__name__
