"""Completions' ``echo``: the prompt before the completion, and with ``logprobs`` the prompt's
own tokens scored (each given those before it), ``max_tokens=0`` for scoring alone — what
evaluation harnesses send. The scores are checked against the model's logits."""

from __future__ import annotations

import numpy as np
import openai
import orjson
import pytest

from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.scheduler import Scheduler
from fd.engine.runner.llm import LLM
from tests.kit.api import FakeEngine, parse_sse, setup
from tests.kit.engine import prefix_logits


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _client(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)


async def test_score_a_prompt_with_max_tokens_0(served, tiny_runner, tiny_tokenizer):
    api, eng = served
    client = _client(api)
    prompt = "The river runs by the old stone"
    ids = tiny_tokenizer.encode(prompt)
    c = await client.completions.create(
        model=api.cfg.model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    ch = c.choices[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert c.usage.prompt_tokens == len(ids) and c.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for t in range(1, len(ids)):  # token t given tokens 0..t-1, from the model's own logits
        ref = _log_softmax(prefix_logits(tiny_runner, ids[:t]))
        assert lp.token_logprobs[t] == pytest.approx(ref[ids[t]], abs=1e-4), t
        best = [ref[b] for b in np.argsort(-ref, kind="stable")[:2]]
        # (keyed by the token's text, as OpenAI's are: two byte tokens that each decode to
        # U+FFFD share a key)
        top = sorted(lp.top_logprobs[t].values(), reverse=True)
        assert top[0] == pytest.approx(best[0], abs=1e-4)
        assert all(any(v == pytest.approx(b, abs=1e-4) for b in best) for v in top)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    await client.close()


async def test_echo_with_a_completion_streamed_and_not(served, tiny_runner, tiny_tokenizer):
    api, _ = served
    client = _client(api)
    prompt = "A lamp and a bird"
    ids = tiny_tokenizer.encode(prompt)
    ref = LLM(tiny_runner, tiny_tokenizer).generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )[0]
    kw = dict(
        model=api.cfg.model_name,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    c = await client.completions.create(**kw)
    assert c.choices[0].text == prompt + ref.text and c.usage.completion_tokens == 5
    c = await client.completions.create(**kw, logprobs=0)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 5 and lp.token_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])

    text, first = "", None
    async for chunk in await client.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            first = ch.text if first is None else first
            text += ch.text
    assert first.startswith(prompt) and text == prompt + ref.text
    # a token-id prompt echoes its text; a batch echoes each prompt before its own completion
    b = await client.completions.create(
        model=api.cfg.model_name, prompt=[ids, "Sand"], max_tokens=0, echo=True, temperature=0
    )
    assert [ch.text for ch in b.choices] == [tiny_tokenizer.decode(ids), "Sand"]
    await client.close()


def test_prompt_scores_do_not_depend_on_how_the_prompt_was_chunked(tiny_runner, monkeypatch):
    """Chunked prefill: each chunk's last position is scored against the next chunk's first
    token (ScheduledSeq.prompt_next); the scores equal those of one whole-prompt step. So do
    those of a step whose logits the runner makes a few rows at a time (SCORE_ROWS)."""
    from fd.control.request_data import RequestData

    prompt = tuple(range(3, 40))
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)

    def scores(budget: int) -> dict[int, tuple]:
        sched = Scheduler(SchedulerConfig(num_blocks=64, max_num_batched_tokens=budget, max_model_len=128))
        sched.add("r", RequestData(prompt_token_ids=prompt, sampling=sp))
        got: dict[int, tuple] = {}
        steps = 0
        while sched.has_work():
            out = sched.schedule()
            res = tiny_runner.execute(out)
            for first, entries in res.prompt_logprobs.values():
                for j, e in enumerate(entries):
                    got[first + j] = e
            sched.update(out, res)
            steps += 1
        return got, steps

    whole, n1 = scores(256)
    chunked, n2 = scores(8)
    monkeypatch.setattr("fd.engine.runner.model_runner.SCORE_ROWS", 5)
    sliced, n3 = scores(256)
    assert n2 > n1 == n3 and sorted(whole) == sorted(chunked) == sorted(sliced) == list(range(1, len(prompt)))
    for p in whole:
        for other in (chunked, sliced):
            assert other[p][0] == pytest.approx(whole[p][0], abs=1e-4)
            assert [t for t, _ in other[p][1]] == [t for t, _ in whole[p][1]]


async def test_an_echo_replays_the_same_from_the_stream(served):
    import aiohttp

    api, _ = served
    body = {
        "model": api.cfg.model_name,
        "prompt": "Stone and sand",
        "max_tokens": 3,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/v1/completions", json=body, headers={"X-Request-Id": "echo-r"}) as r:
            original = await r.read()
        async with s.get(f"{api.url}/v1/requests/echo-r/stream") as r:
            replay = await r.read()
    assert replay == original and b"Stone and sand" in original


async def test_an_echo_aborted_before_it_ran_still_shows_the_prompt(real_bus):
    """No tokens event ever comes (the abort overtook the request): the final carries the echo."""
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        for stream in (False, True):
            rid = f"early-echo-{stream}"
            await real_bus.tombstone_many([rid], "http", 60)
            resp = await client.post(
                "/v1/completions",
                headers={"X-Request-Id": rid},
                json={"model": "tiny", "prompt": "hey", "echo": True, "max_tokens": 3, "stream": stream},
            )
            if stream:
                chunks = [orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]]
                assert "".join(c["choices"][0]["text"] for c in chunks) == "hey"
                assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
            else:
                body = await resp.json()
                assert body["choices"][0]["text"] == "hey" and body["choices"][0]["finish_reason"] == "abort"


async def test_vllm_prompt_logprobs_with_ranks(served, tiny_runner, tiny_tokenizer):
    """vLLM's ``prompt_logprobs=k``: per prompt token (the first has none) its log-probability
    and rank in its position's distribution, with the k likeliest; in each completions choice,
    beside the choices for chat; refused on a stream and with echo (as vLLM refuses the
    first)."""
    import aiohttp

    api, _ = served
    client = _client(api)
    ids = [40, 41, 300, 7, 41]
    c = await client.completions.create(
        model=api.cfg.model_name, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    got = c.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for t in range(1, len(ids)):
        ref = _log_softmax(prefix_logits(tiny_runner, ids[:t]))
        d = got[t]
        mine = d[str(ids[t])]
        assert mine["logprob"] == pytest.approx(ref[ids[t]], abs=1e-4)
        assert mine["rank"] == 1 + int((ref > ref[ids[t]] + 1e-6).sum())
        assert mine["decoded_token"] == tiny_tokenizer.decode([ids[t]])
        order = np.argsort(-ref, kind="stable")[:2]
        for j, b in enumerate(order):
            if int(b) != ids[t]:
                assert d[str(int(b))]["rank"] == j + 1
                assert d[str(int(b))]["logprob"] == pytest.approx(ref[b], abs=1e-4)
        assert len(d) == 2 + (str(ids[t]) not in {str(int(b)) for b in order})
    messages = [{"role": "user", "content": "Hi there"}]
    chat = await client.chat.completions.create(
        model=api.cfg.model_name, messages=messages, max_tokens=1, n=2, extra_body={"prompt_logprobs": 0}
    )
    chat_ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages), add_special_tokens=False)
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == len(chat_ids) and [list(d) for d in plp[1:]] == [[str(t)] for t in chat_ids[1:]]
    async with aiohttp.ClientSession() as s:
        for body in ({"stream": True}, {"echo": True}, {"prompt_logprobs": 21}):
            async with s.post(
                f"{api.url}/v1/completions", json={"prompt": ids, "prompt_logprobs": 1, **body}
            ) as r:
                out = await r.json()
                assert r.status == 400 and out["error"]["param"] == "prompt_logprobs", (body, out)
    await client.close()
