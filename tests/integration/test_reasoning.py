"""Reasoning models, as vLLM's ``--reasoning-parser``: the model's ``<think>...</think>`` comes
back as ``reasoning_content`` beside the answer (streamed and not, replayed the same from the
stream, with tool calls read from the answer only); vLLM's ``chat_template_kwargs`` reach the
chat template (Qwen3's ``enable_thinking``)."""

from __future__ import annotations

import itertools
import json
import re

import aiohttp
import numpy as np
import openai
import orjson
import pytest

from fd.api.config import ApiConfig
from fd.api.reasoning import ReasoningParser, split_all
from fd.api.tool_calls import call_id
from fd.compose import join_in_process, start_api, start_engine
from fd.control.events import Accepted, decode
from fd.control.guided import canonical, starting_after
from fd.control.sampling import SamplingParams
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.api import FakeEngine, FakeTokenizer, assert_openai_error, parse_sse, setup
from tests.kit.api import accumulate as accumulate_answer

# what a reasoning model writes: its thinking (tags split across deltas), then the answer
WORDS = ("<thi", "nk>\nTwo and ", "two.</th", "ink>\n\nIt is ", "4.")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "2+2?"}]}


# ----------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    "kind,text,want",
    [
        ("deepseek_r1", "<think>\nhmm</think>\n\nAnswer", ("\nhmm", "\n\nAnswer")),
        ("deepseek_r1", "hmm</think>Answer", ("hmm", "Answer")),  # the template opened <think>
        ("deepseek_r1", "still thinking when cut", ("still thinking when cut", "")),
        ("deepseek_r1", "<thin", ("<thin", "")),
        ("deepseek_r1", "a < b </thinking> </think>c</think>", ("a < b </thinking> ", "c</think>")),
        ("qwen3", "<think>x</think>y", ("x", "y")),
        ("qwen3", "no thinking here</think>", ("", "no thinking here</think>")),
        ("qwen3", " <think>late</think>", ("", " <think>late</think>")),
        ("qwen3", "<thin", ("", "<thin")),
        ("qwen3", "", ("", "")),
    ],
)
def test_the_split_is_the_same_however_the_text_comes(kind, text, want):
    assert split_all(kind, text) == want
    for cuts in itertools.combinations(range(1, len(text)), min(3, max(0, len(text) - 1))):
        p = ReasoningParser(kind)
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        items = [x for piece in pieces for x in p.feed(piece)] + p.finish()
        got = (
            "".join(t for k, t in items if k == "reasoning"),
            "".join(t for k, t in items if k == "content"),
        )
        assert got == want, pieces


def test_the_parser_lets_out_thinking_as_it_comes_and_holds_only_a_possible_tag():
    p = ReasoningParser("deepseek_r1")
    assert p.feed("<think>") == []
    assert p.feed("abc</") == [("reasoning", "abc")]
    assert p.feed("think>ok") == [("content", "ok")]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")


# ----------------------------------------------------------------------------- through the API


def _accumulate(chunks: list[dict]) -> dict[int, dict]:
    """What OpenAI's clients make of streamed deltas, per choice, with the thinking."""
    out = accumulate_answer(chunks)
    for c in chunks:
        for ch in c["choices"]:
            o = out[ch["index"]]
            o["reasoning"] = o.get("reasoning", "") + (ch["delta"].get("reasoning_content") or "")
    return out


async def test_thinking_streamed_replayed_and_not_streamed(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), reasoning_parser="deepseek_r1") as client:
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "r1"}
        )
        original = await resp.read()
        events = parse_sse(original)
        assert events[-1] == (None, "[DONE]")
        chunks = [orjson.loads(d) for _, d in events[:-1]]
        assert _accumulate(chunks) == {
            0: {
                "reasoning": "\nTwo and two.",
                "content": "\n\nIt is 4.",
                "calls": {},
                "finish_reason": "stop",
            }
        }
        # thinking streams as it comes: before the answer's first chunk
        kinds = [
            k
            for c in chunks
            for k, v in c["choices"][0]["delta"].items()
            if k in ("reasoning_content", "content") and v
        ]
        assert kinds.index("reasoning_content") < kinds.index("content")
        story = [decode(f) for _, f in await real_bus.redis.xrange(real_bus.keys.req("r1"))]
        assert isinstance(story[0], Accepted) and story[0].reasoning_parser == "deepseek_r1"
        assert await (await client.get("/v1/requests/r1/stream")).read() == original
        body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": "\n\nIt is 4.",
            "reasoning_content": "\nTwo and two.",
        }
        # n > 1: each choice thinks on its own
        body = await (await client.post("/v1/chat/completions", json={**CHAT, "n": 2})).json()
        assert [c["message"]["reasoning_content"] for c in body["choices"]] == ["\nTwo and two."] * 2
        resp = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})
        got = _accumulate([orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]])
        assert [got[k]["reasoning"] for k in (0, 1)] == ["\nTwo and two."] * 2
        assert [got[k]["content"] for k in (0, 1)] == ["\n\nIt is 4."] * 2


async def test_include_reasoning_false_leaves_the_thinking_out(real_bus):
    """vLLM's include_reasoning: false reads the thinking and shows only the answer, streamed,
    replayed (the story says so) and not, for each choice."""
    hide = {**CHAT, "include_reasoning": False}
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), reasoning_parser="deepseek_r1") as client:
        resp = await client.post(
            "/v1/chat/completions", json={**hide, "stream": True}, headers={"X-Request-Id": "r-hide"}
        )
        original = await resp.read()
        chunks = [orjson.loads(d) for _, d in parse_sse(original)[:-1]]
        assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks if c["choices"])
        assert _accumulate(chunks)[0]["content"] == "\n\nIt is 4."
        story = [decode(f) for _, f in await real_bus.redis.xrange(real_bus.keys.req("r-hide"))]
        assert story[0].include_reasoning is False
        assert await (await client.get("/v1/requests/r-hide/stream")).read() == original
        body = await (await client.post("/v1/chat/completions", json={**hide, "n": 2})).json()
        assert [c["message"] for c in body["choices"]] == [
            {"role": "assistant", "content": "\n\nIt is 4.", "reasoning_content": None}
        ] * 2
        resp = await client.post("/v1/chat/completions", json={**CHAT, "include_reasoning": "no"})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "include_reasoning"
        # the default, and the story of a request that left it as it is
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r-show"})
        story = [decode(f) for _, f in await real_bus.redis.xrange(real_bus.keys.req("r-show"))]
        assert story[0].include_reasoning is None


async def test_tool_calls_are_read_from_the_answer_not_the_thinking(real_bus):
    words = (
        '<think>I could write <tool_call>{"name": "x"}</tool_call> here.</think>',
        'Checking.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    )
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    async with setup(
        real_bus, FakeEngine(real_bus, words=words), reasoning_parser="qwen3", tool_parser="hermes"
    ) as client:
        chat = {**CHAT, "tools": [tool]}
        resp = await client.post(
            "/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Request-Id": "r2"}
        )
        got = _accumulate([orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]])
        assert got == {
            0: {
                "reasoning": 'I could write <tool_call>{"name": "x"}</tool_call> here.',
                "content": "Checking.",
                "calls": {0: {"id": call_id("r2", 0, 0), "name": "get_time", "arguments": "{}"}},
                "finish_reason": "tool_calls",
            }
        }
        body = await (await client.post("/v1/chat/completions", json=chat)).json()
        message = body["choices"][0]["message"]
        assert (
            message["content"] == "Checking." and message["tool_calls"][0]["function"]["name"] == "get_time"
        )
        assert message["reasoning_content"].startswith("I could write")


async def test_what_is_not_read_for_thinking(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), reasoning_parser="deepseek_r1") as client:
        # a guided answer is the grammar's from its first token
        body = await (
            await client.post(
                "/v1/chat/completions",
                json={**CHAT, "response_format": {"type": "json_object"}},
                headers={"X-Request-Id": "r3"},
            )
        ).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}
        story = [decode(f) for _, f in await real_bus.redis.xrange(real_bus.keys.req("r3"))]
        assert story[0].reasoning_parser is None
        # completions have no messages to put it in
        body = await (await client.post("/v1/completions", json={"model": "tiny", "prompt": "2+2?"})).json()
        assert body["choices"][0]["text"] == "".join(WORDS)
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS)) as client:  # a server without one
        body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}


async def test_the_openai_client_reads_the_thinking(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), reasoning_parser="deepseek_r1") as client:
        oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
        c = await oa.chat.completions.create(**CHAT)
        assert c.choices[0].message.reasoning_content == "\nTwo and two."
        assert c.choices[0].message.content == "\n\nIt is 4."
        stream = await oa.chat.completions.create(**CHAT, stream=True)
        thought = "".join(
            [
                getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                async for ch in stream
                if ch.choices
            ]
        )
        assert thought == "\nTwo and two."
        await oa.close()


async def test_chat_template_kwargs_reach_the_template(
    embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    template = (
        "{% for m in messages %}{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]"
        "{% endif %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    )
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-think"),
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), chat_template=template, reasoning_parser="qwen3"),
        tokenizer=tiny_tokenizer,
    )
    join_in_process(api, eng)
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        async with aiohttp.ClientSession() as s:

            async def tokens(body: dict) -> tuple[int, dict]:
                async with s.post(f"{api.url}/tokenize", json=body) as r:
                    return r.status, await r.json()

            _, on = await tokens({"messages": msgs})
            _, off = await tokens({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
            assert on["tokens"] == tiny_tokenizer.encode("Hi")
            assert off["tokens"] == tiny_tokenizer.encode("Hi<think>\n\n</think>")
            async with s.post(
                f"{api.url}/v1/chat/completions",
                json={"messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
            ) as r:
                body = await r.json()
            assert r.status == 200 and body["usage"]["prompt_tokens"] == len(off["tokens"])
            # an earlier answer's thinking reaches the template as the client sends it back
            tpl_msgs = [*msgs, {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}]
            _, turn = await tokens({"messages": tpl_msgs})
            assert turn["tokens"] == tiny_tokenizer.encode("Hi[greet]Hello")
            async with s.post(
                f"{api.url}/tokenize",
                json={"messages": [*msgs, {"role": "assistant", "content": "x", "reasoning_content": 5}]},
            ) as r:
                err = assert_openai_error(await r.json(), r.status)
                assert r.status == 400 and err["param"] == "messages[1].reasoning_content"
            for bad, status in (({"messages": []}, 400), ("yes", 400)):
                async with s.post(
                    f"{api.url}/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": bad}
                ) as r:
                    err = assert_openai_error(await r.json(), r.status)
                    assert r.status == status and err["param"] == "chat_template_kwargs"
    finally:
        await api.stop()
        await eng.stop()
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        await start_api(
            embedded_redis.client,
            keys,
            ApiConfig(model_dir=str(tiny_model_dir), reasoning_parser="nope"),
            tokenizer=tiny_tokenizer,
        )


# ----------------------------------------------------------------------------- structured outputs after thinking


def test_a_spec_may_start_after_a_token():
    from fd.control.guided import GuidedError, after_token, canonical, grammar, parse, starting_after

    plain = canonical({"regex": "[0-9]{3}"})
    later = starting_after(plain, 300)
    assert json.loads(later) == {"regex": "[0-9]{3}", "after": 300} and after_token(later) == 300
    assert parse(later) == parse(plain) and after_token(plain) is None
    assert grammar(later) == grammar(plain)
    for bad in ('{"regex": "a", "after": -1}', '{"regex": "a", "after": true}', '{"after": 3}'):
        with pytest.raises(GuidedError):
            parse(bad)


def test_the_runner_masks_only_after_the_token(tiny_model_dir, tiny_runner, tiny_tokenizer):
    """Guides: no mask while the token has not come; from the token after it, the grammar's
    (the same mask a plain spec gives an output that starts there), rebuilt if forgotten."""
    from fd.control.guided import canonical, starting_after
    from fd.engine.runner.guided import Guides

    tj = (tiny_model_dir / "tokenizer.json").read_text()
    g = Guides(tj, tiny_runner.vocab_size, tiny_runner.eos_token_ids)
    plain = canonical({"regex": "[0-9]{3}"})
    later = starting_after(plain, 7)
    assert g.allowed("r", later, (5, 6)) is None
    g.took("r", 7)  # (sampled freely: nothing to consume yet)
    first = g.allowed("r", later, (5, 6, 7))
    assert (first == g.allowed("ref", plain, ())).all() and 0 < first.sum() < tiny_runner.vocab_size
    digit = int(next(t for t in np.flatnonzero(first) if tiny_tokenizer.decode([int(t)]).isdigit()))
    g.took("r", digit)
    assert (g.allowed("r", later, (5, 6, 7, digit)) == g.allowed("ref2", plain, (digit,))).all()
    g.keep_only(set())
    assert (g.allowed("r", later, (5, 6, 7, digit)) == g.allowed("ref3", plain, (digit,))).all()


def test_the_model_thinks_freely_then_answers_in_the_grammar(tiny_model_dir, tiny_tokenizer):
    """With the real tiny model: greedy, the output is the unconstrained model's up to and
    including the token, then the grammar's (the token stands for </think>)."""
    runner = ModelRunner(str(tiny_model_dir), num_blocks=64, block_size=16)
    llm = LLM(runner, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("The harbour")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    end = free[2]  # the third token the model writes on its own
    spec = starting_after(canonical({"regex": "[0-9]{3}"}), end)
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, guided=spec))[0]
    k = free.index(end) + 1
    assert got.token_ids[:k] == free[:k] and got.finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}", tiny_tokenizer.decode(got.token_ids[k:]))
    assert not re.fullmatch("[0-9]{3}", tiny_tokenizer.decode(free[k : k + 3]))  # (it would not have)


class _ThinkTokenizer(FakeTokenizer):
    """The fake tokenizer, with <think> and </think> as one token each (ids 299 and 300)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        for part in re.split("(</?think>)", text):
            out += {"<think>": [299], "</think>": [300]}.get(part) or list(part.encode())
        return out


@pytest.mark.parametrize(
    "content,after", [("2+2?", 300), ("2+2? <think>x</think>", None), ("<think>x</think> then <think>y", 300)]
)
def test_a_guided_chat_on_a_reasoning_server_is_guided_after_the_thinking(content, after):
    from fd.api import protocol, validation

    limits = validation.Limits(model_name="tiny", max_model_len=512, reasoning_parser="qwen3")
    body = {"messages": [{"role": "user", "content": content}], "response_format": {"type": "json_object"}}
    gen = protocol.parse_chat(body, limits, _ThinkTokenizer())
    assert json.loads(gen.sampling.guided).get("after") == after
    assert gen.reasoning_parser == "qwen3"
    # a forced tool call is the grammar's from its first token: nothing read as thinking
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    gen = protocol.parse_chat(
        {"messages": body["messages"], "tools": [tool], "tool_choice": "required"}, limits, _ThinkTokenizer()
    )
    assert "after" not in json.loads(gen.sampling.guided) and gen.reasoning_parser is None
