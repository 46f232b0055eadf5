"""fd.control.connect's client on a real redis-server: what its socket timeout does to a cancel,
and to a Redis that stops answering."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.connect import connect
from tests.kit.faults import Engines
from tests.kit.redis import start_redis_server


async def test_a_cancel_is_never_lost_whenever_it_comes_during_a_command(redis_server, keys):
    # A cancel at each turn of the event loop in turn, from before the command is written to
    # after its reply: once cancel() says it took, the task ends cancelled. (redis-py writes
    # under asyncio.wait_for when a socket timeout is set, and Python 3.11's wait_for returns
    # the result of a write that ended just before the cancel came: the cancel was lost.)
    client = connect(redis_server.url)
    try:
        await client.ping()  # (connected: every turn below is the command's own)
        ran_to_the_end = False
        for turns in range(10_000):
            task = asyncio.create_task(client.set(f"{keys.prefix}:c", str(turns)))
            for _ in range(turns):
                await asyncio.sleep(0)
            took = task.cancel()
            result = await asyncio.gather(task, return_exceptions=True)
            if took:
                assert task.cancelled(), (turns, result)
            else:
                ran_to_the_end = True  # (done before the cancel: nothing to lose)
                break
        assert ran_to_the_end  # every turn of a whole command was tried
    finally:
        await client.aclose()


@pytest.fixture
def paused_redis(tmp_path):
    """A redis-server of the test's own, which the test pauses with ``pause()`` (SIGSTOP: its
    sockets stay open and nothing answers) and ``resume()``s; resumed and killed at the end."""
    server = start_redis_server(str(tmp_path))
    paused = []

    def pause() -> None:
        os.kill(server.pid, signal.SIGSTOP)
        paused.append(True)

    def resume() -> None:
        if paused:
            os.kill(server.pid, signal.SIGCONT)
            paused.clear()

    server.pause, server.resume = pause, resume
    try:
        yield server
    finally:
        resume()
        server.kill()


async def test_a_new_request_to_a_paused_redis_is_a_503_within_one_timeout(
    paused_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """The API's answer to a request that arrives just after Redis stopped answering (SIGSTOP):
    the documented 503 after ``--redis-timeout``, not after one timeout per command its path
    makes (its stream reader is reading, so the request rings its doorbell first)."""
    timeout = 2.0
    factory = lambda: connect(paused_redis.url, timeout)  # noqa: E731
    engines = Engines(factory, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    api = None
    try:
        await engines.start("E")
        api = await start_api(
            factory, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
        )
        body = {"model": api.cfg.model_name, "prompt": "Once upon a time", "max_tokens": 2}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{api.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()  # (served: its stream reader is running)
            paused_redis.pause()
            t0 = time.monotonic()
            async with s.post(f"{api.url}/v1/completions", json=body) as r:
                status, answer = r.status, await r.json()
        waited = time.monotonic() - t0
        assert status == 503, answer
        assert answer["error"]["code"] == "service_unavailable"
        assert waited < 1.5 * timeout, waited
    finally:
        paused_redis.resume()
        if api is not None:
            await api.stop()
        await engines.stop_all()
