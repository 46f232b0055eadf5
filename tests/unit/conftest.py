"""tests/unit: pure tests, seconds in all. No Redis (real or embedded), no subprocess, no
network; the tiny model made in a temp dir is fine. A unit test that asks for a server fails
here and belongs in tests/integration."""

from __future__ import annotations

import pytest

#: the fixtures that start a server (or an engine on one): integration's alone
SERVERS = frozenset(
    {
        "redis_server",
        "embedded_redis",
        "redis_url",
        "redis_client",
        "bus",
        "real_bus",
        "served",
        "openai_client",
        "engines",
        "cluster_url",
    }
)


@pytest.fixture(autouse=True)
def _no_servers(request) -> None:
    used = sorted(SERVERS & set(request.fixturenames))
    assert not used, f"a unit test starts no server ({', '.join(used)}): it belongs in tests/integration"
