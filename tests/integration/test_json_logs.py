"""Logs a shipper takes (issue #44, item 4): with ``--log-format json`` every line `fd serve`
writes, on stdout and stderr, its model worker's included, is one JSON object; an access line
per HTTP request (a 401 and a hang-up too, never a key); vLLM's throughput line while busy;
progress as records, never a ``\\r``; in text mode no bar off a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from fd.control.logs import JsonLines, StatsLine, _progress_records
from tests.kit.redis import free_port

PY = sys.executable
KEY = "sk-json-logs-secret-key"


def _spawn(*args: str, env: dict, merged: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "fd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> tuple[int, bytes, bytes]:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err or b""


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"fd serve exited early: {proc.returncode}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("never healthy")


def _env(tmp_path) -> dict:
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache"), "FD_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("FD_REDIS_URL", None)
    env.pop("FD_API_KEY", None)
    return env


async def _stream(
    http, url: str, body: dict, rid: str, hang_up_after_s: float | None = None, hang_up_after_chunks: int = 0
) -> int:
    """A streamed completion; with ``hang_up_after_s``, the connection is dropped then, or after
    ``hang_up_after_chunks`` chunks if those come first (a fast model must not finish first)."""
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": rid}
    t0 = time.monotonic()
    chunks = 0
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        async for _ in r.content:
            chunks += 1
            if hang_up_after_s is not None and (
                time.monotonic() - t0 > hang_up_after_s or chunks == hang_up_after_chunks
            ):
                r.close()  # (the client hangs up mid-stream)
                break
    return chunks


async def test_a_json_start_writes_only_json_lines(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = _spawn(
        "serve",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--log-format",
        "json",
        "--api-key",
        KEY,
        "--log-stats-interval",
        "0.5",
        env=_env(tmp_path),
    )
    try:
        await _wait_healthy(url, serve)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 401  # (no key)
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
            headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "jl-plain"}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            assert await _stream(http, url, streamed, "jl-stream") > 0
            long = {**body, "max_tokens": 1500, "ignore_eos": True, "stream": True}
            # (after a stats tick, 0.5 s, and well before the end: the tiny model streams its
            # 1,500 tokens in ~1.3 s on this project's 2-CPU machines, as ~1,360 chunks)
            await _stream(http, url, long, "jl-hangup", hang_up_after_s=0.7, hang_up_after_chunks=700)
        await asyncio.sleep(0.3)  # (the hang-up's access line is written as its handler ends)
    finally:
        code, out, err = _stop(serve)
    assert code == 0, err.decode(errors="replace")[-2000:]
    records = []
    for stream, raw in (("stdout", out), ("stderr", err)):
        assert b"\r" not in raw, f"a carriage return on {stream}"
        for line in raw.decode().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                pytest.fail(f"not JSON on {stream}: {line!r}")
            assert isinstance(rec, dict) and {"ts", "level", "msg"} <= rec.keys(), line
            records.append(rec)
    text = (out + err).decode()
    assert KEY not in text and "Bearer" not in text and "Authorization" not in text
    # the banner, on stdout, as a record that says where it serves
    banner = [r for r in map(json.loads, out.decode().splitlines()) if r.get("event") == "serving"]
    assert banner and banner[0]["url"] == f"{url}/v1"
    # the model worker logs through the same set-up: its GEMM plan line, and progress records
    worker = [r for r in records if r.get("process") == "fd-model-worker"]
    assert any("GEMMs" in r["msg"] for r in worker), worker
    progress = [r for r in records if r.get("event") == "progress"]
    assert progress and progress[-1]["done"] == progress[-1]["total"] == 21, progress
    access = {r.get("request_id"): r for r in records if r.get("event") == "access"}
    denied = [r for r in records if r.get("event") == "access" and r["status"] == 401]
    assert denied and denied[0]["path"] == "/v1/completions"
    plain = access["jl-plain"]
    assert (plain["method"], plain["path"], plain["status"], plain["completion_tokens"]) == (
        "POST",
        "/v1/completions",
        200,
        8,
    ), plain
    assert plain["prompt_tokens"] >= 1
    assert plain["latency_ms"] >= 0
    assert access["jl-stream"]["status"] == 200 and access["jl-stream"]["completion_tokens"] == 8
    assert access["jl-hangup"]["status"] == 499, access["jl-hangup"]
    stats = [r for r in records if r.get("event") == "stats"]
    assert stats, "no throughput line while a request ran"
    assert {"prompt_throughput", "generation_throughput", "running", "waiting", "kv_cache_usage"} <= (
        stats[0].keys()
    )
    assert any(r["generation_throughput"] > 0 for r in stats)
    assert "Avg generation throughput" in stats[0]["msg"]


async def test_text_mode_off_a_terminal_has_no_bars(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = _spawn("serve", "--model", "tiny", "--port", str(port), env=_env(tmp_path), merged=True)
    try:
        await _wait_healthy(url, serve)
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"X-Request-Id": "jl-text"}
            ) as r:
                assert r.status == 200
    finally:
        code, out, _ = _stop(serve)
    assert code == 0, out.decode(errors="replace")[-2000:]
    assert b"\r" not in out and b"loading weights" not in out  # (no tqdm bar on a pipe)
    text = out.decode()
    assert "fd serving tiny-llama on" in text
    line = next(ln for ln in text.splitlines() if "request_id=jl-text" in ln)
    assert '"POST /v1/completions HTTP/1.1" 200' in line and "completion_tokens=4" in line
    assert "GEMMs" in text  # (the worker's line, through fd's text format)


async def test_access_lines_are_vllms_flags_to_turn_off(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, caplog
):
    """On by default; ``--disable-access-log-for-endpoints`` leaves out the paths it names, and
    ``--disable-uvicorn-access-log`` every line."""
    from fd.api.config import ApiConfig
    from fd.compose import start_api

    cases = (
        ({}, {"/version", "/v1/models"}),
        ({"disable_access_log_for_endpoints": ("/version",)}, {"/v1/models"}),
        ({"disable_uvicorn_access_log": True}, set()),
    )
    for kw, logged in cases:
        caplog.clear()
        api = await start_api(
            embedded_redis.client,
            keys,
            ApiConfig(model_dir=str(tiny_model_dir), api_key=KEY, **kw),
            tokenizer=tiny_tokenizer,
        )
        try:
            with caplog.at_level(logging.INFO, logger="fd.access"):
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{api.url}/version") as r:
                        assert r.status == 200
                    async with http.get(
                        f"{api.url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}
                    ) as r:
                        assert r.status == 401
        finally:
            await api.stop()
        lines = [r for r in caplog.records if r.name == "fd.access"]
        assert {r.path for r in lines} == logged, kw
        assert all(KEY not in r.getMessage() and KEY not in str(vars(r)) for r in lines)
        assert all(r.status == (200 if r.path == "/version" else 401) for r in lines)


def test_the_stats_line_is_logged_only_while_busy(caplog):
    now = [0.0]
    line = StatsLine(logging.getLogger("t.stats"), clock=lambda: now[0])
    idle = dict(running=0, waiting=0, kv_usage=0.0, cache_queries=0, cache_hits=0)
    with caplog.at_level(logging.INFO, logger="t.stats"):
        now[0] = 10.0
        assert not line.tick(prompt_tokens=0, generation_tokens=0, **idle)  # nothing ran: quiet
        now[0] = 20.0
        busy = dict(idle, running=2, waiting=1, kv_usage=0.25, cache_queries=100, cache_hits=40)
        assert line.tick(prompt_tokens=100, generation_tokens=500, **busy)
        now[0] = 30.0
        assert line.tick(prompt_tokens=100, generation_tokens=600, **idle)  # ran in the interval
        now[0] = 40.0
        assert not line.tick(prompt_tokens=100, generation_tokens=600, **idle)
    recs = [r for r in caplog.records if r.name == "t.stats"]
    assert len(recs) == 2
    first = recs[0]
    assert first.getMessage() == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )
    assert (first.prompt_throughput, first.generation_throughput, first.prefix_cache_hit_rate) == (
        10.0,
        50.0,
        0.4,
    )
    assert recs[1].generation_throughput == 10.0 and recs[1].running == 0


def test_printed_lines_become_json_objects_and_json_passes_through():
    target = io.StringIO()
    lines = JsonLines(target, "stderr", "warning")
    lines.write("making the model ...\nhalf a ")
    lines.write("line\r10%|##  |\r")
    lines.write('{"ts": 1, "level": "info", "msg": "a child\'s record"}\n')
    lines.write("fd serve: error: port 1 is in use\n")
    lines.close_line()
    out = [json.loads(ln) for ln in target.getvalue().splitlines()]
    assert [r["msg"] for r in out] == [
        "making the model ...",
        "half a line",
        "10%|##  |",
        "a child's record",
        "fd serve: error: port 1 is in use",
    ]
    assert out[0]["level"] == "warning" and out[0]["logger"] == "stderr"
    assert out[3] == {"ts": 1, "level": "info", "msg": "a child's record"}
    assert out[4]["level"] == "error"
    assert "\r" not in target.getvalue()


def test_progress_records_come_at_the_start_the_end_and_a_steady_rate(caplog, monkeypatch):
    import fd.control.logs as logs

    t = [0.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: t[0])
    with caplog.at_level(logging.INFO, logger="fd.progress"):
        for _i in _progress_records(range(100), "loading weights", 100):
            t[0] += 0.05  # 5 s in all: a record about every PROGRESS_EVERY_S
    recs = [r for r in caplog.records if r.name == "fd.progress"]
    assert all(r.event == "progress" and r.what == "loading weights" and r.total == 100 for r in recs)
    done = [r.done for r in recs]
    assert done[0] == 0 and done[-1] == 100 and done == sorted(done)
    assert 5 <= len(recs) <= 8, done
