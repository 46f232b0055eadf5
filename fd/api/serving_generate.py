"""The generating routes (vLLM's ``OpenAIServingChat`` and ``OpenAIServingCompletion``):
``/v1/chat/completions`` and ``/v1/completions``, one request or a response of n choices,
as JSON or SSE; and ``GET /v1/requests/{id}/stream``, such a response again from its story.

Parsing, validation and response shapes live in :mod:`fd.api.protocol` and
:mod:`fd.api.rendering`; this moves bytes: body in, ``request`` event out, the request's
stream back.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web

from fd.api import bodies, protocol, rendering
from fd.api.cancellation import watch_of
from fd.api.choices import Choices
from fd.api.context import CALLER, RID, ApiContext, json_response, valid_request_id
from fd.api.errors import bad_request, id_taken, not_found, unavailable
from fd.api.responses_renderer import ResponsesRenderer
from fd.api.streaming import Streams, Timing, events, merged
from fd.api.tenancy import story
from fd.api.validation import Body
from fd.control.entry_ids import entry_id_key
from fd.control.events import Accepted, Claimed, Final, Preempted, Request, RequestData, Tokens
from fd.control.keys import choice_ids


def _echo(gen: protocol.GenerationRequest, prompt: int) -> dict[str, Any]:
    """The echo fields of a choice's ``accepted`` event (its prompt's text), if asked."""
    if not gen.echo_texts:
        return {}
    return {"echo": gen.echo_texts[prompt], "echo_only": gen.echo_only or None}


class ServingGenerate:
    """Chat and completions, live and replayed, over one replica's context."""

    def __init__(self, ctx: ApiContext, streams: Streams):
        self.ctx = ctx
        self.streams = streams

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "chat", "chatcmpl", protocol.parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "completion", "cmpl", protocol.parse_completion)

    async def generate(
        self,
        request: web.Request,
        endpoint: str,
        prefix: str,
        parse,
        body: Body | None = None,
        keep: list | None = None,
    ) -> web.StreamResponse:
        """A generating request, from its body (read here unless given) to its answer. ``keep``:
        a Responses API conversation to store beside the story (``previous_response_id``)."""
        ctx = self.ctx
        await ctx.check_redis()
        arrival = time.monotonic()
        rid, explicit = ctx.request_id(request, prefix)
        shown = request[RID]  # the id the client sees; `rid` is the event log's
        if body is None:
            body = await ctx.body(request)
        await ctx.know_adapters(body)
        gen: protocol.GenerationRequest = parse(body, ctx.limits, ctx.tokenizer)
        ctx.say_ignored(body.ignored(), rid)
        ctx.log_request(rid, endpoint, gen.prompt_token_ids, gen.sampling)
        ctx.metrics.vllm.incoming(gen.model)
        if gen.n > 1 or gen.prompts:
            return await self._generate_choices(request, rid, explicit, endpoint, gen, arrival)
        if explicit:
            await ctx.id_free(rid, shown)
        watch = watch_of(request)
        watch.background = gen.background
        now = time.time()
        created = int(now)
        if keep is not None:
            await ctx.bus.save_conversation(rid, keep)
        sub = await ctx.mux.subscribe(rid, b"0")  # before submit: nothing can be missed
        timing: Timing | None = None
        try:
            watch.request_id = rid  # from here on a disconnect aborts it
            await ctx.bus.submit(
                Request(
                    request_id=rid,
                    data=RequestData(
                        prompt_token_ids=gen.prompt_token_ids,
                        sampling=gen.sampling,
                        arrival_ts=int(now * 1000),
                        model=gen.model,
                        api=ctx.cfg.api_id,
                        background=gen.background,
                        priority=gen.priority,
                    ),
                ),
                Accepted(
                    request_id=rid,
                    api=ctx.cfg.api_id,
                    prompt_tokens=len(gen.prompt_token_ids),
                    endpoint=endpoint,
                    model=gen.model,
                    created=created,
                    include_usage=gen.include_usage,
                    continuous_usage=gen.continuous_usage or None,
                    tenant=request[CALLER].tag,
                    **gen.rendering(),
                    **gen.prompt_ids_field(gen.prompt_token_ids),
                    **_echo(gen, 0),
                ),
            )
            ctx.redis_ok()
            sub.story_started()
            renderer = self.streams.renderer(
                shown,
                endpoint,
                gen.model,
                created,
                len(gen.prompt_token_ids),
                gen.include_usage,
                gen.continuous_usage,
            )
            timing = Timing(ctx.metrics, arrival, len(gen.prompt_token_ids), gen.sampling.max_tokens)
            if gen.stream:
                return await self.streams.stream(request, shown, events(sub), renderer, timing)
            if gen.background and isinstance(renderer, ResponsesRenderer):
                # OpenAI's background mode: answered at once, queued; the client polls
                # GET /v1/responses/<id> (or streams it from there)
                return json_response(renderer.queued(), headers={"X-Request-Id": shown})
            return await self._collect(shown, sub, renderer, timing, watch)
        finally:
            if timing is not None:
                timing.close()
            await sub.close()

    async def _generate_choices(
        self,
        request: web.Request,
        rid: str,
        explicit: bool,
        endpoint: str,
        gen: protocol.GenerationRequest,
        arrival: float,
    ) -> web.StreamResponse:
        """``n > 1``, or a completions batch: the response's choices run as requests
        ``<id>.<k>`` (``choice_ids``), each with its own story, its own engine slot and, given a
        seed, ``seed + j`` for a prompt's ``j``-th choice; their events are merged into one
        response. A disconnect aborts all of them; so does an abort of the response's id, from
        anywhere (``P:owner`` marks it, see ``Bus.submit_choices``)."""
        ctx = self.ctx
        plan = gen.choices()
        shown = request[RID]
        ids = await ctx.choice_ids(rid, explicit, len(plan), shown)
        watch = watch_of(request)
        watch.background = gen.background
        now = time.time()
        created = int(now)
        n_prompt = sum(map(len, gen.prompts or (gen.prompt_token_ids,)))  # each prompt once
        common = dict(
            api=ctx.cfg.api_id,
            endpoint=endpoint,
            model=gen.model,
            created=created,
            include_usage=gen.include_usage,
            continuous_usage=gen.continuous_usage or None,
            tenant=request[CALLER].tag,
            **gen.rendering(),
        )
        subs = [await ctx.mux.subscribe(c, b"0") for c in ids]  # before submit: nothing missed
        timing: list[Timing] = []
        try:
            watch.request_id, watch.abort_ids = rid, ids  # from here on a disconnect aborts them
            items = [
                (
                    Request(
                        request_id=c,
                        data=RequestData(
                            prompt_token_ids=prompt,
                            sampling=sp,
                            arrival_ts=int(now * 1000),
                            model=gen.model,
                            api=ctx.cfg.api_id,
                            background=gen.background,
                            parent=rid,
                            priority=gen.priority,
                        ),
                    ),
                    Accepted(
                        request_id=c,
                        parent=rid,
                        index=k,
                        prompt_tokens=len(prompt),
                        **common,
                        **gen.prompt_ids_field(prompt),
                        **_echo(gen, k // gen.n),
                    ),
                )
                for k, (c, (prompt, sp)) in enumerate(zip(ids, plan, strict=True))
            ]
            parent = Accepted(request_id=rid, choices=len(ids), n=gen.n, prompt_tokens=n_prompt, **common)
            if not await ctx.bus.submit_choices(parent, items):
                raise id_taken(shown)
            for sub in subs:
                sub.story_started()
            choices = Choices(
                shown,
                len(ids),
                endpoint,
                gen.model,
                created,
                n_prompt,
                gen.include_usage,
                ctx.token_bytes,
                gen.continuous_usage,
                gen.n,
                request_ids=ids,
            )
            timing = [  # latencies are each choice's; vLLM's n, each response's once
                Timing(ctx.metrics, arrival, len(prompt), sp.max_tokens, gen.n if k % gen.n == 0 else 0)
                for k, (prompt, sp) in enumerate(plan)
            ]
            if gen.stream:
                resp = await self.streams.stream(request, shown, merged(subs), choices, timing)
            else:
                resp = await self._collect_choices(shown, subs, choices, timing, watch)
            return resp
        finally:
            for t in timing:
                t.close()
            for sub in subs:
                await sub.close()

    async def _collect_choices(
        self, rid: str, subs: list, choices: Choices, timing: list[Timing], watch
    ) -> web.Response:
        async with contextlib.aclosing(merged(subs)) as batches:
            async for batch in batches:
                for k, _eid, ev in batch or ():
                    if isinstance(ev, Tokens):
                        timing[k].tokens(len(ev.token_ids))
                        choices.add_tokens(
                            k, ev.text, len(ev.token_ids), ev.token_ids, ev.logprobs, ev.prompt_logprobs
                        )
                    elif isinstance(ev, Accepted):
                        choices.parts[k].accept(ev)
                    elif isinstance(ev, (Claimed, Preempted)):
                        timing[k].engine_event(ev)
                    elif isinstance(ev, Final):
                        timing[k].final(ev)
                        choices.finals[k] = ev
                        if ev.finish_reason == "error":
                            watch.finished = True
                            await self.streams.abort_rest(choices)
                            raise bodies.final_error(ev)
                if choices.done:
                    watch.finished = True
                    return json_response(choices.response(), headers={"X-Request-Id": rid})
        raise unavailable("The request's stream ended without a final event.")

    async def _collect(
        self, rid: str, sub, renderer: rendering.Renderer, timing: Timing, watch
    ) -> web.Response:
        async for _eid, ev in sub:
            if isinstance(ev, Tokens):
                timing.tokens(len(ev.token_ids))
                renderer.add_tokens(ev.text, len(ev.token_ids), ev.token_ids, ev.logprobs, ev.prompt_logprobs)
            elif isinstance(ev, Accepted):
                renderer.accept(ev)
            elif isinstance(ev, (Claimed, Preempted)):
                timing.engine_event(ev)
            elif isinstance(ev, Final):
                watch.finished = True
                timing.final(ev)
                return json_response(renderer.response(ev), headers={"X-Request-Id": rid})
        raise unavailable("The request's stream ended without a final event.")

    # ------------------------------------------------------------------ replay / resume

    async def stream_request(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/requests/{id}/stream``: the request's response again, from the start or
        after ``Last-Event-ID``, then live until its final; from any replica. Watching is not
        owning: a watcher that disconnects aborts nothing."""
        shown = request.match_info["id"]
        if not valid_request_id(shown):
            raise bad_request("Invalid request id.", "id", "invalid_request_id")
        request[RID] = shown
        last = (request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "").strip()
        # As the original request asked, unless the replaying client says otherwise.
        asked = request.query.get("include_usage")
        rid, history = await story(self.ctx.bus, request[CALLER], shown)  # (another tenant's: none)
        if not history:
            raise not_found(
                f"No request with id '{shown}' (never accepted, or expired).", "id", "request_not_found"
            )
        first = history[0][1]
        if isinstance(first, Accepted) and first.endpoint == "embeddings":
            raise bad_request(
                f"Request '{shown}' is an embeddings request: its answer is not a stream.",
                "id",
                "invalid_value",
            )
        if asked is not None:
            iu = asked.lower() not in ("0", "false", "no")
        else:
            iu = first.include_usage if isinstance(first, Accepted) else True
        n = first.choices if isinstance(first, Accepted) else None
        try:
            if n and n > 1:
                skip = [entry_id_key(p.strip()) for p in last.split(",")] if last else None
                if skip is not None and len(skip) != n:
                    raise ValueError(last)
            else:
                skip = entry_id_key(last) if last else None
        except ValueError:
            raise bad_request(
                "Last-Event-ID is not an id this request's stream sent.", "Last-Event-ID"
            ) from None
        if n and n > 1:
            return await self._replay_choices(request, rid, first, iu, skip)
        if isinstance(first, Accepted):
            renderer = self.streams.renderer(
                shown,
                first.endpoint or "completion",
                first.model,
                first.created,
                first.prompt_tokens,
                iu,
                bool(first.continuous_usage),
            )
        else:  # an abort overtook the request: its whole story is the abort (no `accepted`)
            renderer = rendering.CompletionRenderer(shown, self.ctx.cfg.model_name, first.ts // 1000, 0, iu)
        return await self.streams.stream(
            request, shown, self.streams.story_then_live(rid, history), renderer, None, skip
        )

    async def _replay_choices(
        self,
        request: web.Request,
        rid: str,
        first: Accepted,
        include_usage: bool,
        skip: list[tuple[int, int]] | None,
    ) -> web.StreamResponse:
        """:meth:`stream_request` of a response of n choices: their streams, merged again."""
        shown = request[RID]
        ids = choice_ids(rid, first.choices)
        for k, c in enumerate(ids):
            if not await self.ctx.bus.request_exists(c):
                raise not_found(
                    f"Choice '{shown}.{k}' of request '{shown}' has expired.", "id", "request_not_found"
                )
        choices = Choices(
            shown,
            first.choices,
            first.endpoint or "completion",
            first.model,
            first.created,
            first.prompt_tokens,
            include_usage,
            self.ctx.token_bytes,
            bool(first.continuous_usage),
            first.n,
            request_ids=ids,
        )
        subs = [await self.ctx.mux.subscribe(c, b"0") for c in choices.request_ids]
        for sub in subs:
            sub.story_started()  # (read above: they exist)
        try:
            return await self.streams.stream(request, shown, merged(subs), choices, None, skip)
        finally:
            for sub in subs:
                await sub.close()
