"""What OpenAI's own clients (the ``openai`` SDK, LangChain, LiteLLM) read of a response beyond
its text (#44 item 6), through the ``openai`` SDK against API + engine on the tiny model: the
request's fields a Response echoes, on create, in its stream and on retrieve; input items with
ids the SDK parses; cancel of a response that is not ``background`` refused as OpenAI and vLLM
refuse it; a named ``tool_choice`` cut by ``max_tokens`` still answered as the call (vLLM's);
and a context-length error in OpenAI's words, which LiteLLM classifies."""

from __future__ import annotations

import json
import os

import openai
import orjson
import pytest
from openai.types.responses import (
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseOutputMessage,
)

from fd.api.errors import context_length_exceeded
from fd.api.tool_calls import ToolCall, forced_calls

ECHOED = (
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "background",
    "metadata",
    "previous_response_id",
    "tool_choice",
    "tools",
    "text",
    "truncation",
    "parallel_tool_calls",
    "user",
)
PICK = {
    "type": "function",
    "name": "pick",
    "description": "Pick a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _echo(r) -> dict:
    """The echoed fields of a Response as the server sent them (not the SDK's defaults for
    what it left out; ``store``, not in the SDK's model, rides as an extra field)."""
    d = r.model_dump(mode="json", exclude_unset=True)
    return {k: d.get(k, "<missing>") for k in (*ECHOED, "store")}


# ----------------------------------------------------------------------------- echoed fields


async def test_a_response_echoes_its_request_on_create_stream_and_retrieve(openai_client):
    api, oa = openai_client
    sent = dict(
        instructions="Be brief.",
        max_output_tokens=3,
        temperature=0.5,
        top_p=0.75,
        metadata={"job": "nightly", "team": "a"},
        store=True,
        tools=[PICK],
        tool_choice="none",
        text={"format": {"type": "text"}},
        truncation="disabled",
        parallel_tool_calls=False,
        user="someone",
    )
    r = await oa.responses.create(model=api.cfg.model_name, input="Hi", **sent)
    want = {**sent, "background": False, "previous_response_id": None}
    assert _echo(r) == want
    got = await oa.responses.retrieve(r.id)
    assert _echo(got) == want and got.model_dump() == r.model_dump()
    # previous_response_id as the client sent it, though the request ran on its conversation
    r2 = await oa.responses.create(
        model=api.cfg.model_name, input="And?", previous_response_id=r.id, max_output_tokens=2
    )
    assert r2.previous_response_id == r.id == (await oa.responses.retrieve(r2.id)).previous_response_id
    # streamed: the created, in-progress and terminal events' Response echo it too
    events = [
        ev
        async for ev in await oa.responses.create(model=api.cfg.model_name, input="Hi", stream=True, **sent)
    ]
    carried = [ev.response for ev in events if hasattr(ev, "response")]
    assert [ev.type for ev in events if hasattr(ev, "response")] == [
        "response.created",
        "response.in_progress",
        "response.incomplete",
    ]
    assert all(_echo(x) == want for x in carried)
    replay = [
        ev async for ev in await oa.responses.retrieve(carried[0].id, stream=True)
    ]  # (from the story: the same echo)
    assert all(_echo(ev.response) == want for ev in replay if hasattr(ev, "response"))


async def test_what_a_response_echoes_when_the_request_sent_nothing(openai_client):
    api, oa = openai_client
    d = api.cfg.sampling_defaults
    r = await oa.responses.create(model=api.cfg.model_name, input="Hi", max_output_tokens=1)
    want = {
        "instructions": None,
        "max_output_tokens": 1,
        "temperature": float(d.get("temperature", 1.0)),  # (what it ran with: the model's default)
        "top_p": float(d.get("top_p", 1.0)),
        "background": False,
        "metadata": {},
        "previous_response_id": None,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "parallel_tool_calls": True,
        "user": None,
        "store": True,
    }
    assert _echo(r) == want == _echo(await oa.responses.retrieve(r.id))
    # background: the queued answer says so, and so does every retrieve after it
    b = await oa.responses.create(model=api.cfg.model_name, input="Hi", max_output_tokens=1, background=True)
    assert b.status == "queued" and b.background is True
    assert (await oa.responses.retrieve(b.id)).background is True
    s = await oa.responses.create(model=api.cfg.model_name, input="Hi", max_output_tokens=1, store=False)
    assert (await oa.responses.retrieve(s.id)).model_extra["store"] is False
    for metadata in ({"k": 1}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, "x"):
        with pytest.raises(openai.BadRequestError) as e:
            await oa.responses.create(model=api.cfg.model_name, input="Hi", metadata=metadata)
        assert e.value.body["param"] == "metadata"


# ----------------------------------------------------------------------------- input items


async def test_input_items_have_ids_and_the_sdks_types(openai_client):
    api, oa = openai_client
    given = [
        {"role": "user", "content": "Time?"},
        {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Noon."}]},
        {"id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
    ]
    r = await oa.responses.create(model=api.cfg.model_name, input=given, max_output_tokens=1)
    page = await oa.responses.input_items.list(r.id, order="asc")
    items = page.data
    assert [type(it) for it in items] == [
        ResponseInputMessageItem,
        ResponseFunctionToolCallItem,
        ResponseFunctionToolCallOutputItem,
        ResponseOutputMessage,
        ResponseInputMessageItem,
    ]
    assert all(it.status == "completed" for it in items)
    ids = [it.id for it in items]
    assert all(ids) and len(set(ids)) == len(ids) and ids[-1] == "msg_mine"  # (the client's kept)
    assert ids[0].startswith("msg_") and ids[1].startswith("fc_")
    assert [it.id for it in (await oa.responses.input_items.list(r.id, order="asc")).data] == ids  # stable
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Time?"
    assert items[3].content[0].type == "output_text" and items[3].content[0].text == "Noon."
    assert (items[1].call_id, items[1].name, items[2].output) == ("c1", "get_time", "12:00")
    # a string input is one user message with an id too
    r = await oa.responses.create(model=api.cfg.model_name, input="Hello", max_output_tokens=1)
    (only,) = (await oa.responses.input_items.list(r.id)).data
    assert isinstance(only, ResponseInputMessageItem) and only.id.startswith("msg_")
    assert only.role == "user" and only.content[0].text == "Hello"


# ----------------------------------------------------------------------------- cancel


async def test_only_a_background_response_is_cancelled(openai_client):
    """OpenAI: "Only responses created with background=true can be cancelled"; vLLM: "Cannot
    cancel a synchronous response." (400, param response_id)."""
    api, oa = openai_client
    r = await oa.responses.create(model=api.cfg.model_name, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        await oa.responses.cancel(r.id)
    assert e.value.status_code == 400 and e.value.body["param"] == "response_id"
    assert "background=true" in e.value.message and "synchronous" in e.value.message
    assert (await oa.responses.retrieve(r.id)).status == r.status  # (untouched)
    streamed = [
        ev
        async for ev in await oa.responses.create(
            model=api.cfg.model_name, input="Hi", max_output_tokens=2, stream=True
        )
    ]
    with pytest.raises(openai.BadRequestError):
        await oa.responses.cancel(streamed[0].response.id)
    # a background one is cancelled, and, ended, answers as it ended
    b = await oa.responses.create(model=api.cfg.model_name, input="Go", max_output_tokens=1, background=True)
    for _ in range(2):
        assert (await oa.responses.cancel(b.id)).id == b.id


# ----------------------------------------------------------------------------- named tool_choice


CITY = {"type": "function", "function": {k: PICK[k] for k in ("name", "description", "parameters")}}


def test_a_named_answer_cut_short_is_still_the_call():
    assert forced_calls("named:f", '{"a": ') == [ToolCall("f", '{"a": ')]  # (as written so far)
    assert forced_calls("named:f", ' {"a": 1} ') == [ToolCall("f", '{"a": 1}')]
    assert forced_calls("named:f", "") is None  # (nothing written: no call)
    assert forced_calls("required", '[{"name": "f", "param') is None


async def test_a_named_tool_choice_cut_by_max_tokens_answers_the_call(openai_client):
    """vLLM's: the call with the arguments written so far, finish_reason ``length`` (guided
    decoding makes the random tiny model's answer the tool's JSON, so greedy it is the same
    answer, whole or cut)."""
    api, oa = openai_client
    kw = dict(
        model=api.cfg.model_name,
        messages=[{"role": "user", "content": "Where?"}],
        tools=[CITY],
        tool_choice={"type": "function", "function": {"name": "pick"}},
        temperature=0,
    )
    whole = (await oa.chat.completions.create(**kw, max_tokens=60)).choices[0]
    (call,) = whole.message.tool_calls
    assert whole.finish_reason == "stop" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    cut = (await oa.chat.completions.create(**kw, max_tokens=2)).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (part,) = cut.message.tool_calls
    assert part.function.name == "pick" and part.function.arguments.strip()
    assert call.function.arguments.startswith(part.function.arguments.strip())
    with pytest.raises(ValueError):
        json.loads(part.function.arguments)  # (cut short: not yet JSON)
    # streamed: the call's delta, then finish_reason length
    chunks = [c async for c in await oa.chat.completions.create(**kw, max_tokens=2, stream=True)]
    deltas = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()]
    assert [(t.function.name, t.function.arguments) for t in deltas] == [("pick", part.function.arguments)]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]
    assert not any(ch.delta.content for c in chunks for ch in c.choices)
    # the Responses API: the function_call item, incomplete with the response
    r = await oa.responses.create(
        model=api.cfg.model_name,
        input="Where?",
        tools=[PICK],
        tool_choice={"type": "function", "name": "pick"},
        temperature=0,
        max_output_tokens=2,
    )
    (item,) = r.output
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (item.type, item.name, item.status) == ("function_call", "pick", "incomplete")
    assert item.arguments == part.function.arguments
    assert (await oa.responses.retrieve(r.id)).output[0].arguments == item.arguments


# ----------------------------------------------------------------------------- context length


def test_the_context_length_message_is_openais():
    e = context_length_exceeded(64, 60, 10, "messages")
    assert e.message == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(60 in the messages, 10 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages")
    assert context_length_exceeded(64, 80, None, "messages").message == (
        "This model's maximum context length is 64 tokens. However, your messages resulted in 80 "
        "tokens. Please reduce the length of the messages."
    )


async def test_a_prompt_too_long_is_openais_context_length_error(openai_client):
    api, oa = openai_client
    n = api.cfg.max_model_len
    cases = [
        (oa.chat.completions.create, {"messages": [{"role": "user", "content": "x " * n}]}, "messages"),
        (
            oa.chat.completions.create,
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": n},
            "messages",
        ),
        (oa.completions.create, {"prompt": "x " * n}, "prompt"),
        (oa.completions.create, {"prompt": "x", "max_tokens": n}, "prompt"),
        (oa.responses.create, {"input": "x " * n}, "input"),
        (oa.responses.create, {"input": "x", "max_output_tokens": n}, "input"),
    ]
    for call, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await call(model=api.cfg.model_name, **kw)
        err = e.value
        assert err.code == "context_length_exceeded" and err.param == param, err.body
        assert f"This model's maximum context length is {n} tokens. However, " in err.message
    # (the counts, where a length was asked: what some clients read back)
    with pytest.raises(openai.BadRequestError) as e:
        await oa.chat.completions.create(
            model=api.cfg.model_name, messages=[{"role": "user", "content": "x"}], max_tokens=n
        )
    prompt = e.value.body["message"].split("(")[1].split(" in the messages")[0]
    assert f"you requested {int(prompt) + n} tokens ({prompt} in the messages, {n} in the completion)" in (
        e.value.message
    )


async def test_litellm_classifies_it_as_a_context_window_error(openai_client):
    """LiteLLM matches OpenAI's words ("This model's maximum context length is") to raise its
    ContextWindowExceededError, which routers act on (a fallback to a longer context)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no fetch at import)
    import litellm

    api, _ = openai_client
    for provider in ("openai", "hosted_vllm"):
        with pytest.raises(litellm.ContextWindowExceededError):
            await litellm.acompletion(
                model=f"{provider}/{api.cfg.model_name}",
                api_base=f"{api.url}/v1",
                api_key="none",
                messages=[{"role": "user", "content": "x " * api.cfg.max_model_len}],
                num_retries=0,
            )
    body = orjson.loads(orjson.dumps(context_length_exceeded(8, 9, None, "messages").body()))
    assert litellm.litellm_core_utils.exception_mapping_utils.ExceptionCheckers.is_error_str_context_window_exceeded(
        body["error"]["message"]
    )


async def test_input_items_page_as_openais_newest_first(openai_client):
    """OpenAI's paging: ``limit`` (default 20), ``order`` (default ``desc``), ``after`` /
    ``before``; the SDK's auto-paging walks every item with ``after``."""
    api, oa = openai_client
    given = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    r = await oa.responses.create(model=api.cfg.model_name, input=given, max_output_tokens=1)
    texts = lambda items: [it.content[0].text for it in items]  # noqa: E731
    page = await oa.responses.input_items.list(r.id, limit=2)
    assert texts(page.data) == ["m4", "m3"] and page.has_more and page.last_id == page.data[-1].id
    assert texts([it async for it in oa.responses.input_items.list(r.id, limit=2)]) == [
        "m4",
        "m3",
        "m2",
        "m1",
        "m0",
    ]
    asc = await oa.responses.input_items.list(r.id, order="asc")
    assert texts(asc.data) == ["m0", "m1", "m2", "m3", "m4"] and not asc.has_more
    after = await oa.responses.input_items.list(r.id, order="asc", after=asc.data[1].id, limit=2)
    assert texts(after.data) == ["m2", "m3"] and after.has_more
    # (``before``, which the SDK no longer names, as a plain query parameter)
    before = await oa.responses.input_items.list(r.id, order="asc", extra_query={"before": asc.data[2].id})
    assert texts(before.data) == ["m0", "m1"]
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError) as e:
            await oa.responses.input_items.list(r.id, **bad)
        assert e.value.body["param"] == next(iter(bad))
