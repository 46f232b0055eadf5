"""``P:lifecycle`` (DESIGN.md, the lifecycle stream): each request's milestones and each
engine's load, written as they happen by the API and the engine, readable with a plain XREAD,
with no prompt text in it."""

from __future__ import annotations

import aiohttp

from fd.control.bus import LIFECYCLE_MAXLEN
from fd.control.events import EngineLoad, FirstToken, RequestAccepted, RequestClaimed, RequestFinished, Tokens
from tests.kit.faults import wait_for

PROMPT = "The lifecycle of a sea turtle"


async def test_a_request_leaves_its_milestones_and_the_engine_its_load(served):
    api, eng = served
    bus = api.bus
    body = {"model": api.cfg.model_name, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/v1/completions", json=body) as r:
            assert r.status == 200
            answer = await r.json()
    rid = answer["id"]

    async def finished() -> bool:  # (and the engine's load noted after it: idle)
        _, evs = await bus.read_lifecycle("0", None)
        types = [type(e) for _, e in evs if getattr(e, "request_id", rid) == rid]
        return RequestFinished in types and types[-1] is EngineLoad

    assert await wait_for(finished, 10)
    _, got = await bus.read_lifecycle("0", None)
    mine = [e for _, e in got if getattr(e, "request_id", None) == rid]
    assert [type(e) for e in mine] == [RequestAccepted, RequestClaimed, FirstToken, RequestFinished]
    accepted, claimed, first, final = mine
    assert accepted.endpoint == "completion" and accepted.prompt_tokens == answer["usage"]["prompt_tokens"]
    assert claimed.engine == first.engine == final.engine == eng.node.id and claimed.attempt == 1
    assert final.finish_reason == "length"
    assert (final.prompt_tokens, final.completion_tokens) == (
        answer["usage"]["prompt_tokens"],
        answer["usage"]["completion_tokens"],
    )
    assert accepted.ts <= claimed.ts <= first.ts <= final.ts
    # The engine's load: at least once for each step it decided while the request ran, and
    # once more as the work ran out (nothing running, every block free but the cached).
    story = [e for _, e in await bus.read_req(rid)]
    steps = {e.step for e in story if isinstance(e, Tokens)}
    loads = [e for _, e in got if isinstance(e, EngineLoad)]
    assert {e.engine for e in loads} == {eng.node.id}
    assert len({e.step for e in loads}) >= len(steps)
    assert any(e.running == 1 for e in loads)
    last = loads[-1]
    assert last.running == last.waiting == 0 and last.blocks_free == last.blocks_total
    # No prompt text, and a plain XREAD reads it (as redis-cli would), capped.
    raw = await bus.redis.xread({bus.keys.lifecycle: "0"})
    fields = [f for _, entries in raw for _, f in entries]
    assert fields and not any(PROMPT.encode() in v or b"turtle" in v for f in fields for v in f.values())
    assert bus.maxlen(bus.keys.lifecycle) == LIFECYCLE_MAXLEN


async def test_a_reader_skips_what_a_later_release_writes(real_bus, keys):
    """The stream is versioned and has many readers: an entry of a type this release does not
    know, or of a newer schema version, is skipped, not dead-lettered by every reader; a field
    it does not know is ignored."""
    r = real_bus.redis
    await r.xadd(keys.lifecycle, {"type": "engine_moved", "v": "1", "engine": "e1", "ts": "5"})
    await r.xadd(
        keys.lifecycle, {"type": "first_token", "v": "2", "request_id": "r0", "engine": "e1", "ts": "6"}
    )
    extra = {"type": "first_token", "v": "1", "request_id": "r1", "engine": "e1", "ts": "7", "new_field": "x"}
    await r.xadd(keys.lifecycle, extra)
    _, got = await real_bus.read_lifecycle("0", None)
    assert [e for _, e in got] == [FirstToken(request_id="r1", engine="e1", ts=7)]
    assert await r.xlen(keys.dead) == 0


async def test_the_spec_names_the_lifecycle_route_as_the_admins(served):
    api, _ = served
    async with aiohttp.ClientSession() as s, s.get(f"{api.url}/openapi.json") as r:
        doc = await r.json()
    route = doc["paths"]["/v1/lifecycle"]["get"]
    assert route["security"] == [{"adminKey": []}]
    assert "text/event-stream" in route["responses"]["200"]["content"]
