"""Fixtures of tests/unit and tests/integration: the tiny and the default model, a real
redis-server (tests/kit/redis.py's launcher), the embedded server, and a Bus on each. Unit tests
take none of the servers (tests/unit/conftest.py holds them to it); they start on first use.

Every test gets its own key prefix, so tests share the two session-scoped servers without
seeing each other's keys. Clients are made inside the test's own event loop (a redis.asyncio
connection belongs to the loop that opened it).
"""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import settings

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.embedded import EmbeddedRedis
from fd.control.keys import Keys
from fd.engine.runner.process import tune
from tests.kit.real_model import (  # noqa: F401
    smollm2_dir,
    smollm2_gguf,
    smollm2_reference,
    smollm2_runner,
    smollm2_tokenizer,
)
from tests.kit.redis import RedisDidNotStart, RedisNotInstalled, RedisProcess, free_port, start_redis_server
from tests.kit.tiny_model import openai_client, served, tiny_model_dir, tiny_runner, tiny_tokenizer  # noqa: F401

# the settings fd's own processes run the model with; nothing above imports Paddle
tune()

# Property tests that do not fix their examples draw new ones each run here, where a failure is
# a find to keep (tests/unit/test_scheduler_props.py found a harness gap that way); CI (CI=true)
# draws the same ones every time, so a landing is never decided by the draw.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> RedisProcess:
    """The session's real redis-server (tests/kit/redis.py's launcher), killed by pid at the end."""
    try:
        server = start_redis_server(str(tmp_path_factory.mktemp("redis")))
    except (RedisNotInstalled, RedisDidNotStart) as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.stop()


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
