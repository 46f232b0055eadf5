"""The command line as an operator uses it: real processes, a real redis-server, redis-cli."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.kit.processes import spawn_fd, stop_fd, wait_healthy
from tests.kit.redis import free_port

PY = sys.executable

#: A streamed request long enough to be running when a test cuts something under it.
LONG = {
    "model": "tiny-llama",
    "prompt": "Hi",
    "max_tokens": 1500,
    "temperature": 0,
    "stream": True,
    "ignore_eos": True,
}


def _fd(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "fd", *args], capture_output=True, text=True, timeout=120, **kw)


def _redis_cli() -> str:
    exe = shutil.which("redis-cli")
    if exe is None:
        pytest.fail("redis-cli is not on PATH; install it with `apt-get install redis-tools`", pytrace=False)
    return exe


async def _stream_until_final(http, url, body, rid):
    text, reason = "", None
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                obj = json.loads(line[5:])
                for c in obj.get("choices") or []:
                    text += c["text"]
                    reason = c["finish_reason"] or reason
    return text, reason


async def test_split_deployment_operator_commands(redis_server, keys, tmp_path):
    model = tmp_path / "tiny"
    r = _fd("make-tiny-model", str(model))
    assert r.returncode == 0, r.stderr
    assert (model / "config.json").exists() and (model / "tokenizer.json").exists()
    # Room for a request that outlasts `fd abort`'s own start (~0.8 s of imports): the tiny
    # model streams its 2,048 positions in about 1.5 s.
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    url, prefix, port = redis_server.url, keys.prefix, free_port()
    common = ("--redis-url", url, "--prefix", prefix)
    engine = spawn_fd(
        "engine",
        *common,
        "--model",
        str(model),
        "--engine-id",
        "cli-e1",
        "--kv-cache-mb",
        "16",
        "--log-format",
        "json",
    )
    api = spawn_fd("api", *common, "--model", str(model), "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, [engine, api])
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{base}/v1/completions",
                json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
            ) as resp:
                body = await resp.json()
            assert resp.status == 200, body
            assert body["usage"]["completion_tokens"] == 8
            rid_done = body["id"]
            async with http.post(
                f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "n": 2}
            ) as resp:
                rid_two = (await resp.json())["id"]

            # an operator aborts a long request by hand with redis-cli
            long = {
                "model": "tiny",
                "prompt": "Go on",
                "max_tokens": 12000,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            task = asyncio.create_task(_stream_until_final(http, base, long, "by-hand"))
            await asyncio.sleep(0.5)
            xadd = subprocess.run(
                [
                    _redis_cli(),
                    "-p",
                    str(redis_server.port),
                    "XADD",
                    f"{prefix}:control",
                    "*",
                    "type",
                    "abort",
                    "request_id",
                    "by-hand",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            )
            assert xadd.returncode == 0, xadd.stderr
            text, reason = await asyncio.wait_for(task, 30)
            assert reason == "abort" and text

            # `fd abort` does the same from a shell
            task = asyncio.create_task(_stream_until_final(http, base, long, "by-cli"))
            await asyncio.sleep(0.5)
            r = _fd("abort", "by-cli", *common, "--json")
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["accepted"] == ["by-cli"]
            _, reason = await asyncio.wait_for(task, 30)
            assert reason == "abort"

        r = _fd("trace", "by-cli", *common, "--json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        kinds = [row["type"] for row in rows if row["type"] != "tokens"]
        assert kinds == ["accepted", "claimed", "abort_requested", "drained", "blocks_released", "final"]
        assert next(row for row in rows if row["type"] == "abort_requested")["source"] == "cli"
        r = _fd("trace", rid_done, *common)
        assert r.returncode == 0 and "final" in r.stdout and "finish_reason=length" in r.stdout
        r = _fd("trace", rid_two, *common, "--json")  # a response of two choices: theirs too
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        assert [row["request_id"] for row in rows if row["type"] in ("accepted", "final")] == [
            rid_two,
            f"{rid_two}.0",
            f"{rid_two}.0",
            f"{rid_two}.1",
            f"{rid_two}.1",
        ]

        for _ in range(20):  # the heartbeat refreshes once a second
            r = _fd("status", *common, "--json")
            assert r.returncode == 0, r.stderr
            st = json.loads(r.stdout)
            e1 = st["engines"]["cli-e1"]
            if e1["blocks_free"] == e1["blocks_total"]:
                break
            await asyncio.sleep(0.3)
        assert e1["blocks_free"] == e1["blocks_total"] and e1["running"] == "0"
        assert st["requests_pending"] == 0

        out = tmp_path / "journal.jsonl"
        r = _fd("events", "export", "--out", str(out), *common)
        assert r.returncode == 0, r.stderr + r.stdout
        assert out.stat().st_size > 0
        r = _fd("replay", "--engine", "cli-e1", *common)
        assert r.returncode == 0, r.stdout + r.stderr
        r = _fd("replay", str(out), "--html", str(tmp_path / "t.html"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert (tmp_path / "t.html").read_text().count("<svg") >= 1
    finally:
        code_api, out_api = stop_fd(api)
        code_engine, out_engine = stop_fd(engine)
    assert code_api == 0, out_api
    assert code_engine == 0, out_engine
    # --log-format json: every log line the engine wrote is one JSON object
    lines = [ln for ln in out_engine.splitlines() if ln.startswith("{")]
    assert lines and all(isinstance(json.loads(ln), dict) for ln in lines)


async def test_fd_serve_embedded_as_a_new_user(tmp_path):
    """`fd serve --model tiny`: the tiny model is made on first use, the embedded control
    plane answers redis-cli, Ctrl-C exits cleanly. (`fd serve` with no --model at all serves
    the real default model: tests/integration/test_real_model.py.)"""
    port, rport = free_port(), free_port()
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache"), "FD_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("FD_REDIS_URL", None)
    serve = spawn_fd("serve", "--model", "tiny", "--port", str(port), "--embedded-port", str(rport), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, [serve], timeout=90)
        # the operator's commands on this machine find it with no URL
        status = _fd("status", env=env)
        assert status.returncode == 0, status.stderr
        assert "engine" in status.stdout.lower(), status.stdout
        ping = subprocess.run(
            [_redis_cli(), "-p", str(rport), "PING"], capture_output=True, text=True, timeout=10
        )
        assert ping.stdout.strip() == "PONG"
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(_stream_until_final(http, base, LONG, "embedded-1"))
            await asyncio.sleep(0.5)
            subprocess.run(
                [
                    _redis_cli(),
                    "-p",
                    str(rport),
                    "XADD",
                    "fd:control",
                    "*",
                    "type",
                    "abort",
                    "request_id",
                    "embedded-1",
                ],
                check=True,
                capture_output=True,
                timeout=10,
            )
            text, reason = await asyncio.wait_for(task, 30)
            assert reason == "abort"
            n = subprocess.run(
                [_redis_cli(), "-p", str(rport), "XLEN", "fd:req:{embedded-1}"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            assert int(n.stdout) >= 6
    finally:
        code, out = stop_fd(serve, signal.SIGINT)
    assert code == 0, out
    assert "embedded control plane: redis-cli -p" in out
    assert f"FD_REDIS_URL=redis://127.0.0.1:{rport}" in out
    gone = _fd("status", env=env)  # (its record went with it)
    assert gone.returncode != 0 and "no fd serve with key prefix 'fd' is running" in gone.stderr
    assert not list((tmp_path / "run").glob("*.json"))


def _children(pid: int, marker: bytes) -> list[int]:
    """Child processes of ``pid`` whose command line contains ``marker`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and marker in cmd:
            out.append(int(entry))
    return out


async def test_fd_serve_worker_cpus_auto_places_the_worker_by_the_cpus_there_are(tmp_path):
    """Two CPUs: the worker on both at nice +10 against fd serve, or (its GEMMs no faster on
    two threads) on the last alone with fd serve on the other; more: all but the first, which
    fd serve keeps."""
    port = free_port()
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache")}
    serve = spawn_fd("serve", "--model", "tiny", "--port", str(port), "--worker-cpus", "auto", env=env)
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", [serve], timeout=90)
        cpus = os.sched_getaffinity(0)
        workers = _children(serve.pid, b"spawn_main")
        assert len(workers) == 1
        nice = os.getpriority(os.PRIO_PROCESS, workers[0]) - os.getpriority(os.PRIO_PROCESS, serve.pid)
        worker_cpus = os.sched_getaffinity(workers[0])
        serve_cpus = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{serve.pid}/task")}
        if len(cpus) == 2:
            assert (worker_cpus, nice, serve_cpus) in (
                (cpus, 10, {frozenset(cpus)}),
                ({max(cpus)}, 0, {frozenset(cpus - {max(cpus)})}),
            )
        elif len(cpus) > 2:
            assert (worker_cpus, nice, serve_cpus) == (cpus - {min(cpus)}, 0, {frozenset({min(cpus)})})
        else:
            print(f"NOTE: one CPU here ({cpus}): --worker-cpus auto pins nothing; not checked")
            assert worker_cpus == cpus
    finally:
        code, out = stop_fd(serve)
    assert code == 0, out


def test_fd_serve_refuses_a_worker_cpu_it_cannot_have():
    r = _fd("serve", "--worker-cpus", "4096")
    assert r.returncode != 0
    assert "--worker-cpus 4096: CPUs [4096] are not among this process's CPUs" in r.stderr


async def test_fd_serve_whose_model_worker_dies_says_so_and_exits(tmp_path):
    """The model worker killed under a streaming request: `fd serve` says what died, closes
    the stream within a moment instead of keeping it open with keep-alives for a minute, and
    exits 1."""
    port = free_port()
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache")}
    serve = spawn_fd("serve", "--model", "tiny", "--port", str(port), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, [serve], timeout=90)
        workers = _children(serve.pid, b"spawn_main")
        assert workers, "no model worker process found"
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(_stream_until_final(http, base, LONG, "orphaned-1"))
            await asyncio.sleep(0.5)
            for w in workers:
                os.kill(w, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(aiohttp.ClientError):  # the stream is cut: no final can come
                await asyncio.wait_for(task, 30)
            assert time.monotonic() - t0 < 10
        serve.wait(timeout=20)
    finally:
        code, out = stop_fd(serve)
    assert code == 1, out
    assert "the model worker died" in out


def test_start_up_mistakes_are_one_line_errors(tmp_path):
    r = _fd("serve", "--model", str(tmp_path / "nowhere"))
    assert r.returncode != 0 and "is not a model directory" in r.stderr
    assert "Traceback" not in r.stderr
    r = _fd("serve", "--model", "tiny", "--max-model-len", "1000000", "--port", str(free_port()))
    assert r.returncode == 1 and "--max-model-len 1000000 must be between 2 and the model's" in r.stderr
    assert "Traceback" not in r.stderr
    port = free_port()  # nothing listens there
    r = _fd("status", "--redis-url", f"redis://127.0.0.1:{port}")
    assert r.returncode == 1 and r.stderr.startswith("fd status: error:")
    assert "Traceback" not in r.stderr
    r = _fd("abort", "bad{id}", "--redis-url", f"redis://127.0.0.1:{port}")
    assert r.returncode != 0 and "invalid request id" in r.stderr


async def test_servers_run_full_collections_on_a_timer_not_on_heap_growth():
    """A full collection walks every live container (with the embedded server, every stored
    stream entry): `fd serve/api/engine` run them every FULL_GC_EVERY_S instead of whenever
    Python's growth rule fires in the middle of a burst."""
    import gc

    from fd.cli import serving as cli_serving

    before = gc.get_threshold()
    try:
        cli_serving._tune_gc()
        assert gc.get_threshold()[:2] == before[:2]  # young generations as Python has them
        assert gc.get_threshold()[2] >= 1 << 30  # no automatic full collection
        assert gc.get_freeze_count() > 0  # start-up's objects out of the collector's sight
        assert cli_serving._gc_task is not None and not cli_serving._gc_task.done()
    finally:
        if cli_serving._gc_task is not None:
            cli_serving._gc_task.cancel()
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_vllm_command_line_runs_here():
    """`vllm serve MODEL` with the flags people paste: the model as the first argument, flags
    that mean nothing here taken and named at start, the ones fd cannot honour refused."""
    from fd.cli.args import vllm_compat
    from fd.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "/models/qwen",
            "--trust-remote-code",
            "--dtype",
            "auto",
            "-tp",
            "1",
            "--enforce-eager",
            "--enable-chunked-prefill",
            "--enable-prefix-caching",
            "--gpu-memory-utilization",
            "0.9",
            "--disable-log-requests",
            "--port",
            "8001",
        ]
    )
    notes = vllm_compat(args)
    assert args.model == "/models/qwen" and args.port == 8001
    assert [n.split(" ")[0] for n in notes] == [
        "--trust-remote-code",
        "--enforce-eager",
        "--enable-chunked-prefill",
        "--disable-log-requests",
        "--gpu-memory-utilization",
    ]
    assert vllm_compat(build_parser().parse_args(["serve"])) == []  # (nothing pasted: nothing said)
    for argv, says in (
        (["serve", "-tp", "2"], "one device"),
        (["serve", "m1", "--model", "m2"], "given twice"),
        (["serve", "--enable-prefix-caching", "--no-enable-prefix-caching"], "together"),
        (["engine", "--device", "gpu", "--gpu-memory-utilization", "0.9"], "--kv-cache-mb"),
    ):
        with pytest.raises(SystemExit, match=says):
            vllm_compat(build_parser().parse_args(argv))
    with pytest.raises(SystemExit):  # not a dtype: argparse names the choices
        build_parser().parse_args(["serve", "--dtype", "int3"])


async def test_fd_serve_api_server_count_spreads_connections_over_api_processes(tmp_path, redis_server):
    """vLLM's --api-server-count: more API processes on the same port (SO_REUSEPORT), each an
    API node of the same control plane; the stories' `accepted` events name which one took
    each request. On the embedded server (through its TCP door) and on a real Redis; every
    API process goes when fd serve does."""
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache")}
    for extra in ([], ["--redis-url", redis_server.url, "--prefix", "apis"]):
        port, rport = free_port(), free_port()
        serve = spawn_fd(
            "serve",
            "--model",
            "tiny",
            "--port",
            str(port),
            "--embedded-port",
            str(rport),
            "--api-server-count",
            "3",
            *extra,
            env=env,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base, [serve], timeout=90)
            apis = _children(serve.pid, b"spawn_main")
            assert len(apis) == 3  # the model worker and two API processes
            prefix = "apis" if extra else "fd"
            cli = [_redis_cli(), *(["-u", redis_server.url] if extra else ["-p", str(rport)])]
            taken: set[str] = set()
            deadline = time.monotonic() + 30  # (/health answers before the other processes listen)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                k = 0
                while len(taken) < 3 and time.monotonic() < deadline:
                    k += 1  # (a new connection each: the kernel picks a process for each)
                    async with http.post(
                        f"{base}/v1/completions",
                        json={"prompt": "Hi", "max_tokens": 2},
                        headers={"X-Request-Id": f"spread-{k}"},
                    ) as r:
                        assert r.status == 200
                        rid = (await r.json())["id"]
                    first = subprocess.run(
                        [*cli, "XRANGE", f"{prefix}:req:{{{rid}}}", "-", "+", "COUNT", "1"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout.split()
                    taken.add(first[first.index("api") + 1])
            assert len(taken) == 3, taken
        finally:
            code, out = stop_fd(serve, signal.SIGINT)
        assert code == 0, out
        for pid in apis:  # none outlives fd serve
            assert (
                not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
            )


def test_fd_alone_prints_its_help_and_fd_version_its_version():
    alone = _fd()
    assert alone.returncode == 0 and "usage: fd" in alone.stdout and "serve" in alone.stdout
    assert not alone.stderr.strip()
    version = _fd("--version")
    assert version.returncode == 0 and version.stdout.startswith("fd ")


def test_fd_replay_of_a_missing_file_says_so_in_one_line(tmp_path):
    r = _fd("replay", str(tmp_path / "nowhere.jsonl"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: cannot read {tmp_path / 'nowhere.jsonl'}: No such file or directory"
