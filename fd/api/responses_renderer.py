"""A Responses API request's events as the client sees them (fd/api/responses.py parses the
request): the Response object, or its stream of typed events with their sequence numbers.
Everything it needs is in the request's ``accepted`` event (the endpoint, the tool and reasoning
parsers, the fields the Response echoes), so a replay from any replica renders the same."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from fd.api.bodies import final_error, final_usage
from fd.api.reasoning import REASONING, ReasoningParser
from fd.api.responses import UNKNOWN_ECHO, echo_in
from fd.api.tool_calls import PARSERS, ToolCall, call_id, forced_calls, make_parser
from fd.control.events import Accepted, Final
from fd.control.token_payloads import logprobs_entries

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
            part = "output_text"
        else:
            self._open = {"id": f"rs_{self.rid}_{n}", "type": "reasoning", "text": []}
            part = "reasoning_text"
        out += [
            self._event(
                "response.output_item.added", output_index=n, item=self._item(self._open, "in_progress")
            ),
            self._event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=n,
                content_index=0,
                part=_part(part, ""),
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
