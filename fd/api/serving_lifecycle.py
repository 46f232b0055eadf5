"""``GET /v1/lifecycle`` (DESIGN.md §2, ``P:lifecycle``): the lifecycle stream as server-sent
events, for what watches fd over HTTP (a dashboard, a router, an autoscaler).

Admin key only: the stream names every tenant's requests. Each entry is one SSE event, its
Redis entry id as ``id:``, its type as ``event:`` and its fields as a JSON object (numbers as
numbers), so a client that reconnects with ``Last-Event-ID`` goes on from any replica. It ends
when its client hangs up, or with an ``error`` event when Redis fails.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from fd.api import sse
from fd.api.context import CALLER, ApiContext
from fd.api.errors import ApiError, bad_request, server_error, unauthorized, unavailable
from fd.api.streaming import KEEPALIVE_S
from fd.control.entry_ids import entry_id_key
from fd.control.events import LifecycleEvent, json_fields
from fd.control.outage import REDIS_FAILURES, is_outage, reason

log = logging.getLogger("fd.api")

#: BLOCK of each read: at most the API's longest (fd/control/connect.py's MIN_TIMEOUT_S is above
#: it), and how long a read goes on after its client left (see :meth:`ServingLifecycle._read`).
BLOCK_MS = 1000
#: The largest entry id part Redis takes (an unsigned 64-bit number).
_MAX_PART = (1 << 64) - 1


def _cursor(request: web.Request) -> str:
    """Where the stream starts: after ``Last-Event-ID`` (an EventSource reconnecting sends it,
    and it wins over the URL it reconnects to), else after ``?since=``, else only what comes
    next (``$``). ``0``: from the oldest entry kept."""
    header = request.headers.get("Last-Event-ID")
    param, given = ("Last-Event-ID", header) if header is not None else ("since", request.query.get("since"))
    given = (given or "").strip() or "$"
    if given == "$":
        return given
    try:
        ms, seq = entry_id_key(given)
    except ValueError:
        ms = seq = -1
    if not (0 <= ms <= _MAX_PART and 0 <= seq <= _MAX_PART):
        raise bad_request(
            f"{param} is not a lifecycle stream entry id ('<ms>-<seq>', '0' or '$').", param, "invalid_value"
        )
    return f"{ms}-{seq}"


class ServingLifecycle:
    """The lifecycle stream's SSE route, over one replica's context."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self._reads: set[asyncio.Task[Any]] = set()  # reads left to finish by clients that hung up

    async def lifecycle(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/lifecycle``: every entry after the cursor (:func:`_cursor`), then each new
        one as it comes, with a ``: keep-alive`` comment after KEEPALIVE_S of silence."""
        if not request[CALLER].admin:
            raise unauthorized("This endpoint needs the admin key (Authorization: Bearer <admin key>).")
        ctx = self.ctx
        cursor: bytes | str = _cursor(request)
        await ctx.check_redis()
        # A first read that does not block, before the answer starts: "$" is resolved here, and
        # a Redis that fails is a 503 (the error middleware's), not a stream that ends at once.
        cursor, batch = await ctx.bus.read_lifecycle(cursor, None)
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        said = loop.time()
        try:
            while True:
                if batch:
                    await resp.write(b"".join(sse.frame(json_fields(ev), eid, ev.TYPE) for eid, ev in batch))
                    said = loop.time()
                elif loop.time() - said >= KEEPALIVE_S:
                    await resp.write(sse.comment("keep-alive"))
                    said = loop.time()
                try:
                    cursor, batch = await self._read(cursor)
                except REDIS_FAILURES as e:
                    # The answer has begun: the stream ends with why, and the client reconnects
                    # with the last id it saw (an EventSource does so by itself).
                    await resp.write(sse.frame(self._failed(e).body(), None, "error"))
                    await resp.write_eof()
                    return resp
        except ConnectionError:  # a write to a client that left (a hang-up mid-read cancels instead)
            return resp

    def _failed(self, e: BaseException) -> ApiError:
        """What the error middleware would have answered a Redis failure with."""
        if is_outage(e):
            self.ctx.redis_failed(e)
            return unavailable(f"The control plane (Redis) is unavailable: {reason(e)}")
        log.error("redis refused a read of %s: %s", self.ctx.bus.keys.lifecycle, e)
        return server_error(f"The control plane (Redis) refused the read: {e}")

    async def _read(self, cursor: bytes | str) -> tuple[bytes, list[tuple[bytes, LifecycleEvent]]]:
        """One blocking read, in a task of its own that a client's hang-up does not cancel: a
        blocking read cancelled on the embedded server leaves a waiter inside it (DESIGN.md §6).
        The handler ends at the hang-up; the read ends within BLOCK_MS, its answer unread."""
        task = asyncio.create_task(self.ctx.bus.read_lifecycle(cursor, BLOCK_MS), name="fd-lifecycle-read")
        self._reads.add(task)
        task.add_done_callback(self._read_done)
        return await asyncio.shield(task)

    def _read_done(self, task: asyncio.Task[Any]) -> None:
        self._reads.discard(task)
        if not task.cancelled():
            task.exception()  # (a read whose client left: its error is nobody's to see)
