"""In ``fd serve`` an abort reaches the engine once: through its read of ``P:control``, the
record, as on any other engine (no in-process delivery beside it). A request the engine runs is
aborted there and then, with no tombstone race and no remembered abort."""

from __future__ import annotations

import aiohttp

from tests.kit.faults import wait_for


async def test_an_abort_reaches_the_engine_beside_the_api_once(served, monkeypatch):
    api, eng = served
    node = eng.node
    laid: list[tuple[str, ...]] = []
    handled: list[tuple[str, ...]] = []
    real_tombstones, real_abort = node.bus.tombstone_many, node.aborts.abort

    async def tombstones(rids, source, ttl_s):
        laid.append(tuple(rids))
        return await real_tombstones(rids, source, ttl_s)

    async def abort(rids, source, entries=None):
        handled.append(tuple(rids))
        return await real_abort(rids, source, entries)

    monkeypatch.setattr(node.bus, "tombstone_many", tombstones)
    monkeypatch.setattr(node.aborts, "abort", abort)
    body = {
        "model": api.cfg.model_name,
        "prompt": "Hello",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/v1/completions", json=body) as r:
            rid = r.headers["X-Request-Id"]
            async for _line in r.content:
                break  # streaming: the engine runs it
            async with s.post(f"{api.url}/v1/abort_requests", json={"request_ids": [rid]}) as a:
                assert a.status == 200
            assert await wait_for(lambda: not node.sched.knows(rid), 10)  # released and ended
    assert await wait_for(lambda: handled == [(rid,)], 10)
    assert laid == []  # a request the engine ran: no tombstone
    assert node.requests.take_dismissed(rid) is None
