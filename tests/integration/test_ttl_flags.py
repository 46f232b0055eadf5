"""``--request-ttl`` and ``--tombstone-ttl`` (DESIGN.md §2, §4) as ``fd serve`` takes them,
on its embedded store and on a real Redis (the options ``fd api`` and ``fd engine`` build the
same way): the TTLs of a finished request's keys and of an abort's tombstone."""

from __future__ import annotations

import aiohttp

from fd.cli.main import build_parser
from fd.cli.serving import _start_serving
from fd.control.bus import REQUEST_TTL_S, Bus
from fd.control.connect import connect
from fd.control.embedded import EmbeddedRedis
from fd.control.events import Abort
from fd.control.keys import Keys
from tests.kit.engine import story
from tests.kit.faults import wait_for


async def _serve_one(argv: list[str], prefix: str) -> dict[str, int]:
    """Start what ``fd serve <argv>`` starts, finish one request and abort an id nobody sent;
    the TTLs of their keys, in seconds."""
    args = build_parser().parse_args(
        ["serve", "--executor", "timed", "--step-ms", "1", "--port", "0", "--prefix", prefix, *argv]
    )
    embedded, engine, api = await _start_serving(args)
    client = connect(args.redis_url) if args.redis_url else embedded.client()
    bus = Bus(client, Keys(prefix))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{api.url}/v1/completions",
                headers={"X-Request-Id": "t1"},
                json={"model": api.cfg.model_name, "prompt": "Hi", "max_tokens": 3},
            ) as r:
                assert r.status == 200, await r.text()
        await story(bus, "t1")
        await bus.publish(bus.keys.control, Abort(request_ids=("ghost",), source="cli"))
        await wait_for(lambda: bus.owner("ghost"), what="the ghost's tombstone")
        return {
            "story": await client.ttl(bus.keys.req("t1")),
            "owner": await client.ttl(bus.keys.owner("t1")),
            "tombstone": await client.ttl(bus.keys.owner("ghost")),
        }
    finally:
        await api.stop()
        await engine.stop()
        await client.aclose()
        if embedded is not None:
            embedded.stop()


async def test_fd_serve_ttl_flags_on_the_embedded_store(tiny_model_dir, keys):
    ttl = await _serve_one(
        ["--model", str(tiny_model_dir), "--request-ttl", "120", "--tombstone-ttl", "45"], keys.prefix
    )
    assert 60 < ttl["story"] <= 120 and 60 < ttl["owner"] <= 120
    assert 0 < ttl["tombstone"] <= 45


async def test_fd_serve_keeps_stories_shorter_on_the_embedded_store(tiny_model_dir, keys):
    ttl = await _serve_one(["--model", str(tiny_model_dir)], keys.prefix)
    assert EmbeddedRedis.REQUEST_TTL_S < REQUEST_TTL_S
    assert EmbeddedRedis.REQUEST_TTL_S - 60 < ttl["story"] <= EmbeddedRedis.REQUEST_TTL_S
    assert EmbeddedRedis.REQUEST_TTL_S - 60 < ttl["owner"] <= EmbeddedRedis.REQUEST_TTL_S
    assert 0 < ttl["tombstone"] <= 600


async def test_ttl_flags_on_a_real_redis(tiny_model_dir, keys, redis_server):
    ttl = await _serve_one(
        [
            "--model",
            str(tiny_model_dir),
            "--redis-url",
            redis_server.url,
            "--request-ttl",
            "90",
            "--tombstone-ttl",
            "30",
        ],
        keys.prefix,
    )
    assert 30 < ttl["story"] <= 90 and 30 < ttl["owner"] <= 90
    assert 0 < ttl["tombstone"] <= 30
    default = await _serve_one(
        ["--model", str(tiny_model_dir), "--redis-url", redis_server.url], keys.prefix + "d"
    )
    assert REQUEST_TTL_S - 60 < default["story"] <= REQUEST_TTL_S


async def test_a_request_that_runs_longer_than_the_ttl_keeps_its_story(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """The TTL counts from the accept and from the final; in between, the engine that runs a
    request renews its story and owner key, so a long run loses neither mid-way."""
    from fd.compose import start_engine
    from fd.engine.node.node_config import EngineConfig
    from tests.kit.engine import GatedRunner, submit, types
    from tests.kit.faults import RunnerSlice

    ttl = 2
    bus = Bus(connect(redis_server.url), keys, req_ttl_s=ttl)
    eng = await start_engine(
        lambda: connect(redis_server.url),
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="long", request_ttl_s=ttl, heartbeat_s=0.2),
        runner=GatedRunner(RunnerSlice(tiny_runner, 0, 64, delay=0.05)),
        tokenizer=tiny_tokenizer,
    )
    try:
        await submit(bus, "long", list(range(10, 20)), max_tokens=80, ignore_eos=True)
        evs = await story(bus, "long", timeout=60)  # (80 steps of 50 ms: twice the TTL)
        assert types(evs)[:2] == ["accepted", "claimed"] and types(evs).count("final") == 1
        assert sum(len(e.token_ids) for e in evs if e.TYPE == "tokens") == 80
        assert 0 < await bus.redis.ttl(keys.req("long")) <= ttl
        assert await bus.owner("long") == "long#1"  # (its owner token, fd/control/fence.py)
    finally:
        await eng.stop()
        await bus.redis.aclose()
