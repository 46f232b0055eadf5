"""Redis outages and stuck requests.

The outage test runs its own redis-server (append-only file, fsync'ed per write) and restarts
it on the same port in the middle of a streamed request: the engine keeps its state, retries,
and publishes what it held back in order and exactly once; the API answers 503 meanwhile and
recovers by itself; the open client stream resumes and ends complete."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import AbortRequested, Tokens
from fd.control.sampling import SamplingParams
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, tokens_of, types
from tests.kit.faults import Engines, OwnRedis, all_blocks_free, stream_completion, wait_for

PROMPT = [5, 17, 33, 9, 41, 12, 7, 19]


async def test_redis_restart_mid_stream(tmp_path, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    redis = OwnRedis(str(tmp_path))
    redis.start()
    engines = Engines(redis.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis.url), keys)
    api = None
    try:
        eng = await engines.start("E", delay=0.03)
        api = await start_api(
            lambda: connect(redis.url),
            keys,
            ApiConfig(model_dir=str(tiny_model_dir)),
            tokenizer=tiny_tokenizer,
        )
        prompt = "Once upon a time"
        ids = tiny_tokenizer.encode(prompt)
        ref = LLM(tiny_runner, tiny_tokenizer).generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        )[0]
        body = {
            "model": api.cfg.model_name,
            "prompt": prompt,
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
        }
        client = asyncio.create_task(stream_completion(api.url, body, {"X-Request-Id": "s1"}))
        await wait_for(lambda: eng.node.sched.knows("s1") and eng.node.steps > 5, what="s1 decoding")
        redis.stop()
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{api.url}/v1/completions", json={**body, "max_tokens": 2}) as r:
                assert r.status == 503
                err = (await r.json())["error"]
                assert err["code"] == "service_unavailable" and "Redis" in err["message"]
        assert time.monotonic() - t0 < 15
        steps = eng.node.steps
        await asyncio.sleep(0.5)
        redis.start()  # same port, same append-only file
        result = await asyncio.wait_for(client, 60)
        assert result["status"] == 200 and result["done"] and not result["errors"]
        assert result["text"] == ref.text and result["finish_reason"] == "length"
        assert eng.node.steps > steps
        evs = await story(bus, "s1")
        assert tokens_of(evs) == ref.token_ids  # nothing repeated, nothing lost
        assert types(evs).count("final") == 1 and types(evs)[-1] == "final"
        # and the API serves new requests again, on its own
        again = await stream_completion(api.url, {**body, "max_tokens": 5})
        assert again["done"] and again["finish_reason"] == "length"
        await all_blocks_free(eng.node)
        report = replay(await load_journal_from_redis(bus, "E"))
        assert report.divergence is None and not report.analysis.violations
    finally:
        if api is not None:
            await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()
        redis.stop()


@pytest.fixture
async def engines(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    e = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    yield e
    await e.stop_all()


async def test_request_without_progress_times_out_with_an_error(real_bus, engines):
    eng = await engines.start("E", gated=True, request_timeout_s=0.3)
    gate = engines.gates["E"]
    await submit(real_bus, "ok", PROMPT, max_tokens=5)
    assert (await story(real_bus, "ok"))[-1].finish_reason == "length"  # progress: no timeout
    gate.close()  # the next step hangs ...
    await submit(real_bus, "stuck", PROMPT, max_tokens=50, ignore_eos=True)
    await gate.wait_entered(lambda out: any(s.request_id == "stuck" for s in out.seqs))
    evs = await story(real_bus, "stuck", until=AbortRequested)  # ... and the watchdog notices
    assert [e.source for e in evs if isinstance(e, AbortRequested)] == ["timeout"]
    gate.open()
    evs = await story(real_bus, "stuck")
    assert [t for t in types(evs) if t != "tokens"] == [
        "accepted",
        "claimed",
        "abort_requested",
        "drained",
        "blocks_released",
        "final",
    ]
    assert evs[-1].finish_reason == "error" and "request timeout" in evs[-1].error
    assert not any(isinstance(e, Tokens) for e in evs[types(evs).index("abort_requested") :])
    await all_blocks_free(eng.node)


async def test_a_batch_cut_off_midway_is_completed_not_repeated(real_bus):
    # what Redis holds after a pipeline whose connection dropped: a prefix of it, per stream
    from fd.engine.node.outbox import unwritten

    k1, k2 = real_bus.keys.req("o1"), real_bus.keys.req("o2")
    items = [
        (k1, Tokens(request_id="o1", token_ids=(i,), text=f"t{i}", step=i, ts=1000 + i)) for i in range(3)
    ]
    items += [(k2, Tokens(request_id="o2", token_ids=(9,), text="x", step=1, ts=2000))]
    items.insert(1, (k2, Tokens(request_id="o2", token_ids=(8,), text="w", step=0, ts=1999)))
    await real_bus.publish_many(items[:3])  # o1's first two and o2's first one got through
    rest = await unwritten(real_bus, items)
    assert rest == items[3:]
    await real_bus.publish_many(rest)
    assert await unwritten(real_bus, items) == []
    assert tokens_of([e for _, e in await real_bus.read_req("o1")]) == [0, 1, 2]
    assert tokens_of([e for _, e in await real_bus.read_req("o2")]) == [8, 9]


async def test_a_paused_redis_is_a_503_within_the_timeout_and_then_serves_again(
    tmp_path, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """redis-server under SIGSTOP: its sockets stay open and nothing answers. A new request
    gets the documented 503 once a command has waited ``--redis-timeout``; a stream already
    running waits (it is not cut off), and after SIGCONT it ends complete, exactly once, and
    the same API and engine serve new requests."""
    timeout = 2.0
    redis = OwnRedis(str(tmp_path))
    redis.start()
    factory = lambda: connect(redis.url, timeout)  # noqa: E731
    engines = Engines(factory, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis.url), keys)
    api = None
    paused = False
    try:
        eng = await engines.start("E", delay=0.03)
        api = await start_api(
            factory, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
        )
        prompt = "Once upon a time"
        ref = LLM(tiny_runner, tiny_tokenizer).generate(
            [tiny_tokenizer.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        )[0]
        body = {
            "model": api.cfg.model_name,
            "prompt": prompt,
            "max_tokens": 60,
            "temperature": 0,
            "ignore_eos": True,
        }
        client = asyncio.create_task(stream_completion(api.url, body, {"X-Request-Id": "s1"}))
        await wait_for(lambda: eng.node.sched.knows("s1") and eng.node.steps > 3, what="s1 decoding")
        os.kill(redis.proc.pid, signal.SIGSTOP)
        paused = True
        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{api.url}/v1/completions", json={**body, "max_tokens": 2}) as r:
                status, answer = r.status, await r.json()
        waited = time.monotonic() - t0
        assert status == 503, answer
        assert answer["error"]["code"] == "service_unavailable" and "Redis" in answer["error"]["message"]
        assert waited < 3 * timeout  # the bound is the timeout: one command's wait
        assert not client.done()  # the running stream waits for Redis, not cut off
        os.kill(redis.proc.pid, signal.SIGCONT)
        paused = False
        result = await asyncio.wait_for(client, 60)
        assert result["status"] == 200 and result["done"] and not result["errors"]
        assert result["text"] == ref.text and result["finish_reason"] == "length"
        evs = await story(bus, "s1")
        assert tokens_of(evs) == ref.token_ids and types(evs).count("final") == 1
        again = await stream_completion(api.url, {**body, "max_tokens": 5})
        assert again["status"] == 200 and again["done"] and again["finish_reason"] == "length"
        await all_blocks_free(eng.node)
    finally:
        if paused:
            os.kill(redis.proc.pid, signal.SIGCONT)
        if api is not None:
            await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()
        redis.stop()
