"""A Redis Sentinel deployment of the test's own: a primary, a replica of it and one sentinel
(quorum 1, a primary it cannot reach for 1 s is down), each a real process on a free port,
killed by pid when the test ends."""

from __future__ import annotations

import os
import time
from pathlib import Path

import redis

from tests.kit.redis import RedisProcess, executable, launch, server_argv

SERVICE = "mymaster"


class SentinelSet:
    def __init__(self, tmpdir: str):
        self.dir = tmpdir
        self.servers: dict[str, RedisProcess] = {}
        self.ports: dict[str, int] = {}

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, argv_for_port) -> None:
        """Starts ``name`` on a free port (tests/kit/redis.py's launcher)."""
        self.servers[name] = launch(argv_for_port, self.dir, name=name)
        self.ports[name] = self.servers[name].port

    def _server_argv(self, name: str, port: int, *extra: str) -> list[str]:
        # (no diskless-sync delay: a replica is in sync a moment after it starts, not 5 s later)
        return server_argv(
            port,
            self.dir,
            "--repl-diskless-sync-delay",
            "0",
            "--dbfilename",
            f"{name}.rdb",
            *extra,
            name=name,
            loglevel="notice",
        )

    def _sentinel_argv(self, port: int) -> list[str]:
        conf = os.path.join(self.dir, "sentinel.conf")  # (sentinel rewrites it: its own file)
        with open(conf, "w") as f:
            f.write(
                f"port {port}\n"
                "bind 127.0.0.1\n"
                f"dir {self.dir}\n"
                "logfile sentinel.log\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['primary']} 1\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
            )
        return [executable("redis-sentinel"), conf]

    def start(self) -> SentinelSet:
        executable("redis-sentinel")  # (missing: say so before starting anything)
        self._spawn("primary", lambda p: self._server_argv("primary", p))
        self._spawn(
            "replica",
            lambda p: self._server_argv("replica", p, "--replicaof", "127.0.0.1", str(self.ports["primary"])),
        )
        self._until(
            lambda: self.direct("replica").info("replication").get("master_link_status") == "up",
            "the replica in sync with the primary",
        )
        self._spawn("sentinel", self._sentinel_argv)
        # A failover needs a replica the sentinel has heard from and finds linked to its primary.
        self._until(
            lambda: any(
                r.get("master-link-status") == "ok" and "s_down" not in r.get("flags", "")
                for r in self.sentinel().sentinel_slaves(SERVICE)
            ),
            "the sentinel seeing the replica",
        )
        return self

    def stop(self) -> None:
        for server in self.servers.values():
            server.kill()

    # ------------------------------------------------------------------ looking

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.ports['sentinel']}/{SERVICE}"

    def direct(self, name: str, db: int = 0) -> redis.Redis:
        """A plain client of one server (by its role at start: ``primary`` or ``replica``)."""
        return redis.Redis(port=self.ports[name], db=db, socket_timeout=5)

    def sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.ports["sentinel"], socket_timeout=5, decode_responses=True)

    def primary_port(self) -> int:
        """The primary's port as clients learn it (``SENTINEL MASTERS``, which names the new
        one once the failover has ended; ``GET-MASTER-ADDR-BY-NAME`` names it earlier)."""
        return int(self.sentinel().sentinel_masters()[SERVICE]["port"])

    def _until(self, pred, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if pred():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        out = []
        for name in ("primary", "replica", "sentinel"):
            path = os.path.join(self.dir, f"{name}.log")
            if os.path.exists(path):
                out.append(f"--- {name}.log\n" + Path(path).read_text(errors="replace")[-3000:])
        return "\n".join(out)

    # ------------------------------------------------------------------ faults

    def failover(self) -> None:
        """What an operator's ``SENTINEL FAILOVER`` does: the replica is promoted while the old
        primary stays up (the sentinel turns it into a replica some 10 s later)."""
        assert self.sentinel().execute_command("SENTINEL", "FAILOVER", SERVICE)

    def kill_primary(self) -> None:
        """The primary dies (SIGKILL); the sentinel finds it down after 1 s and fails over."""
        self.servers["primary"].kill()

    def wait_promoted(self, timeout: float = 20.0) -> None:
        """Until the sentinel tells clients the replica is the primary."""
        self._until(lambda: self.primary_port() == self.ports["replica"], "the failover", timeout)
