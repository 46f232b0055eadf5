"""A request's story starts exactly once (fd/control/story.py): a start that Redis ran but whose
reply was lost is sent again by redis-py and writes nothing the second time, even when the
request ran to its final in between; an id whose story is another request's is refused with
nothing written (the API's 409)."""

from __future__ import annotations

import aiohttp
import pytest

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import Accepted, Final, Request
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.control.story import IdTaken
from tests.kit.engine import types
from tests.kit.faults import ReplyCutter, engines  # noqa: F401, F811  (engines: a fixture)

TS = 1_700_000_000_000


def pair(rid: str, prompt_tokens: int = 3) -> tuple[Request, Accepted]:
    """A request and its accepted as the API makes them, ``ts`` fixed (a resend is the same
    fields, as redis-py's resend of the same command is)."""
    data = RequestData(prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=4))
    return (
        Request(request_id=rid, data=data, ts=TS),
        Accepted(request_id=rid, prompt_tokens=prompt_tokens, endpoint="completion", ts=TS),
    )


async def story_types(bus: Bus, rid: str) -> list[str]:
    return types([ev for _, ev in await bus.read_req(rid)])


async def queued_ids(bus: Bus) -> list[str]:
    return [f[b"request_id"].decode() for _, f in await bus.redis.xrange(bus.keys.requests)]


async def test_a_start_sent_again_writes_nothing(bus):
    req, acc = pair("r")
    assert await bus.submit(req, acc)
    assert await bus.submit(req, acc)  # the same start again: done already
    assert await story_types(bus, "r") == ["accepted"]
    assert await queued_ids(bus) == ["r"]

    # ... also once the request ran to its final: nothing follows a final
    await bus.publish(bus.keys.req("r"), Final(request_id="r", finish_reason="length", engine="A"))
    assert await bus.submit(req, acc)
    assert await story_types(bus, "r") == ["accepted", "final"]
    assert await queued_ids(bus) == ["r"]

    # another request under the same id: refused, nothing written
    other_req, other_acc = pair("r", prompt_tokens=9)
    with pytest.raises(IdTaken):
        await bus.submit(other_req, other_acc)
    assert await story_types(bus, "r") == ["accepted", "final"]
    assert await queued_ids(bus) == ["r"]
    assert 0 < await bus.redis.ttl(bus.keys.req("r")) <= bus.req_ttl_s


async def test_a_start_whose_reply_was_lost_is_written_once(redis_server, keys):
    """The API's client retries a command whose connection broke: the resend of a start that
    Redis had run finds it done (before, it wrote a second ``accepted`` and a second
    ``P:requests`` entry, and the resend could land after the request's final)."""
    proxy = await ReplyCutter(redis_server.port).start()
    client = connect(proxy.url)
    bus = Bus(client, keys)
    try:
        assert await bus.submit(*pair("warm"))  # (the script loaded)
        proxy.arm("EVALSHA")
        assert await bus.submit(*pair("r"))
        assert proxy.cuts == 1
        assert await story_types(bus, "r") == ["accepted"]
        assert await queued_ids(bus) == ["warm", "r"]
    finally:
        await client.aclose()
        await proxy.close()


async def test_the_api_answers_409_for_an_id_taken_under_it(
    redis_server, keys, tiny_model_dir, tiny_tokenizer
):
    """An id whose story another request started after the API checked it (two clients racing
    on one X-Request-Id): a 409, and the other request's story untouched."""
    from fd.api.config import ApiConfig
    from fd.compose import start_api

    client = connect(redis_server.url)
    bus = Bus(client, keys)
    api = await start_api(
        lambda: connect(redis_server.url),
        keys,
        ApiConfig(model_dir=str(tiny_model_dir)),
        tokenizer=tiny_tokenizer,
    )
    try:
        real_exists = api.bus.request_exists

        async def racing(rid):  # the other client's start lands between the check and the submit
            free = not await real_exists(rid)
            await bus.submit(*pair(rid))
            return not free

        api.bus.request_exists = racing
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{api.url}/v1/completions",
                headers={"X-Request-Id": "dup"},
                json={"prompt": "hi", "max_tokens": 2},
            ) as resp:
                assert resp.status == 409, await resp.text()
                body = await resp.json()
        assert body["error"]["code"] == "duplicate_request_id"
        assert "dup" in body["error"]["message"]
        assert await story_types(bus, "dup") == ["accepted"]
        assert await queued_ids(bus) == ["dup"]
    finally:
        await api.stop()
        await client.aclose()


async def test_a_second_entry_of_one_request_runs_nothing_twice(engines, redis_server, keys):
    """A request's ``P:requests`` entry twice (a resent XADD on a Redis Cluster, where it is
    not in the story's script; or one an operator wrote by hand): the copy claimed while the
    request runs, and the copy claimed after its final, are each acknowledged; the story is
    one run, one final, nothing after it, the model ran it once, and the stream is left empty."""
    from tests.kit.engine import story, tokens_of
    from tests.kit.faults import all_blocks_free, wait_for

    client = connect(redis_server.url)
    bus = Bus(client, keys)
    try:
        eng = await engines.start("A", delay=0.02, gated=True)
        _, acc = pair("r")
        req = _greedy("r", max_tokens=12)
        assert await bus.submit(req, acc)
        await wait_for(lambda: _has_tokens(bus, "r"), 10, "r running")
        await bus.publish(bus.keys.requests, req)  # the copy, while it runs
        first = await story(bus, "r")
        await bus.publish(bus.keys.requests, req)  # and one after its final

        async def stream_empty():
            return await bus.redis.xlen(bus.keys.requests) == 0

        await wait_for(stream_empty, 10, "P:requests empty")
        await all_blocks_free(eng.node)
        evs = [ev for _, ev in await bus.read_req("r")]
        assert evs == first  # nothing after the final
        assert types(evs).count("claimed") == 1 and types(evs).count("final") == 1
        assert len(tokens_of(evs)) == 12
        # and the model ran it once: one prefill (a copy run again would prefill again, for
        # the fence to turn its events away)
        prefills = [
            s
            for out in engines.gates["A"].batches
            for s in out.seqs
            if s.request_id == "r" and s.start_pos == 0
        ]
        assert len(prefills) == 1
    finally:
        await client.aclose()


async def test_a_copy_another_engine_claims_goes_to_the_owner_and_is_acked_after_the_final(
    engines, redis_server, keys
):
    """The copy of a running request claimed by an engine that does not run it: the claim
    loses to the owner's token, and the entry becomes the owner's (pending on its consumer
    beside the request's own entry, never acknowledged by the loser); once the request has
    finished, the owner's failover scan acknowledges it. One run, one final, and the stream
    is left empty.

    A's gate holds r's step while B claims the copy: the copy is pending on A only while r
    runs (its own entry pending too) and for at most a failover interval after r's final,
    so looking for it after r may have finished would race A's scan."""
    from tests.kit.engine import story, tokens_of
    from tests.kit.faults import wait_for

    client = connect(redis_server.url)
    bus = Bus(client, keys)
    try:
        a = await engines.start(
            "A", delay=0.02, max_num_seqs=1, gated=True
        )  # busy with r: claims nothing more
        gate = engines.gates["A"]
        req = _greedy("r", max_tokens=40)
        assert await bus.submit(req, pair("r")[1])
        await wait_for(lambda: _has_tokens(bus, "r"), 10, "r running on A")
        gate.close()
        await gate.wait_entered()  # r cannot finish until the gate opens

        async def pending():
            rows = await bus.redis.xpending_range(bus.keys.requests, "engines", "-", "+", 10)
            return [(p["message_id"], p["consumer"]) for p in rows]

        ((own, consumer),) = await pending()
        assert consumer == b"A"
        await engines.start("B")
        copy = await bus.publish(bus.keys.requests, req)

        async def copy_pending_on_a():
            return await pending() == [(own, b"A"), (copy, b"A")]

        await wait_for(copy_pending_on_a, 10, "the copy pending on the owner A")
        gate.open()
        first = await story(bus, "r")

        async def stream_empty():
            return await bus.redis.xlen(bus.keys.requests) == 0

        await wait_for(stream_empty, 10, "P:requests empty")
        evs = [ev for _, ev in await bus.read_req("r")]
        assert evs == first  # nothing after the final
        assert types(evs).count("claimed") == 1 and types(evs).count("final") == 1
        assert len(tokens_of(evs)) == 40
        assert a.node.taken_over == 0  # (the scan acknowledged a finished request: nothing to run)
    finally:
        await client.aclose()


def _greedy(rid: str, max_tokens: int) -> Request:
    """A greedy request of a three-token prompt that runs to ``max_tokens``."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id=rid, data=RequestData(prompt_token_ids=(5, 6, 7), sampling=sampling), ts=TS)


async def _has_tokens(bus: Bus, rid: str) -> bool:
    return "tokens" in await story_types(bus, rid)
