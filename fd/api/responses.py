"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it: the request becomes a
chat request, and its events render as a Response object or its stream of typed events.

Sans-IO, like :mod:`fd.api.protocol`: :func:`parse` turns a body into the
:class:`~fd.api.protocol.GenerationRequest` of the chat request it stands for (endpoint
``responses``), and :class:`~fd.api.responses_renderer.ResponsesRenderer` turns the request's events into what the client
sees. Everything the rendering needs is in the ``accepted`` event (the endpoint, the tool and
reasoning parsers, the request fields the Response echoes: :func:`echo_of`), so a replay from any replica (``GET /v1/requests/<id>/stream``) sends the
same events, sequence numbers included.

Served: text input (a string, or messages whose content is text, earlier ``function_call``
and ``function_call_output`` items), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (structured outputs), function ``tools`` with ``tool_choice`` (as
chat's: ``auto`` needs a server with a tool-call parser), a reasoning model's thinking as a
``reasoning`` item (``--reasoning-parser``), vLLM's sampling extensions, fd's ``background``.
``previous_response_id`` goes on from a stored response (the server keeps each response's
conversation beside its story, :func:`input_items` and :func:`output_as_input`). Refused with
a 400, not ignored: tools other than functions, and input other than text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

import orjson

from fd.api.errors import ApiError, bad_request
from fd.api.protocol import GenerationRequest, parse_chat
from fd.api.validation import Body, Limits, is_bool, is_int, is_num, opt
from fd.control.tokenizer import TokenizerLike

_TEXT_PARTS = ("input_text", "output_text", "text")
#: chat's fields that mean nothing here (several choices, chat's log-probabilities): left out
#: of the chat request, and said to be ignored if sent
_CHAT_ONLY = (
    "messages",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "response_format",
    "return_token_ids",
)


def _text(content: Any, where: str) -> Any:
    if not isinstance(content, list):
        return content
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise bad_request(
                f"{where}.content[{j}] must be a text part ({', '.join(_TEXT_PARTS)}).",
                f"{where}.content[{j}]",
                "unsupported",
            )
        out.append({"type": "text", "text": part.get("text")})
    return out


def _messages(body: Body | dict) -> tuple[list[dict], list[str]]:
    """``instructions`` and ``input`` as chat's ``messages`` (validated by chat's parse), and
    where each came from (``input[i]``, ``instructions``), for naming what chat's parse finds
    wrong with one."""
    given = body.get("input")
    if given is None:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    origin: list[str] = []
    if isinstance(given, str):
        out: list[dict] = [{"role": "user", "content": given}]
        origin.append("input")
    elif isinstance(given, list) and given:
        out = []
        for i, item in enumerate(given):
            if len(origin) < len(out):
                origin.append(f"input[{i - 1}]")
            kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
            where = f"input[{i}]"
            if kind == "message":
                out.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
            elif kind == "function_call":  # an earlier answer's call: the assistant's
                call = {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), where),
                    }
                )
            elif kind == "reasoning":
                continue  # an earlier answer's thinking: the template shows the answers only
            else:
                raise bad_request(
                    f"{where} is a {kind!r} item; messages, function_call and "
                    "function_call_output items are supported here.",
                    where,
                    "unsupported",
                )
        if len(origin) < len(out):
            origin.append(f"input[{len(given) - 1}]")
    else:
        raise bad_request("'input' must be a string or a non-empty list of items.", "input", "invalid_type")
    instructions = opt(body, "instructions", lambda v: isinstance(v, str), "a string", None)
    if instructions:
        out.insert(0, {"role": "system", "content": instructions})
        origin.insert(0, "instructions")
    return out, origin


def _tools(body: Body | dict) -> tuple[Any, Any]:
    """``tools`` and ``tool_choice`` in chat's shape (functions are flat here)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        chat_tools = []
        for j, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad_request(
                    f"tools[{j}]: only function tools are supported here.", f"tools[{j}]", "unsupported"
                )
            chat_tools.append(
                {
                    "type": "function",
                    "function": {
                        k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None
                    },
                }
            )
        tools = chat_tools or None
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def _format(body: Body | dict) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    text = opt(body, "text", lambda v: isinstance(v, dict), "an object", None)
    if not text or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            "'text.format.type' must be text, json_object or json_schema.", "text.format", "invalid_value"
        )
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}
    return {"type": fmt["type"]}


_RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def _rename(e: ApiError, origin: list[str]) -> None:
    """An error of chat's parse, named in this request's terms."""
    param = e.param or ""
    m = re.match(r"messages\[(\d+)\]", param)
    if m is not None and int(m.group(1)) < len(origin):
        e.param = origin[int(m.group(1))] + param[m.end() :]
        e.message = e.message.replace(m.group(0), origin[int(m.group(1))], 1)
    elif param == "messages":
        e.param = "input"
    else:
        for chat_name, name in _RENAMED.items():
            if param.startswith(chat_name):
                e.param = name + param[len(chat_name) :]
                e.message = e.message.replace(f"'{chat_name}'", f"'{name}'")
                break


def input_items(body: Body | dict) -> list:
    """``input`` as a list of items (a string is one user message), as it is kept for a
    response that continues this one."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": given}]}]
    return list(given) if isinstance(given, list) else []


def output_as_input(output: list[dict]) -> list[dict]:
    """A response's output as the input items of the conversation that goes on from it: its
    messages and calls (its thinking is not shown again, as chat templates leave it out)."""
    out: list[dict] = []
    for it in output:
        if it.get("type") == "message":
            out.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": c.get("text", "")} for c in it["content"]],
                }
            )
        elif it.get("type") == "function_call":
            out.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
    return out


#: What a Response echoes of a request whose story carries no echo (a story of an earlier
#: release): unknown is null, except where OpenAI's object has a value for a request that sent
#: nothing.
UNKNOWN_ECHO: dict[str, Any] = {
    "background": None,
    "instructions": None,
    "max_output_tokens": None,
    "metadata": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "store": None,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": None,
    "top_p": None,
    "truncation": "disabled",
    "user": None,
}
MAX_METADATA = 16  # OpenAI's metadata: 16 pairs, keys up to 64 characters, values up to 512


def _is_metadata(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and len(v) <= MAX_METADATA
        and all(isinstance(k, str) and len(k) <= 64 for k in v)
        and all(isinstance(x, str) and len(x) <= 512 for x in v.values())
    )


def echo_of(body: Body | dict, limits: Limits) -> dict[str, Any]:
    """What the Response echoes of its request, as OpenAI's object does: each field as sent,
    else what the request runs with (the model's sampling defaults), else OpenAI's default.
    Takes the original body (``previous_response_id`` as the client sent it). Checks the
    fields only echoed (``metadata``, ``user``, ``truncation``); chat's parse checks the rest,
    so a bad one is a 400 either way."""
    defaults = limits.sampling_defaults

    def num(name: str) -> float:
        v = body.get(name)
        return float(v) if is_num(v) else float(defaults.get(name, 1.0))

    text = body.get("text")
    tools = body.get("tools")
    prev = body.get("previous_response_id")
    return {
        "background": body.get("background") is True,
        "instructions": opt(body, "instructions", lambda v: isinstance(v, str), "a string", None),
        "max_output_tokens": body.get("max_output_tokens") if is_int(body.get("max_output_tokens")) else None,
        "metadata": opt(
            body,
            "metadata",
            _is_metadata,
            f"an object of at most {MAX_METADATA} strings (keys up to 64 characters, values up to 512)",
            {},
        ),
        "parallel_tool_calls": opt(body, "parallel_tool_calls", is_bool, "a boolean", True),
        "previous_response_id": prev if isinstance(prev, str) else None,
        "store": body.get("store") is not False,
        "temperature": num("temperature"),
        "text": {"format": {"type": "text"}, **text} if isinstance(text, dict) else UNKNOWN_ECHO["text"],
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "tools": tools if isinstance(tools, list) else [],
        "top_logprobs": body.get("top_logprobs") if is_int(body.get("top_logprobs")) else 0,
        "top_p": num("top_p"),
        "truncation": opt(
            body, "truncation", lambda v: v in ("auto", "disabled"), "'auto' or 'disabled'", "disabled"
        ),
        "user": opt(body, "user", lambda v: isinstance(v, str), "a string", None),
    }


def echo_in(accepted: Any) -> dict[str, Any] | None:
    """The echo a Responses request's ``accepted`` event carries (:func:`parse` puts it in the
    event's ``echo``, completions' echo of their prompt: what the answer echoes of its request),
    so every replica's render of its stream, retrieve and replay says the same; None for a
    story of an earlier release, which carries none."""
    raw = getattr(accepted, "echo", None)
    if not raw:
        return None
    try:
        echo = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return echo if isinstance(echo, dict) else None


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(response_id: str, items: list) -> list[dict]:
    """A kept conversation as OpenAI's ``input_items`` lists it: each item typed, a message's
    content as parts (``input_text``, an assistant's ``output_text``), a status, and an id:
    the client's, else one made from the response's id and the item's place, so it is the
    same on every call and every replica (clients page and refer by it)."""
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # (never kept: the parse refuses such input)
        kind = item.get("type", "message")
        shown = {**item, "type": kind}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
            shown["content"] = [
                {
                    **p,
                    "type": part if p.get("type") in _TEXT_PARTS else p.get("type"),
                    **({"annotations": p.get("annotations", [])} if part == "output_text" else {}),
                }
                for p in parts
                if isinstance(p, dict)
            ]
        elif kind == "reasoning":
            shown.setdefault("summary", [])
        shown.setdefault("status", "completed")
        digest = hashlib.sha256(f"{response_id}#input#{i}".encode()).hexdigest()[:24]
        made = f"{_ITEM_PREFIX.get(kind, 'item')}_{digest}"
        out.append({"id": item.get("id") if isinstance(item.get("id"), str) else made, **shown})
    return out


def parse(
    body: Body | dict, limits: Limits, tokenizer: TokenizerLike, echo: dict[str, Any] | None = None
) -> GenerationRequest:
    """The chat request a Responses body stands for, answered as a Response; ``echo``
    (:func:`echo_of` the client's body) goes on its ``accepted`` event (:func:`echo_in`)."""
    if body.get("previous_response_id") is not None:  # (the server puts it into `input` first)
        raise bad_request(
            "'previous_response_id' is not supported here.", "previous_response_id", "unsupported"
        )
    cap = opt(body, "max_output_tokens", is_int, "an integer", None)
    if cap is not None and cap < 1:
        raise bad_request("'max_output_tokens' must be at least 1.", "max_output_tokens", "invalid_value")
    tools, choice = _tools(body)
    messages, origin = _messages(body)
    chat = {
        **{k: None for k in _CHAT_ONLY},
        "messages": messages,
        "max_tokens": cap,
        "response_format": _format(body),
        "tools": tools,
        "tool_choice": choice,
        **_logprobs(body),
    }
    sent = [k for k in _CHAT_ONLY if k in body and k != "top_logprobs"]  # (the Responses API's too)
    shaped = body.replaced(chat) if isinstance(body, Body) else {**body, **chat}
    try:
        gen = parse_chat(shaped, limits, tokenizer)
    except ApiError as e:  # (named as the client wrote it)
        _rename(e, origin)
        raise
    finally:
        if isinstance(body, Body):
            body.seen.difference_update(sent)  # (chat's, sent here: ignored, and said so)
    shown = (orjson.dumps(echo).decode(),) if echo is not None else ()
    return dataclasses.replace(gen, endpoint="responses", echo_texts=shown, echo_only=False)


#: ``include`` values: the answer's log-probabilities; reasoning kept for a stateless client
#: (fd's reasoning items are plain text: there is nothing encrypted to give back).
INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")


def _logprobs(body: dict) -> dict:
    """OpenAI's ``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: chat's
    ``logprobs`` and ``top_logprobs``."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("'include' must be a list of strings.", "include", "invalid_type")
    for x in include:
        if x not in INCLUDE:
            raise bad_request(
                f"'include' value {x!r} is not supported (only {', '.join(INCLUDE)}).",
                "include",
                "unsupported",
            )
    top = opt(body, "top_logprobs", is_int, "an integer", None)
    if "message.output_text.logprobs" not in include:
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}
