"""fd as a user meets it: the official ``openai`` client against API + engine in one process
over the embedded control plane (what ``fd serve`` runs), and a multi-replica deployment on
real Redis."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from fd.api.config import ApiConfig
from fd.compose import start_api, start_engine
from fd.control.connect import connect
from fd.control.sampling import SamplingParams
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.llm import LLM


def _client(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)


async def test_completions_and_chat_stream_and_not(served, tiny_runner, tiny_tokenizer):
    api, eng = served
    client = _client(api)
    model = api.cfg.model_name
    prompt = "Hello there, how"
    ref = LLM(tiny_runner, tiny_tokenizer).generate(
        [tiny_tokenizer.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]

    c = await client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.choices[0].text == ref.text
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 10 and c.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt))

    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, reasons, usage = "", [], None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert text == ref.text and reasons[-1] == "length" and usage.completion_tokens == 10

    messages = [{"role": "user", "content": "Say something"}]
    chat_ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages))
    chat_ref = LLM(tiny_runner, tiny_tokenizer).generate(
        [chat_ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    r = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == chat_ref.text
    assert r.usage.prompt_tokens == len(chat_ids) and r.usage.completion_tokens == 8

    s = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    content = ""
    async for chunk in s:
        if chunk.choices and chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
    assert content == chat_ref.text
    await client.close()


async def test_half_the_clients_hang_up(served):
    """32 streaming requests, half closed by the client after a few chunks: those end `abort`,
    the rest finish normally, and every KV block comes back."""
    api, eng = served
    client = _client(api)
    model = api.cfg.model_name
    ids: dict[int, str] = {}

    async def one(i: int):
        s = await client.completions.create(
            model=model,
            prompt=f"Request number {i}",
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n, last = 0, None
        async for chunk in s:
            ids[i] = chunk.id
            n += 1
            last = chunk.choices[0].finish_reason if chunk.choices else last
            if i % 2 == 0 and n == 3:
                await s.close()
                return "closed"
        return last

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert all(r == "length" for i, r in enumerate(results) if i % 2 == 1)
    bus = api.bus
    for i in range(0, 32, 2):
        for _ in range(500):
            evs = [e for _, e in await bus.read_req(ids[i])]
            if evs and evs[-1].TYPE == "final":
                break
            await asyncio.sleep(0.01)
        assert evs[-1].finish_reason == "abort", [e.TYPE for e in evs]
        t = [e.TYPE for e in evs if e.TYPE != "tokens"]
        assert t == ["accepted", "claimed", "abort_requested", "drained", "blocks_released", "final"]
        assert next(e for e in evs if e.TYPE == "abort_requested").source == "disconnect"
    for _ in range(200):
        if eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks:
            break
        await asyncio.sleep(0.01)
    assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks
    # each abort counted once
    for _ in range(200):
        if len(await bus.redis.xrange(bus.keys.control)) >= 16:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the control read has come round to them
    assert b'fd_abort_requests_total{source="disconnect"} 16.0' in eng.metrics.render()
    await client.close()


def _texts(events) -> list[str]:
    import orjson

    out = []
    for _, d in events:
        if d != "[DONE]":
            obj = orjson.loads(d)
            out.extend(c["text"] for c in obj.get("choices") or [])
    return out


async def _sse_events(resp):
    """Parse an SSE body into (id, data) pairs."""
    out, cur_id = [], None
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("id:"):
            cur_id = line[3:].strip()
        elif line.startswith("data:"):
            out.append((cur_id, line[5:].strip()))
    return out


async def test_two_replicas_two_engines_resume_from_any_replica(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    from fd.engine.runner.model_runner import ModelRunner

    factory = lambda: connect(redis_server.url)  # noqa: E731
    runner2 = ModelRunner(str(tiny_model_dir), device="cpu", num_blocks=256, batch_invariant=True)
    e1 = await start_engine(
        factory,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e1"),
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
    )
    e2 = await start_engine(
        factory,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e2"),
        runner=runner2,
        tokenizer=tiny_tokenizer,
    )
    a = await start_api(factory, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer)
    b = await start_api(factory, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer)
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": a.cfg.model_name,
                "prompt": "Resume me",
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "background": True,
            }
            # replica A: read a few events, then go away
            async with http.post(
                f"{a.url}/v1/completions", json=body, headers={"X-Request-Id": "resume-1", "X-Event-Ids": "1"}
            ) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == "resume-1"
                seen = []
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if line.startswith("id:"):
                        last_id = line[3:].strip()
                    elif line.startswith("data:") and line != "data: [DONE]":
                        seen.append((last_id, line[5:].strip()))
                        if len(seen) == 5:
                            break
            # replica B: the whole story from the start
            async with http.get(f"{b.url}/v1/requests/resume-1/stream", headers={"X-Event-Ids": "1"}) as resp:
                assert resp.status == 200
                full = await _sse_events(resp)
            assert full[-1][1] == "[DONE]"
            full_ids = [i for i, d in full if d != "[DONE]"]
            assert full_ids[:5] == [i for i, _ in seen]
            # one stream entry per SSE id (the final entry renders as the finish chunk plus
            # the usage chunk, under the same id)
            distinct = [i for n, i in enumerate(full_ids) if n == 0 or full_ids[n - 1] != i]
            assert len(distinct) == len(set(distinct))
            # replica B again, resuming after the last event A delivered: no gap, no duplicate
            async with http.get(
                f"{b.url}/v1/requests/resume-1/stream", headers={"Last-Event-ID": seen[-1][0]}
            ) as resp:
                rest = await _sse_events(resp)
            # replays render as the original did (same chunks, byte for byte)
            assert [i for i, _ in seen] + [i for i, _ in rest] == [i for i, _ in full]
            assert [d for _, d in seen] + [d for _, d in rest] == [d for _, d in full]
            assert _texts(seen) + _texts(rest) == _texts(full)
        import orjson

        text = "".join(
            orjson.loads(d)["choices"][0]["text"]
            for _, d in full
            if d != "[DONE]" and orjson.loads(d).get("choices")
        )
        ref = LLM(tiny_runner, tiny_tokenizer).generate(
            [tiny_tokenizer.encode("Resume me")],
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        )[0]
        assert text == ref.text
    finally:
        for x in (a, b, e1, e2):
            await x.stop()


async def test_requests_not_announced_in_process_are_still_claimed_while_busy(served, embedded_redis, keys):
    """In fd serve the engine claims when its API says it submitted something, and otherwise
    polls P:requests every CLAIM_POLL_S: a request written by anyone else (another API node,
    redis-cli) still starts while the engine is busy."""
    from fd.control.bus import Bus
    from tests.kit.engine import story, submit

    api, eng = served
    client = _client(api)
    busy = asyncio.create_task(
        client.completions.create(
            model=api.cfg.model_name,
            prompt="keep busy",
            max_tokens=300,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    )
    for _ in range(500):
        if eng.node.sched.num_running:
            break
        await asyncio.sleep(0.005)
    assert eng.node.admission.arrivals_told and eng.node.sched.num_running  # announced, and running
    other = Bus(embedded_redis.client(), keys)  # not the API's bus: nobody announces this one
    try:
        await submit(other, "from-elsewhere", [5, 6, 7], max_tokens=4)
        evs = await story(other, "from-elsewhere", timeout=10)
        assert [e.TYPE for e in evs if e.TYPE != "tokens"][-1] == "final"
        assert evs[-1].finish_reason == "length" and not busy.done()  # claimed while busy
    finally:
        await other.redis.aclose()
    await busy
    await client.close()


async def test_requests_not_announced_in_process_are_still_claimed_while_idle(served, embedded_redis, keys):
    """Idle, an fd serve engine waits for its API's word instead of in a blocking read of
    P:requests, and asks P:requests every CLAIM_POLL_S meanwhile: a request written by anyone
    else starts too, and one the API announces starts without waiting for the poll."""
    from fd.control.bus import Bus
    from tests.kit.engine import story, submit

    api, eng = served
    client = _client(api)
    await client.completions.create(model=api.cfg.model_name, prompt="announce", max_tokens=2)
    for _ in range(500):
        if not eng.node.sched.has_work():
            break
        await asyncio.sleep(0.005)
    assert eng.node.admission.arrivals_told and not eng.node.sched.has_work()  # told before, idle now
    other = Bus(embedded_redis.client(), keys)
    try:
        await submit(other, "idle-elsewhere", [5, 6, 7], max_tokens=3)
        evs = await story(other, "idle-elsewhere", timeout=10)
        assert [e.TYPE for e in evs if e.TYPE != "tokens"] == [
            "accepted",
            "claimed",
            "blocks_released",
            "final",
        ]
        assert evs[-1].finish_reason == "length"
    finally:
        await other.redis.aclose()
    # (ignore_eos: sampled, the random model may end it with EOS first)
    r = await client.completions.create(
        model=api.cfg.model_name, prompt="announced", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    await client.close()


def _reference_logprobs(runner, prompt: list[int], out: list[int], top: int):
    """For each token of a greedy output: its log-probability and the ``top`` likeliest, from
    the model's logits for the whole prefix (a prefill in scratch blocks, the engine idle)."""
    import numpy as np

    from tests.kit.engine import prefix_logits

    res = []
    for k in range(len(out)):
        x = prefix_logits(runner, prompt + out[:k])
        lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        best = np.argsort(-lp, kind="stable")[:top]
        res.append((float(lp[out[k]]), [(int(t), float(lp[t])) for t in best]))
    return res


async def test_logprobs_through_the_openai_client(served, tiny_runner, tiny_tokenizer):
    api, _eng = served
    client = _client(api)
    model = api.cfg.model_name
    prompt = "Hello there, how"
    ids = tiny_tokenizer.encode(prompt)
    c = await client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    messages = [{"role": "user", "content": "Say something"}]
    s = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    content, text = [], ""
    async for chunk in s:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    plain = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].logprobs is None  # only when asked

    def word(t: int) -> str:
        return tiny_tokenizer.id_to_bytes(t).decode("utf-8", errors="replace")

    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    greedy = (
        LLM(tiny_runner, tiny_tokenizer)
        .generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        .token_ids
    )
    ref = _reference_logprobs(tiny_runner, list(ids), list(greedy), 3)
    assert lp.tokens == [word(t) for t in greedy]
    for got, (want, best), top in zip(lp.token_logprobs, ref, lp.top_logprobs):
        assert abs(got - want) < 1e-4 and got <= 0
        assert top == {word(t): pytest.approx(v, abs=1e-4) for t, v in best}  # (as the server builds it)
        assert abs(max(top.values()) - got) < 1e-4  # greedy: the chosen one is the likeliest
    assert lp.text_offset == [sum(len(word(t)) for t in greedy[:k]) for k in range(6)]

    chat_ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages))
    greedy = (
        LLM(tiny_runner, tiny_tokenizer)
        .generate([chat_ids], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
        .token_ids
    )
    ref = _reference_logprobs(tiny_runner, list(chat_ids), list(greedy), 2)
    assert [e.token for e in content] == [word(t) for t in greedy]
    assert [e.bytes for e in content] == [list(tiny_tokenizer.id_to_bytes(t)) for t in greedy]
    for e, (want, best) in zip(content, ref):
        assert abs(e.logprob - want) < 1e-4
        assert [(x.token, round(x.logprob, 4)) for x in e.top_logprobs] == [
            (word(t), round(v, 4)) for t, v in best
        ]


async def test_tokenize_detokenize_and_version(served, tiny_tokenizer):
    """vLLM's helpers: the ids the generating endpoints would use, and back."""
    api, _eng = served
    messages = [{"role": "user", "content": "Say something"}]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/tokenize", json={"prompt": "Hello there"}) as r:
            body = await r.json()
            assert r.status == 200
            assert body["tokens"] == tiny_tokenizer.encode("Hello there", add_special_tokens=True)
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] == api.cfg.max_model_len
        async with s.post(f"{api.url}/tokenize", json={"messages": messages}) as r:
            chat = (await r.json())["tokens"]
            assert chat == tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages))
        async with s.post(f"{api.url}/detokenize", json={"tokens": body["tokens"]}) as r:
            assert r.status == 200 and "Hello there" in (await r.json())["prompt"]
        for path, bad, param in (
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/detokenize", {"tokens": [1, -1]}, "tokens"),
            ("/detokenize", {"model": "gpt-4", "tokens": [1]}, "model"),
        ):
            async with s.post(f"{api.url}{path}", json=bad) as r:
                assert r.status in (400, 404) and (await r.json())["error"]["param"] == param
        async with s.get(f"{api.url}/version") as r:
            assert r.status == 200 and (await r.json())["version"]
