"""``INFO`` on the embedded server (fakeredis has none): what ``redis-cli INFO``, redis-py's
``info()`` and a monitoring scrape read from a Redis, with the facts the embedded server has.

It answers the sections ``server``, ``clients``, ``memory``, ``persistence``, ``replication``,
``cpu`` and ``keyspace`` (any of them by name, several at once as Redis 7 takes them, or
``default``/``all``/``everything``; an unknown one gives nothing, as Redis). Numbers the
server does not keep (command counts, hit rates) are left out rather than made up. Memory is the
process's: the store lives in the process that runs ``fd serve``'s API and engine and has no
allocator of its own, so ``used_memory`` is that process's resident set (``used_memory_rss``
too) and ``used_memory_peak`` its peak; ``maxmemory`` is 0 (no limit: stories leave only by
their TTL, ``--request-ttl``).
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeAlias

import fakeredis

#: One value of INFO as redis-py's ``info()`` reads it: a number where it parses as one, a
#: ``db<n>`` line's ``a=1,b=2`` as a dict of them.
InfoValue: TypeAlias = int | float | str | dict[str, int | float | str]

#: The Redis the embedded server behaves as (``fakeredis.FakeServer(version=...)``), as INFO and
#: HELLO say it: what the bus is tested against on a real server too.
REDIS_VERSION = (7, 0, 0)

SECTIONS = ("server", "clients", "memory", "persistence", "replication", "cpu", "keyspace")


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n}B"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # (not Linux: the peak is what there is)
        return _peak_bytes()


def _peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (bytes on macOS, KiB on Linux)


class ServerInfo:
    """The facts one embedded server reports, rendered as Redis renders INFO."""

    def __init__(self, fake_server: fakeredis.FakeServer, port: int, tcp_clients: Callable[[], int]):
        self.fake_server = fake_server
        self.port = port
        self.tcp_clients = tcp_clients
        self.started = time.time()
        self.run_id = os.urandom(20).hex()

    def render(self, asked: Sequence[bytes]) -> bytes:
        names = [a.decode(errors="replace").lower() for a in asked] or ["default"]
        wanted: list[str] = []
        for name in names:
            for section in SECTIONS if name in ("default", "all", "everything") else (name,):
                if section in SECTIONS and section not in wanted:
                    wanted.append(section)
        parts = []
        for section in wanted:
            fields = getattr(self, f"_{section}")()
            body = "".join(f"{k}:{v}\r\n" for k, v in fields)
            parts.append(f"# {section.capitalize()}\r\n{body}")
        return "\r\n".join(parts).encode()

    def _server(self) -> list[tuple[str, object]]:
        uptime = int(time.time() - self.started)
        return [
            ("redis_version", ".".join(map(str, REDIS_VERSION))),
            ("redis_mode", "standalone"),
            ("os", f"{platform.system()} {platform.release()} {platform.machine()}"),
            ("arch_bits", 64 if sys.maxsize > 2**32 else 32),
            ("process_id", os.getpid()),
            ("run_id", self.run_id),
            ("tcp_port", self.port),
            ("uptime_in_seconds", uptime),
            ("uptime_in_days", uptime // 86400),
            ("executable", sys.executable),
            ("fd_embedded", 1),
            ("fakeredis_version", fakeredis.__version__),
        ]

    def _clients(self) -> list[tuple[str, object]]:
        return [("connected_clients", self.tcp_clients())]  # (the TCP door's; in-process ones aside)

    def _memory(self) -> list[tuple[str, object]]:
        rss = _rss_bytes()
        peak = max(rss, _peak_bytes())  # (the peak was sampled earlier than statm)
        return [
            ("used_memory", rss),
            ("used_memory_human", _human(rss)),
            ("used_memory_rss", rss),
            ("used_memory_rss_human", _human(rss)),
            ("used_memory_peak", peak),
            ("used_memory_peak_human", _human(peak)),
            ("maxmemory", 0),
            ("maxmemory_human", "0B"),
            ("maxmemory_policy", "noeviction"),
            ("mem_allocator", "python"),
        ]

    def _persistence(self) -> list[tuple[str, object]]:
        return [
            ("loading", 0),
            ("aof_enabled", 0),
            ("rdb_changes_since_last_save", 0),
            ("rdb_bgsave_in_progress", 0),
        ]

    def _replication(self) -> list[tuple[str, object]]:
        return [("role", "master"), ("connected_slaves", 0)]

    def _cpu(self) -> list[tuple[str, object]]:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return [("used_cpu_sys", f"{use.ru_stime:.6f}"), ("used_cpu_user", f"{use.ru_utime:.6f}")]

    def _keyspace(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for index in range(16):
            client = fakeredis.FakeRedis(server=self.fake_server, db=index)
            keys = client.dbsize()  # (what is past its TTL goes first)
            if keys:
                pipe = client.pipeline(transaction=False)
                for key in client.scan_iter(count=1000):
                    pipe.ttl(key)
                expires = sum(ttl >= 0 for ttl in pipe.execute())
                out.append((f"db{index}", f"keys={keys},expires={expires},avg_ttl=0"))
        return out


def parse_info(text: bytes) -> dict[str, InfoValue]:
    """INFO's text as redis-py's ``info()`` gives it: numbers as numbers, ``a=1,b=2`` as dicts."""
    out: dict[str, InfoValue] = {}
    for line in text.decode().splitlines():
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, value = line.split(":", 1)
        if "=" in value and key.startswith("db"):
            out[key] = {k: _number(v) for k, v in (kv.split("=", 1) for kv in value.split(","))}
        else:
            out[key] = _number(value)
    return out


def _number(v: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v
