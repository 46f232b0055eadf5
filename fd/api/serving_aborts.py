"""Aborts (DESIGN.md §5): ``POST /v1/abort_requests`` and ``POST /v1/requests/{id}/cancel``
by id, and the abort a client's hang-up makes (:mod:`fd.api.cancellation`). Every engine
reads every abort; the one that owns a request ends it.
"""

from __future__ import annotations

import asyncio
import math

from aiohttp import web

from fd.api.abort import parse_abort
from fd.api.cancellation import Cancellation
from fd.api.context import (
    CALLER,
    ApiContext,
    json_response,
    new_abort_id,
    valid_engine_id,
    valid_request_id,
)
from fd.api.errors import bad_request, unauthorized
from fd.api.tenancy import abort_targets
from fd.control.events import MAX_IDS_PER_ABORT, Abort, AbortAll, Accepted, Final
from fd.control.keys import all_valid_request_ids, choice_ids

MAX_WAIT_S = 300.0


class ServingAborts:
    """The abort routes, and the disconnect aborts of the generating routes it guards
    (``cancellation.guard``)."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.cancellation = Cancellation(self._abort_on_disconnect)

    async def on_cleanup(self, app: web.Application) -> None:
        await self.cancellation.drain()

    async def _abort_on_disconnect(self, request_ids: tuple[str, ...]) -> None:
        bus = self.ctx.bus
        await bus.publish(
            bus.keys.control, Abort(request_ids=request_ids, source="disconnect", abort_id=new_abort_id())
        )
        # fd_abort_requests_total is counted by the engine where the abort takes effect
        # (every engine reads every abort; exactly one owns the request).
        # their finals go unseen by this replica (a response of n choices: n requests)
        self.ctx.metrics.requests_total.labels("abort").inc(len(request_ids))
        self.ctx.metrics.vllm.finished("abort", len(request_ids))

    async def abort_requests(self, request: web.Request) -> web.Response:
        """Publish one abort and answer at once (``?wait=S``: the old synchronous answer)."""
        ctx = self.ctx
        wait = request.query.get("wait")
        timeout = None
        if wait is not None:
            try:
                timeout = float(wait)
            except ValueError:
                raise bad_request("'wait' must be a number of seconds.", "wait", "invalid_value") from None
            if not math.isfinite(timeout) or timeout < 0:
                raise bad_request("'wait' must be a number of seconds.", "wait", "invalid_value")
            timeout = min(timeout, MAX_WAIT_S)
        body = parse_abort(
            await ctx.body(request),
            valid_request_id,
            valid_engine_id,
            MAX_IDS_PER_ABORT,
            all_valid_request_ids,
        )
        abort_id = new_abort_id()
        caller = request[CALLER]
        if body.abort_all:
            if not caller.admin:  # (every tenant's requests)
                raise unauthorized("abort_all needs the admin key (Authorization: Bearer <admin key>).")
            await ctx.bus.publish(
                ctx.bus.keys.control, AbortAll(engine=body.engine, source="http", abort_id=abort_id)
            )
            return json_response(
                {
                    "abort_id": abort_id,
                    "abort_all": True,
                    "engine": body.engine,
                    "accepted": [],
                    "rejected": [],
                }
            )
        # a tenant aborts its own requests; any other id is aborted where an unknown id would
        # be, in its own space, so the answer is the same as for one
        targets = await abort_targets(ctx.bus, caller, body.request_ids)
        await ctx.publish_abort(tuple(t for t in targets if t is not None), abort_id)
        if timeout is not None:
            return json_response(await self.wait_final(tuple(targets), timeout, body.request_ids))
        return json_response(
            {
                "abort_id": abort_id,
                "accepted": list(body.request_ids),
                "rejected": [{"request_id": r, "reason": why} for r, why in body.rejected],
            }
        )

    async def cancel_request(self, request: web.Request) -> web.Response:
        """``POST /v1/requests/{id}/cancel``: abort one request; answers at once."""
        shown = request.match_info["id"]
        if not valid_request_id(shown):
            raise bad_request("Invalid request id.", "id", "invalid_request_id")
        abort_id = new_abort_id()
        # (another tenant's id: aborted where an unknown one would be, as abort_requests does)
        targets = await abort_targets(self.ctx.bus, request[CALLER], (shown,))
        await self.ctx.publish_abort(tuple(t for t in targets if t is not None), abort_id)
        return json_response({"abort_id": abort_id, "accepted": [shown], "rejected": []})

    async def wait_final(
        self, ids: tuple[str | None, ...], timeout: float, shown: tuple[str, ...] | None = None
    ) -> dict:
        """What an abort that waits answers: which requests reached their final within ``timeout``,
        named as the client named them (``shown``; by default the log's ids). None: no
        request's (a tenant's id too long for its space)."""
        bus, mux = self.ctx.bus, self.ctx.mux
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def one(rid: str | None) -> Final | None:
            if rid is None:
                return None
            history = await bus.read_req(rid, b"0")
            if not history:
                return None
            first = history[0][1]
            if isinstance(first, Accepted) and first.choices and first.choices > 1:
                # a response of n choices: done when every choice is, its tokens theirs summed
                finals = await asyncio.gather(*(one(c) for c in choice_ids(rid, first.choices)))
                if any(f is None for f in finals):
                    return None
                n = sum(int((f.usage or {}).get("completion_tokens") or 0) for f in finals)
                # aborted if the abort ended any choice; else as its first choice ended
                reasons = [f.finish_reason for f in finals]
                why = "abort" if "abort" in reasons else reasons[0]
                return Final(request_id=rid, finish_reason=why, usage={"completion_tokens": n})
            for _eid, ev in history:
                if isinstance(ev, Final):
                    return ev
            sub = await mux.subscribe(rid, history[-1][0])
            try:
                async with asyncio.timeout_at(deadline):
                    async for _eid, ev in sub:
                        if isinstance(ev, Final):
                            return ev
            except TimeoutError:
                return None
            finally:
                await sub.close()
            return None

        finals = await asyncio.gather(*(one(r) for r in ids))
        return _listing(tuple(shown or ids), finals)


def _listing(names: tuple[str | None, ...], finals: list[Final | None]) -> dict:
    """The answer of an abort that waits: under ``aborted`` the requests the abort ended (their
    final's reason is ``abort``); under ``finished``, only when there are some, those that
    ended otherwise (before it, or as it came), by finish reason: ``{"length": [...]}``; under
    ``not_found`` those without a final in time, unknown ids among them. An abort does nothing
    to a request that has finished, so listing one as aborted would say what did not happen."""
    aborted, finished, missing = [], {}, []
    for rid, fin in zip(names, finals, strict=False):
        if fin is None:
            missing.append(rid)
            continue
        n = (fin.usage or {}).get("completion_tokens", 0)
        entry = {"request_id": rid, "output_token_count": n if isinstance(n, int) else 0}
        if fin.finish_reason == "abort":
            aborted.append(entry)
        else:
            finished.setdefault(fin.finish_reason, []).append(entry)
    out: dict = {"aborted": aborted, "not_found": missing}
    if finished:  # (absent otherwise: the answer's shape before it listed them)
        out["finished"] = finished
    return out
