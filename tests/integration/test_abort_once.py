"""In ``fd serve`` an abort reaches the engine twice: told in-process as the API publishes it, and
again from ``P:control``, which is the record. The engine handles it once: the echo acts only on
the ids the in-process delivery left to it, so a request that ended in between costs no tombstone
race and no remembered abort."""

from __future__ import annotations

import aiohttp

from fd.control.events import Abort
from tests.kit.faults import wait_for


async def test_an_abort_told_in_process_is_not_handled_again_from_the_stream(served, monkeypatch):
    api, eng = served
    node = eng.node
    laid: list[tuple[str, ...]] = []
    real_tombstones = node.bus.tombstone_many

    async def tombstones(rids, source, ttl_s):
        laid.append(tuple(rids))
        return await real_tombstones(rids, source, ttl_s)

    monkeypatch.setattr(node.bus, "tombstone_many", tombstones)
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
            abort = Abort(request_ids=(rid, "never-seen"), source="api", abort_id="a-once")
            node.aborts.on_local(abort)  # what the API's publish tells the engine beside it
            assert await wait_for(lambda: not node.sched.knows(rid), 10)  # released and ended
            # ... and then P:control brings the same abort: only the id it left is handled
            await node._on_control(abort)
    assert laid == [("never-seen",)]
    assert node.requests.take_dismissed(rid) is None
    await node._on_control(abort)  # a third delivery (a replay of the stream) is the plain path
    assert laid == [("never-seen",), (rid, "never-seen")]
