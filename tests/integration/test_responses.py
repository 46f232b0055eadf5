"""OpenAI's Responses API (``POST /v1/responses``) through the ``openai`` client's own
``responses.create``: text in and out on the real tiny model (greedy output equal to the
engine's own on the chat-templated prompt), its typed stream with sequence numbers, a replay
from the request's stream that sends the same bytes, structured output by ``text.format``,
and a 400 for what it does not serve."""

from __future__ import annotations

import json
import logging

import aiohttp
import openai
import pytest

from fd.control.events import Abort, Accepted, decode
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM


def _prompt(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _greedy(runner, tokenizer, ids, n):
    return LLM(runner, tokenizer).generate(
        [list(ids)], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )[0]


async def test_text_in_text_out(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    ids = _prompt(tiny_tokenizer, [{"role": "user", "content": "Hello there"}])
    want = _greedy(tiny_runner, tiny_tokenizer, ids, 5)
    r = await oa.responses.create(
        model=api.cfg.model_name,
        input="Hello there",
        max_output_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "response" and r.output_text == want.text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(ids), 5, len(ids) + 5)
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].status == "incomplete"  # (cut with the response, as OpenAI marks it)
    # instructions and messages (text parts too) are the chat's system and turns
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    ids = _prompt(tiny_tokenizer, messages)
    r = await oa.responses.create(
        model=api.cfg.model_name,
        instructions="Be brief.",
        max_output_tokens=3,
        temperature=0,
        input=[
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
        ],
        extra_body={"ignore_eos": True},
    )
    assert (
        r.usage.input_tokens == len(ids)
        and r.output_text == _greedy(tiny_runner, tiny_tokenizer, ids, 3).text
    )
    # a response that ended by itself is completed
    r = await oa.responses.create(
        model=api.cfg.model_name,
        input="Hi",
        max_output_tokens=4,
        extra_body={"logit_bias": {str(tiny_runner.eos_token_ids[0]): 100}},
    )
    assert r.status == "completed" and r.incomplete_details is None and r.usage.output_tokens == 1
    assert all(it.status == "completed" for it in r.output)


async def test_the_stream_its_sequence_and_a_replay(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    ids = _prompt(tiny_tokenizer, [{"role": "user", "content": "Stream it"}])
    want = _greedy(tiny_runner, tiny_tokenizer, ids, 6)
    stream = await oa.responses.create(
        model=api.cfg.model_name,
        input="Stream it",
        max_output_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    events = [ev async for ev in stream]
    kinds = [ev.type for ev in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert text == want.text == events[-4].text
    last = events[-1].response
    assert (
        last.output_text == want.text and last.usage.output_tokens == 6 and last.id == events[0].response.id
    )
    # the stream's bytes: typed frames, no [DONE]; a replay from the request's stream is the same
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{api.url}/v1/responses",
            headers={"X-Request-Id": "resp-bytes"},
            json={"input": "Stream it", "max_output_tokens": 3, "stream": True},
        ) as r:
            original = await r.read()
        async with s.get(f"{api.url}/v1/requests/resp-bytes/stream") as r:
            assert await r.read() == original
    frames = original.decode().strip().split("\n\n")  # (no id: lines unless asked for)
    assert all(f.split("\n")[0] == "event: " + json.loads(f.split("\n")[1][6:])["type"] for f in frames)
    assert b"[DONE]" not in original
    story = [decode(f) for _, f in await api.bus.redis.xrange(api.bus.keys.req("resp-bytes"))]
    assert isinstance(story[0], Accepted) and story[0].endpoint == "responses"


async def test_structured_output_by_text_format(openai_client):
    api, oa = openai_client
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = await oa.responses.create(
        model=api.cfg.model_name,
        input="x",
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
    )
    assert r.status == "completed" and json.loads(r.output_text)["a"] in (1, 2)


async def test_an_abort_ends_the_stream_as_incomplete(openai_client):
    api, oa = openai_client
    stream = await oa.responses.create(
        model=api.cfg.model_name,
        input="go on",
        max_output_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    rid, events = None, []
    async for ev in stream:
        events.append(ev)
        if ev.type == "response.created":
            rid = ev.response.id
        if ev.type == "response.output_text.delta" and rid is not None:
            await api.bus.publish(api.bus.keys.control, Abort(request_ids=(rid,)))
            rid = None  # (once)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert events[-1].response.incomplete_details.reason == "cancelled"
    assert events[-1].response.usage.output_tokens < 2000


async def test_what_it_does_not_serve_is_a_400(openai_client, caplog):
    api, _ = openai_client
    for body, param in (
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        # (auto, the default, needs a server with a tool-call parser, as chat's)
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "file_search_call", "id": "1"}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {
                "instructions": "Be brief.",
                "input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}],
            },
            "input[1].role",
        ),
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": api.cfg.max_model_len}, "input"),  # (OpenAI's param)
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{api.url}/v1/responses", json=body) as r:
                out = await r.json()
        assert r.status == 400 and out["error"]["param"] == param, (body, out)
    # every field its OpenAPI schema lists is read
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/openapi.json") as r:
            props = (await r.json())["components"]["schemas"]["ResponsesRequest"]["properties"]
        with caplog.at_level(logging.WARNING, logger="fd.api"):
            async with s.post(
                f"{api.url}/v1/responses",
                json={**{k: None for k in props}, "input": "x", "max_output_tokens": 1},
            ) as r:
                assert r.status == 200, await r.text()
    assert not [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]


async def test_a_client_that_hangs_up_aborts_its_response(openai_client):
    """/v1/responses is a generating endpoint like the others: a hang-up mid-stream runs the
    abort protocol, and the story ends with the abort's final."""
    import asyncio

    from fd.control.events import Final

    api, _ = openai_client
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{api.url}/v1/responses",
            headers={"X-Request-Id": "resp-gone"},
            json={"input": "x", "max_output_tokens": 2000, "stream": True, "ignore_eos": True},
        ) as r:
            async for line in r.content:
                if line.startswith(b"event: response.output_text.delta"):
                    break
    for _ in range(200):
        story = [decode(f) for _, f in await api.bus.redis.xrange(api.bus.keys.req("resp-gone"))]
        finals = [ev for ev in story if isinstance(ev, Final)]
        if finals:
            break
        await asyncio.sleep(0.02)
    assert finals and finals[0].finish_reason == "abort"
    assert [type(ev).__name__ for ev in story][-3:] == ["Drained", "BlocksReleased", "Final"]


# ------------------------------------------------------------------ tools and thinking (scripted text)

WORDS = (
    "<think>I could",
    " call it.</th",
    "ink>Checking.",
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
)
TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


async def test_thinking_text_and_calls_are_items_in_order(real_bus):
    from fd.api.tool_calls import call_id
    from tests.kit.api import FakeEngine, parse_sse, setup

    want = [
        {"type": "reasoning", "text": "I could call it."},
        {"type": "message", "text": "Checking."},
        {"type": "function_call", "name": "get_time", "arguments": '{"tz": "UTC"}'},
    ]

    def items(output: list[dict]) -> list[dict]:
        out = []
        for it in output:
            if it["type"] == "function_call":
                out.append({k: it[k] for k in ("type", "name", "arguments")})
            else:
                out.append({"type": it["type"], "text": it["content"][0]["text"]})
        return out

    body = {"model": "tiny", "input": "What time is it?", "tools": [TOOL]}
    async with setup(
        real_bus, FakeEngine(real_bus, words=WORDS), reasoning_parser="qwen3", tool_parser="hermes"
    ) as client:
        r = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "resp-t1"})
        out = await r.json()
        assert r.status == 200 and items(out["output"]) == want, out
        assert out["output"][2]["call_id"] == call_id("resp-t1", 0, 0) and out["status"] == "completed"
        r = await client.post(
            "/v1/responses", json={**body, "stream": True}, headers={"X-Request-Id": "resp-t2"}
        )
        original = await r.read()
        chunks = [json.loads(d) for _, d in parse_sse(original)]
        assert [c["sequence_number"] for c in chunks] == list(range(len(chunks)))
        kinds = [c["type"] for c in chunks]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert items(chunks[-1]["response"]["output"]) == want
        thought = "".join(c["delta"] for c in chunks if c["type"] == "response.reasoning_text.delta")
        said = "".join(c["delta"] for c in chunks if c["type"] == "response.output_text.delta")
        assert (thought, said) == ("I could call it.", "Checking.")
        # each item added before its deltas and done after them, one item at a time
        added = [c["output_index"] for c in chunks if c["type"] == "response.output_item.added"]
        done = [c["output_index"] for c in chunks if c["type"] == "response.output_item.done"]
        assert added == done == [0, 1, 2]
        assert kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")
        assert await (await client.get("/v1/requests/resp-t2/stream")).read() == original
        # the openai client reads the same
        oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
        res = await oa.responses.create(model="tiny", input="What time is it?", tools=[TOOL])
        assert [it.type for it in res.output] == ["reasoning", "message", "function_call"]
        assert res.output_text == "Checking." and res.output[2].name == "get_time"
        await oa.close()


async def test_earlier_calls_and_their_outputs_reach_the_template(openai_client, tiny_tokenizer):
    api, oa = openai_client
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    messages = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    async with aiohttp.ClientSession() as s:  # the same conversation as chat's
        async with s.post(f"{api.url}/tokenize", json={"messages": messages, "tools": chat_tools}) as t:
            ids = (await t.json())["tokens"]
    assert "12:00" in tiny_tokenizer.decode(ids) and "get_time" in tiny_tokenizer.decode(ids)
    r = await oa.responses.create(
        model=api.cfg.model_name,
        max_output_tokens=1,
        tools=[tool],
        tool_choice="none",
        input=[
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        ],
    )
    assert r.usage.input_tokens == len(ids)


def _pick_tool(choices: list[int]) -> dict:
    """A function tool whose one argument ``n`` is one of ``choices``."""
    return {
        "type": "function",
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"n": {"enum": choices}},
            "required": ["n"],
            "additionalProperties": False,
        },
    }


async def _pick(api, oa, tool: dict, text: str):
    """A response that must call ``tool`` (a named tool choice)."""
    return await oa.responses.create(
        model=api.cfg.model_name,
        input=text,
        max_output_tokens=30,
        tools=[tool],
        tool_choice={"type": "function", "name": "pick"},
    )


async def test_a_named_tool_choice_answers_with_the_call(openai_client):
    api, oa = openai_client
    tool = _pick_tool([1, 2, 3])
    r = await _pick(api, oa, tool, "Pick one")
    (call,) = r.output
    assert (
        call.type == "function_call" and call.name == "pick" and json.loads(call.arguments)["n"] in (1, 2, 3)
    )


# ------------------------------------------------------------------ retrieve, resume, cancel


async def test_retrieve_a_response_and_resume_its_stream(openai_client):
    """The output lives in the request's stream, so a response can be retrieved (OpenAI's
    ``responses.retrieve``) and its stream picked up after the last event a client saw
    (``starting_after``), from any replica, while it runs (fd's ``background``) or after."""
    api, oa = openai_client
    r = await oa.responses.create(model=api.cfg.model_name, input="Keep this", max_output_tokens=4)
    got = await oa.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    stream = await oa.responses.create(
        model=api.cfg.model_name,
        input="Go on",
        max_output_tokens=40,
        stream=True,
        extra_body={"background": True, "ignore_eos": True},
    )
    seen = []
    async for ev in stream:
        seen.append(ev)
        if ev.type == "response.output_text.delta":
            break  # the client goes away; the response runs on
    await stream.close()
    rid = seen[0].response.id
    rest = [
        ev
        async for ev in await oa.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
    ]
    assert [ev.sequence_number for ev in seen + rest] == list(range(len(seen) + len(rest)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 40
    text = "".join(ev.delta for ev in seen + rest if ev.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == (await oa.responses.retrieve(rid)).output_text
    for missing in ("resp-none", seen[0].response.id + "x"):
        with pytest.raises(openai.NotFoundError):
            await oa.responses.retrieve(missing)
    chat = await oa.chat.completions.create(
        model=api.cfg.model_name, max_tokens=1, messages=[{"role": "user", "content": "x"}]
    )
    with pytest.raises(openai.NotFoundError):  # a chat completion is not a response
        await oa.responses.retrieve(chat.id)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/v1/responses/{rid}?stream=true&starting_after=x") as resp:
            assert resp.status == 400


async def test_cancel_a_running_response(openai_client):
    api, oa = openai_client
    stream = await oa.responses.create(
        model=api.cfg.model_name,
        input="Go on",
        max_output_tokens=2000,
        stream=True,
        extra_body={"background": True, "ignore_eos": True},
    )
    async for ev in stream:
        if ev.type == "response.created":
            rid = ev.response.id
        if ev.type == "response.output_text.delta":
            break
    await stream.close()
    r = await oa.responses.cancel(rid)
    assert r.status == "cancelled" and r.usage.output_tokens < 2000
    assert (await oa.responses.retrieve(rid)).status == "cancelled"
    assert (await oa.responses.cancel(rid)).status == "cancelled"  # (again: as it ended)


# ------------------------------------------------------------------ previous_response_id


async def test_a_conversation_goes_on_from_a_stored_response(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    r1 = await oa.responses.create(
        model=api.cfg.model_name,
        input="Hi there",
        max_output_tokens=3,
        temperature=0,
        instructions="Be brief.",
    )
    r2 = await oa.responses.create(
        model=api.cfg.model_name,
        previous_response_id=r1.id,
        input="And then?",
        max_output_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # (instructions are not carried over, as OpenAI's)
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And then?"},
    ]
    ids = _prompt(tiny_tokenizer, messages)
    assert r2.usage.input_tokens == len(ids)
    assert r2.output_text == _greedy(tiny_runner, tiny_tokenizer, ids, 3).text
    kept = await oa.responses.input_items.list(r2.id, order="asc")
    assert [it.role for it in kept.data] == ["user", "assistant", "user"]
    # a chain goes on from the last link
    r3 = await oa.responses.create(
        model=api.cfg.model_name, previous_response_id=r2.id, input="Ok.", max_output_tokens=1
    )
    ids = _prompt(
        tiny_tokenizer,
        [*messages, {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Ok."}],
    )
    assert r3.usage.input_tokens == len(ids)
    # store false keeps nothing to go on from
    r4 = await oa.responses.create(model=api.cfg.model_name, input="x", max_output_tokens=1, store=False)
    for prev in (r4.id, "resp-unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            await oa.responses.create(model=api.cfg.model_name, previous_response_id=prev, input="y")
        assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        await oa.responses.create(model=api.cfg.model_name, previous_response_id="bad id!", input="y")


async def test_a_call_and_its_output_go_on_from_a_stored_response(openai_client, tiny_tokenizer):
    api, oa = openai_client
    tool = _pick_tool([1, 2])
    r1 = await _pick(api, oa, tool, "Pick")
    (call,) = r1.output
    r2 = await oa.responses.create(
        model=api.cfg.model_name,
        previous_response_id=r1.id,
        max_output_tokens=1,
        tools=[tool],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}],
    )
    chat = {
        "messages": [
            {"role": "user", "content": "Pick"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "pick", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {k: tool[k] for k in ("name", "parameters")}}],
    }
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{api.url}/tokenize", json=chat) as t:
            assert r2.usage.input_tokens == len((await t.json())["tokens"])


async def test_background_is_answered_at_once_and_polled(openai_client):
    """OpenAI's background mode: the create call answers queued at once; the response runs on
    and is polled with retrieve."""
    import asyncio

    api, oa = openai_client
    r = await oa.responses.create(
        model=api.cfg.model_name,
        input="Go",
        max_output_tokens=40,
        background=True,
        extra_body={"ignore_eos": True},
    )
    assert r.status == "queued" and r.output == []
    for _ in range(200):
        r = await oa.responses.retrieve(r.id)
        if r.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    assert r.status == "incomplete" and r.usage.output_tokens == 40 and r.output_text


async def test_the_answers_logprobs_when_included(openai_client):
    """OpenAI's ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: one entry a
    generated token, the same as chat's for the same conversation; streamed, the deltas carry
    them in order and the done event has them all; retrieve shows them again."""
    api, oa = openai_client
    kw = dict(
        model=api.cfg.model_name,
        input="Name a colour.",
        max_output_tokens=6,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    r = await oa.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 6 and all(len(x.top_logprobs) == 2 for x in lps)
    chat = await oa.chat.completions.create(
        model=api.cfg.model_name,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Name a colour."}],
    )
    want = chat.choices[0].logprobs.content
    assert [(x.token, x.bytes) for x in lps] == [(x.token, x.bytes) for x in want]
    assert [x.logprob for x in lps] == pytest.approx([x.logprob for x in want], abs=1e-4)
    assert [[t.token for t in x.top_logprobs] for x in lps] == [
        [t.token for t in x.top_logprobs] for x in want
    ]
    deltas, done = [], None
    async for ev in await oa.responses.create(**kw, stream=True):
        if ev.type == "response.output_text.delta":
            deltas += ev.logprobs
        elif ev.type == "response.output_text.done":
            done = ev.logprobs
    assert [x.token for x in deltas] == [x.token for x in done] == [x.token for x in lps]
    again = await oa.responses.retrieve(r.id)
    assert [x.token for x in again.output[0].content[0].logprobs] == [x.token for x in lps]
    # not asked: none; a value fd cannot give: refused
    plain = await oa.responses.create(model=api.cfg.model_name, input="Name a colour.", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as e:
        await oa.responses.create(model=api.cfg.model_name, input="x", include=["file_search_call.results"])
    assert e.value.body["param"] == "include"
