"""A request's events as its client sees them: batches off the stream mux, rendered as SSE
frames, with the latencies measured where the client sees them. The live generating routes
and those that replay a stored stream (``/v1/requests/{id}/stream``, ``/v1/responses/{id}``)
share it, so a replayed frame is byte for byte the live one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from fd.api import rendering, sse
from fd.api.cancellation import watch_of
from fd.api.choices import Choices, choices_cursor
from fd.api.context import ApiContext, new_abort_id
from fd.api.errors import story_lost, unavailable
from fd.api.responses_renderer import ResponsesRenderer
from fd.control.entry_ids import entry_id_key
from fd.control.events import Accepted, Claimed, Final, Preempted, Tokens
from fd.control.metrics import Metrics
from fd.control.mux import StoryLost

KEEPALIVE_S = 15.0  # an SSE comment this often while nothing happens, so proxies keep the line


class Timing:
    """TTFT / ITL / E2E of one live request, measured where the client sees them, and vLLM's
    per-request metrics from the same events (fd.control.vllm_metrics.VllmRequest). ``n``: the
    response's choices, given to one of them (0 for the others, so vLLM's n counts once)."""

    def __init__(
        self,
        metrics: Metrics,
        arrival: float,
        prompt_tokens: int = 0,
        max_tokens: int | None = None,
        n: int = 1,
    ):
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.vllm = metrics.vllm.request(arrival, prompt_tokens, max_tokens, n)

    def close(self) -> None:
        """Its handler is done, with or without the final (a client that hung up, a background
        response answered at once): it no longer waits in vLLM's waiting count."""
        self.vllm.close()

    def engine_event(self, ev: Claimed | Preempted) -> None:
        """An engine claimed the request (its queue time ends) or preempted it."""
        if isinstance(ev, Claimed):
            self.vllm.claimed(time.monotonic())
        elif not ev.handback:  # (a draining engine handing it back is no preemption)
            self.vllm.preempted()

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        self.vllm.tokens(now, n)
        if self.last is None:
            self.m.time_to_first_token_seconds.observe(now - self.arrival)
            n -= 1
        elif n:
            per = (now - self.last) / n
            for _ in range(n):
                self.m.inter_token_latency_seconds.observe(per)
            n = 0
        self.last = now

    def final(self, final: Final) -> None:
        now = time.monotonic()
        self.m.e2e_request_latency_seconds.observe(now - self.arrival)
        self.m.requests_total.labels(final.finish_reason).inc()
        self.vllm.final(now, final.finish_reason, final.usage)


def render(ev: Any, renderer: Any, timing: Timing | None) -> tuple[bytes | None, list[dict]]:
    """One event of a request's stream as what its SSE frames carry: a token chunk already
    serialised, or chunks (``accepted``: the start; ``final``: the end), or nothing."""
    if isinstance(ev, Tokens):
        n = len(ev.token_ids)
        if timing is not None:
            timing.tokens(n)
        if renderer.structured:  # may be several chunks (content, then a tool call)
            return None, renderer.token_chunks(ev.text, n, ev.token_ids, ev.logprobs, ev.prompt_logprobs)
        return renderer.token_json(ev.text, n, ev.token_ids, ev.logprobs, ev.prompt_logprobs), []
    if isinstance(ev, Accepted):
        return None, renderer.start_chunks(ev)
    if isinstance(ev, Final):
        if timing is not None:
            timing.final(ev)
        return None, renderer.final_chunks(ev)
    if isinstance(ev, (Claimed, Preempted)) and timing is not None:
        timing.engine_event(ev)
    return None, []


async def events(sub) -> AsyncIterator[list[tuple[bytes, Any]] | None]:
    """The subscription's events, in batches of what was delivered together (one write
    each), with ``None`` whenever it was quiet for KEEPALIVE_S."""
    while True:
        if not await sub.ready(KEEPALIVE_S):
            yield None
            continue
        batch = sub.take_ready()
        if batch:
            yield batch
        elif sub.done:
            return


async def merged(subs: list) -> AsyncIterator[list[tuple[int, bytes, Any]] | None]:
    """The choices' events as they come, ``(choice, entry id, event)``, in batches (one
    write each), ``None`` whenever all were quiet for KEEPALIVE_S; ends once every choice
    has ended. One wake-up for any of them (``Subscription.on_put``)."""
    put = asyncio.Event()
    for sub in subs:
        sub.on_put = put.set
    while True:
        put.clear()
        batch = [(k, eid, ev) for k, sub in enumerate(subs) for eid, ev in sub.take_ready()]
        if batch:
            yield batch
            continue
        if all(sub.done for sub in subs):
            return
        # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancellation that
        # comes as the wait ends (CPython gh-86296), and a handler cancelled by its client's
        # hang-up would go on streaming instead of aborting the request.
        try:
            async with asyncio.timeout(KEEPALIVE_S):
                await put.wait()
        except TimeoutError:
            yield None


#: The request header by which a client of a generating POST asks for ``id:`` lines (any value
#: but "0" or "false"): what it resumes from with ``Last-Event-ID``.
EVENT_IDS_HEADER = "X-Event-Ids"


def with_event_ids(request: web.Request) -> bool:
    """Whether a stream's frames carry ``id:`` lines. OpenAI's streams are ``data:`` lines only,
    and clients that strip a leading ``data: `` from each event and parse the rest (vLLM's
    benchmark client) fail on anything else; so a stream carries ids only when its client asks
    (:data:`EVENT_IDS_HEADER`), or resumes from one (``Last-Event-ID``, ``?last_event_id=``),
    and the same request's stream and its replay are the same bytes."""
    if "Last-Event-ID" in request.headers or "last_event_id" in request.query:
        return True
    flag = request.headers.get(EVENT_IDS_HEADER, "")
    return bool(flag) and flag.strip().lower() not in ("0", "false", "no")


class Streams:
    """SSE answers over one replica's mux: a request's events live, its story replayed, or
    the story and then the rest live. A response of n choices that fails stops its other
    choices, which is why this holds the context and not only the mux."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx

    def renderer(
        self,
        rid: str,
        endpoint: str,
        model: str,
        created: int,
        prompt_tokens: int,
        include_usage: bool,
        continuous_usage: bool,
    ) -> rendering.Renderer | ResponsesRenderer:
        """What renders a request's events, by the endpoint its ``accepted`` event names."""
        if endpoint == "responses":
            return ResponsesRenderer(rid, model, created, prompt_tokens, self.ctx.token_bytes)
        return rendering.make_renderer(
            rid,
            endpoint,
            model,
            created,
            prompt_tokens,
            include_usage,
            self.ctx.token_bytes,
            continuous_usage,
        )

    async def abort_rest(self, choices: Choices) -> None:
        """One choice failed: the response has failed, so the others stop too."""
        rest = tuple(c for c, f in zip(choices.request_ids, choices.finals, strict=False) if f is None)
        if rest:
            await self.ctx.publish_abort(rest, new_abort_id())

    async def story_then_live(self, rid: str, history: list) -> AsyncIterator:
        """A request's events so far, then (unless it has ended) the rest as they come."""
        yield history
        if any(isinstance(ev, Final) for _, ev in history):
            return
        sub = await self.ctx.mux.subscribe(rid, history[-1][0])
        try:
            async for batch in events(sub):
                yield batch
        finally:
            await sub.close()

    async def stream(
        self,
        request: web.Request,
        rid: str,
        events: AsyncIterator,
        renderer: rendering.Renderer | Choices,
        timing: Timing | list[Timing] | None,
        skip_until: Any = None,
    ) -> web.StreamResponse:
        """Render events as SSE until the final. Entries at or before ``skip_until`` only update
        the renderer's state (a resume), the rest are written with their entry id. (A response
        of n choices: a :class:`Choices`, a timing and a ``skip_until`` per choice.)"""
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "X-Request-Id": rid,
            }
        )
        await resp.prepare(request)
        watch = watch_of(request)
        write = self._write_choice_events if isinstance(renderer, Choices) else self._write_events
        ids = with_event_ids(request)
        async with contextlib.aclosing(events):
            try:
                await write(resp, events, renderer, timing, skip_until, watch, ids)
            except StoryLost as e:  # (nothing left to abort: the stream ends with why)
                watch.finished = True
                error = story_lost(str(e)).body()
                named = not isinstance(renderer, Choices) and renderer.named_events
                await resp.write(sse.frame(error, None, "error") if named else sse.frame(error) + sse.DONE)
        await resp.write_eof()
        return resp

    async def _write_choice_events(
        self, resp, events, choices: Choices, timing, skip_until, watch, ids: bool
    ) -> None:
        """:meth:`_write_events` for a response of n choices. A frame's ``id:`` is where every
        choice's stream stands (``choices_cursor``), so ``Last-Event-ID`` resumes them all."""
        n = len(choices.parts)
        cursor = [b"0"] * n
        skip = skip_until or [(0, 0)] * n
        async for batch in events:
            if batch is None:
                await resp.write(sse.comment("keep-alive"))
                continue
            out: list[bytes] = []
            failed = False
            for k, eid, ev in batch:
                cursor[k] = eid
                payload, chunks = render(ev, choices.choice(k), None if timing is None else timing[k])
                failed = isinstance(ev, Final) and ev.finish_reason == "error"
                if (payload is not None or chunks) and entry_id_key(eid) > skip[k]:
                    cid = choices_cursor(cursor) if ids else None
                    out += (
                        [sse.json_frame(payload, cid)]
                        if payload is not None
                        else [sse.frame(c, cid) for c in chunks]
                    )
                if failed or choices.done:
                    break
            if failed or choices.done:
                watch.finished = True
                if failed:  # the response has failed: the other choices stop too
                    await self.abort_rest(choices)
                out.append(sse.DONE)
            if out:
                await resp.write(b"".join(out))
            if failed or choices.done:
                return
        await resp.write(sse.frame(unavailable("The request's stream ended without a final event.").body()))

    async def _write_events(self, resp, events, renderer, timing, skip_until, watch, ids: bool) -> None:
        """Write each batch of events as one ``write``: the bytes are exactly those of one
        write per event, in order; only the number of sends (and wake-ups) shrinks. (A
        renderer with ``named_events``, the Responses API's, names each frame's event type and
        sends no ``[DONE]``.)"""
        named = renderer.named_events
        async for batch in events:
            if batch is None:
                await resp.write(sse.comment("keep-alive"))
                continue
            out: list[bytes] = []
            done = False
            for eid, ev in batch:
                payload, chunks = render(ev, renderer, timing)
                if isinstance(ev, Final):
                    watch.finished = done = True
                if (payload is not None or chunks) and (skip_until is None or entry_id_key(eid) > skip_until):
                    fid = eid if ids else None
                    if payload is not None:
                        out.append(sse.json_frame(payload, fid))
                    elif named:
                        out += [sse.frame(c, fid, c["type"]) for c in chunks]
                    else:
                        out += [sse.frame(c, fid) for c in chunks]
                if done:
                    if not named:
                        out.append(sse.DONE)
                    break
            if out:
                await resp.write(b"".join(out))
            if done:
                break
        else:
            await resp.write(
                sse.frame(unavailable("The request's stream ended without a final event.").body())
            )
