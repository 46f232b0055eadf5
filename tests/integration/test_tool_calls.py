"""Tool calling, as vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes``: the tools
reach the chat template, the model's ``<tool_call>`` text comes back as OpenAI ``tool_calls``
(streamed and not, replayed the same from the stream), and what fd cannot do is refused."""

from __future__ import annotations

import itertools

import aiohttp
import openai
import orjson
import pytest

from fd.api.tool_calls import HermesParser, ToolCall, call_id, parse_all
from fd.control.events import Accepted, decode
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.api import FakeEngine, accumulate, assert_openai_error, parse_sse, setup

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# what a hermes model writes: a sentence, then two calls (the first tag split across deltas)
WORDS = (
    "Let me look.",
    "\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_call>\n',
    '<tool_call>{"name": "get_time", ',
    '"arguments": {}}</tool_call>',
    "\n",
)
CALLS = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}


# ----------------------------------------------------------------------------- the parser


def _feed_all(pieces) -> tuple[str, list[ToolCall]]:
    p = HermesParser()
    items = [x for piece in pieces for x in p.feed(piece)] + p.finish()
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)]


def test_the_parse_is_the_same_however_the_text_is_split():
    """A replay's deltas need not be the original's; the rendered content and calls must be."""
    text = "".join(WORDS) + "And <tool this is not a tag. <tool_call>{not json}</tool_call>"
    want = parse_all(text)
    assert want == ("Let me look.\n\nAnd <tool this is not a tag. <tool_call>{not json}</tool_call>", CALLS)
    for a, b in itertools.combinations(range(1, len(text)), 2):
        if a % 3 and b % 5:  # most pairs of cut points, two-thirds of a second
            continue
        assert _feed_all([text[:a], text[a:b], text[b:]]) == want, (a, b)
    assert _feed_all(list(text)) == want  # a character at a time


def test_what_the_parser_lets_out_and_holds():
    p = HermesParser()
    assert p.feed("Sure") == ["Sure"]
    assert p.feed(" <tool") == [" "]  # maybe a tag: held
    assert p.feed("box>") == ["<toolbox>"]  # not one: let out
    assert p.feed('<tool_call>{"name": "f", "argu') == []  # a call: held until its end
    assert p.feed('ments": {"a": [1, 2]}}</tool_call>') == [ToolCall("f", '{"a": [1, 2]}')]
    assert p.feed("\n\n") == []  # blank after a call: not content ...
    assert p.feed("Done.") == ["\n\nDone."]  # ... unless more content follows
    assert p.finish() == []
    # a call the model did not close before it stopped is taken if it parses, else shown
    assert parse_all('<tool_call>{"name": "f", "arguments": {"x": 1}}') == ("", [ToolCall("f", '{"x": 1}')])
    assert parse_all('<tool_call>{"name": "f", "argu') == ('<tool_call>{"name": "f", "argu', [])
    # arguments already given as JSON text, or no arguments
    assert parse_all('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        ToolCall("f", '{"x": 1}')
    ]
    assert parse_all('<tool_call>{"name": "f"}</tool_call>')[1] == [ToolCall("f", "{}")]
    # a call with no name is not a call
    assert parse_all('<tool_call>{"arguments": {}}</tool_call>')[1] == []


# ----------------------------------------------------------------------------- over HTTP


async def test_calls_streamed_replayed_and_not_streamed(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), tool_parser="hermes") as client:
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "tc1"}
        )
        assert resp.status == 200
        original = await resp.read()
        events = parse_sse(original)
        assert events[-1] == (None, "[DONE]")
        got = accumulate([orjson.loads(d) for _, d in events[:-1]])
        assert got == {
            0: {
                "content": "Let me look.\n",
                "finish_reason": "tool_calls",
                "calls": {
                    0: {"id": call_id("tc1", 0, 0), "name": "get_weather", "arguments": '{"city": "Paris"}'},
                    1: {"id": call_id("tc1", 0, 1), "name": "get_time", "arguments": "{}"},
                },
            }
        }
        # the story says how to render it, so any replica's replay is the same bytes
        story = [decode(f) for _, f in await real_bus.redis.xrange(real_bus.keys.req("tc1"))]
        assert isinstance(story[0], Accepted) and story[0].tool_parser == "hermes"
        replay = await (await client.get("/v1/requests/tc1/stream")).read()
        assert replay == original
        # the prompt offered the tool (the fake template writes "tool:<name>")
        body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
        plain = await (await client.post("/v1/chat/completions", json={**CHAT, "tools": None})).json()
        assert body["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len(b"tool:get_weather\n")
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        rid = body["id"]
        assert choice["message"] == {
            "role": "assistant",
            "content": "Let me look.\n",
            "tool_calls": [
                {
                    "id": call_id(rid, 0, 0),
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": call_id(rid, 0, 1),
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        }
        # without tools the same text is just text
        assert plain["choices"][0]["message"]["content"] == "".join(WORDS)
        assert plain["choices"][0]["finish_reason"] == "stop"


async def test_every_choice_calls_on_its_own(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), tool_parser="hermes") as client:
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}, headers={"X-Request-Id": "tc2"}
        )
        got = accumulate([orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]])
        assert sorted(got) == [0, 1]
        for k in (0, 1):
            assert [c["name"] for c in got[k]["calls"].values()] == ["get_weather", "get_time"]
            assert got[k]["calls"][0]["id"] == call_id("tc2", k, 0)
        body = await (await client.post("/v1/chat/completions", json={**CHAT, "n": 2})).json()
        ids = [c["message"]["tool_calls"][0]["id"] for c in body["choices"]]
        assert len(set(ids)) == 2 and [c["finish_reason"] for c in body["choices"]] == ["tool_calls"] * 2


async def test_tool_choice_none_offers_the_tools_but_reads_no_calls(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), tool_parser="hermes") as client:
        body = await (await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}
        assert body["usage"]["prompt_tokens"] > len(b"u:Weather in Paris?\na:")


async def test_a_conversation_with_calls_and_their_results(real_bus):
    """The assistant's earlier calls (arguments as JSON text, as OpenAI's clients send them)
    and the tools' answers are accepted and reach the template."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    async with setup(real_bus, FakeEngine(real_bus), tool_parser="hermes") as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["message"]["content"] == "Hello, world!"


@pytest.mark.parametrize(
    "extra, param, code",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}},
            "tool_choice",
            "invalid_value",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "invalid_value",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tools": {"type": "function"}}, "tools", "invalid_type"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools",
            "missing_required_parameter",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools", "invalid_type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools",
            "invalid_type",
        ),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice", "invalid_value"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}
                ]
            },
            "messages[0].tool_calls",
            "invalid_value",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls", "invalid_type"),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
            "messages[0].tool_call_id",
            "invalid_type",
        ),
    ],
)
async def test_what_is_refused(real_bus, extra, param, code):
    async with setup(real_bus, tool_parser="hermes") as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, **extra})
        assert resp.status == 400
        err = assert_openai_error(await resp.json())
        assert (err["param"], err["code"]) == (param, code)
    assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_a_server_without_a_parser_refuses_auto_as_vllm_does(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)  # auto: the default with tools
        err = assert_openai_error(await resp.json())
        assert resp.status == 400 and (err["param"], err["code"]) == ("tool_choice", "unsupported")
        assert "--tool-call-parser" in err["message"]
        resp = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})
        assert resp.status == 200


def test_the_flags_go_together():
    from fd.cli.main import main

    with pytest.raises(SystemExit, match="go together"):
        main(["serve", "--tool-call-parser", "hermes"])
    with pytest.raises(SystemExit, match="go together"):
        main(["api", "--enable-auto-tool-choice"])


async def test_the_real_model_sees_the_tools(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """The tiny model's template offers tools Qwen's way; through the `openai` client the prompt
    is that rendering (usage), and greedy output equals the engine's own for it."""
    from fd.api.config import ApiConfig
    from fd.compose import start_api
    from fd.control.connect import connect
    from tests.kit.faults import Engines

    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    api = None
    try:
        await engines.start("E")
        api = await start_api(
            lambda: connect(redis_server.url),
            keys,
            ApiConfig(model_dir=str(tiny_model_dir), tool_parser="hermes"),
            tokenizer=tiny_tokenizer,
        )
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ]
        text = tiny_tokenizer.apply_chat_template(
            [
                messages[0],
                {
                    **messages[1],
                    "content": "",
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
                },
                messages[2],
            ],
            tools=[WEATHER],
        )
        assert "<tools>" in text and '"get_weather"' in text and "<tool_response>" in text
        ids = tiny_tokenizer.encode(text)
        want = (
            LLM(tiny_runner, tiny_tokenizer)
            .generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
            .text
        )
        client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
        c = await client.chat.completions.create(
            model=api.cfg.model_name,
            messages=messages,
            tools=[WEATHER],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert c.usage.prompt_tokens == len(ids)
        assert c.choices[0].message.content == want and not c.choices[0].message.tool_calls
        async with aiohttp.ClientSession() as s:  # /tokenize takes the tools too, as vLLM's
            async with s.post(
                f"{api.url}/tokenize",
                json={"model": api.cfg.model_name, "messages": messages, "tools": [WEATHER]},
            ) as r:
                assert (await r.json())["tokens"] == ids
        await client.close()
    finally:
        if api is not None:
            await api.stop()
        await engines.stop_all()


async def test_the_openai_client_reads_the_calls(real_bus):
    """The official client's own types, streamed (its deltas by index) and not."""
    async with setup(real_bus, FakeEngine(real_bus, words=WORDS), tool_parser="hermes") as http:
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
        c = await client.chat.completions.create(model="tiny", messages=CHAT["messages"], tools=[WEATHER])
        msg = c.choices[0].message
        assert c.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look.\n"
        assert [(t.type, t.function.name, t.function.arguments) for t in msg.tool_calls] == [
            ("function", "get_weather", '{"city": "Paris"}'),
            ("function", "get_time", "{}"),
        ]
        stream = await client.chat.completions.create(
            model="tiny", messages=CHAT["messages"], tools=[WEATHER], stream=True
        )
        calls: dict[int, list] = {}
        reasons = []
        async for chunk in stream:
            for ch in chunk.choices:
                for t in ch.delta.tool_calls or ():
                    calls.setdefault(t.index, []).append((t.id, t.function.name, t.function.arguments))
                reasons.append(ch.finish_reason)
        assert [v[0][1:] for _, v in sorted(calls.items())] == [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", "{}"),
        ]
        assert reasons[-1] == "tool_calls"
        await client.close()


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
        },
    },
}


async def test_a_forced_call_is_what_the_model_answers(served):
    """tool_choice "required" or a named function makes the model's whole answer a call
    (guided decoding to the tools' schemas), with no server flag, as in vLLM: the random
    tiny model, whose free text is noise, returns calls whose arguments fit the schemas."""
    api, _ = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    kw = dict(
        model=api.cfg.model_name,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CITY, TIME],
        max_tokens=60,
    )
    c = await client.chat.completions.create(
        **kw, temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    ch = c.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None  # OpenAI's, for a named one
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    assert orjson.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    for seed in (1, 2, 3):  # (one call each: a random model may well list calls without end)
        c = await client.chat.completions.create(
            **kw, temperature=1.0, seed=seed, tool_choice="required", parallel_tool_calls=False
        )
        ch = c.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        for call in ch.message.tool_calls:
            args = orjson.loads(call.function.arguments)
            assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    # streamed: the calls come whole before the last chunk
    stream = await client.chat.completions.create(
        **kw, temperature=0, stream=True, tool_choice="required", parallel_tool_calls=False
    )
    calls = [
        t for chunk in [c async for c in stream] for chx in chunk.choices for t in chx.delta.tool_calls or ()
    ]
    assert calls and all(t.function.name in ("get_weather", "get_time") for t in calls)
    await client.close()


def test_forced_answers_read_as_calls():
    from fd.api.tool_calls import forced_calls

    assert forced_calls(
        "required", '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    ) == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]
    assert forced_calls("named:f", ' {"a": [1, 2]} ') == [ToolCall("f", '{"a": [1, 2]}')]
    # a named answer cut short is still its call, with the arguments so far (vLLM's)
    assert forced_calls("named:f", '{"a": ') == [ToolCall("f", '{"a": ')]
    for mode, cut in (("required", '[{"name": "f", "param'), ("required", "{}")):
        assert forced_calls(mode, cut) is None


async def test_a_forced_answer_cut_short(real_bus):
    """(The fake engine ignores the grammar: what a max_tokens cut leaves looks the same.) A
    named function's answer is its call whatever its text, as vLLM's; a ``required`` one that
    does not parse is shown as text."""
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        body = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        r = await (await client.post("/v1/chat/completions", json=body)).json()
        message = r["choices"][0]["message"]
        assert message["content"] is None
        assert [c["function"] for c in message["tool_calls"]] == [
            {"name": "get_weather", "arguments": "Hello, world!"}
        ]
        events = parse_sse(
            await (await client.post("/v1/chat/completions", json={**body, "stream": True})).read()
        )
        got = accumulate([orjson.loads(d) for _, d in events[:-1]])
        assert not got[0]["content"] and got[0]["calls"]
        sent = [
            decode(f).data.sampling.guided for _, f in await real_bus.redis.xrange(real_bus.keys.requests)
        ]
        assert sent and all(orjson.loads(g)["json"] == WEATHER["function"]["parameters"] for g in sent)
        required = {**CHAT, "tool_choice": "required"}
        r = await (await client.post("/v1/chat/completions", json=required)).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world!"}


# ----------------------------------------------------------------------------- llama3_json

LLAMA = (
    "<|python_",
    'tag|>{"name": "get_weather", ',
    '"parameters": {"city": "Paris"}}; ',
    '{"name": "get_time", "parameters": {}}',
)


@pytest.mark.parametrize(
    "text,want",
    [
        ("".join(LLAMA), ("", CALLS)),
        ('  {"name": "get_time", "arguments": {}}\n', ("", [ToolCall("get_time", "{}")])),
        ("The weather is fine.", ("The weather is fine.", [])),
        ('<b>bold</b> {"name": "x"}', ('<b>bold</b> {"name": "x"}', [])),  # calls only at the start
        ('{"name": "f", "parameters": {"a": 1}', ('{"name": "f", "parameters": {"a": 1}', [])),  # cut short
        ('{"no_name": 1}', ('{"no_name": 1}', [])),
        ("<|pyth", ("<|pyth", [])),
    ],
)
def test_llama3_json_reads_an_answer_that_is_the_calls(text, want):
    _same_parse_at_every_cut(text, "llama3_json", want)


def _same_parse_at_every_cut(text: str, name: str, want) -> None:
    """The whole text's parse, and the same however it is cut in three deltas."""
    from fd.api.tool_calls import make_parser

    assert parse_all(text, name) == want
    for cuts in itertools.combinations(range(1, len(text)), min(2, max(0, len(text) - 1))):
        p = make_parser(name)
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)))]
        items = [x for piece in pieces for x in p.feed(piece)] + p.finish()
        got = ("".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)])
        assert got == want, pieces


async def _two_calls_streamed_and_replayed(client, rid: str) -> None:
    """The scripted answer's two calls (get_weather for Paris, get_time), streamed as
    tool_calls, and replayed byte for byte."""
    resp = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": rid}
    )
    original = await resp.read()
    got = accumulate([orjson.loads(d) for _, d in parse_sse(original)[:-1]])
    assert got == {
        0: {
            "content": "",
            "finish_reason": "tool_calls",
            "calls": {
                0: {"id": call_id(rid, 0, 0), "name": "get_weather", "arguments": '{"city": "Paris"}'},
                1: {"id": call_id(rid, 0, 1), "name": "get_time", "arguments": "{}"},
            },
        }
    }
    assert await (await client.get(f"/v1/requests/{rid}/stream")).read() == original


async def test_llama3_json_calls_through_the_api(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=LLAMA), tool_parser="llama3_json") as client:
        await _two_calls_streamed_and_replayed(client, "ll1")
        body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
        message = body["choices"][0]["message"]
        assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == [
            "get_weather",
            "get_time",
        ]
    async with setup(
        real_bus, FakeEngine(real_bus, words=("Sunny", " today.")), tool_parser="llama3_json"
    ) as client:  # an answer that is not a call streams
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        chunks = [orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1]]
        texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert "".join(t or "" for t in texts) == "Sunny today." and "Sunny" in texts


# ----------------------------------------------------------------------------- pythonic

PY = ('[get_weather(city="Par', 'is"), get_time()]')


@pytest.mark.parametrize(
    "text,want",
    [
        ("".join(PY), ("", [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")])),
        (
            '<|python_start|>[f(a=1, b=[1, 2], c={"k": None})]<|python_end|>',
            ("", [ToolCall("f", '{"a": 1, "b": [1, 2], "c": {"k": null}}')]),
        ),
        ("The weather is fine.", ("The weather is fine.", [])),
        ("[1, 2, 3]", ("[1, 2, 3]", [])),  # a list, but not of calls
        ("[f(x)]", ("[f(x)]", [])),  # a positional argument: not a call fd can name
        ('[f(a=open("x"))]', ('[f(a=open("x"))]', [])),  # not a literal: never run
        ("[f(a=1)", ("[f(a=1)", [])),  # cut short
        ("[f(a={1, 2})]", ("[f(a={1, 2})]", [])),  # no JSON for a set
        ("<|python_st", ("<|python_st", [])),
    ],
)
def test_pythonic_reads_an_answer_that_is_a_list_of_calls(text, want):
    _same_parse_at_every_cut(text, "pythonic", want)


async def test_pythonic_calls_through_the_api(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, words=PY), tool_parser="pythonic") as client:
        await _two_calls_streamed_and_replayed(client, "py1")
    from fd.cli.main import build_parser

    assert (
        build_parser()
        .parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
        .tool_call_parser
        == "pythonic"
    )


# ----------------------------------------------------------------------------- mistral

MISTRAL = (
    "Let me check. ",
    "[TOOL_",
    'CALLS][{"name": "get_weather", "arguments": {"city": "Par',
    'is"}}, {"name": "get_time", "arguments": {}}]',
)
CALLS_2 = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]


@pytest.mark.parametrize(
    "text,want",
    [
        ("".join(MISTRAL), ("Let me check. ", CALLS_2)),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', ("", CALLS_2)),
        ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', ("", CALLS_2[:1])),
        ("[TOOL_CALLS]get_time{}", ("", CALLS_2[1:])),  # ([ARGS] skipped as special: split at the brace)
        ("The weather is fine [TOOL_ nope].", ("The weather is fine [TOOL_ nope].", [])),
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
            ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', []),
        ),
        ("[TOOL_CALLS][1, 2]", ("[TOOL_CALLS][1, 2]", [])),
        ("[TOOL_CALLS]f[ARGS]not json", ("[TOOL_CALLS]f[ARGS]not json", [])),
        ("[TOOL_CAL", ("[TOOL_CAL", [])),
    ],
)
def test_mistral_reads_content_then_the_calls(text, want):
    _same_parse_at_every_cut(text, "mistral", want)


async def test_mistral_calls_through_the_api(real_bus):
    """Calls read as vLLM's mistral parser reads them, with 9-character ids (what Mistral's
    chat templates take back), and the request keeps special tokens' text for the parser."""
    async with setup(real_bus, FakeEngine(real_bus, words=MISTRAL), tool_parser="mistral") as client:
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "mi"}
        )
        original = await resp.read()
        got = accumulate([orjson.loads(d) for _, d in parse_sse(original)[:-1]])
        assert got[0]["content"] == "Let me check. " and got[0]["finish_reason"] == "tool_calls"
        calls = got[0]["calls"]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", "{}"),
        ]
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls.values())
        assert [c["id"] for c in calls.values()] == [call_id("mi", 0, k, "mistral") for k in range(2)]
        assert await (await client.get("/v1/requests/mi/stream")).read() == original
        body = await (
            await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "mi2"})
        ).json()
        assert [c["id"] for c in body["choices"][0]["message"]["tool_calls"]] == [
            call_id("mi2", 0, k, "mistral") for k in range(2)
        ]
    reqs = [decode(f, e) for e, f in await real_bus.redis.xrange(real_bus.keys.requests)]
    assert reqs and all(r.data.sampling.skip_special_tokens is False for r in reqs)
