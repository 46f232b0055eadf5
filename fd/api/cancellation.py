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

The cancellation comes two loop turns after the hang-up: the peer's end of the connection is
read in one turn, the connection is closed in the next, and the cancelled handler runs in the
one after. Under load a turn is every other stream's token writes (a few ms at 32 streams), so
each guarded request also has a :class:`HangUpEar` between its transport and aiohttp's
protocol (asyncio's public ``set_protocol``), which publishes the abort in the turn that reads
the peer's end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from fd.control.outage import REDIS_FAILURES, is_outage, reason

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


class HangUpEar(asyncio.Protocol):
    """aiohttp's protocol for one connection, passed everything, and told first of the peer's
    end: its EOF, or a connection reset. A close of the server's own (shutdown, keep-alive
    timeout) is no hang-up and says nothing. ``on_hangup`` is the guarded request's, set
    while its handler runs (a kept-alive connection serves one request after another)."""

    def __init__(self, inner: asyncio.Protocol):
        self.inner = inner
        self.on_hangup: Callable[[], None] | None = None

    @classmethod
    def of(cls, transport: asyncio.BaseTransport | None) -> HangUpEar | None:
        """The connection's ear, put in place on its first guarded request."""
        if transport is None or transport.is_closing():
            return None
        protocol = transport.get_protocol()
        if isinstance(protocol, cls):
            return protocol
        ear = cls(protocol)  # type: ignore[arg-type]
        transport.set_protocol(ear)
        return ear

    def _heard(self) -> None:
        hangup, self.on_hangup = self.on_hangup, None
        if hangup is not None:
            try:
                hangup()
            except Exception:
                log.exception("a hang-up's abort failed")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        self._heard()
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, OSError):  # a reset (None: the server closed it)
            self._heard()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


#: How long a disconnect's abort is sent again while Redis is out (see Cancellation._publish).
ABORT_RETRY_S = 60.0


class Cancellation:
    """Wraps generating handlers; ``on_disconnect(request_ids)`` publishes the abort (of the
    watch's ``abort_ids``, else its ``request_id``)."""

    def __init__(self, on_disconnect: Callable[[tuple[str, ...]], Awaitable[None]]):
        self._on_disconnect = on_disconnect
        self._tasks: set[asyncio.Task] = set()

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            watch = request[WATCH] = Watch()
            ear = HangUpEar.of(request.transport)
            if ear is not None:
                ear.on_hangup = lambda: self._disconnected(watch)
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
            finally:
                if ear is not None:
                    ear.on_hangup = None

        guarded.__name__ = getattr(handler, "__name__", "guarded")
        guarded.__doc__ = handler.__doc__
        guarded.with_cancellation = True  # type: ignore[attr-defined]
        return guarded

    def _disconnected(self, watch: Watch) -> None:
        if watch.request_id is None or watch.background or watch.finished or watch.aborted:
            return
        watch.aborted = True
        ids = watch.abort_ids or (watch.request_id,)
        # Published from its own task: this one is being cancelled and must re-raise now.
        task = asyncio.get_running_loop().create_task(
            self._publish(ids), name=f"disconnect-abort:{watch.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, request_ids: tuple[str, ...]) -> None:
        """The abort, sent again through an outage (Redis away or refusing writes for now,
        fd/control/outage.py) for up to :data:`ABORT_RETRY_S`: a client that hangs up while Redis
        is out of memory still stops its request once Redis takes writes again."""
        backoff, deadline = 0.05, asyncio.get_running_loop().time() + ABORT_RETRY_S
        while True:
            try:
                await self._on_disconnect(request_ids)
                return
            except REDIS_FAILURES as e:
                if not is_outage(e) or asyncio.get_running_loop().time() + backoff > deadline:
                    log.error("could not publish the disconnect abort of %s: %s", request_ids[0], reason(e))
                    return
            except Exception:
                log.exception("could not publish the disconnect abort of %s", request_ids[0])
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def drain(self, grace_s: float = 5.0) -> None:
        """Wait for aborts still being published (app cleanup), those retried through an
        outage for at most ``grace_s``."""
        if self._tasks:
            _, late = await asyncio.wait(list(self._tasks), timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
