"""Responses of n > 1 choices: each choice a request ``<id>.<k>`` of its own, merged into one
response, streamed and not, replayed and resumed from any replica, and aborted as a whole by
the response's id, however the abort comes."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from fd.control.events import Abort, Accepted, Final, decode
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.api import CHAT_BODY, FakeEngine, control_events, parse_sse, setup, wait_for


def _by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for c in chunks:
        for ch in c.get("choices") or ():
            out.setdefault(ch["index"], []).append(ch)
    return out


def _text(choices: list[dict]) -> str:
    return "".join((ch.get("delta") or {}).get("content") or ch.get("text") or "" for ch in choices)


async def test_stream_of_three_choices(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "n3", "X-Event-Ids": "1"},
            json={**CHAT_BODY, "n": 3, "seed": 7, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert resp.status == 200
        events = parse_sse(await resp.read())
        assert events[-1] == (None, "[DONE]")
        chunks = [orjson.loads(d) for _, d in events[:-1]]
        assert all(c["id"] == "n3" for c in chunks)
        per = _by_choice(chunks)
        assert sorted(per) == [0, 1, 2]
        for chs in per.values():
            assert chs[0]["delta"] == {"role": "assistant", "content": ""}
            assert _text(chs) == "Hello, world!"
            assert [ch["finish_reason"] for ch in chs if ch["finish_reason"]] == ["stop"]
        # one usage for all: the prompt once, every choice's tokens
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15
        assert chunks[-1]["usage"]["prompt_tokens"] == chunks[-1]["usage"]["total_tokens"] - 15
        assert all(c["usage"] is None for c in chunks[:-1])
        # every frame's id says where each choice's stream stands
        assert all(len(eid.split(",")) == 3 for eid, _ in events[:-1])

        # the response's own story is its `accepted`; each choice is a request with its own
        story = [decode(f, e) for e, f in await real_bus.redis.xrange(real_bus.keys.req("n3"))]
        assert [type(ev) for ev in story] == [Accepted] and story[0].choices == 3
        for k in range(3):
            evs = [decode(f, e) for e, f in await real_bus.redis.xrange(real_bus.keys.req(f"n3.{k}"))]
            assert (evs[0].parent, evs[0].index) == ("n3", k) and isinstance(evs[-1], Final)
        seeds = sorted(
            decode(f).data.sampling.seed for _, f in await real_bus.redis.xrange(real_bus.keys.requests)
        )
        assert seeds == [7, 8, 9]  # choice k samples with seed + k


async def test_not_streamed_and_completions(bus):
    async with setup(bus, FakeEngine(bus)) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hey", "n": 2})
        assert resp.status == 200
        body = await resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == ["Hello, world!"] * 2
        assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
        assert body["usage"]["completion_tokens"] == 10
        assert body["id"] == resp.headers["X-Request-Id"]
        chat = await (await client.post("/v1/chat/completions", json={**CHAT_BODY, "n": 2})).json()
        assert [c["message"]["content"] for c in chat["choices"]] == ["Hello, world!"] * 2


async def test_replay_and_resume_from_any_frame(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "rc", "X-Event-Ids": "1"},
            json={
                "model": "tiny",
                "prompt": "hey",
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        original = parse_sse(await resp.read())

        def content(events):  # what each choice said, in order, and the last chunk
            chunks = [orjson.loads(d) for _, d in events if d != "[DONE]"]
            return {
                k: [(ch["text"], ch["finish_reason"]) for ch in chs] for k, chs in _by_choice(chunks).items()
            }, chunks[-1] if chunks else None

        replay = parse_sse(await (await client.get("/v1/requests/rc/stream")).read())
        assert content(replay) == content(original) and replay[-1] == (None, "[DONE]")
        for cut in range(len(original) - 1):  # resume after every frame a client could have seen
            seen = original[: cut + 1]
            rest = parse_sse(
                await (
                    await client.get("/v1/requests/rc/stream", headers={"Last-Event-ID": original[cut][0]})
                ).read()
            )
            got, _ = content(seen + rest)
            assert got == content(original)[0], cut  # nothing lost, nothing twice
            assert rest[-1] == (None, "[DONE]")
        r = await client.get("/v1/requests/rc/stream", headers={"Last-Event-ID": "1-0"})
        assert r.status == 400  # one id where two choices need one each


async def test_a_disconnect_aborts_every_choice(real_bus):
    eng = FakeEngine(real_bus, hold=True)
    async with setup(real_bus, eng) as client:
        resp = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "dc"},
            json={"model": "tiny", "prompt": "hey", "n": 3, "stream": True},
        )
        await resp.content.readline()
        resp.close()
        assert await wait_for(lambda: _all_final(real_bus, ["dc.0", "dc.1", "dc.2"]))
        aborts = [ev for ev in await control_events(real_bus) if isinstance(ev, Abort)]
        assert len(aborts) == 1 and aborts[0].source == "disconnect"
        assert set(aborts[0].request_ids) == {"dc.0", "dc.1", "dc.2"}
        for k in range(3):
            evs = [decode(f, e) for e, f in await real_bus.redis.xrange(real_bus.keys.req(f"dc.{k}"))]
            assert evs[-1].finish_reason == "abort"


async def _all_final(bus, ids) -> bool:
    for rid in ids:
        evs = [decode(f, e) for e, f in await bus.redis.xrange(bus.keys.req(rid))]
        if not evs or not isinstance(evs[-1], Final):
            return False
    return True


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"n": 0}, "n", "invalid_value"),
        ({"n": 17}, "n", "invalid_value"),
        ({"n": "2"}, "n", "invalid_type"),
        ({"n": 2, "best_of": 3}, "best_of", "unsupported"),
    ],
)
async def test_choices_validated(real_bus, extra, param, code):
    async with setup(real_bus) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", **extra})
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert (err["param"], err["code"]) == (param, code)
        long = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "x" * 127},
            json={"model": "tiny", "prompt": "x", "n": 2},
        )
        assert long.status == 400 and (await long.json())["error"]["param"] == "X-Request-Id"
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_real_engine_choices_and_an_operator_abort_by_the_response_id(
    served, tiny_runner, tiny_tokenizer
):
    """Greedy choices all equal the engine's own output; seeded ones each equal a request with
    seed + k; `redis-cli XADD fd:control '*' type abort request_id <response id>` ends every
    choice with `abort` and every block comes back."""
    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    model = api.cfg.model_name
    prompt = "Hello there"
    ids = tiny_tokenizer.encode(prompt)
    llm = LLM(tiny_runner, tiny_tokenizer)
    greedy = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    c = await client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [ch.text for ch in c.choices] == [greedy.text] * 2 and c.usage.completion_tokens == 16

    seeded = [
        llm.generate([ids], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5 + k))[
            0
        ].text
        for k in range(3)
    ]
    s = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", "", ""]
    async for chunk in s:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == seeded and len(set(texts)) > 1

    total = eng.node.sched.num_free_blocks
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=400, n=2, stream=True, extra_body={"ignore_eos": True}
    )
    first = await stream.__anext__()
    rid = first.id
    await api.bus.redis.xadd(api.bus.keys.control, {"type": "abort", "request_id": rid})
    reasons = {}
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "abort", 1: "abort"}
    assert await wait_for(lambda: _free(eng, total))
    await client.close()


async def _free(eng, total) -> bool:
    await asyncio.sleep(0)
    return eng.node.sched.num_free_blocks == total and not eng.node.sched.has_work()


async def test_an_abort_that_overtook_the_response_aborts_every_choice(real_bus):
    """The id was aborted before the request came (its tombstone is where the mark would go):
    each choice meets a tombstone of its own at submit, and never reaches P:requests."""
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        await real_bus.tombstone_many(["early"], "http", 60)
        resp = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "early"},
            json={"model": "tiny", "prompt": "hey", "n": 2},
        )
        assert resp.status == 200
        body = await resp.json()
        assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"]
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_two_engines_share_the_choices_and_an_abort_of_the_id_reaches_both(
    redis_server, real_bus, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """Real Redis, two engines with two running slots each, a response of four choices: the
    choices run on both engines, and `/v1/abort_requests` naming only the response's id (on a
    replica that did not accept it) ends every one with `abort` and frees both engines' blocks."""
    from fd.api.config import ApiConfig
    from fd.compose import start_api
    from fd.control.connect import connect
    from tests.kit.faults import Engines, all_blocks_free, sse_objects

    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    apis = []
    try:
        a = await engines.start("A", delay=0.005, max_num_seqs=2)
        b = await engines.start("B", delay=0.005, max_num_seqs=2)
        for _ in range(2):
            apis.append(
                await start_api(
                    lambda: connect(redis_server.url),
                    keys,
                    ApiConfig(model_dir=str(tiny_model_dir)),
                    tokenizer=tiny_tokenizer,
                )
            )
        body = {
            "model": apis[0].cfg.model_name,
            "prompt": "four ways",
            "n": 4,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        reasons: dict[int, str] = {}
        asked = False
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{apis[0].url}/v1/completions", json=body, headers={"X-Request-Id": "four"}
            ) as resp:
                started: set[int] = set()
                async for obj in sse_objects(resp):
                    if obj is None:
                        break
                    for ch in obj.get("choices") or ():
                        if ch.get("text"):
                            started.add(ch["index"])
                        if ch.get("finish_reason"):
                            reasons[ch["index"]] = ch["finish_reason"]
                    if len(started) == 4 and not asked:
                        holders = {e.id for e in (a, b) for k in range(4) if e.node.sched.knows(f"four.{k}")}
                        assert holders == {"A", "B"}  # the choices are spread over both
                        async with s.post(
                            f"{apis[1].url}/v1/abort_requests", json={"request_ids": ["four"]}
                        ) as r:
                            assert r.status == 200
                        asked = True
        assert asked and reasons == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}
        for e in (a, b):
            await all_blocks_free(e.node)
    finally:
        for api in apis:
            await api.stop()
        await engines.stop_all()


async def test_a_completions_batch_with_n(real_bus):
    """OpenAI's batch of prompts, each with n choices: prompt i's j-th choice is index i*n + j;
    usage counts each prompt once."""
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "bt"},
            json={"model": "tiny", "prompt": ["hey", [5, 6, 7, 8]], "n": 2, "seed": 3},
        )
        assert resp.status == 200
        body = await resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"]["prompt_tokens"] == len(b"hey") + 4  # FakeTokenizer: a token a byte
        assert body["usage"]["completion_tokens"] == 20
        reqs = {
            decode(f).request_id: decode(f).data
            for _, f in await real_bus.redis.xrange(real_bus.keys.requests)
        }
        assert [reqs[f"bt.{k}"].prompt_token_ids for k in range(4)] == [tuple(b"hey")] * 2 + [
            (5, 6, 7, 8)
        ] * 2
        assert [reqs[f"bt.{k}"].sampling.seed for k in range(4)] == [3, 4, 3, 4]


async def test_real_engine_batch_equals_one_request_a_prompt(served, tiny_runner, tiny_tokenizer):
    api, _ = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    prompts = ["The river", "A stone and the lamp"]
    llm = LLM(tiny_runner, tiny_tokenizer)
    refs = [
        g.text
        for g in llm.generate(
            [tiny_tokenizer.encode(p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        )
    ]
    c = await client.completions.create(
        model=api.cfg.model_name, prompt=prompts, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [ch.text for ch in c.choices] == refs
    assert c.usage.prompt_tokens == sum(len(tiny_tokenizer.encode(p)) for p in prompts)
    await client.close()


async def test_a_failed_choice_fails_the_response(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, fail="CUDA out of memory")) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 2})
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "CUDA out of memory"
        resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "n": 2, "stream": True})
        events = parse_sse(await resp.read())
        assert events[-1] == (None, "[DONE]")
        assert orjson.loads(events[-2][1])["error"]["message"] == "CUDA out of memory"
        assert sum("error" in orjson.loads(d) for _, d in events[:-1]) == 1  # one error, then done


def test_the_choices_mark_and_ids():
    from fd.control.keys import choice_ids, choices_owner, is_tombstone, owner_choices

    assert choice_ids("r", 3) == ("r.0", "r.1", "r.2")
    assert owner_choices(choices_owner(3)) == 3 and not is_tombstone(choices_owner(3))
    # an engine id, a tombstone, or a hand-written value that is no mark: not a response of choices
    for owner in (
        None,
        "e0",
        "aborted:http",
        "choices=",
        "choices=x",
        "choices=0",
        "choices=5000",
        "choices:3",
    ):
        assert owner_choices(owner) is None, owner


async def test_the_response_index_lives_as_long_as_its_choices(served):
    """Its story and mark got the request TTL at accept; a response that generates for long
    must not lose them before its choices' stories. A `background` response whose client left
    has no handler to renew them: the engine does, with each choice's final, and the client
    that comes back later replays the whole response."""
    api, eng = served
    keys = (api.bus.keys.req("ttl"), api.bus.keys.owner("ttl"))
    body = {
        "model": api.cfg.model_name,
        "prompt": "hey",
        "n": 2,
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "background": True,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/v1/completions", json=body, headers={"X-Request-Id": "ttl"}) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first frame: both choices are running
            for key in keys:  # as if the response had been running for most of the TTL
                await api.bus.redis.expire(key, 100)
        # the client is gone; the choices go on (background)
        for k in range(2):
            assert await wait_for(lambda k=k: _ended(api.bus, f"ttl.{k}"))
        for key in keys:
            assert await api.bus.redis.ttl(key) > api.bus.req_ttl_s - 5
        assert await control_events(api.bus) == []  # nothing aborted
        async with s.get(f"{api.url}/v1/requests/ttl/stream") as replay:
            chunks = [orjson.loads(d) for _, d in parse_sse(await replay.read())[:-1]]
    reasons = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert reasons == {0: "length", 1: "length"}


async def _ended(bus, rid) -> bool:
    story = await bus.read_req(rid)
    return bool(story) and isinstance(story[-1][1], Final)


async def test_continuous_usage_counts_every_choice(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hey",
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        chunks = [orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 10  # both choices' tokens, so far
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(b"hey")}
        texts = sum(1 for c in chunks for ch in c["choices"] if ch.get("text"))
        assert texts == 8 and len(chunks) == texts + 2 + 1  # 4 words each, 2 finals, usage
