"""Shared fixtures: a real redis-server, the embedded server, and a Bus on each.

Every test gets its own key prefix, so tests share the two session-scoped servers without
seeing each other's keys. Clients are made inside the test's own event loop (a redis.asyncio
connection belongs to the loop that opened it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import settings

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.embedded import EmbeddedRedis
from fd.control.keys import Keys
from fd.engine.runner.process import tune
from tests.engine_fixtures import openai_client, served, tiny_model_dir, tiny_runner, tiny_tokenizer  # noqa: F401
from tests.real_model import smollm2_dir, smollm2_gguf, smollm2_reference, smollm2_runner, smollm2_tokenizer  # noqa: F401

# the settings fd's own processes run the model with; nothing above imports Paddle
tune()

# Property tests that do not fix their examples draw new ones each run here, where a failure is
# a find to keep (tests/test_scheduler_props.py found a harness gap that way); CI (CI=true)
# draws the same ones every time, so a landing is never decided by the draw.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    url: str
    port: int
    pid: int


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(tmpdir: str) -> tuple[subprocess.Popen, RedisServer]:
    """A throwaway redis-server on a free port; the caller kills it by pid."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(
            "redis-server is not on PATH; install it (e.g. `apt-get install redis-server`) "
            "-- the bus tests need a real Redis next to the embedded one",
            pytrace=False,
        )
    for _attempt in range(5):  # the free port can be taken between probing and binding
        port = free_port()
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                tmpdir,
                "--loglevel",
                "warning",
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return proc, RedisServer(f"redis://127.0.0.1:{port}", port, proc.pid)
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    log = os.path.join(tmpdir, "redis.log")
    tail = open(log, errors="replace").read()[-2000:] if os.path.exists(log) else ""
    pytest.fail(f"redis-server did not answer PING on a free port after 5 tries\n{tail}", pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    proc, server = start_redis_server(str(tmp_path_factory.mktemp("redis")))
    yield server
    os.kill(server.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.kill(server.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def embedded_redis():
    server = EmbeddedRedis(port=free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["real", "embedded"])
def redis_url(request) -> str:
    """The URL of each server in turn (the embedded one through its TCP port)."""
    if request.param == "real":
        return request.getfixturevalue("redis_server").url
    return request.getfixturevalue("embedded_redis").url


@pytest.fixture
def keys() -> Keys:
    return Keys(prefix=f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def redis_client(request, redis_url):
    """A client for each server in turn: TCP to the real Redis, and for the embedded server the
    in-process client that ``fd serve`` uses (its TCP door is tested on its own)."""
    if request.node.callspec.params["redis_url"] == "embedded":
        client = request.getfixturevalue("embedded_redis").client()
    else:
        client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def bus(redis_client, keys) -> Bus:
    return Bus(redis_client, keys)


@pytest.fixture
async def real_bus(redis_server, keys):
    client = connect(redis_server.url)
    yield Bus(client, keys)
    await client.aclose()
