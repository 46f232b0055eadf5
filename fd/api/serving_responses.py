"""OpenAI's Responses API (vLLM's ``OpenAIServingResponses``): ``POST /v1/responses``, a chat
request rendered as a Response (:mod:`fd.api.responses`), and the stored ones:
``GET /v1/responses/{id}``, its ``input_items`` and ``POST .../cancel``. A response's output
lives in its stream for the story's TTL, which is how long it can be retrieved.
"""

from __future__ import annotations

import functools

import orjson
from aiohttp import web

from fd.api.context import CALLER, RID, ApiContext, json_response, new_abort_id, valid_request_id
from fd.api.errors import bad_request, not_found
from fd.api.responses import (
    echo_in,
    echo_of,
    input_items,
    listed_items,
    output_as_input,
)
from fd.api.responses import parse as parse_responses
from fd.api.responses_renderer import ResponsesRenderer
from fd.api.serving_aborts import ServingAborts
from fd.api.serving_generate import ServingGenerate
from fd.api.streaming import Streams
from fd.api.tenancy import story
from fd.api.validation import is_bool, opt
from fd.control.events import Accepted, Claimed, Final, Tokens

#: input_items' page, as OpenAI's: 20 by default, at most 100
INPUT_ITEMS_PAGE, INPUT_ITEMS_MAX = 20, 100
CANCEL_WAIT_S = 2.0  # POST /v1/responses/{id}/cancel waits this long for the abort's final


class ServingResponses:
    """A Response is generated as a chat request is (``generate``), and cancelled as any
    request is (``aborts``); what is its own is the conversation kept beside its story."""

    def __init__(self, ctx: ApiContext, streams: Streams, generate: ServingGenerate, aborts: ServingAborts):
        self.ctx = ctx
        self.streams = streams
        self.generate = generate
        self.aborts = aborts

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (fd.api.responses): a chat request rendered as a Response.
        Its conversation is kept beside its story (unless ``store`` is false), so a later
        request can go on from it with ``previous_response_id``."""
        bus = self.ctx.bus
        body = await self.ctx.body(request)
        echo = echo_of(body, self.ctx.limits)
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str) or not valid_request_id(prev):
                raise bad_request(
                    "'previous_response_id' must be a response id.", "previous_response_id", "invalid_value"
                )
            prev_rid, history = await story(bus, request[CALLER], prev)
            before = await bus.conversation(prev_rid) if history else None
            if before is None:
                raise not_found(
                    f"No stored response with id '{prev}' (never made here, made with "
                    "store false, or expired).",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            if not any(isinstance(ev, Final) for _eid, ev in history):
                raise bad_request(
                    f"Response '{prev}' is still running.", "previous_response_id", "invalid_value"
                )
            done = self._snapshot(prev, history)
            if done["status"] == "failed":
                raise bad_request(f"Response '{prev}' failed.", "previous_response_id", "invalid_value")
            body = body.replaced(
                {
                    "input": before + output_as_input(done["output"]) + input_items(body),
                    "previous_response_id": None,
                }
            )
        store = opt(body, "store", is_bool, "a boolean", True)
        answer = await self.generate.generate(
            request,
            "responses",
            "resp",
            functools.partial(parse_responses, echo=echo),  # (the echo rides on its `accepted`)
            body=body,
            keep=input_items(body) if store else None,
        )
        if echo["background"] and isinstance(answer, web.Response) and answer.status == 200:
            # The queued answer is rendered before any `accepted` event is read back, so the
            # echo its renderer learns from that event is put in here.
            answer.body = orjson.dumps({**orjson.loads(answer.body), **echo})
        return answer

    async def _story(self, request: web.Request) -> tuple[str, str, list]:
        """The story of a Responses API request (``/v1/responses/{id}``), or a 404: its id in
        the event log, the client's, and the story; another tenant's is a 404 too."""
        shown = request.match_info["id"]
        if not valid_request_id(shown):
            raise bad_request("Invalid response id.", "id", "invalid_request_id")
        request[RID] = shown
        rid, history = await story(self.ctx.bus, request[CALLER], shown)
        first = history[0][1] if history else None
        if not isinstance(first, Accepted) or first.endpoint != "responses":
            raise not_found(
                f"No response with id '{shown}' (never made here, or expired).", "id", "response_not_found"
            )
        return rid, shown, history

    def _renderer(self, rid: str, first: Accepted) -> ResponsesRenderer:
        return ResponsesRenderer(rid, first.model, first.created, first.prompt_tokens, self.ctx.token_bytes)

    def _snapshot(self, rid: str, history: list) -> dict:
        r = self._renderer(rid, history[0][1])
        final, started = None, False
        for _eid, ev in history:
            if isinstance(ev, Accepted):
                r.accept(ev)
            elif isinstance(ev, Tokens):
                r.add_tokens(ev.text, len(ev.token_ids), ev.token_ids, ev.logprobs)
            elif isinstance(ev, Claimed):
                started = True
            elif isinstance(ev, Final):
                final = ev
        return r.snapshot(final) if final is not None or started else r.queued()

    async def get_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` (OpenAI's retrieve): the Response as it stands; with
        ``?stream=true`` its events from the start, or after ``starting_after`` (a sequence
        number), then live until it ends, from any replica."""
        rid, shown, history = await self._story(request)
        if request.query.get("stream", "").lower() not in ("true", "1"):
            return json_response(self._snapshot(shown, history), headers={"X-Request-Id": shown})
        renderer = self._renderer(shown, history[0][1])
        after = request.query.get("starting_after")
        if after is not None:
            try:
                renderer.starting_after = int(after)
            except ValueError:
                raise bad_request(
                    "'starting_after' must be a sequence number.", "starting_after", "invalid_value"
                ) from None
        return await self.streams.stream(
            request, shown, self.streams.story_then_live(rid, history), renderer, None, None
        )

    async def response_input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items``: the conversation it was given (after that of
        the response it continued), as kept for ``previous_response_id``, a page at a time as
        OpenAI's: ``limit`` (1-100, default 20), ``order`` (``desc``, the default, or ``asc``),
        and ``after`` / ``before`` an item's id (the SDK's auto-paging sends ``after``)."""
        q = request.query
        try:
            limit = int(q.get("limit", INPUT_ITEMS_PAGE))
        except ValueError:
            limit = 0
        if not 1 <= limit <= INPUT_ITEMS_MAX:
            raise bad_request(
                f"'limit' must be an integer from 1 to {INPUT_ITEMS_MAX}.", "limit", "invalid_value"
            )
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be 'asc' or 'desc'.", "order", "invalid_value")
        rid, shown, _history = await self._story(request)
        items = await self.ctx.bus.conversation(rid)
        if items is None:
            raise not_found(
                f"Response '{shown}' was made with store false, or its input expired.",
                "id",
                "response_not_found",
            )
        data = listed_items(shown, items)
        if order == "desc":
            data.reverse()
        for name in ("after", "before"):
            mark = q.get(name)
            if mark is None:
                continue
            at = next((i for i, item in enumerate(data) if item["id"] == mark), None)
            if at is None:
                raise bad_request(f"No input item with id '{mark}' in this response.", name, "invalid_value")
            data = data[at + 1 :] if name == "after" else data[:at]
        page = data[:limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(data) > limit,
            },
            headers={"X-Request-Id": shown},
        )

    async def cancel_response(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: abort it and answer with the Response once the
        abort's final is in (or, past CANCEL_WAIT_S, as it stands); again, once it has ended,
        the Response as it ended. Only a ``background`` response is cancelled here, as OpenAI's
        and vLLM's: any other is a 400 (its client ends it by going away)."""
        rid, shown, history = await self._story(request)
        echo = echo_in(history[0][1])
        if echo is not None and echo.get("background") is not True:  # (None: an earlier release's)
            raise bad_request(
                "Cannot cancel a synchronous response: only responses created with "
                "background=true can be cancelled.",
                "response_id",
                "invalid_request",
            )
        if not any(isinstance(ev, Final) for _eid, ev in history):
            await self.ctx.publish_abort((rid,), new_abort_id())
            await self.aborts.wait_final((rid,), CANCEL_WAIT_S)
            history = await self.ctx.bus.read_req(rid, b"0")
        return json_response(self._snapshot(shown, history), headers={"X-Request-Id": shown})
