"""A real 3-master Redis Cluster of a module's own: each master started by tests/kit/redis.py's
launcher, joined with ``redis-cli --cluster create``, killed by pid when the module ends."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.kit.redis import (
    RedisDidNotStart,
    RedisNotInstalled,
    RedisProcess,
    executable,
    free_port,
    launch,
    server_argv,
)

MASTERS = 3


def _start_cluster(tmpdir: str, servers: list[RedisProcess]) -> list[int]:
    cli = executable("redis-cli")
    for i in range(MASTERS):
        servers.append(
            launch(
                lambda p, i=i: server_argv(
                    p,
                    tmpdir,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-config-file",
                    f"nodes-{i}.conf",
                    name=f"redis-{i}",
                ),
                tmpdir,
                name=f"redis-{i}",
            )
        )
    ports = [s.port for s in servers]
    deadline = time.monotonic() + 10
    subprocess.run(
        [
            cli,
            "--cluster",
            "create",
            *[f"127.0.0.1:{p}" for p in ports],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    while True:
        infos = [
            subprocess.run(
                [cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True, timeout=5
            ).stdout
            for p in ports
        ]
        if all("cluster_state:ok" in i for i in infos):
            return ports
        if time.monotonic() > deadline + 20:
            raise RedisDidNotStart(f"cluster_state never became ok: {infos[0][:200]}")
        time.sleep(0.05)


def _kill(servers: list[RedisProcess]) -> None:
    for s in servers:
        s.kill()
    servers.clear()


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    servers: list[RedisProcess] = []
    try:
        for attempt in range(3):  # a free (cluster bus) port can be taken between probing and binding
            tmpdir = str(tmp_path_factory.mktemp(f"cluster{attempt}"))
            try:
                ports = _start_cluster(tmpdir, servers)
                break
            except RedisNotInstalled as e:
                pytest.fail(f"{e} (redis-tools brings redis-cli)", pytrace=False)
            except (RedisDidNotStart, subprocess.SubprocessError) as e:
                _kill(servers)
                error = e
        else:
            pytest.fail(f"could not start a {MASTERS}-master Redis Cluster: {error}", pytrace=False)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        _kill(servers)
