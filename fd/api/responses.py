"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it: the request becomes a
chat request, and its events render as a Response object or its stream of typed events.

Sans-IO, like :mod:`fd.api.protocol`: :func:`parse` turns a body into a
:class:`~fd.api.protocol.GenerationRequest` (endpoint ``responses``) and
:class:`ResponsesRenderer` turns the request's events into what the client sees. Everything
the rendering needs is in the ``accepted`` event (the endpoint says which renderer), so a
replay from any replica (``GET /v1/requests/<id>/stream``) sends the same events, sequence
numbers included.

Served: text input (a string, or messages whose content is text), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (structured outputs), vLLM's
sampling extensions, fd's ``background``. Refused with a 400, not ignored: tools,
``previous_response_id`` and non-text input, which need what this server does not keep or
read.
"""

from __future__ import annotations

from typing import Any, Callable

from control.events import Final
from fd.api import protocol
from fd.api.errors import ApiError, bad_request
from fd.api.protocol import (ChatRendering, GenerationRequest, Limits, TokenizerLike, _background,
                             _chat_ids, _check_model, _opt, _sampling, _template_kwargs, final_error,
                             final_usage, parse_messages)

_TEXT_PARTS = ("input_text", "output_text", "text")


def _messages(body: protocol.Body | dict) -> list[dict]:
    """``instructions`` and ``input`` as chat messages (validated as chat's are)."""
    given = body.get("input")
    if given is None:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    if isinstance(given, str):
        items: list = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        items = []
        for i, item in enumerate(given):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise bad_request(f"input[{i}] is a {kind!r} item; only messages are supported here.",
                                  f"input[{i}]", "unsupported")
            content = item.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                        raise bad_request(f"input[{i}].content[{j}] must be a text part "
                                          f"({', '.join(_TEXT_PARTS)}).", f"input[{i}].content[{j}]",
                                          "unsupported")
                    texts.append({"type": "text", "text": part.get("text")})
                content = texts
            items.append({"role": item.get("role"), "content": content})
    else:
        raise bad_request("'input' must be a string or a non-empty list of messages.", "input",
                          "invalid_type")
    instructions = _opt(body, "instructions", lambda v: isinstance(v, str), "a string", None)
    if instructions:
        items.insert(0, {"role": "system", "content": instructions})
    try:
        return parse_messages({"messages": items})
    except ApiError as e:  # (named as the client wrote it: input, not messages)
        e.param = (e.param or "").replace("messages", "input", 1) or "input"
        e.message = e.message.replace("messages", "input", 1)
        raise


def _format(body: protocol.Body | dict) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    text = _opt(body, "text", lambda v: isinstance(v, dict), "an object", None)
    if not text or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format.type' must be text, json_object or json_schema.",
                          "text.format", "invalid_value")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}
    return {"type": fmt["type"]}


def parse(body: protocol.Body | dict, limits: Limits, tokenizer: TokenizerLike) -> GenerationRequest:
    model = _check_model(body, limits)
    if body.get("previous_response_id") is not None:
        raise bad_request("'previous_response_id' is not supported: this server keeps no responses; "
                          "send the conversation as 'input'.", "previous_response_id", "unsupported")
    if body.get("tools"):
        raise bad_request("'tools' are not supported on /v1/responses here; use "
                          "/v1/chat/completions.", "tools", "unsupported")
    messages = _messages(body)
    ids = _chat_ids(messages, tokenizer, ChatRendering(), None, _template_kwargs(body))
    cap = _opt(body, "max_output_tokens", protocol._is_int, "an integer", None)
    if cap is not None and cap < 1:
        raise bad_request("'max_output_tokens' must be at least 1.", "max_output_tokens", "invalid_value")
    changes: dict[str, Any] = {"max_tokens": cap, "response_format": _format(body)}
    shaped = body.replaced(changes) if isinstance(body, protocol.Body) else {**body, **changes}
    try:
        sampling = _sampling(shaped, len(ids), limits, None)
    except ApiError as e:  # (named as the client wrote it)
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace("'max_tokens'", "'max_output_tokens'")
        raise
    stream = _opt(body, "stream", protocol._is_bool, "a boolean", False)
    return GenerationRequest("responses", model, ids, sampling, stream, background=_background(body))


_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class ResponsesRenderer:
    """A request's events as a Response object, or as the Responses API's stream: created,
    in progress, the message item and its text part opened, the text's deltas, then each
    closed and the terminal event (``response.completed``, ``response.incomplete`` — cut by
    ``max_output_tokens``, or aborted — or ``response.failed``). Each event carries its
    ``sequence_number``; frames name their event type, and no ``[DONE]`` follows."""

    structured = True  # (the server takes token_chunks, not a pre-serialised token chunk)
    named_events = True

    def __init__(self, request_id: str, model: str, created: int, prompt_tokens: int,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.rid = request_id
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.text: list[str] = []
        self.item_id = f"msg_{request_id}"
        self._seq = 0

    def accept(self, accepted: Any) -> None:
        """(Nothing beyond the constructor's: the interface of :class:`protocol.Renderer`.)"""

    def _event(self, kind: str, **fields: Any) -> dict:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list) -> dict:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": content}

    def _response(self, status: str, final: Final | None = None) -> dict:
        body: dict[str, Any] = {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [], "error": None, "incomplete_details": None,
            "instructions": None, "metadata": None, "parallel_tool_calls": False,
            "temperature": None, "top_p": None, "max_output_tokens": None, "tool_choice": "none",
            "tools": [], "text": {"format": {"type": "text"}}, "usage": None}
        if final is None:
            return body
        text = "".join(self.text)
        body["output"] = [self._item("completed" if status == "completed" else "incomplete",
                                     [self._part(text)])]
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "cancelled":
            body["incomplete_details"] = {"reason": "cancelled"}
        u = final_usage(final, self.prompt_tokens, self.completion_tokens)
        body["usage"] = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}
        return body

    def start_chunks(self, accepted: Any = None) -> list[dict]:
        opened = self._response("in_progress")
        return [self._event("response.created", response=opened),
                self._event("response.in_progress", response=opened),
                self._event("response.output_item.added", output_index=0, item=self._item("in_progress", [])),
                self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                            content_index=0, part=self._part(""))]

    def add_tokens(self, text: str, n_tokens: int, token_ids: tuple[int, ...] = (),
                   logprobs: Any = None, prompt_logprobs: Any = None) -> str:
        self.completion_tokens += n_tokens
        if text:
            self.text.append(text)
        return text

    def token_chunks(self, text: str, n_tokens: int, token_ids: tuple[int, ...] = (),
                     logprobs: Any = None, prompt_logprobs: Any = None) -> list[dict]:
        if not self.add_tokens(text, n_tokens):
            return []
        return [self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                            content_index=0, delta=text, logprobs=[])]

    def final_chunks(self, final: Final) -> list[dict]:
        if final.finish_reason == "error":
            failed = self._response("failed", final)
            err = final_error(final).body()["error"]
            failed["error"] = {"code": err.get("code") or "server_error", "message": err["message"]}
            return [self._event("response.failed", response=failed)]
        status = _STATUS.get(final.finish_reason, "completed")
        text = "".join(self.text)
        done = self._response(status, final)
        return [self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                            content_index=0, part=self._part(text)),
                self._event("response.output_item.done", output_index=0, item=done["output"][0]),
                self._event("response.completed" if status == "completed" else "response.incomplete",
                            response=done)]

    def response(self, final: Final) -> dict:
        """The whole Response object; raises the error a failed request answers with."""
        if final.finish_reason == "error":
            raise final_error(final)
        return self._response(_STATUS.get(final.finish_reason, "completed"), final)
