"""``--request-ttl`` and ``--tombstone-ttl`` (DESIGN.md §2, §4) as ``fd serve`` takes them,
on its embedded store and on a real Redis (the options ``fd api`` and ``fd engine`` build the
same way): the TTLs of a finished request's keys and of an abort's tombstone."""

from __future__ import annotations

import aiohttp

from control.bus import REQUEST_TTL_S, Bus
from control.connect import connect
from control.embedded import EmbeddedRedis
from control.events import Abort
from control.keys import Keys
from fd.cli import _start_serving, build_parser
from tests.enginekit import story
from tests.faultkit import wait_for


async def _serve_one(argv: list[str], prefix: str) -> dict[str, int]:
    """Start what ``fd serve <argv>`` starts, finish one request and abort an id nobody sent;
    the TTLs of their keys, in seconds."""
    args = build_parser().parse_args(["serve", "--executor", "timed", "--step-ms", "1",
                                      "--port", "0", "--prefix", prefix, *argv])
    embedded, engine, api = await _start_serving(args)
    client = connect(args.redis_url) if args.redis_url else embedded.client()
    bus = Bus(client, Keys(prefix))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{api.url}/v1/completions", headers={"X-Request-Id": "t1"},
                                 json={"model": api.cfg.model_name, "prompt": "Hi",
                                       "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
        await story(bus, "t1")
        await bus.publish(bus.keys.control, Abort(request_ids=("ghost",), source="cli"))
        await wait_for(lambda: bus.owner("ghost"), what="the ghost's tombstone")
        return {"story": await client.ttl(bus.keys.req("t1")),
                "owner": await client.ttl(bus.keys.owner("t1")),
                "tombstone": await client.ttl(bus.keys.owner("ghost"))}
    finally:
        await api.stop()
        await engine.stop()
        await client.aclose()
        if embedded is not None:
            embedded.stop()


async def test_fd_serve_ttl_flags_on_the_embedded_store(tiny_model_dir, keys):
    ttl = await _serve_one(["--model", str(tiny_model_dir), "--request-ttl", "120",
                            "--tombstone-ttl", "45"], keys.prefix)
    assert 60 < ttl["story"] <= 120 and 60 < ttl["owner"] <= 120
    assert 0 < ttl["tombstone"] <= 45


async def test_fd_serve_keeps_stories_shorter_on_the_embedded_store(tiny_model_dir, keys):
    ttl = await _serve_one(["--model", str(tiny_model_dir)], keys.prefix)
    assert EmbeddedRedis.REQUEST_TTL_S < REQUEST_TTL_S
    assert EmbeddedRedis.REQUEST_TTL_S - 60 < ttl["story"] <= EmbeddedRedis.REQUEST_TTL_S
    assert EmbeddedRedis.REQUEST_TTL_S - 60 < ttl["owner"] <= EmbeddedRedis.REQUEST_TTL_S
    assert 0 < ttl["tombstone"] <= 600


async def test_ttl_flags_on_a_real_redis(tiny_model_dir, keys, redis_server):
    ttl = await _serve_one(["--model", str(tiny_model_dir), "--redis-url", redis_server.url,
                            "--request-ttl", "90", "--tombstone-ttl", "30"], keys.prefix)
    assert 30 < ttl["story"] <= 90 and 30 < ttl["owner"] <= 90
    assert 0 < ttl["tombstone"] <= 30
    default = await _serve_one(["--model", str(tiny_model_dir), "--redis-url", redis_server.url],
                               keys.prefix + "d")
    assert REQUEST_TTL_S - 60 < default["story"] <= REQUEST_TTL_S
