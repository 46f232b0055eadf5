"""Start-up comfort (issue #44, item 5): a busy port fails `fd serve` at once, before the model
loads; the context served is what the KV cache holds when no ``--max-model-len`` is given
(said once, no warning), and a ``--max-model-len`` the KV cache cannot hold is refused."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from fd.api.listen import hold_port
from fd.compose import start_engine
from fd.engine.node.node_config import EngineConfig, SchedulerSettings, engine_context
from tests.kit.redis import free_port

PY = sys.executable


def _env(tmp_path) -> dict:
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache"), "FD_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("FD_REDIS_URL", None)
    return env


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_busy_port_fails_the_start_before_the_model_loads(tmp_path, fmt):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        t0 = time.monotonic()
        r = subprocess.run(
            [PY, "-m", "fd", "serve", "--model", "tiny", "--port", str(port), "--log-format", fmt],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(tmp_path),
        )
        took = time.monotonic() - t0
    finally:
        busy.close()
    assert r.returncode != 0
    assert took < 10, took  # (python and fd's imports; the model's load alone is more)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert f"port {port}" in lines[0] and "in use" in lines[0]
    assert "Traceback" not in r.stderr
    # nothing of the model was touched: the tiny model (made on first use) was never made
    assert not (tmp_path / "cache").exists()


def test_hold_port_refuses_a_port_in_use_and_hands_a_free_one_over():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use"):
            hold_port("127.0.0.1", port)
    finally:
        listener.close()
    held = hold_port("127.0.0.1", 0)
    sock = held.take()
    assert sock is not None and held.socks == [] and sock.getsockname()[1] != 0
    sock.close()


def test_the_context_served_is_the_models_or_what_the_kv_cache_holds(caplog):
    with caplog.at_level(logging.INFO, logger="fd.engine"):
        assert engine_context(None, 8192, 5824) == 5824
        assert engine_context(None, 2048, 262144) == 2048
        assert engine_context(1024, 8192, 5824) == 1024
    said = [r.getMessage() for r in caplog.records]
    assert any("max_model_len 5824: what the KV cache holds" in m for m in said), said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(ValueError, match="--max-model-len 8192 is more than the KV cache holds .5824 tokens"):
        engine_context(8192, 8192, 5824)


async def test_an_engine_fits_its_context_to_the_kv_cache_and_refuses_more(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, caplog
):
    from fd.engine.runner.timed_runner import TimedRunner

    caplog.set_level(logging.INFO)
    runner = TimedRunner.for_tokenizer(tiny_tokenizer, step_ms=1, num_blocks=4)  # 64 tokens
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-fit"),
        runner=runner,
        tokenizer=tiny_tokenizer,
    )
    await eng.stop()
    assert eng.max_model_len == 64
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert any("max_model_len 64: what the KV cache holds" in r.getMessage() for r in caplog.records)
    runner = TimedRunner.for_tokenizer(tiny_tokenizer, step_ms=1, num_blocks=4)
    with pytest.raises(ValueError, match="--max-model-len 128 is more than the KV cache holds"):
        await start_engine(
            embedded_redis.client,
            keys,
            EngineConfig(
                model_dir=str(tiny_model_dir),
                engine_id="e-big",
                scheduler=SchedulerSettings(max_model_len=128),
            ),
            runner=runner,
            tokenizer=tiny_tokenizer,
        )


async def test_fd_serve_serves_what_its_kv_cache_holds_without_a_warning(tmp_path):
    """A default start (no --max-model-len) on a KV cache shorter than the model's context: no
    warning; the API's context is the engine's; an explicit larger one is a one-line error."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [PY, "-m", "fd", "serve", "--model", "tiny", "--port", str(port), "--num-blocks", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp_path),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        async with aiohttp.ClientSession() as http:
            while True:
                assert serve.poll() is None and time.monotonic() < deadline, "fd serve did not start"
                try:
                    async with http.get(f"{url}/v1/models") as r:
                        if r.status == 200:
                            models = await r.json()
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
    finally:
        if serve.poll() is None:
            os.kill(serve.pid, signal.SIGINT)
        out, _ = serve.communicate(timeout=30)
    assert serve.returncode == 0, out
    assert models["data"][0]["max_model_len"] == 128  # 8 blocks of 16
    assert "max_model_len 128: what the KV cache holds" in out
    assert "WARNING" not in out and "fewer than the context" not in out, out
    r = subprocess.run(
        [PY, "-m", "fd", "serve", "--model", "tiny", "--port", str(free_port()), "--num-blocks", "8"]
        + ["--max-model-len", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
    )
    assert r.returncode == 1
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert errors == [
        "fd serve: error: --max-model-len 1024 is more than the KV cache holds (128 tokens): give "
        "--max-model-len 128 or less, or more --num-blocks (vLLM refuses this too)"
    ], r.stderr
    assert "Traceback" not in r.stderr
