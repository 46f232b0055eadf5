"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it: the request becomes a
chat request, and its events render as a Response object or its stream of typed events.

Sans-IO, like :mod:`fd.api.protocol`: :func:`parse` turns a body into the
:class:`~fd.api.protocol.GenerationRequest` of the chat request it stands for (endpoint
``responses``), and :class:`ResponsesRenderer` turns the request's events into what the client
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

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Callable
from typing import Any

import orjson

from fd.api.bodies import final_error, final_usage
from fd.api.errors import ApiError, bad_request
from fd.api.protocol import GenerationRequest, parse_chat
from fd.api.reasoning import REASONING, ReasoningParser
from fd.api.tool_calls import PARSERS, ToolCall, call_id, forced_calls, make_parser
from fd.api.validation import Body, Limits, is_bool, is_int, is_num, opt
from fd.control.events import Accepted, Final
from fd.control.token_payloads import logprobs_entries
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


_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class ResponsesRenderer:
    """A request's events as a Response object, or as the Responses API's stream: created and
    in progress; then each output item in turn (the thinking as a ``reasoning`` item, the
    answer's text as a ``message``, each call as a ``function_call``), added, filled by its
    deltas and done; then the terminal event (``response.completed``, ``response.incomplete``
    — cut by ``max_output_tokens``, or aborted — or ``response.failed``). Each event carries
    its ``sequence_number``; frames name their event type, and no ``[DONE]`` follows."""

    structured = True  # (the server takes token_chunks, not a pre-serialised token chunk)
    named_events = True

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.rid = request_id
        # what the Response echoes of its request (the `accepted` event's, echo_in);
        # UNKNOWN_ECHO's where the story carries none
        self.echo: dict[str, Any] = dict(UNKNOWN_ECHO)
        self._token_bytes = token_bytes  # (a token's text, for logprobs)
        self._lp: list[dict] = []  # the message's tokens' log-probabilities (include ...logprobs)
        self._lp_due = 0  # how many of them no delta has carried yet
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text: list[str] = []
        self.items: list[dict] = []  # the output items closed so far
        self._open: dict | None = None  # the item being filled: reasoning or message
        self._calls = 0
        self._seq = 0
        self.reasoning: ReasoningParser | None = None
        self.tools = None  # a tool-call parser (fd.api.tool_calls)
        self._tool_kind = ""  # its name
        self.forced: str | None = None  # tool_choice required / named: the answer is the call(s)
        self.starting_after = -1  # OpenAI's: a resumed stream sends the events after this one

    def accept(self, accepted: Accepted | None) -> None:
        """The parsers the ``accepted`` event names (as :meth:`rendering.Renderer.accept`)."""
        if accepted is None:
            return
        echo = echo_in(accepted)
        if echo is not None:
            self.echo = {**UNKNOWN_ECHO, **echo}
        mode = accepted.tool_parser
        if mode and self.tools is None and self.forced is None:
            if mode in PARSERS:
                self.tools, self._tool_kind = make_parser(mode), mode
            else:
                self.forced = mode
        kind = accepted.reasoning_parser
        if kind and self.reasoning is None and self.forced is None:
            with contextlib.suppress(ValueError):  # (a story of a later release)
                self.reasoning = ReasoningParser(kind)

    # -- events
    def _event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _opened(self, kind: str) -> list[dict]:
        """Close what is open, unless it is ``kind``; open a ``kind`` item."""
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close()
        n = len(self.items)
        if kind == "message":
            self._open = {"id": f"msg_{self.rid}_{n}", "type": "message", "role": "assistant", "text": []}
            out += [
                self._event(
                    "response.output_item.added", output_index=n, item=self._item(self._open, "in_progress")
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self._open["id"],
                    output_index=n,
                    content_index=0,
                    part=_part("output_text", ""),
                ),
            ]
        else:
            self._open = {"id": f"rs_{self.rid}_{n}", "type": "reasoning", "text": []}
            out += [
                self._event(
                    "response.output_item.added", output_index=n, item=self._item(self._open, "in_progress")
                ),
                self._event(
                    "response.content_part.added",
                    item_id=self._open["id"],
                    output_index=n,
                    content_index=0,
                    part=_part("reasoning_text", ""),
                ),
            ]
        return out

    def _item(self, it: dict, status: str) -> dict:
        text = "".join(it["text"])
        if it["type"] == "message":
            content = [_part("output_text", text, self._lp)] if status != "in_progress" else []
            return {
                "id": it["id"],
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": it["id"],
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": [_part("reasoning_text", text)] if status != "in_progress" else [],
        }

    def _close(self, status: str = "completed") -> list[dict]:
        it, self._open = self._open, None
        if it is None:
            return []
        n, text = len(self.items), "".join(it["text"])
        done = self._item(it, status)
        self.items.append(done)
        kind = "output_text" if it["type"] == "message" else "reasoning_text"
        return [
            self._event(
                f"response.{kind}.done",
                item_id=it["id"],
                output_index=n,
                content_index=0,
                text=text,
                **({"logprobs": self._lp} if kind == "output_text" else {}),
            ),
            self._event(
                "response.content_part.done",
                item_id=it["id"],
                output_index=n,
                content_index=0,
                part=done["content"][0],
            ),
            self._event("response.output_item.done", output_index=n, item=done),
        ]

    def _delta(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        out = self._opened(kind)
        self._open["text"].append(text)
        n = len(self.items)
        if kind == "message":
            carried, self._lp_due = self._lp[len(self._lp) - self._lp_due :], 0
            return out + [
                self._event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=n,
                    content_index=0,
                    delta=text,
                    logprobs=carried,
                )
            ]
        return out + [
            self._event(
                "response.reasoning_text.delta",
                item_id=self._open["id"],
                output_index=n,
                content_index=0,
                delta=text,
            )
        ]

    def _call(self, call: ToolCall, status: str = "completed") -> list[dict]:
        out = self._close()
        n, i = len(self.items), self._calls
        self._calls += 1
        item = {
            "id": f"fc_{self.rid}_{i}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id(self.rid, 0, i, self._tool_kind),
            "name": call.name,
            "arguments": "",
        }
        done = {**item, "status": status, "arguments": call.arguments}
        self.items.append(done)
        return out + [
            self._event("response.output_item.added", output_index=n, item=item),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=n,
                delta=call.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=n,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=n, item=done),
        ]

    def _answer(self, items: list) -> list[dict]:
        out: list[dict] = []
        for x in items:
            out += self._call(x) if isinstance(x, ToolCall) else self._delta("message", x)
        return out

    def _feed(self, text: str) -> list[dict]:
        """The events of the model's next text."""
        if self.forced is not None or not text:
            return []  # (a forced call is rendered whole at the end)
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        out: list[dict] = []
        for kind, t in pieces:
            if kind == REASONING:
                out += self._delta("reasoning", t)
            else:
                out += self._answer(self.tools.feed(t) if self.tools is not None else [t])
        return out

    def _finish(self, status: str) -> list[dict]:
        """What the parsers held back, then the last item closed: cut short with the response
        (``incomplete`` by max_output_tokens or an abort, as OpenAI marks it) or completed."""
        out: list[dict] = []
        if self.reasoning is not None:
            for kind, t in self.reasoning.finish():
                out += (
                    self._delta("reasoning", t)
                    if kind == REASONING
                    else self._answer(self.tools.feed(t) if self.tools is not None else [t])
                )
        if self.tools is not None:
            out += self._answer(self.tools.finish())
        elif self.forced is not None:
            text = "".join(self.text)
            calls = forced_calls(self.forced, text)
            if calls is None:
                out += self._answer([text])
            else:  # (cut short with the response: the call is incomplete, as OpenAI marks it)
                for call in calls:
                    out += self._call(call, "completed" if status == "completed" else "incomplete")
        return out + self._close("completed" if status == "completed" else "incomplete")

    def _response(self, status: str, final: Final | None = None) -> dict:
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": list(self.items),
            "error": None,
            "incomplete_details": None,
            **self.echo,
            "usage": None,
        }
        if final is None:
            return body
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "cancelled":
            body["incomplete_details"] = {"reason": "cancelled"}
        u = final_usage(final, self.prompt_tokens, self.completion_tokens)
        body["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }
        return body

    def _status(self, final: Final) -> str:
        return _STATUS.get(final.finish_reason, "completed")

    def _shown(self, events: list[dict]) -> list[dict]:
        if self.starting_after < 0:
            return events
        return [e for e in events if e["sequence_number"] > self.starting_after]

    # -- the interface of rendering.Renderer
    def start_chunks(self, accepted: Accepted | None = None) -> list[dict]:
        self.accept(accepted)
        opened = self._response("in_progress")
        return self._shown(
            [
                self._event("response.created", response=opened),
                self._event("response.in_progress", response=opened),
            ]
        )

    def add_tokens(
        self,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> str:
        self.completion_tokens += n_tokens
        if text:
            self.text.append(text)
        if logprobs is not None:
            self._add_logprobs(token_ids, logprobs)
        return text

    def _add_logprobs(self, token_ids: tuple[int, ...], logprobs: Any) -> None:
        """OpenAI's ``message.output_text.logprobs``: for an answer that is all one message (no
        thinking, no tools: where its tokens' text goes is then plain)."""
        if self.reasoning is not None or self.tools is not None or self.forced is not None:
            return

        def entry(t: int, lp: float) -> dict:
            b = self._token_bytes(int(t)) if self._token_bytes is not None else b""
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        for t, (lp, top) in zip(token_ids, logprobs_entries(logprobs, len(token_ids)) or (), strict=False):
            self._lp.append({**entry(t, lp), "top_logprobs": [entry(a, c) for a, c in top]})
            self._lp_due += 1

    def token_chunks(
        self,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> list[dict]:
        return self._shown(self._feed(self.add_tokens(text, n_tokens, token_ids, logprobs)))

    def _failed(self, final: Final) -> dict:
        failed = self._response("failed", final)
        err = final_error(final).body()["error"]
        failed["error"] = {"code": err.get("code") or "server_error", "message": err["message"]}
        return failed

    def final_chunks(self, final: Final) -> list[dict]:
        if final.finish_reason == "error":
            return self._shown([self._event("response.failed", response=self._failed(final))])
        status = self._status(final)
        out = self._finish(status)
        return self._shown(
            out
            + [
                self._event(
                    "response.completed" if status == "completed" else "response.incomplete",
                    response=self._response(status, final),
                )
            ]
        )

    def response(self, final: Final) -> dict:
        """The whole Response object; raises the error a failed request answers with."""
        if final.finish_reason == "error":
            raise final_error(final)
        status = self._status(final)
        self._feed("".join(self.text))
        self._finish(status)
        return self._response(status, final)

    def queued(self) -> dict:
        """The Response a background request is answered with at once (OpenAI's)."""
        return self._response("queued")

    def snapshot(self, final: Final | None) -> dict:
        """The Response object as it stands (OpenAI's retrieve): in progress with the items
        finished so far, or as it ended (a failed one too, with its error)."""
        if final is not None and final.finish_reason == "error":
            return self._failed(final)
        if final is not None:
            return self.response(final)
        self._feed("".join(self.text))
        return self._response("in_progress")


def _part(kind: str, text: str, logprobs: list | None = None) -> dict:
    return {
        "type": kind,
        "text": text,
        **({"annotations": [], "logprobs": list(logprobs or ())} if kind == "output_text" else {}),
    }
