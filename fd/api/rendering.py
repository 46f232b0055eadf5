"""OpenAI responses, without I/O: a request's events in, its JSON and SSE chunks out (in the
shapes of fd/api/bodies.py).

The other half of fd/api/protocol.py (which parses request bodies): every response shape a
client sees is made here from the events on the request's story, so any API replica renders
the same bytes for the same story, and each shape is testable without a server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import orjson

from fd.api.bodies import (
    chat_chunk,
    chat_completion,
    completion_chunk,
    final_error,
    final_usage,
    stop_reason,
    text_completion,
    usage_chunk,
)
from fd.api.reasoning import REASONING, ReasoningParser, split_all
from fd.api.tool_calls import PARSERS as TOOL_PARSERS
from fd.api.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    call_id,
    forced_calls,
    make_parser,
    parse_all,
)
from fd.control.endings import usage
from fd.control.events import Accepted, Final
from fd.control.token_payloads import logprobs_entries, prompt_logprob_ranks, prompt_logprobs_entries

_TEXT_MARKER = "\x00fd-text\x00"  # JSON-escaped, it can appear in no id, model or text


class Renderer:
    """Turns one request's events into response bodies, identically on every replica: what
    chat and completions share (the text, usage, log-probabilities, token ids, the final
    chunks' order). :class:`ChatRenderer` and :class:`CompletionRenderer` give the shapes;
    :func:`make_renderer` picks one by the request's endpoint, once.

    Everything it needs (endpoint, model, created) comes from the ``accepted`` event, so a
    replay from another replica renders the same chunks the original stream did.
    """

    #: the ``accepted`` event's endpoint this renders (and :func:`usage_chunk`'s shape)
    endpoint = ""
    #: whether each SSE frame names its event type and the stream ends without ``[DONE]``
    #: (the Responses API's renderer does; chat and completions frames are unnamed)
    named_events = False

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        include_usage: bool = False,
        token_bytes: Callable[[int], bytes] | None = None,
        continuous_usage: bool = False,
        index: int = 0,
    ):
        self.rid = request_id
        self.index = index  # the choice this renders (n > 1: one renderer a choice)
        self.usage_chunk = True  # the usage chunk after the final (n > 1: one for all, by Choices)
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        # usage so far on every chunk (vLLM's continuous_usage_stats), not null
        self.continuous_usage = include_usage and continuous_usage
        self.completion_tokens = 0
        self.text: list[str] = []
        self._token_template: tuple[bytes, bytes] | None = None
        self._token_bytes = token_bytes or (lambda _t: b"")
        # (token, logprob, top, text offset) of every token, for those who asked
        self.logprobs: list[tuple[int, float, Any, int]] = []
        self._lp_shown = 0  # how many of them a chunk carried already
        self._lp_offset = 0  # completions' text_offset of the next token
        self.tokens_as_ids = False  # return_tokens_as_token_ids (the `accepted` event's)
        self.prompt_scores_k: int | None = None  # vLLM's prompt_logprobs (the `accepted` event's)
        self.prompt_scores: list[dict | None] | None = None  # what the response shows of them
        # vLLM's return_token_ids (the `accepted` event's prompt_ids): the prompt's ids once,
        # each chunk the ids of its tokens (a token held back for its text rides with the next)
        self.prompt_ids: list[int] | None = None
        self.out_ids: list[int] = []
        self._ids_shown = 0
        self._prompt_ids_shown = False

    # -- the shapes, each endpoint's own
    def _text_dict(self, text: str) -> dict:
        """A chunk of ``text`` before its usage and index."""
        raise NotImplementedError

    def _render_logprobs(self, entries: list) -> dict:
        """Log-probabilities in the endpoint's OpenAI shape."""
        raise NotImplementedError

    def _prompt_place(self, body: dict) -> dict:
        """Where a chunk or a response carries the prompt's ids and scores (vLLM's places)."""
        raise NotImplementedError

    def _content_chunks(self, text: str) -> list[dict]:
        """The chunks of a tokens event's shown text."""
        return [self._text_chunk(text)]

    def _held_chunks(self) -> list[dict]:
        """What parsers held back, let out before the final chunk."""
        return []

    def _last_chunk(self, finish_reason: str) -> dict:
        """The final chunk, before its stop reason, log-probabilities, ids and usage."""
        raise NotImplementedError

    def _body(self, final: Final) -> dict:
        """The whole response body, before its log-probabilities and ids."""
        raise NotImplementedError

    # -- log-probabilities
    def _add_prompt_logprobs(self, field: Any) -> None:
        """A first tokens event's ``prompt_logprobs``: the prompt's tokens, the first with none;
        as vLLM's ``prompt_logprobs`` when the request asked for those, else echo's."""
        got = prompt_logprobs_entries(field)
        if got is None:
            return
        ids, entries = got
        if self.prompt_scores_k is not None:
            self.prompt_scores = self._prompt_scores(ids, entries, prompt_logprob_ranks(field, len(entries)))
            return
        for t, (lp, top) in zip(ids, [(None, None), *entries], strict=True):
            self.logprobs.append((t, lp, top, self._lp_offset))
            self._lp_offset += len(self._token(t)[0])

    def _prompt_scores(self, ids: list[int], entries: list, ranks: list[int] | None) -> list[dict | None]:
        """vLLM's shape: per prompt token (the first has none) ``{id: {logprob, rank,
        decoded_token}}`` for the token and its position's likeliest ``prompt_logprobs``."""
        out: list[dict | None] = [None]
        for i, (t, (lp, top)) in enumerate(zip(ids[1:], entries, strict=True)):
            rank = (
                ranks[i]
                if ranks is not None
                else next((j + 1 for j, (a, _) in enumerate(top) if a == t), None)
            )
            d = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token(t)[0]}}
            for j, (a, c) in enumerate(top[: self.prompt_scores_k]):
                d.setdefault(str(a), {"logprob": c, "rank": j + 1, "decoded_token": self._token(a)[0]})
            out.append(d)
        return out

    def _with_ids(self, chunk: dict) -> dict:
        """return_token_ids: the chunk carries the ids not shown yet (and, the first time, the
        prompt's)."""
        if self.prompt_ids is None or not chunk.get("choices"):
            return chunk
        if not self._prompt_ids_shown:
            self._prompt_ids_shown = True
            self._prompt_place(chunk)["prompt_token_ids"] = self.prompt_ids
        chunk["choices"][0]["token_ids"] = self.out_ids[self._ids_shown :]
        self._ids_shown = len(self.out_ids)
        return chunk

    def _add_logprobs(self, token_ids: tuple[int, ...], logprobs: Any) -> None:
        """A tokens event's ``logprobs`` (fd.control.token_payloads.logprobs_field)."""
        entries = logprobs_entries(logprobs, len(token_ids))
        for t, (lp, top) in zip(token_ids, entries or (), strict=False):
            self.logprobs.append((t, lp, top, self._lp_offset))
            self._lp_offset += len(self._token(t)[0])

    def _token(self, t: int) -> tuple[str, bytes]:
        if self.tokens_as_ids:  # (vLLM's return_tokens_as_token_ids: ids that say which token)
            s = f"token_id:{int(t)}"
            return s, s.encode()
        b = self._token_bytes(int(t))
        return b.decode("utf-8", errors="replace"), b

    def _unshown_logprobs(self) -> dict | None:
        if self._lp_shown == len(self.logprobs):
            return None
        entries, self._lp_shown = self.logprobs[self._lp_shown :], len(self.logprobs)
        return self._render_logprobs(entries)

    def _template(self) -> tuple[bytes, bytes] | None:
        """The JSON of a text chunk split around its text: ``head + dumps(text) + tail`` is
        byte for byte ``orjson.dumps`` of the chunk :meth:`token_chunks` builds, without
        building and serialising the whole dict per token. ``None`` if the split is ambiguous
        (the marker also appears elsewhere), and the dict path is used instead."""
        if self._token_template is None:
            marker = orjson.dumps(_TEXT_MARKER)
            whole = orjson.dumps(self._text_chunk(_TEXT_MARKER))
            head, sep, tail = whole.partition(marker)
            self._token_template = (head, tail) if sep and marker not in tail else (b"", b"")
        return self._token_template if self._token_template[0] else None

    def _text_chunk(self, text: str) -> dict:
        return self._with_usage(self._text_dict(text))

    def final_usage(self, final: Final) -> dict[str, int]:
        """:func:`final_usage` of the tokens this renderer counted."""
        return final_usage(final, self.prompt_tokens, self.completion_tokens)

    def _with_usage(self, chunk: dict, final: Final | None = None) -> dict:
        if self.index and chunk["choices"]:
            chunk["choices"][0]["index"] = self.index
        if self.continuous_usage:
            p, c = self.prompt_tokens, self.completion_tokens
            chunk["usage"] = usage(p, c) if final is None else self.final_usage(final)
        return chunk

    # -- streaming
    def accept(self, accepted: Accepted) -> None:
        """What an ``accepted`` event says of the rendering beyond the constructor's, so every
        replica renders as the original did."""
        self.tokens_as_ids = bool(accepted.tokens_as_ids)
        self.prompt_scores_k = accepted.prompt_logprobs
        ids = accepted.prompt_ids
        if ids is not None:
            self.prompt_ids = list(ids)

    @property
    def structured(self) -> bool:
        """A tokens event may render as several chunks (content, then a tool call): the
        caller takes :meth:`token_chunks`, not :meth:`token_json`."""
        return False

    def start_chunks(self, accepted: Accepted | None = None) -> list[dict]:
        """Rendered for the ``accepted`` event."""
        if accepted is not None:
            self.accept(accepted)
        return []

    def _shown_text(self, text: str, token_ids: tuple[int, ...], prompt_logprobs: Any) -> tuple[str, bool]:
        """A tokens event's text as the response shows it, and whether its tokens count."""
        self.text.append(text)
        return text, True

    def add_tokens(
        self,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> str:
        """A tokens event, taken in (a non-streaming response renders them all at the end).
        Returns the text it adds to the response."""
        if self.prompt_scores_k is not None and prompt_logprobs is not None:
            self._add_prompt_logprobs(prompt_logprobs)  # (vLLM's, beside the output)
        text, counted = self._shown_text(text, token_ids, prompt_logprobs)
        if not counted:
            return text
        self.completion_tokens += n_tokens
        if self.prompt_ids is not None:
            self.out_ids.extend(token_ids)
        if logprobs is not None:
            self._add_logprobs(token_ids, logprobs)
        return text

    def token_chunks(
        self,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> list[dict]:
        """The chunk of a tokens event; its log-probabilities, if the request asked, ride on it
        (or, for tokens with no text of their own yet, on the next chunk that has some)."""
        text = self.add_tokens(text, n_tokens, token_ids, logprobs, prompt_logprobs)
        chunks = self._content_chunks(text) if text else []
        if chunks and self.logprobs:
            chunks[0]["choices"][0]["logprobs"] = self._unshown_logprobs()
        if chunks and self.prompt_ids is not None:
            self._with_ids(chunks[0])
        return chunks

    def _dict_path(self, logprobs: Any) -> bool:
        """Whether a tokens event's chunk carries more than its text (:meth:`token_json`)."""
        return (
            logprobs is not None
            or bool(self.logprobs)
            or self.continuous_usage
            or self.prompt_ids is not None
        )

    def token_json(
        self,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> bytes | None:
        """:meth:`token_chunks`, already serialised: the one chunk's JSON (``orjson.dumps``
        of it, byte for byte), or ``None`` when there is no chunk (no text). Not for a
        :attr:`structured` renderer, whose event may be several chunks."""
        if self._dict_path(logprobs):
            chunks = self.token_chunks(text, n_tokens, token_ids, logprobs, prompt_logprobs)
            return orjson.dumps(chunks[0]) if chunks else None
        self.completion_tokens += n_tokens
        self.text.append(text)
        if not text:
            return None
        t = self._template()
        if t is None:
            return orjson.dumps(self._text_chunk(text))
        return t[0] + orjson.dumps(text) + t[1]

    def final_chunks(self, final: Final) -> list[dict]:
        if final.finish_reason == "error":
            return [final_error(final).body()]
        held = self._held_chunks()
        last = self._last_chunk(final.finish_reason)
        if final.stop_reason is not None:
            last["choices"][0]["stop_reason"] = stop_reason(final)
        if self.logprobs:
            last["choices"][0]["logprobs"] = self._unshown_logprobs()
        out = [*held, self._with_ids(self._with_usage(last, final))]
        if self.include_usage and self.usage_chunk:
            out.append(
                usage_chunk(self.endpoint, self.rid, self.created, self.model, self.final_usage(final))
            )
        return out

    # -- non-streaming
    def response(self, final: Final) -> dict:
        """The whole response body; raises the error a failed request answers with."""
        if final.finish_reason == "error":
            raise final_error(final)
        body = self._body(final)
        if self.logprobs:
            body["choices"][0]["logprobs"] = self._render_logprobs(self.logprobs)
        where = self._prompt_place(body)
        if self.prompt_scores_k is not None:
            where["prompt_logprobs"] = self.prompt_scores
        if self.prompt_ids is not None:
            where["prompt_token_ids"] = self.prompt_ids
            body["choices"][0]["token_ids"] = self.out_ids
        return body


class ChatRenderer(Renderer):
    """``/v1/chat/completions``: the assistant's role first, the model's text read for tool
    calls (the ``accepted`` event's ``tool_parser``) and for its thinking (its
    ``reasoning_parser``), and chat's shapes of log-probabilities and token ids."""

    endpoint = "chat"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # chat with tools (the `accepted` event's tool_parser): the model's text read for calls
        self.tools: HermesParser | Llama3JsonParser | None = None
        self._tool_kind = ""  # its --tool-call-parser name
        self.forced: str | None = None  # tool_choice required / named (fd.api.tool_calls.forced_calls)
        self._calls = 0  # tool calls rendered so far
        # chat on a server with --reasoning-parser (the `accepted` event's reasoning_parser):
        # the thinking goes to reasoning_content, the rest on to the tool-call parser or content
        self.reasoning: ReasoningParser | None = None
        self.show_reasoning = True  # (include_reasoning false: the thinking is read, not shown)

    def _text_dict(self, text: str) -> dict:
        return chat_chunk(self.rid, self.created, self.model, {"content": text}, None, self.include_usage)

    def _render_logprobs(self, entries: list) -> dict:
        """OpenAI's chat shape: a ``content`` list."""

        def entry(t: int, lp: float) -> dict:
            s, b = self._token(t)
            return {"token": s, "logprob": lp, "bytes": list(b)}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(a, c) for a, c in top]} for t, lp, top, _ in entries
            ]
        }

    def _prompt_place(self, body: dict) -> dict:
        return body  # (beside the choices)

    def accept(self, accepted: Accepted) -> None:
        mode = accepted.tool_parser
        if mode and self.tools is None and self.forced is None:
            if mode in TOOL_PARSERS:
                self.tools, self._tool_kind = make_parser(mode), mode
            else:  # "required" / "named:<function>": the whole output is the call(s)
                self.forced = mode
        kind = accepted.reasoning_parser
        if kind and self.reasoning is None and self.forced is None:
            # (a story of a later release may name a parser this one lacks: then none)
            with contextlib.suppress(ValueError):
                self.reasoning = ReasoningParser(kind)
        self.show_reasoning = accepted.include_reasoning is not False
        super().accept(accepted)

    @property
    def structured(self) -> bool:
        return self.tools is not None or self.forced is not None or self.reasoning is not None

    def _forced(self) -> tuple[str, list[ToolCall]]:
        """A forced call's output: its calls (a named function's with the arguments written so
        far when cut short, as vLLM's), or a ``required`` answer cut short as content."""
        text = "".join(self.text)
        calls = forced_calls(self.forced, text)
        return ("", calls) if calls is not None else (text, [])

    def _call_json(self, i: int, call: ToolCall) -> dict:
        return {
            "id": call_id(self.rid, self.index, i, self._tool_kind),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _call_delta(self, call: ToolCall) -> dict:
        i, self._calls = self._calls, self._calls + 1
        return {"tool_calls": [{"index": i, **self._call_json(i, call)}]}

    def _delta_chunk(self, delta: dict) -> dict:
        return self._with_usage(
            chat_chunk(self.rid, self.created, self.model, delta, None, self.include_usage)
        )

    def _tool_chunks(self, items: list) -> list[dict]:
        """Chunks for what the tool-call parser let out: content as text chunks, each call as
        one delta."""
        return [
            self._text_chunk(x) if isinstance(x, str) else self._delta_chunk(self._call_delta(x))
            for x in items
        ]

    def _answer_chunks(self, text: str) -> list[dict]:
        """Chunks of the answer's text: through the tool-call parser, if the request has one."""
        return (
            self._tool_chunks(self.tools.feed(text)) if self.tools is not None else [self._text_chunk(text)]
        )

    def _reasoned_chunks(self, pieces: list[tuple[str, str]]) -> list[dict]:
        """Chunks of what the reasoning parser let out: thinking as ``reasoning_content``
        deltas, the answer as :meth:`_answer_chunks`."""
        out: list[dict] = []
        for kind, text in pieces:
            if kind == REASONING:
                if self.show_reasoning:
                    out.append(self._delta_chunk({"reasoning_content": text}))
            else:
                out += self._answer_chunks(text)
        return out

    def _content_chunks(self, text: str) -> list[dict]:
        if self.forced is not None:  # (a forced call is rendered whole at the end)
            return []
        if self.reasoning is not None:
            return self._reasoned_chunks(self.reasoning.feed(text))
        return self._answer_chunks(text)

    def _finish_reason(self, fr: str, called: bool) -> str:
        # as vLLM: a response that called tools ends with "tool_calls" when it stopped itself,
        # but a named tool_choice with "stop", as OpenAI's
        if self.forced is not None and self.forced.startswith("named:"):
            return fr
        return "tool_calls" if called and fr == "stop" else fr

    def start_chunks(self, accepted: Accepted | None = None) -> list[dict]:
        """Chat announces the assistant role first."""
        super().start_chunks(accepted)
        return [self._with_ids(self._delta_chunk({"role": "assistant", "content": ""}))]

    def _held_chunks(self) -> list[dict]:
        held = [] if self.reasoning is None else self._reasoned_chunks(self.reasoning.finish())
        if self.tools is not None:
            held += self._tool_chunks(self.tools.finish())
        elif self.forced is not None:
            text, calls = self._forced()
            held += self._tool_chunks([text] if text else calls)
        return held

    def _last_chunk(self, finish_reason: str) -> dict:
        fr = self._finish_reason(finish_reason, self._calls > 0)
        return chat_chunk(self.rid, self.created, self.model, {}, fr, self.include_usage)

    def _body(self, final: Final) -> dict:
        text = "".join(self.text)
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_all(self.reasoning.kind, text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = parse_all(text, self._tool_kind)
        elif self.forced is not None:
            text, calls = self._forced()
        body = chat_completion(
            self.rid,
            self.created,
            self.model,
            text,
            self._finish_reason(final.finish_reason, bool(calls)),
            self.final_usage(final),
            stop_reason(final),
        )
        message = body["choices"][0]["message"]
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [self._call_json(i, c) for i, c in enumerate(calls)]
        if self.reasoning is not None:
            message["reasoning_content"] = (reasoning or None) if self.show_reasoning else None
        return body


class CompletionRenderer(Renderer):
    """``/v1/completions``: text chunks, echo (the prompt's text before the completion's, from
    the ``accepted`` event), and completions' shapes of log-probabilities and token ids."""

    endpoint = "completion"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # the prompt's text goes before the completion's, with the first tokens event (which
        # brings the prompt's log-probabilities, if asked); echo_only (max_tokens=0): the one
        # token the engine generated is not shown or counted
        self.echo: str | None = None
        self.echo_only = False
        self._echoed = False

    def _text_dict(self, text: str) -> dict:
        return completion_chunk(self.rid, self.created, self.model, text, None, self.include_usage)

    def _render_logprobs(self, entries: list) -> dict:
        """OpenAI's completions shape: four parallel lists."""
        return {
            "tokens": [self._token(t)[0] for t, _, _, _ in entries],
            "token_logprobs": [lp for _, lp, _, _ in entries],
            "top_logprobs": [None if top is None else self._top_by_text(top) for _, _, top, _ in entries],
            "text_offset": [off for _, _, _, off in entries],
        }

    def _top_by_text(self, top) -> dict[str, float]:
        """Completions' alternatives, keyed by text: where two tokens' texts are the same (byte
        tokens that each decode to U+FFFD), the likelier one's."""
        out: dict[str, float] = {}
        for a, c in top:
            out.setdefault(self._token(a)[0], c)
        return out

    def _prompt_place(self, body: dict) -> dict:
        return body["choices"][0]  # (in the choice)

    def accept(self, accepted: Accepted) -> None:
        if accepted.echo is not None:
            self.echo = accepted.echo
            self.echo_only = bool(accepted.echo_only)
        super().accept(accepted)

    def final_usage(self, final: Final) -> dict[str, int]:
        """An echo-only request (max_tokens=0) generated nothing shown."""
        if self.echo_only:
            return usage(self.prompt_tokens, 0)
        return super().final_usage(final)

    def _shown_text(self, text: str, token_ids: tuple[int, ...], prompt_logprobs: Any) -> tuple[str, bool]:
        """The echoed prompt first, once."""
        if self.echo is not None and token_ids and not self._echoed:
            self._echoed = True
            if prompt_logprobs is not None:
                self._add_prompt_logprobs(prompt_logprobs)
            text = self.echo + ("" if self.echo_only else text)
            self.text.append(text)
            return text, not self.echo_only
        if self.echo_only:
            return "", False
        return super()._shown_text(text, token_ids, prompt_logprobs)

    def _owed_echo(self) -> str:
        """The echo, if no tokens event brought it (a request aborted before it ran)."""
        if self.echo is None or self._echoed:
            return ""
        self._echoed = True
        return self.echo

    def _dict_path(self, logprobs: Any) -> bool:
        return self.echo is not None or super()._dict_path(logprobs)

    def _last_chunk(self, finish_reason: str) -> dict:
        # (an echo still owed, if no token ever came: aborted before it ran)
        return completion_chunk(
            self.rid, self.created, self.model, self._owed_echo(), finish_reason, self.include_usage
        )

    def _body(self, final: Final) -> dict:
        text = self._owed_echo() + "".join(self.text)
        return text_completion(
            self.rid,
            self.created,
            self.model,
            text,
            final.finish_reason,
            self.final_usage(final),
            stop_reason(final),
        )


def make_renderer(
    request_id: str,
    endpoint: str,
    model: str,
    created: int,
    prompt_tokens: int,
    include_usage: bool = False,
    token_bytes: Callable[[int], bytes] | None = None,
    continuous_usage: bool = False,
    index: int = 0,
) -> ChatRenderer | CompletionRenderer:
    """The renderer of the ``accepted`` event's ``endpoint``: chat's, or completions' for any
    other (a story that names none)."""
    cls = ChatRenderer if endpoint == "chat" else CompletionRenderer
    return cls(request_id, model, created, prompt_tokens, include_usage, token_bytes, continuous_usage, index)
