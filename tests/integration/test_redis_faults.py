"""Redis's own faults, against a real redis-server of the test's own: error replies that say
"not now" (out of memory, read-only) are outages every node rides out, and a story that
disappears (Redis emptied) ends its client's stream with an error instead of leaving it
waiting for ever."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import redis as sync_redis

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import Claimed, Final, Tokens
from fd.control.mux import StoryLost, StoryRewound, StreamMux
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, tokens_of, types
from tests.kit.faults import Engines, OwnRedis, all_blocks_free, engines, stream_completion, wait_for  # noqa: F401

PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground", "It was a dark"]


@dataclass
class Deployment:
    redis: OwnRedis
    admin: sync_redis.Redis  # (a client of the test's own, for the faults)
    bus: Bus
    eng: Any
    api: Any


@pytest.fixture
async def deploy(tmp_path, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """``await deploy(delay)``: a redis-server of the test's own, an engine ``E`` stepping
    at least ``delay`` s and an API node on it; all stopped at the end."""
    redis = OwnRedis(str(tmp_path))
    redis.start()
    admin = sync_redis.Redis(port=redis.port)
    engines = Engines(redis.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis.url), keys)
    apis = []

    async def start(delay: float) -> Deployment:
        eng = await engines.start("E", delay=delay)
        opts = ApiConfig(model_dir=str(tiny_model_dir))
        apis.append(await start_api(lambda: connect(redis.url), keys, opts, tokenizer=tiny_tokenizer))
        return Deployment(redis, admin, bus, eng, apis[-1])

    try:
        yield start
    finally:
        for api in apis:
            await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()
        admin.close()
        redis.stop()


def _refuse(r: sync_redis.Redis, kind: str) -> None:
    if kind == "oom":  # noeviction (the default) and less room than is used: writes refused
        r.config_set("maxmemory", 1)
    else:  # a replica of a primary that is not there: its data kept, writes refused
        r.execute_command("REPLICAOF", "127.0.0.1", "1")


def _accept(r: sync_redis.Redis, kind: str) -> None:
    if kind == "oom":
        r.config_set("maxmemory", 0)
    else:
        r.execute_command("REPLICAOF", "NO", "ONE")


@pytest.mark.parametrize("kind", ["oom", "readonly"])
async def test_redis_refusing_writes_mid_stream_is_an_outage_the_engine_rides_out(
    kind, deploy, tiny_runner, tiny_tokenizer, caplog
):
    d = await deploy(0.03)
    eng, api, admin, bus = d.eng, d.api, d.admin, d.bus
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    refs = LLM(tiny_runner, tiny_tokenizer).generate([tiny_tokenizer.encode(p) for p in PROMPTS], params)
    body = {"model": api.cfg.model_name, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    clients = [
        asyncio.create_task(stream_completion(api.url, {**body, "prompt": p}, {"X-Request-Id": f"s{i}"}))
        for i, p in enumerate(PROMPTS)
    ]
    await wait_for(lambda: all(eng.node.sched.knows(f"s{i}") for i in range(4)), what="all admitted")
    await wait_for(lambda: eng.node.steps > 8, what="decoding")
    _refuse(admin, kind)
    await wait_for(lambda: eng.node.link.outage is not None, what="the engine to meet the refusal")
    steps = eng.node.steps
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/health") as r:
            assert r.status == 503
            said = (await r.json())["error"]["message"]
            assert ("OOM" if kind == "oom" else "READONLY") in said
        async with s.post(f"{api.url}/v1/completions", json={**body, "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "service_unavailable"
    await asyncio.sleep(1.0)  # the engine waits out the refusal: alive, its requests kept
    assert not eng.task.done()
    assert all(eng.node.sched.knows(f"s{i}") for i in range(4))
    assert eng.node.steps - steps <= 4  # (no stepping ahead of what it cannot publish)
    _accept(admin, kind)
    results = await asyncio.wait_for(asyncio.gather(*clients), 60)
    for ref, result in zip(refs, results):
        assert result["status"] == 200 and result["done"] and not result["errors"]
        assert result["text"] == ref.text and result["finish_reason"] == "length"
    for i, ref in enumerate(refs):
        evs = await story(bus, f"s{i}")
        assert tokens_of(evs) == ref.token_ids  # nothing repeated, nothing lost
        assert types(evs).count("final") == 1 and types(evs)[-1] == "final"
    assert eng.node.link.outage is None
    # one line as the outage starts (and one as it ends), not one per failed call
    said = [r for r in caplog.records if r.name == "fd.engine.node.node" and "redis unavailable" in r.message]
    assert 1 <= len(said) <= 2 < eng.node.link.errors, [r.message for r in said]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/health") as r:
            assert r.status == 200
    again = await stream_completion(api.url, {**body, "prompt": "x", "max_tokens": 5})
    assert again["done"] and again["finish_reason"] == "length"
    await all_blocks_free(eng.node)


async def test_an_emptied_redis_ends_every_client_stream_with_an_error(deploy):
    """FLUSHALL under live streams (what a restart without persistence, a lost volume or a
    failover to a replica that had not caught up leave): every client gets an error naming
    what happened, streams then ``[DONE]``, within the mux's two looks (2 s apart) and a read; the
    engine frees the blocks of the requests whose ownership went with it."""
    d = await deploy(0.05)
    eng, api, admin = d.eng, d.api, d.admin
    body = {"model": api.cfg.model_name, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    streams = [
        asyncio.create_task(stream_completion(api.url, {**body, "prompt": p}, {"X-Request-Id": f"s{i}"}))
        for i, p in enumerate(PROMPTS[:3])
    ]

    async def whole() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{api.url}/v1/completions",
                json={**body, "prompt": PROMPTS[3]},
                headers={"X-Request-Id": "w"},
            ) as r:
                return r.status, await r.json()

    unary = asyncio.create_task(whole())
    await wait_for(lambda: all(eng.node.sched.knows(r) for r in ("s0", "s1", "s2", "w")), what="admitted")
    await wait_for(lambda: eng.node.steps > 5, what="decoding")
    admin.flushall()
    t0 = asyncio.get_running_loop().time()
    results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    status, answer = await asyncio.wait_for(unary, 30)
    waited = asyncio.get_running_loop().time() - t0
    for result in results:
        assert result["status"] == 200 and result["done"]  # an error event, then [DONE]
        assert [e["code"] for e in result["errors"]] == ["story_lost"]
        assert "disappeared" in result["errors"][0]["message"]
        assert result["finish_reason"] is None
    assert status == 503 and answer["error"]["code"] == "story_lost"
    assert waited < 15  # (documented: within about 5 s of the loss)
    await all_blocks_free(eng.node, timeout=10)  # their owner keys went: dropped, blocks back
    again = await stream_completion(api.url, {**body, "prompt": "x", "max_tokens": 5})
    assert again["done"] and again["finish_reason"] == "length" and not again["errors"]
    assert not eng.task.done()


async def test_the_mux_ends_a_lost_story_only_once_it_is_known_to_have_been_written(bus, keys):
    """On both stores: a story subscribed before its request is submitted is not lost while
    it does not exist yet; once the submitter says it was written (or an entry was read), its
    absence ends the subscription with ``StoryLost``, and a key overwritten with another type
    ends its subscription without holding up the others' reads."""
    mux = StreamMux(bus.redis, keys, "lost-test", block_ms=100, lost_look_s=0.05)
    await mux.start()
    try:
        early = await mux.subscribe("early", b"0")  # nothing written yet
        flushed = await mux.subscribe("flushed", b"0")
        flushed.story_started()  # written, then gone before any read saw it
        read = await mux.subscribe("read", b"0")
        overwritten = await mux.subscribe("typed", b"0")
        ok = await mux.subscribe("ok", b"0")
        await submit(bus, "read", [1, 2, 3])
        await submit(bus, "typed", [1, 2, 3])
        await submit(bus, "ok", [1, 2, 3])
        assert (await anext(read))[1].TYPE == "accepted"
        assert (await anext(overwritten))[1].TYPE == "accepted"
        await bus.redis.delete(keys.req("read"))
        await bus.redis.delete(keys.req("typed"))
        await bus.redis.set(keys.req("typed"), "x")
        for sub, rid in ((flushed, "flushed"), (read, "read"), (overwritten, "typed")):
            with pytest.raises(StoryLost, match=rid):
                await asyncio.wait_for(anext(sub), 5)
        assert (await asyncio.wait_for(anext(ok), 5))[1].TYPE == "accepted"  # its read goes on
        await bus.publish(keys.req("ok"), Tokens(request_id="ok", token_ids=(4,), text="d", step=1))
        assert (await asyncio.wait_for(anext(ok), 5))[1].TYPE == "tokens"
        await asyncio.sleep(0.3)  # several looks: the unwritten one waits on
        assert not early._items and not early.done
        await submit(bus, "early", [1, 2, 3])
        assert (await asyncio.wait_for(anext(early), 5))[1].TYPE == "accepted"
    finally:
        await mux.stop()


async def test_a_hang_up_while_redis_refuses_writes_still_aborts_its_request(deploy):
    """The disconnect's abort meets OOM: the API sends it again until Redis takes writes,
    and the request ends as a disconnect abort, not after all its tokens."""
    d = await deploy(0.03)
    eng, api, admin, bus = d.eng, d.api, d.admin, d.bus
    body = {
        "model": api.cfg.model_name,
        "prompt": PROMPTS[0],
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        resp = await s.post(f"{api.url}/v1/completions", json=body, headers={"X-Request-Id": "gone"})
        assert resp.status == 200
        await resp.content.readline()  # streaming
        _refuse(admin, "oom")
        await wait_for(lambda: eng.node.link.outage is not None, what="the engine to meet OOM")
        resp.close()  # the client hangs up while no abort can be written
    await asyncio.sleep(1.0)
    _accept(admin, "oom")
    evs = await story(bus, "gone", timeout=30)
    assert evs[-1].finish_reason == "abort"
    assert [e.source for e in evs if e.TYPE == "abort_requested"] == ["disconnect"]
    assert len(tokens_of(evs)) < 1000
    await all_blocks_free(eng.node)


async def test_a_reply_about_one_requests_key_ends_only_that_request(
    real_bus, keys, engines, tiny_runner, tiny_tokenizer, caplog
):
    """An owner key overwritten with a hash mid-run: Redis answers WRONGTYPE for that
    request's commands only. The engine logs it with the command, drops that request (its
    blocks back) and runs the others to their exact ends."""
    eng = await engines.start("E", delay=0.02)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = [[5, 17, 33, 9], [41, 12, 7, 19], [3, 8, 22, 40]]
    refs = LLM(tiny_runner, tiny_tokenizer).generate(prompts, params)
    for rid, prompt in zip(("a", "poisoned", "c"), prompts):
        await submit(real_bus, rid, prompt, max_tokens=60, ignore_eos=True)
    await wait_for(lambda: all(eng.node.sched.knows(r) for r in ("a", "poisoned", "c")), what="admitted")
    await wait_for(lambda: eng.node.steps > 5, what="decoding")
    await real_bus.redis.delete(keys.owner("poisoned"))
    await real_bus.redis.hset(keys.owner("poisoned"), "x", "1")
    for rid, ref in (("a", refs[0]), ("c", refs[2])):
        evs = await story(real_bus, rid)
        assert tokens_of(evs) == ref.token_ids and evs[-1].finish_reason == "length"
    await wait_for(lambda: not eng.node.sched.knows("poisoned"), what="the poisoned request dropped")
    await all_blocks_free(eng.node)
    assert not eng.task.done()
    assert "WRONGTYPE" in caplog.text


async def test_scripts_flushed_mid_stream_are_loaded_again(deploy, tiny_runner, tiny_tokenizer):
    """``SCRIPT FLUSH`` (what a restart does to the script cache): the fence's and the story
    start's next calls meet NOSCRIPT, load their script again and go on."""
    d = await deploy(0.02)
    eng, api, admin = d.eng, d.api, d.admin
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    (ref,) = LLM(tiny_runner, tiny_tokenizer).generate([tiny_tokenizer.encode(PROMPTS[0])], params)
    body = {"model": api.cfg.model_name, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    client = asyncio.create_task(stream_completion(api.url, {**body, "prompt": PROMPTS[0]}))
    await wait_for(lambda: eng.node.steps > 5, what="decoding")
    admin.script_flush()
    result = await asyncio.wait_for(client, 30)
    assert result["done"] and not result["errors"] and result["text"] == ref.text
    admin.script_flush()
    again = await stream_completion(api.url, {**body, "prompt": "x", "max_tokens": 5})
    assert again["status"] == 200 and again["done"] and again["finish_reason"] == "length"
    assert not eng.task.done()


@pytest.mark.parametrize("continuation", ["same", "different", "skipping"])
async def test_a_reader_sent_an_end_the_story_lost_skips_its_repetition_or_ends(bus, keys, continuation):
    """What a reader on a failed-over Redis meets: it was sent t3 and t4, the story lost
    them, and another engine goes on from t2 (its tokens at positions 2, 3, ...). A greedy
    continuation repeats t3 t4: not sent again, the client's text goes on exactly; one that
    differs, or that leaves positions out, ends the stream with an error (StoryRewound), never
    a text that repeats, forks or skips."""
    mux = StreamMux(bus.redis, keys, "rewind-test", block_ms=100)
    await mux.start()
    story = keys.req("w")

    def toks(first: int, *ids: int) -> list:
        return [
            (story, Tokens(request_id="w", token_ids=(t,), text=f"t{t}", step=t, pos=first + i))
            for i, t in enumerate(ids)
        ]

    try:
        sub = await mux.subscribe("w", b"0")
        await submit(bus, "w", [1, 2, 3])
        sub.story_started()
        await bus.publish_many([(story, Claimed(request_id="w", engine="A")), *toks(0, 1, 2, 3, 4)])
        seen = [await asyncio.wait_for(anext(sub), 5) for _ in range(6)]
        assert [ev.TYPE for _, ev in seen] == ["accepted", "claimed", "tokens", "tokens", "tokens", "tokens"]
        lost = [eid for eid, _ in (await bus.redis.xrange(story))[-2:]]
        await bus.redis.xdel(story, *lost)  # (what the failover lost)
        after = {"same": toks(2, 3, 4, 5), "different": toks(2, 3, 9, 5), "skipping": toks(5, 6)}[
            continuation
        ]
        await bus.publish_many([(story, Claimed(request_id="w", engine="B", attempt=2)), *after])
        await bus.publish(story, Final(request_id="w", finish_reason="length", engine="B"))
        if continuation == "same":
            rest = [ev async for _, ev in sub]
            assert [ev.TYPE for ev in rest] == ["claimed", "tokens", "final"]
            assert rest[1].token_ids == (5,)  # t3 t4 not sent twice
        else:
            assert (await asyncio.wait_for(anext(sub), 5))[1].TYPE == "claimed"
            with pytest.raises(StoryRewound):
                await asyncio.wait_for(anext(sub), 5)
    finally:
        await mux.stop()


async def test_a_reader_ahead_of_a_story_that_lost_what_it_read_ends_with_an_error(bus, keys):
    """A failover's split: the reader read entries the old primary took after the promotion;
    on the new primary the story lacks them and went on to its final under lower ids. A read
    after the last entry the reader saw would wait for ever: the reader's look finds that
    entry missing and ends the stream with ``StoryRewound``. A reader whose last entry is in
    place reads on through the same looks."""
    from fd.control.events import encode

    mux = StreamMux(bus.redis, keys, "split-test", block_ms=100, lost_look_s=0.05)
    await mux.start()
    try:
        split = await mux.subscribe("split", b"0")
        ok = await mux.subscribe("ok", b"0")
        for rid in ("split", "ok"):
            await submit(bus, rid, [1, 2, 3])
            await bus.publish(keys.req(rid), Claimed(request_id=rid, engine="A"))
        for sub in (split, ok):
            assert [(await asyncio.wait_for(anext(sub), 5))[1].TYPE for _ in range(2)] == [
                "accepted",
                "claimed",
            ]
        # the new primary's story: the accepted (replicated before the split), then what its
        # writer appended meanwhile, all under ids below the claimed the reader read
        accepted = (await bus.redis.xrange(keys.req("split"), count=1))[0][1]
        await bus.redis.delete(keys.req("split"))
        await bus.redis.xadd(keys.req("split"), accepted, id="1-1")
        tail = [
            Claimed(request_id="split", engine="B"),
            Tokens(request_id="split", token_ids=(4,), text="d", step=1, pos=0),
            Final(request_id="split", finish_reason="length", engine="B"),
        ]
        for i, ev in enumerate(tail, start=2):
            await bus.redis.xadd(keys.req("split"), encode(ev), id=f"1-{i}")
        with pytest.raises(StoryRewound, match="split"):
            await asyncio.wait_for(anext(split), 5)
        await asyncio.sleep(0.3)  # several looks
        await bus.publish(keys.req("ok"), Final(request_id="ok", finish_reason="length", engine="A"))
        assert [ev.TYPE async for _, ev in ok] == ["final"]
    finally:
        await mux.stop()
