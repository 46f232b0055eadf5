"""Client disconnects become aborts: one mechanism for every generating endpoint.

A client that goes away must free its engine slot at once, whether its request is still
queued, prefilling, or streaming; waiting for the next failed write would leave a queued or
prefilling request running for nothing (FastDeploy PR 5320). aiohttp can cancel a handler's
task when its connection is lost (``handler_cancellation``, which :func:`fd.api.server.make_app`
turns on for the app); this module tells that cancellation apart from the server's own
shutdown and turns it into exactly one ``abort`` (``source=disconnect``) on ``P:control``.

Telling them apart: when the connection drops, aiohttp sets a connection error on the
request's payload *before* it cancels the handler; on shutdown it sets ``CancelledError``.
Either way the cancellation is re-raised: swallowing it would keep a shutting-down server
waiting on handlers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("fd.api.cancellation")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Watch:
    """What the handler tells the guard about its request, as it goes."""

    request_id: str | None = None  # set once the request may have reached Redis
    # what a disconnect aborts: the request, or a response's choices (n > 1), by their ids
    abort_ids: tuple[str, ...] = ()
    background: bool = False  # the client asked that a disconnect not abort it
    finished: bool = False  # its final was seen: nothing left to abort
    aborted: bool = False  # a disconnect abort was already published


#: The status a response to a client that hung up is logged with (nginx's "client closed request").
CLIENT_CLOSED = 499

WATCH = web.RequestKey("fd.watch", Watch)  # the Watch in request[...]


def watch_of(request: web.Request) -> Watch:
    """The handler's side: the guard's :class:`Watch` for this request."""
    w = request.get(WATCH)
    if w is None:  # called outside a guarded handler: a harmless, unwatched stand-in
        w = request[WATCH] = Watch()
    return w


def client_disconnected(request: web.Request) -> bool:
    """True when the peer closed the connection (as opposed to the server shutting down)."""
    try:
        exc = request.content.exception()
    except Exception:  # pragma: no cover - a payload without exception()
        exc = None
    if isinstance(exc, Exception):  # connection_lost sets ConnectionResetError / OSError
        return True
    transport = request.transport
    return exc is None and (transport is None or transport.is_closing())


class Cancellation:
    """Wraps generating handlers; ``on_disconnect(request_ids)`` publishes the abort (of the
    watch's ``abort_ids``, else its ``request_id``).

    ``notice(request_ids)``, if given, runs at once, inside the cancelled handler, before the
    publish gets its own task: ``fd serve`` uses it to tell the engine in this process, a loop
    turn or two before the publish would."""

    def __init__(
        self,
        on_disconnect: Callable[[tuple[str, ...]], Awaitable[None]],
        notice: Callable[[tuple[str, ...]], None] | None = None,
    ):
        self._on_disconnect = on_disconnect
        self._notice = notice
        self._tasks: set[asyncio.Task] = set()

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            watch = request[WATCH] = Watch()
            try:
                return await handler(request)
            except asyncio.CancelledError:
                if client_disconnected(request):
                    self._disconnected(watch)
                raise
            except ConnectionError:
                # A write to a closing transport: the peer left (a shutdown cancels instead).
                # Answered, not raised: aiohttp logs a handler's exception as an error with its
                # traceback, and a client hanging up is no error. The answer meets the closed
                # connection, which aiohttp takes quietly (nginx's 499, in an access log).
                self._disconnected(watch)
                return web.Response(status=CLIENT_CLOSED)

        guarded.__name__ = getattr(handler, "__name__", "guarded")
        guarded.__doc__ = handler.__doc__
        guarded.with_cancellation = True  # type: ignore[attr-defined]
        return guarded

    def _disconnected(self, watch: Watch) -> None:
        if watch.request_id is None or watch.background or watch.finished or watch.aborted:
            return
        watch.aborted = True
        ids = watch.abort_ids or (watch.request_id,)
        if self._notice is not None:
            try:
                self._notice(ids)
            except Exception:
                log.exception("disconnect notice for %s failed", watch.request_id)
        # Published from its own task: this one is being cancelled and must re-raise now.
        task = asyncio.get_running_loop().create_task(
            self._publish(ids), name=f"disconnect-abort:{watch.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, request_ids: tuple[str, ...]) -> None:
        try:
            await self._on_disconnect(request_ids)
        except Exception:
            log.exception("could not publish the disconnect abort of %s", request_ids[0])

    async def drain(self) -> None:
        """Wait for aborts still being published (app cleanup)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
