"""The API node's HTTP surface (DESIGN.md §5): the aiohttp app, its middlewares, and its routes
wired to the handlers.

The handlers are grouped by endpoint family over one shared :class:`~fd.api.context.ApiContext`,
as vLLM's ``OpenAIServing*`` classes are: generating (:mod:`fd.api.serving_generate`), the
Responses API (:mod:`fd.api.serving_responses`), embeddings (:mod:`fd.api.serving_embeddings`),
aborts (:mod:`fd.api.serving_aborts`) and the rest (:mod:`fd.api.serving_admin`). This module
keeps what is the app's own: the key check, CORS, the error shape, and which route goes where.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Iterable
from http import HTTPStatus
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from redis.exceptions import RedisError

from fd.api.cancellation import CLIENT_CLOSED, client_disconnected
from fd.api.config import ApiConfig
from fd.api.context import CALLER, RID, ApiContext, json_response
from fd.api.cors import Cors
from fd.api.errors import ApiError, bad_request, id_taken, server_error, story_lost, unauthorized, unavailable
from fd.api.serving_aborts import ServingAborts
from fd.api.serving_admin import ServingAdmin
from fd.api.serving_embeddings import ServingEmbeddings
from fd.api.serving_generate import ServingGenerate
from fd.api.serving_lifecycle import ServingLifecycle
from fd.api.serving_responses import ServingResponses
from fd.api.streaming import Streams
from fd.api.tenancy import Tenancy
from fd.control.bus import Bus
from fd.control.metrics import Metrics
from fd.control.mux import MuxStopped, StoryLost, StreamMux
from fd.control.outage import is_outage, reason
from fd.control.story import IdTaken

__all__ = ["ApiSite", "make_app"]

log = logging.getLogger("fd.api")

API_KEY = web.AppKey("fd.api", ApiContext)
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # they act on everyone's requests
KEYED_PATHS = ("/score", "/rerank", "/v2/rerank")  # vLLM's, outside /v1: they run the model
CORS_REFUSED = web.RequestKey("fd.cors_refused", bool)
USAGE = web.RequestKey("fd.usage", dict)  # a streamed answer's token counts, as its frames say

#: one line per HTTP request (uvicorn's access log, as vLLM serves it)
access_log = logging.getLogger("fd.access")
#: a token count in an answer's usage object (OpenAI's names, and the Responses API's)
_USAGE_FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)":\s*(\d+)')
_USAGE_NAMES = {b"input_tokens": "prompt_tokens", b"output_tokens": "completion_tokens"}


def _usage_of(data: bytes, into: dict) -> None:
    """The token counts of the last usage object in ``data`` (an answer's JSON, or frames of
    one), into ``into``. A quote inside a JSON string is escaped, so ``"usage"`` is a key."""
    at = data.rfind(b'"usage"')
    if at >= 0:
        for name, n in _USAGE_FIELD.findall(data, at):
            into[_USAGE_NAMES.get(name, name.decode())] = int(n)


async def _sniff_usage(request: web.Request, response: web.StreamResponse) -> None:
    """A streamed answer (SSE) tells its token counts in its last frames, if at all (a
    client's ``include_usage``): its writes are read for them, for the access line."""
    if isinstance(response, web.Response) or not access_log.isEnabledFor(logging.INFO):
        return  # (a whole answer's body is read once its handler returns)
    usage = request[USAGE] = {}
    write = response.write

    # (a plain function handing back write's own coroutine: no frame more per token write)
    def write_reading_usage(data: bytes | bytearray | memoryview) -> Awaitable[None]:
        if b'"usage"' in data:
            _usage_of(bytes(data), usage)
        return write(data)

    response.write = write_reading_usage  # type: ignore[method-assign]


def _access(skip: frozenset[str]):
    """One line per request, after its answer (a stream: once it ended): method, path,
    status, request id, token counts where the answer says them, latency. A client that hung
    up is logged as 499 (nginx's "client closed request"). Never a header: no key is logged.
    The outermost middleware after :func:`_head_read`, so a 401 or a CORS refusal is logged too."""

    @web.middleware
    async def access(request: web.Request, handler):
        if request.path in skip or not access_log.isEnabledFor(logging.INFO):
            return await handler(request)
        t0 = time.perf_counter()
        resp: web.StreamResponse | None = None
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:  # (a redirect: answered by aiohttp as it is)
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            # a hang-up, or the server's own shutdown cancelling its handlers
            status = CLIENT_CLOSED if client_disconnected(request) else 503
            raise
        finally:
            _log_access(request, resp, status, time.perf_counter() - t0)

    return access


def _log_access(request: web.Request, resp: web.StreamResponse | None, status: int, dt: float) -> None:
    usage = request.get(USAGE)
    if usage is None:
        usage = {}
        if isinstance(resp, web.Response) and isinstance(resp.body, (bytes, bytearray)):
            _usage_of(bytes(resp.body), usage)
    rid = request.get(RID) or (resp.headers.get("X-Request-Id") if resp is not None else None)
    fields: dict[str, Any] = {"event": "access", "method": request.method, "path": request.path}
    fields["status"] = status
    if rid:
        fields["request_id"] = rid
    fields.update(usage)
    fields["latency_ms"] = round(dt * 1000, 1)
    fields["client"] = request.remote
    fields["_in_msg"] = ("event", "method", "path", "status")  # (text mode: said in the message)
    access_log.info(
        '"%s %s HTTP/%d.%d" %d',
        request.method,
        request.path,
        request.version.major,
        request.version.minor,
        status,
        extra=fields,
    )


def _error_response(err: ApiError, request: web.Request) -> web.Response:
    rid = request.get(RID)
    return json_response(err.body(), err.status, {"X-Request-Id": rid} if rid else None)


def _preflight(cors: Cors):
    """A browser's CORS preflight, answered before the key check and the router (it carries
    no key, and asks of routes that take no OPTIONS)."""

    @web.middleware
    async def preflight(request: web.Request, handler):
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return await handler(request)
        headers = cors.preflight_headers(
            origin, method, request.headers.get("Access-Control-Request-Headers")
        )
        if headers is None:
            request[CORS_REFUSED] = True  # (its answer says nothing a page could read)
            return json_response(
                bad_request("Disallowed CORS request (origin, method or header).").body(), 400
            )
        return web.Response(status=200, headers=headers)

    return preflight


def _cors_headers(cors: Cors):
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if request.get(CORS_REFUSED):
            return
        for name, value in cors.response_headers(request.headers.get("Origin")).items():
            response.headers.setdefault(name, value)

    return on_prepare


def _http_error(e: web.HTTPException) -> ApiError:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
    return ApiError(e.status, e.reason, "invalid_request_error", None, code)


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error a client sees has OpenAI's shape, routing errors included (and those made
    before any middleware runs: :class:`ApiProtocol`)."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error_response(e, request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(_http_error(e), request)
    except IdTaken:  # another request's story started under this id since it was checked
        shown = request.get(RID, "")
        return _error_response(id_taken(shown), request)
    except RedisError as e:
        if not is_outage(e):  # about this request's command, not the server (fd/control/outage.py)
            log.error("redis refused a command of %s %s: %s", request.method, request.path, e)
            return _error_response(
                server_error(f"The control plane (Redis) refused the request: {e}"), request
            )
        request.app[API_KEY].redis_failed(e)
        return _error_response(unavailable(f"The control plane (Redis) is unavailable: {reason(e)}"), request)
    except HttpProcessingError as e:  # a body aiohttp could not decode (bad gzip, bad chunking)
        return _error_response(bad_request(f"Malformed request body: {e.message}"), request)
    except MuxStopped:
        return _error_response(unavailable("This API replica is shutting down."), request)
    except StoryLost as e:
        return _error_response(story_lost(str(e)), request)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, "Internal server error.", "server_error"), request)


#: how much of aiohttp's account of a malformed request its error message repeats
MAX_DETAIL = 300


def _protocol_error(status: int, exc: BaseException | None, message: str | None) -> ApiError:
    """aiohttp's own answer to a request (one it could not parse; a failure that escaped the
    middlewares) as an ApiError: the status aiohttp chose, what it said, in OpenAI's shape."""
    if status >= 500:
        return ApiError(status, f"{HTTPStatus(status).phrase}.", "server_error")
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the"
        return ApiError(
            status,
            f"The request line or a header is longer than the server's limit ({limit} bytes).",
            "invalid_request_error",
            None,
            "header_too_large",
        )
    detail = " ".join(str(message or getattr(exc, "message", "") or "bad request").split())
    return ApiError(
        status,
        f"Malformed request: {detail[:MAX_DETAIL]}",
        "invalid_request_error",
        None,
        "malformed_request",
    )


class ApiProtocol(web.RequestHandler):
    """aiohttp's protocol for one connection, with two things aiohttp has no setting for.

    Its own answers have OpenAI's error shape. aiohttp answers a request it cannot parse (a
    request line or header over its 8,190-byte limit, too many headers, a malformed request
    line or HTTP version) from ``handle_error``, and an ``Expect`` it refuses from an
    HTTPException raised before the middlewares, both before any middleware can see them; it
    has no hook for either (aiohttp issue #3287), so this overrides the two methods that make
    those answers, and leaves aiohttp's logging and closing as they are.

    And a request's head must be in within ``header_timeout_s`` (0: no limit) of the
    connection's start, or of the first byte of a later head: a client that sends part of a
    head and stops (slowloris) loses its connection. One idle between requests is left to
    aiohttp's keep-alive timeout, and a response, however long, is not timed. aiohttp tells
    no one when a head is complete; the app's first middleware tells this protocol
    (:meth:`head_read`), with the request's body, whose end says the next byte is a head's.
    """

    __slots__ = ("_header_timeout_s", "_head_timer", "_body", "_busy")

    def __init__(self, manager: web.Server, *, header_timeout_s: float = 0, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the last request's
        self._busy = False  # a request is being answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        # (b"": aiohttp re-reading what it holds, no byte from the client)
        if data and self._head_timer is None and (self._body is None or self._body.is_eof()):
            self._await_head()  # (a byte after the last body: the next head's first)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def head_read(self, body: StreamReader) -> None:
        """A request's head is complete (its handler is starting); ``body`` is its payload."""
        self._stop_timer()
        self._body = body
        self._busy = True

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # one the middlewares never saw: aiohttp's refusal of an Expect, raised before them
            resp = json_response(_http_error(resp).body(), resp.status)
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._busy = False

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own logs it (fd.api.parse_errors makes that one line), and refuses once a
        # response has begun; its plain-text answer is replaced.
        super().handle_error(request, status, exc, message)
        resp = json_response(_protocol_error(status, exc, message).body(), status)
        resp.force_close()
        return resp

    def _await_head(self) -> None:
        if self._header_timeout_s > 0:
            loop = asyncio.get_running_loop()
            self._head_timer = loop.call_later(self._header_timeout_s, self._head_late)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._busy:  # a pipelined head, behind an answer still being made: it waits for it
            self._await_head()
            return
        log.debug("closing a connection whose request head took over %s s", self._header_timeout_s)
        self.force_close()


class ApiSite(web.BaseSite):
    """``web.TCPSite``'s work, with each connection served by an :class:`ApiProtocol`.
    aiohttp's own sites serve with the runner's ``web.Server``, which makes aiohttp's protocol
    and no other; ``BaseSite`` is aiohttp's base for a site of one's own (which sets
    ``_server``, as aiohttp's sites do: ``stop()`` closes it, the runner's ``addresses`` read
    it). ``protocol_kw``: ApiProtocol's settings, and aiohttp's ``RequestHandler``'s
    (``access_log``, ...). ``sock``: a socket bound already (``fd serve`` binds its port before
    the model loads), served instead of binding ``host``:``port``; ``ssl_context``: HTTPS."""

    __slots__ = ("_host", "_port", "_reuse_port", "_sock", "_ssl", "_protocol_kw")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        sock: Any = None,
        ssl_context: ssl.SSLContext | None = None,
        **protocol_kw: Any,
    ):
        super().__init__(runner)
        self._host, self._port, self._reuse_port, self._sock = host, port, reuse_port, sock
        self._ssl = ssl_context
        self._protocol_kw = protocol_kw

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server, kw = self._runner.server, self._protocol_kw
        if self._sock is not None:
            self._server = await loop.create_server(
                lambda: ApiProtocol(server, loop=loop, **kw),
                sock=self._sock,
                backlog=self._backlog,
                ssl=self._ssl,
            )
        else:
            self._server = await loop.create_server(
                lambda: ApiProtocol(server, loop=loop, **kw),
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_port=self._reuse_port or None,
                ssl=self._ssl,
            )
        self._port = self._server.sockets[0].getsockname()[1]  # (port 0: the one it got)


@web.middleware
async def _head_read(request: web.Request, handler):
    """Tells the connection's :class:`ApiProtocol` that a request's head is complete. The first
    middleware, so that every request the router gets tells it (a CORS preflight too)."""
    protocol = request.protocol
    if isinstance(protocol, ApiProtocol):  # (an app served by another site has none)
        protocol.head_read(request.content)
    return await handler(request)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_abort_path(request: web.Request) -> bool:
    p = request.path
    return p == "/v1/abort_requests" or (
        p.startswith(("/v1/requests/", "/v1/responses/")) and p.endswith("/cancel")
    )


def _auth(tenancy: Tenancy):
    """``/v1/*`` (and vLLM's scoring routes outside it, which run the model) needs one of
    the API keys; the admin key opens every such route too. Aborts and cancels by id take
    a tenant's key (for its own requests, :mod:`fd.api.tenancy`) or the admin key; what acts
    on everyone's requests (``abort_all``, LoRA adapters) needs the admin key. A refusal is
    a 401 with OpenAI's ``authentication_error``: a client cannot tell "wrong key" from
    "not enough key", which leaks nothing about which keys exist. ``/health``,
    ``/metrics`` and ``/openapi.json`` stay open (see :mod:`fd.api.openapi`)."""

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path.startswith("/v1/") or request.path in KEYED_PATHS:
            caller = tenancy.caller(_bearer(request))
            if caller is None:
                raise unauthorized()
            if not caller.admin and (
                request.path in ADMIN_PATHS or (_is_abort_path(request) and not caller.may_abort)
            ):
                raise unauthorized("This endpoint needs the admin key (Authorization: Bearer <admin key>).")
            request[CALLER] = caller
        return await handler(request)

    return auth


def make_app(
    cfg: ApiConfig,
    bus: Bus,
    mux: StreamMux,
    tokenizer,
    metrics: Metrics,
    *,
    access: bool = False,
    access_skip: Iterable[str] = (),
) -> web.Application:
    """The API node's aiohttp app. It starts ``mux`` if nobody has (and then stops it).
    ``access``: an access line per request (:func:`_access`), but for the paths in
    ``access_skip`` (vLLM's ``--disable-access-log-for-endpoints``).

    ``handler_cancellation`` is what lets :mod:`fd.api.cancellation` see a client leave while
    its request is still queued; it is set here, on the app, so every runner gets it.
    """
    ctx = ApiContext(cfg, bus, mux, tokenizer, metrics)
    streams = Streams(ctx)
    generate = ServingGenerate(ctx, streams)
    aborts = ServingAborts(ctx)
    responses = ServingResponses(ctx, streams, generate, aborts)
    embeddings = ServingEmbeddings(ctx)
    admin = ServingAdmin(ctx)
    lifecycle = ServingLifecycle(ctx)
    middlewares = [_errors, _auth(Tenancy.of(cfg.api_key, cfg.admin_key))]
    if cfg.cors is not None:
        middlewares.insert(0, _preflight(cfg.cors))
    if access:
        middlewares.insert(0, _access(frozenset(access_skip)))
    middlewares.insert(0, _head_read)
    app = web.Application(
        middlewares=middlewares,
        client_max_size=cfg.max_body_bytes + 1,
        handler_args={"handler_cancellation": True},
    )
    if cfg.cors is not None:
        app.on_response_prepare.append(_cors_headers(cfg.cors))
    if access:
        app.on_response_prepare.append(_sniff_usage)
    app[API_KEY] = ctx
    generating = {
        "/v1/chat/completions": generate.chat,
        "/v1/completions": generate.completions,
        "/v1/responses": responses.responses,
        "/v1/embeddings": embeddings.embeddings,
    }
    # vLLM's scoring routes, by each name it serves them under
    generating.update({path: embeddings.score for path in ("/score", "/v1/score")})
    generating.update({path: embeddings.rerank for path in ("/rerank", "/v1/rerank", "/v2/rerank")})
    for path, handler in generating.items():  # every generating endpoint is guarded, by construction
        app.router.add_post(path, aborts.cancellation.guard(handler))
    if cfg.runtime_lora:  # (as vLLM: the routes exist only when allowed)
        app.router.add_post("/v1/load_lora_adapter", admin.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", admin.unload_lora_adapter)
    app.router.add_get("/v1/models", admin.models)
    app.router.add_get("/v1/models/{model:.+}", admin.model)  # (names like "org/model")
    app.router.add_get("/health", admin.health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) liveness route: /health's answer
        app.router.add_route(method, "/ping", admin.health)
    app.router.add_get("/metrics", admin.metrics_endpoint)
    app.router.add_post("/v1/abort_requests", aborts.abort_requests)
    app.router.add_get("/v1/requests/{id:[^/]+}/stream", generate.stream_request)
    app.router.add_get("/v1/lifecycle", lifecycle.lifecycle)  # (admin key only: every tenant's)
    app.router.add_post("/v1/requests/{id:[^/]+}/cancel", aborts.cancel_request)
    app.router.add_get("/v1/responses/{id:[^/]+}", responses.get_response)
    app.router.add_post("/v1/responses/{id:[^/]+}/cancel", responses.cancel_response)
    app.router.add_get("/v1/responses/{id:[^/]+}/input_items", responses.response_input_items)
    app.router.add_get("/openapi.json", admin.openapi)
    app.router.add_post("/tokenize", admin.tokenize)  # vLLM's, outside /v1 as there
    app.router.add_post("/detokenize", admin.detokenize)
    app.router.add_get("/version", admin.version)
    app.on_startup.append(ctx.on_startup)
    # the disconnect aborts still in flight are published before the mux stops
    app.on_cleanup.append(aborts.on_cleanup)
    app.on_cleanup.append(ctx.on_cleanup)
    return app
