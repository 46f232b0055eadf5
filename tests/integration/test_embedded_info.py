"""``INFO`` on the embedded server, through both doors: redis-cli and redis-py over TCP, and
the in-process client ``fd serve`` uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import redis

from fd.control.embedded import EmbeddedRedis


def _redis_cli() -> str:
    exe = shutil.which("redis-cli")
    if exe is None:
        pytest.fail("redis-cli is not on PATH; install it with `apt-get install redis-tools`", pytrace=False)
    return exe


def test_redis_cli_info_has_every_default_section(embedded_redis):
    out = subprocess.run(
        [_redis_cli(), "-p", str(embedded_redis.port), "INFO"], capture_output=True, text=True, timeout=10
    )
    assert out.returncode == 0, out.stderr
    headers = [line.strip() for line in out.stdout.splitlines() if line.startswith("# ")]
    assert headers == [
        "# Server",
        "# Clients",
        "# Memory",
        "# Persistence",
        "# Replication",
        "# Cpu",
        "# Keyspace",
    ]
    assert f"tcp_port:{embedded_redis.port}" in out.stdout.split()
    one = subprocess.run(
        [_redis_cli(), "-p", str(embedded_redis.port), "INFO", "memory"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert [ln for ln in one.stdout.splitlines() if ln.startswith("# ")] == ["# Memory"]


def test_info_keyspace_counts_live_keys_and_expires():
    with EmbeddedRedis() as server:  # (a store of its own: nothing else's keys come and go)
        r = redis.Redis(port=server.port, socket_timeout=5)
        try:
            assert r.info("keyspace") == {}
            r.set("a", "1", ex=100)
            r.xadd("s", {"f": "v"})
            r.set("gone", "1", px=1)
            time.sleep(0.01)
            assert r.info("keyspace")["db0"] == {"keys": 2, "expires": 1, "avg_ttl": 0}
        finally:
            r.close()


def test_redis_py_info_sections_over_tcp(embedded_redis):
    r = redis.Redis(port=embedded_redis.port, socket_timeout=5)
    try:
        server = r.info("server")
        assert server["redis_version"].startswith("7.") and server["redis_mode"] == "standalone"
        assert server["tcp_port"] == embedded_redis.port and server["process_id"] == os.getpid()
        assert server["uptime_in_seconds"] >= 0
        memory = r.info("memory")
        assert memory["used_memory"] > 1 << 20  # (a Python process: megabytes at the least)
        assert memory["used_memory_peak"] >= memory["used_memory_rss"] == memory["used_memory"]
        assert memory["maxmemory"] == 0 and memory["maxmemory_policy"] == "noeviction"
        assert r.info("clients")["connected_clients"] >= 1
        assert r.info("replication")["role"] == "master"
        assert r.info("nosuchsection") == {}
        both = r.info("server", "cpu")  # (Redis 7: several sections at once)
        assert "redis_version" in both and "used_cpu_user" in both and "used_memory" not in both
    finally:
        r.close()


async def test_info_in_process(embedded_redis):
    client = embedded_redis.client()
    try:
        info = await client.info("server")
        assert info["tcp_port"] == embedded_redis.port and info["fd_embedded"] == 1
        assert "used_memory" in await client.info()
    finally:
        await client.aclose()
