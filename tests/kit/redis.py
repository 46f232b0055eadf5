"""The one way the tests (and the benchmarks, through bench/_common.py) start a Redis process:
a real ``redis-server`` (or ``redis-sentinel``) on a free port, waited for until it answers
PING, killed by pid. No pytest here, so bench/ can use it too.

A missing executable is an error that says how to install it, never a skip: these tests exist
to run against the real thing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class RedisNotInstalled(RuntimeError):
    """``redis-server`` (or ``redis-sentinel``, ``redis-cli``) is not on PATH."""


class RedisDidNotStart(RuntimeError):
    """The process exited, or never answered PING."""


#: the Debian package that brings each executable
PACKAGES = {"redis-server": "redis-server", "redis-cli": "redis-tools", "redis-sentinel": "redis-sentinel"}


def executable(name: str = "redis-server") -> str:
    exe = shutil.which(name)
    if exe is None:
        raise RedisNotInstalled(
            f"{name} is not on PATH; install it (e.g. `apt-get install {PACKAGES.get(name, name)}`) "
            "-- the integration tests and benchmarks run a real Redis, they are never skipped"
        )
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, *, any_reply: bool = False) -> bool:
    """Whether a Redis on ``port`` answers PING (``any_reply``: answers at all, e.g. -NOAUTH
    from one that wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
            return bool(reply) if any_reply else reply.startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisProcess:
    """A running redis-server (or sentinel) this process started."""

    proc: subprocess.Popen
    port: int
    dir: str
    name: str = "redis"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def log(self, tail: int = 3000) -> str:
        path = os.path.join(self.dir, f"{self.name}.log")
        return open(path, errors="replace").read()[-tail:] if os.path.exists(path) else ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM by pid, SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # (a paused server cannot act on SIGTERM)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL by pid: what a crash looks like to its clients."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def server_argv(
    port: int, dir: str, *extra: str, name: str = "redis", loglevel: str = "warning"
) -> list[str]:
    """A throwaway redis-server's command line: loopback only, nothing saved, its log in
    ``dir/name.log``; ``extra`` options come last and win over these."""
    return [
        executable("redis-server"),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        dir,
        "--loglevel",
        loglevel,
        "--logfile",
        f"{name}.log",
        *extra,
    ]


def launch(
    argv_for_port: Callable[[int], Sequence[str]],
    dir: str,
    *,
    name: str = "redis",
    port: int | None = None,
    attempts: int = 5,
    timeout: float = 10.0,
    any_reply: bool = False,
) -> RedisProcess:
    """Starts ``argv_for_port(port)`` on a free port (again on another if that one was taken
    between probing and binding) or on ``port`` exactly, and waits until it answers PING."""
    for _attempt in range(1 if port is not None else attempts):
        p = port if port is not None else free_port()
        proc = subprocess.Popen(
            list(argv_for_port(p)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=dir
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if ping(p, any_reply=any_reply):
                return RedisProcess(proc, p, dir, name)
            time.sleep(0.02)
        RedisProcess(proc, p, dir, name).kill()
    where = f"port {port}" if port is not None else f"a free port after {attempts} tries"
    raise RedisDidNotStart(
        f"{name} did not answer PING on {where}\n{RedisProcess(proc, p, dir, name).log(2000)}"
    )


def start_redis_server(
    dir: str,
    *extra: str,
    name: str = "redis",
    port: int | None = None,
    loglevel: str = "warning",
    any_reply: bool = False,
) -> RedisProcess:
    """A throwaway redis-server (``extra``: more options, e.g. an append-only file or ACL
    users) with its files in ``dir``; the caller stops it (``.stop()`` / ``.kill()``)."""
    executable("redis-server")  # (missing: say so before trying ports)
    return launch(
        lambda p: server_argv(p, dir, *extra, name=name, loglevel=loglevel),
        dir,
        name=name,
        port=port,
        any_reply=any_reply,
    )
