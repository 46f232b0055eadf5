"""The API node's HTTP surface (DESIGN.md §5): thin aiohttp handlers over the bus.

Parsing, validation and response shapes live in :mod:`fd.api.protocol`; this module only
moves bytes: body in, ``request`` event out, the request's stream back as JSON or SSE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from redis.exceptions import RedisError

from control.bus import Bus
from control.entry_ids import entry_id_key
from control.events import (
    MAX_FIELD_BYTES,
    MAX_IDS_PER_ABORT,
    Abort,
    AbortAll,
    Accepted,
    Claimed,
    Final,
    Request,
    Tokens,
)
from control.keys import ENGINE_ID_RE, REQUEST_ID_RE, all_valid_request_ids, choice_ids, is_tombstone
from control.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from control.metrics import Metrics
from control.mux import MuxStopped, StreamMux
from control.request_data import RequestData
from control.story import IdTaken
from control.token_payloads import embedding_vector
from fd.api import lora_admin, openapi, protocol, rendering, sse
from fd.api.abort import parse_abort
from fd.api.cancellation import Cancellation, watch_of
from fd.api.choices import Choices, choices_cursor
from fd.api.cors import Cors
from fd.api.embeddings import finish as embedding_finish
from fd.api.embeddings import (
    pair_scores,
    parse_embeddings,
    parse_rerank,
    parse_score,
    rerank_response,
    score_response,
)
from fd.api.embeddings import response as embedding_response
from fd.api.errors import (
    ApiError,
    bad_request,
    conflict,
    id_taken,
    not_found,
    too_large,
    unauthorized,
    unavailable,
)
from fd.api.lora_admin import LoraNames
from fd.api.responses import ResponsesRenderer, input_items, output_as_input
from fd.api.responses import parse as parse_responses
from fd.api.tenancy import TENANT_ID_MAX, Caller, Tenancy, abort_targets, story

log = logging.getLogger("fd.api")

try:
    _VERSION = importlib.metadata.version("fd")
except importlib.metadata.PackageNotFoundError:  # (run from a checkout that was not installed)
    _VERSION = "unknown"

KEEPALIVE_S = 15.0  # an SSE comment this often while nothing happens, so proxies keep the line
HEALTH_TIMEOUT_S = 2.0
MAX_WAIT_S = 300.0


def _new_api_id() -> str:
    return f"api-{uuid.uuid4().hex[:8]}"


@dataclass
class ApiConfig:
    model_name: str
    max_model_len: int
    api_key: str | Sequence[str] | None = None  # one key, or several (each a tenant: fd.api.tenancy)
    admin_key: str | None = None
    max_body_bytes: int = 4 << 20
    api_id: str = field(default_factory=_new_api_id)
    default_max_tokens: int = 16  # completions; chat defaults to the rest of the context
    tool_parser: str | None = None  # vLLM's --enable-auto-tool-choice --tool-call-parser NAME
    # --generation-config: the model's recommended sampling defaults and output cap
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser NAME (fd.api.reasoning)
    model_aliases: tuple[str, ...] = ()  # --served-model-name's names after the first
    cors: Cors | None = field(default_factory=Cors)  # vLLM's --allowed-origins etc.; None: no CORS
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids
    priority_scheduling: bool = False  # --scheduling-policy priority (the engines' too)
    lora_modules: dict[str, str] = field(default_factory=dict)  # vLLM's --lora-modules: name -> path
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    runtime_lora: bool = False


API_KEY = web.AppKey("fd.api", object)
CANCEL_WAIT_S = 2.0  # POST /v1/responses/{id}/cancel waits this long for the abort's final
IGNORED_NAMES = 256  # distinct ignored request fields remembered, each said once
REDIS_SUSPECT_S = 30.0  # after a Redis error, check with a quick ping before each new request
REDIS_PING_TIMEOUT_S = 0.5
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # they act on everyone's requests
KEYED_PATHS = ("/score", "/rerank", "/v2/rerank")  # vLLM's, outside /v1: they run the model
CORS_REFUSED = web.RequestKey("fd.cors_refused", bool)
RID = web.RequestKey("fd.rid", str)  # the request id, echoed in X-Request-Id even on errors
CALLER = web.RequestKey("fd.caller", Caller)  # who sent it (fd.api.tenancy), on the routes with keys


def valid_request_id(rid: str) -> bool:
    """The documented id charset, matched in full: ``re.match`` with ``$`` would also pass an
    id ending in a newline, and an id becomes part of Redis key names."""
    return REQUEST_ID_RE.fullmatch(rid) is not None


def valid_engine_id(eid: str) -> bool:
    return ENGINE_ID_RE.fullmatch(eid) is not None


def _echo(gen: protocol.GenerationRequest, prompt: int) -> dict[str, Any]:
    """The echo fields of a choice's ``accepted`` event (its prompt's text), if asked."""
    if not gen.echo_texts:
        return {}
    return {"echo": gen.echo_texts[prompt], "echo_only": gen.echo_only or None}


def _render(ev: Any, renderer: Any, timing: "_Timing | None") -> tuple[bytes | None, list[dict]]:
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
    return None, []


def _json(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _error_response(err: ApiError, request: web.Request) -> web.Response:
    rid = request.get(RID)
    return _json(err.body(), err.status, {"X-Request-Id": rid} if rid else None)


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
            return _json(bad_request("Disallowed CORS request (origin, method or header).").body(), 400)
        return web.Response(status=200, headers=headers)

    return preflight


def _cors_headers(cors: Cors):
    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if request.get(CORS_REFUSED):
            return
        for name, value in cors.response_headers(request.headers.get("Origin")).items():
            response.headers.setdefault(name, value)

    return on_prepare


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error a client sees has OpenAI's shape, routing errors included."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error_response(e, request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return _error_response(ApiError(e.status, e.reason, "invalid_request_error", None, code), request)
    except IdTaken:  # another request's story started under this id since it was checked
        shown = request.get(RID, "")
        return _error_response(id_taken(shown), request)
    except RedisError as e:
        log.warning("redis error on %s: %s", request.path, e)
        request.app[API_KEY].redis_failed()
        return _error_response(unavailable(f"The control plane (Redis) is unavailable: {e}"), request)
    except HttpProcessingError as e:  # a body aiohttp could not decode (bad gzip, bad chunking)
        return _error_response(bad_request(f"Malformed request body: {e.message}"), request)
    except MuxStopped:
        return _error_response(unavailable("This API replica is shutting down."), request)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(ApiError(500, "Internal server error.", "server_error"), request)


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_abort_path(request: web.Request) -> bool:
    p = request.path
    return p == "/v1/abort_requests" or (
        p.startswith(("/v1/requests/", "/v1/responses/")) and p.endswith("/cancel")
    )


class _Timing:
    """TTFT / ITL / E2E of one live request, measured where the client sees them."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
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
        self.m.e2e_request_latency_seconds.observe(time.monotonic() - self.arrival)
        self.m.requests_total.labels(final.finish_reason).inc()


class Api:
    """The handlers, bound to one bus, one stream mux, one tokenizer and one metrics object."""

    def __init__(self, cfg: ApiConfig, bus: Bus, mux: StreamMux, tokenizer, metrics: Metrics):
        self._redis_suspect_until = 0.0  # see redis_failed()
        self._ignored_said: set[str] = set()  # request fields said to be ignored (_say_ignored)
        self.cfg = cfg
        self.tenancy = Tenancy.of(cfg.api_key, cfg.admin_key)
        self.bus = bus
        self.mux = mux
        self.tokenizer = tokenizer
        # what a token is, for log-probabilities (a tokenizer without it: empty strings)
        self._token_bytes = getattr(tokenizer, "id_to_bytes", None)
        self.metrics = metrics
        self.limits = protocol.Limits(
            cfg.model_name,
            cfg.max_model_len,
            cfg.max_body_bytes,
            cfg.default_max_tokens,
            getattr(tokenizer, "vocab_size", None),
            cfg.tool_parser,
            dict(cfg.sampling_defaults),
            cfg.max_output_tokens,
            cfg.reasoning_parser,
            tuple(cfg.model_aliases),
            cfg.force_include_usage,
            cfg.tokens_as_ids,
            cfg.priority_scheduling,
            tuple(cfg.lora_modules),
        )
        self.cancellation = Cancellation(self._abort_on_disconnect, self._notice_disconnect)
        self.runtime_loras = LoraNames(bus)  # adapters loaded at run time, from any replica
        self._served = {cfg.model_name, *cfg.model_aliases}
        self._noticed: dict[str, Abort] = {}  # disconnect aborts told in-process, not yet published
        self.started = int(time.time())
        self._started_mux = False
        self._openapi = openapi.build(
            cfg.model_name,
            cfg.max_model_len,
            cfg.max_body_bytes,
            self.limits.vocab_size,
            tuple(cfg.model_aliases),
            cfg.runtime_lora,
        )

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def auth(self, request: web.Request, handler):
        """``/v1/*`` (and vLLM's scoring routes outside it, which run the model) needs one of
        the API keys; the admin key opens every such route too. Aborts and cancels by id take
        a tenant's key (for its own requests, :mod:`fd.api.tenancy`) or the admin key; what acts
        on everyone's requests (``abort_all``, LoRA adapters) needs the admin key. A refusal is
        a 401 with OpenAI's ``authentication_error``: a client cannot tell "wrong key" from
        "not enough key", which leaks nothing about which keys exist. ``/health``,
        ``/metrics`` and ``/openapi.json`` stay open (see :mod:`fd.api.openapi`)."""
        if request.path.startswith("/v1/") or request.path in KEYED_PATHS:
            caller = self.tenancy.caller(_bearer(request))
            if caller is None:
                raise unauthorized()
            if not caller.admin and (
                request.path in ADMIN_PATHS or (_is_abort_path(request) and not caller.may_abort)
            ):
                raise unauthorized("This endpoint needs the admin key (Authorization: Bearer <admin key>).")
            request[CALLER] = caller
        return await handler(request)

    async def on_startup(self, app: web.Application) -> None:
        if not self.mux._started:
            await self.mux.start()
            self._started_mux = True

    async def on_cleanup(self, app: web.Application) -> None:
        await self.cancellation.drain()
        if self._started_mux:
            await self.mux.stop()

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        chunks, size = [], 0
        while True:
            try:
                chunk = await request.content.readany()
            except web.RequestPayloadError as e:  # e.g. a Content-Encoding: gzip body that is not gzip
                why = getattr(e.__cause__, "message", None) or "cannot decode it"
                raise bad_request(f"Malformed request body: {why}.") from None
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body(self, request: web.Request) -> dict:
        return protocol.parse_body(await self._read_body(request), self.limits)

    def _request_id(self, request: web.Request, prefix: str) -> tuple[str, bool]:
        """The new request's id in the event log, and whether the client gave it. The id the
        client sees (``request[RID]``) is the one it gave, or the server's: 128 random bits
        (``secrets``), so that no one can guess another client's. A tenant's own id is
        namespaced in the log (:meth:`Caller.own`), so another tenant's cannot collide with it."""
        given = request.headers.get("X-Request-Id")
        if given is None:
            rid = f"{prefix}-{secrets.token_hex(16)}"
            request[RID] = rid
            return rid, False
        if not valid_request_id(given):
            raise bad_request(
                "Invalid X-Request-Id: use 1-128 letters, digits and '_.:@-'.",
                "X-Request-Id",
                "invalid_request_id",
            )
        rid = request[CALLER].own(given)
        if rid is None:
            raise bad_request(
                f"Invalid X-Request-Id: with this API key, at most {TENANT_ID_MAX} characters.",
                "X-Request-Id",
                "invalid_request_id",
            )
        request[RID] = given
        return rid, True

    def _notice_disconnect(self, request_ids: tuple[str, ...]) -> None:
        """In the cancelled handler itself: in-process readers of ``P:control`` (``fd serve``'s
        engine) hear of the abort now; the publish follows from its own task."""
        if self.bus.local_control:
            ev = Abort(
                request_ids=request_ids, source="disconnect", abort_id=f"abort-{uuid.uuid4().hex[:16]}"
            )
            self.bus.tell_local(self.bus.keys.control, ev)
            self._noticed[request_ids[0]] = ev

    async def _abort_on_disconnect(self, request_ids: tuple[str, ...]) -> None:
        ev = self._noticed.pop(request_ids[0], None)
        if ev is not None:
            await self.bus.publish(self.bus.keys.control, ev, tell_local=False)
        else:
            await self.bus.publish(
                self.bus.keys.control,
                Abort(
                    request_ids=request_ids, source="disconnect", abort_id=f"abort-{uuid.uuid4().hex[:16]}"
                ),
            )
        # fd_abort_requests_total is counted by the engine where the abort takes effect
        # (every engine reads every abort; exactly one owns the request).
        # their finals go unseen by this replica (a response of n choices: n requests)
        self.metrics.requests_total.labels("abort").inc(len(request_ids))

    # ------------------------------------------------------------------ generating

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "chatcmpl", protocol.parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion", "cmpl", protocol.parse_completion)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (fd.api.responses): a chat request rendered as a Response.
        Its conversation is kept beside its story (unless ``store`` is false), so a later
        request can go on from it with ``previous_response_id``."""
        body = await self._body(request)
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str) or not valid_request_id(prev):
                raise bad_request(
                    "'previous_response_id' must be a response id.", "previous_response_id", "invalid_value"
                )
            prev_rid, history = await story(self.bus, request[CALLER], prev)
            before = await self.bus.conversation(prev_rid) if history else None
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
        store = protocol._opt(body, "store", protocol._is_bool, "a boolean", True)
        return await self._generate(
            request,
            "responses",
            "resp",
            parse_responses,
            body=body,
            keep=input_items(body) if store else None,
        )

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's embeddings (fd.api.embeddings)."""
        rid, created, req, vectors = await self._embed(request, parse_embeddings)
        return _json(
            embedding_response(rid, created, req, [embedding_finish(v, req) for v in vectors]),
            headers={"X-Request-Id": rid},
        )

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's ``/score`` over an embedding model: cosine similarities (fd.api.embeddings)."""
        rid, created, req, vectors = await self._embed(request, parse_score, "score")
        return _json(
            score_response(rid, created, req, pair_scores(vectors, req)), headers={"X-Request-Id": rid}
        )

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's ``/rerank`` (Jina's and Cohere's API) over an embedding model."""
        rid, _, req, vectors = await self._embed(request, parse_rerank, "rerank")
        return _json(rerank_response(rid, req, pair_scores(vectors, req)), headers={"X-Request-Id": rid})

    async def _embed(self, request: web.Request, parse, prefix: str = "embd") -> tuple[str, int, Any, list]:
        """The vectors of a request's texts: each a request on the engines, ``<id>.<k>`` when
        there are several (as a completions batch's prompts), whose first tokens event carries
        its vector. A hang-up aborts them; so does an abort of the id."""
        await self._check_redis()
        arrival = time.monotonic()
        rid, explicit = self._request_id(request, prefix)
        shown = request[RID]
        body = await self._body(request)
        await self._know_adapters(body)
        parsed = parse(body, self.limits, self.tokenizer)
        req = getattr(parsed, "embed", parsed)  # (a score's: the texts it embeds)
        self._say_ignored(body.ignored(), rid)
        many = len(req.inputs) > 1
        if many:
            ids = await self._choice_ids(rid, explicit, len(req.inputs), shown)
        else:
            ids = (rid,)
            if explicit:
                await self._id_free(rid, shown)
        watch = watch_of(request)
        now = time.time()
        created = int(now)
        common = dict(
            api=self.cfg.api_id,
            endpoint="embeddings",
            model=req.model,
            created=created,
            tenant=request[CALLER].tag,
        )
        requests = [
            (
                Request(
                    request_id=c,
                    data=RequestData(
                        prompt_token_ids=ids_,
                        sampling=req.sampling,
                        arrival_ts=int(now * 1000),
                        model=req.model,
                        api=self.cfg.api_id,
                        parent=rid if many else "",
                        priority=req.priority,
                    ),
                ),
                Accepted(
                    request_id=c,
                    prompt_tokens=len(ids_),
                    **common,
                    **(dict(parent=rid, index=k) if many else {}),
                ),
            )
            for k, (c, ids_) in enumerate(zip(ids, req.inputs))
        ]
        subs = [await self.mux.subscribe(c, b"0") for c in ids]  # before submit: nothing missed
        try:
            watch.request_id = rid  # from here on a disconnect aborts them
            if many:
                watch.abort_ids = ids
                parent = Accepted(
                    request_id=rid, choices=len(ids), n=1, prompt_tokens=sum(map(len, req.inputs)), **common
                )
                if not await self.bus.submit_choices(parent, requests):
                    raise id_taken(shown)
            else:
                await self.bus.submit(*requests[0])
            vectors = await self._collect_embeddings(ids, subs, [_Timing(self.metrics, arrival) for _ in ids])
            watch.finished = True
            return shown, created, parsed, vectors
        finally:
            for sub in subs:
                await sub.close()

    async def _collect_embeddings(self, ids: tuple[str, ...], subs: list, timing: list[_Timing]) -> list:
        """Each input's vector, from its first tokens event, once every input has ended. An
        input that failed or was aborted fails the whole answer (and stops the others)."""
        vectors: list = [None] * len(ids)
        finals: list[Final | None] = [None] * len(ids)
        async with contextlib.aclosing(self._merged(subs)) as merged:
            async for batch in merged:
                for k, _eid, ev in batch or ():
                    if isinstance(ev, Tokens):
                        timing[k].tokens(len(ev.token_ids))
                        if ev.embedding is not None and vectors[k] is None:
                            vectors[k] = embedding_vector(ev.embedding)
                    elif isinstance(ev, Final):
                        timing[k].final(ev)
                        finals[k] = ev
                        if ev.finish_reason in ("error", "abort"):
                            rest = tuple(c for c, f in zip(ids, finals) if f is None)
                            if rest:
                                await self._publish_abort(rest, f"abort-{uuid.uuid4().hex[:16]}")
                            if ev.finish_reason == "error":
                                raise rendering.final_error(ev)
                            raise ApiError(
                                503,
                                f"Input {k} was aborted before its embedding was made.",
                                "server_error",
                                None,
                                "request_aborted",
                            )
                if all(f is not None for f in finals):
                    missing = [k for k, v in enumerate(vectors) if v is None]
                    if missing:
                        raise ApiError(
                            500,
                            f"The engine returned no embedding for input {missing[0]} (an "
                            "engine that cannot make embeddings?).",
                            "server_error",
                            None,
                            "engine_error",
                        )
                    return vectors
        raise unavailable("The request's stream ended without a final event.")

    async def _know_adapters(self, body: dict) -> None:
        """A model name that is not the served model's: an adapter loaded at run time, maybe
        through another replica (``P:loras``, read at most every REFRESH_S)."""
        model = body.get("model")
        if not isinstance(model, str) or model in self._served or model in self.cfg.lora_modules:
            return
        runtime = await self.runtime_loras.refresh()
        names = (*self.cfg.lora_modules, *runtime)
        if names != self.limits.lora_names:
            self.limits = dataclasses.replace(self.limits, lora_names=names)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's, on every engine (fd.api.lora_admin)."""
        taken = self._served | set(self.cfg.lora_modules)
        return web.Response(
            text=await lora_admin.load(self.bus, await self._body(request), taken, self.runtime_loras)
        )

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return web.Response(
            text=await lora_admin.unload(
                self.bus, await self._body(request), set(self.cfg.lora_modules), self.runtime_loras
            )
        )

    def _say_ignored(self, names: list[str], rid: str) -> None:
        """Fields of a request that nothing read, in the log (as vLLM's "present in the request
        but ignored"): once for each name, so a client that always sends one does not fill
        the log (past IGNORED_NAMES names, each time)."""
        new = [n for n in names if n not in self._ignored_said]
        if not new:
            return
        if len(self._ignored_said) < IGNORED_NAMES:
            self._ignored_said.update(new)
        log.warning(
            "request fields ignored (not supported, or misspelt): %s",
            ", ".join(map(repr, new)),
            extra={"request_id": rid},
        )

    def redis_failed(self) -> None:
        """Remember that Redis just failed: until a quick ping succeeds again, new requests get
        their 503 at once instead of after the client's seconds of connection retries."""
        self._redis_suspect_until = time.monotonic() + REDIS_SUSPECT_S

    async def _check_redis(self) -> None:
        if time.monotonic() >= self._redis_suspect_until:
            return
        try:
            async with asyncio.timeout(REDIS_PING_TIMEOUT_S):  # (not wait_for: see _merged)
                await self.bus.redis.ping()
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self.redis_failed()
            raise unavailable(f"The control plane (Redis) is unavailable: {e or type(e).__name__}") from None
        self._redis_suspect_until = 0.0

    async def _generate(
        self,
        request: web.Request,
        endpoint: str,
        prefix: str,
        parse,
        body: protocol.Body | None = None,
        keep: list | None = None,
    ) -> web.StreamResponse:
        """A generating request, from its body (read here unless given) to its answer. ``keep``:
        a Responses API conversation to store beside the story (``previous_response_id``)."""
        await self._check_redis()
        arrival = time.monotonic()
        rid, explicit = self._request_id(request, prefix)
        shown = request[RID]  # the id the client sees; `rid` is the event log's
        if body is None:
            body = await self._body(request)
        await self._know_adapters(body)
        gen: protocol.GenerationRequest = parse(body, self.limits, self.tokenizer)
        self._say_ignored(body.ignored(), rid)
        if gen.n > 1 or gen.prompts:
            return await self._generate_choices(request, rid, explicit, endpoint, gen, arrival)
        if explicit:
            await self._id_free(rid, shown)
        watch = watch_of(request)
        watch.background = gen.background
        now = time.time()
        created = int(now)
        if keep is not None:
            await self.bus.save_conversation(rid, keep)
        sub = await self.mux.subscribe(rid, b"0")  # before submit: nothing can be missed
        try:
            watch.request_id = rid  # from here on a disconnect aborts it
            await self.bus.submit(
                Request(
                    request_id=rid,
                    data=RequestData(
                        prompt_token_ids=gen.prompt_token_ids,
                        sampling=gen.sampling,
                        arrival_ts=int(now * 1000),
                        model=gen.model,
                        api=self.cfg.api_id,
                        background=gen.background,
                        priority=gen.priority,
                    ),
                ),
                Accepted(
                    request_id=rid,
                    api=self.cfg.api_id,
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
            renderer = self._renderer(
                shown,
                endpoint,
                gen.model,
                created,
                len(gen.prompt_token_ids),
                gen.include_usage,
                gen.continuous_usage,
            )
            timing = _Timing(self.metrics, arrival)
            if gen.stream:
                return await self._stream(request, shown, self._events(sub), renderer, timing)
            if gen.background and isinstance(renderer, ResponsesRenderer):
                # OpenAI's background mode: answered at once, queued; the client polls
                # GET /v1/responses/<id> (or streams it from there)
                return _json(renderer.queued(), headers={"X-Request-Id": shown})
            return await self._collect(shown, sub, renderer, timing, watch)
        finally:
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
        plan = gen.choices()
        shown = request[RID]
        ids = await self._choice_ids(rid, explicit, len(plan), shown)
        watch = watch_of(request)
        watch.background = gen.background
        now = time.time()
        created = int(now)
        n_prompt = sum(map(len, gen.prompts or (gen.prompt_token_ids,)))  # each prompt once
        common = dict(
            api=self.cfg.api_id,
            endpoint=endpoint,
            model=gen.model,
            created=created,
            include_usage=gen.include_usage,
            continuous_usage=gen.continuous_usage or None,
            tenant=request[CALLER].tag,
            **gen.rendering(),
        )
        subs = [await self.mux.subscribe(c, b"0") for c in ids]  # before submit: nothing missed
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
                            api=self.cfg.api_id,
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
                for k, (c, (prompt, sp)) in enumerate(zip(ids, plan))
            ]
            parent = Accepted(request_id=rid, choices=len(ids), n=gen.n, prompt_tokens=n_prompt, **common)
            if not await self.bus.submit_choices(parent, items):
                raise id_taken(shown)
            choices = Choices(
                shown,
                len(ids),
                endpoint,
                gen.model,
                created,
                n_prompt,
                gen.include_usage,
                self._token_bytes,
                gen.continuous_usage,
                gen.n,
                request_ids=ids,
            )
            timing = [_Timing(self.metrics, arrival) for _ in ids]  # latencies are each choice's
            if gen.stream:
                resp = await self._stream(request, shown, self._merged(subs), choices, timing)
            else:
                resp = await self._collect_choices(shown, subs, choices, timing, watch)
            return resp
        finally:
            for sub in subs:
                await sub.close()

    async def _id_free(self, rid: str, shown: str) -> None:
        """A client's own id for one request: a 409 if a request has it. (An id whose abort
        overtook it is not a conflict: its story already ends in an abort final, which is what
        this client gets.) A tenant's id is in its own space: only its own requests conflict."""
        if await self.bus.request_exists(rid) and not is_tombstone(await self.bus.owner(rid)):
            raise id_taken(shown)

    async def _choice_ids(self, rid: str, explicit: bool, n: int, shown: str) -> tuple[str, ...]:
        """The ids ``<id>.<k>`` of a response's ``n`` parts, checked: not too long, and (for
        a client's own id) none taken."""
        ids = choice_ids(rid, n)
        if max(map(len, ids)) > 128:
            raise bad_request(
                f"X-Request-Id is too long for {n} choices: each runs as "
                f"'<id>.<index>', at most 128 characters.",
                "X-Request-Id",
                "invalid_request_id",
            )
        if explicit:
            owner = await self.bus.owner(rid)
            taken = [await self.bus.request_exists(r) for r in (rid, *ids)]
            # (an id whose abort overtook it is not a conflict, as for one choice)
            if not is_tombstone(owner) and (owner is not None or any(taken)):
                raise conflict(
                    f"A request with id '{shown}' (or one of its choices) already exists.", "X-Request-Id"
                )
        return ids

    async def _merged(self, subs: list) -> AsyncIterator[list[tuple[int, bytes, Any]] | None]:
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

    async def _collect_choices(
        self, rid: str, subs: list, choices: Choices, timing: list[_Timing], watch
    ) -> web.Response:
        async with contextlib.aclosing(self._merged(subs)) as merged:
            async for batch in merged:
                for k, _eid, ev in batch or ():
                    if isinstance(ev, Tokens):
                        timing[k].tokens(len(ev.token_ids))
                        choices.add_tokens(
                            k, ev.text, len(ev.token_ids), ev.token_ids, ev.logprobs, ev.prompt_logprobs
                        )
                    elif isinstance(ev, Accepted):
                        choices.parts[k].accept(ev)
                    elif isinstance(ev, Final):
                        timing[k].final(ev)
                        choices.finals[k] = ev
                        if ev.finish_reason == "error":
                            watch.finished = True
                            await self._abort_rest(choices)
                            raise rendering.final_error(ev)
                if choices.done:
                    watch.finished = True
                    return _json(choices.response(), headers={"X-Request-Id": rid})
        raise unavailable("The request's stream ended without a final event.")

    async def _abort_rest(self, choices: Choices) -> None:
        """One choice failed: the response has failed, so the others stop too."""
        rest = tuple(c for c, f in zip(choices.request_ids, choices.finals) if f is None)
        if rest:
            await self._publish_abort(rest, f"abort-{uuid.uuid4().hex[:16]}")

    async def _events(self, sub) -> AsyncIterator[list[tuple[bytes, Any]] | None]:
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

    def _renderer(
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
            return ResponsesRenderer(rid, model, created, prompt_tokens, self._token_bytes)
        return rendering.Renderer(
            rid, endpoint, model, created, prompt_tokens, include_usage, self._token_bytes, continuous_usage
        )

    async def _collect(
        self, rid: str, sub, renderer: rendering.Renderer, timing: _Timing, watch
    ) -> web.Response:
        async for _eid, ev in sub:
            if isinstance(ev, Tokens):
                timing.tokens(len(ev.token_ids))
                renderer.add_tokens(ev.text, len(ev.token_ids), ev.token_ids, ev.logprobs, ev.prompt_logprobs)
            elif isinstance(ev, Accepted):
                renderer.accept(ev)
            elif isinstance(ev, Final):
                watch.finished = True
                timing.final(ev)
                return _json(renderer.response(ev), headers={"X-Request-Id": rid})
        raise unavailable("The request's stream ended without a final event.")

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        events: AsyncIterator,
        renderer: rendering.Renderer | Choices,
        timing: _Timing | list[_Timing] | None,
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
        async with contextlib.aclosing(events):
            await write(resp, events, renderer, timing, skip_until, watch)
        await resp.write_eof()
        return resp

    async def _write_choice_events(self, resp, events, choices: Choices, timing, skip_until, watch) -> None:
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
                payload, chunks = _render(ev, choices.choice(k), None if timing is None else timing[k])
                failed = isinstance(ev, Final) and ev.finish_reason == "error"
                if (payload is not None or chunks) and entry_id_key(eid) > skip[k]:
                    cid = choices_cursor(cursor)
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
                    await self._abort_rest(choices)
                out.append(sse.DONE)
            if out:
                await resp.write(b"".join(out))
            if failed or choices.done:
                return
        await resp.write(sse.frame(unavailable("The request's stream ended without a final event.").body()))

    async def _write_events(self, resp, events, renderer, timing, skip_until, watch) -> None:
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
                payload, chunks = _render(ev, renderer, timing)
                if isinstance(ev, Final):
                    watch.finished = done = True
                if (payload is not None or chunks) and (skip_until is None or entry_id_key(eid) > skip_until):
                    if payload is not None:
                        out.append(sse.json_frame(payload, eid))
                    elif named:
                        out += [sse.frame(c, eid, c["type"]) for c in chunks]
                    else:
                        out += [sse.frame(c, eid) for c in chunks]
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
        rid, history = await story(self.bus, request[CALLER], shown)  # (another tenant's: none)
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
            renderer = self._renderer(
                shown,
                first.endpoint or "completion",
                first.model,
                first.created,
                first.prompt_tokens,
                iu,
                bool(first.continuous_usage),
            )
        else:  # an abort overtook the request: its whole story is the abort (no `accepted`)
            renderer = rendering.Renderer(shown, "completion", self.cfg.model_name, first.ts // 1000, 0, iu)
        return await self._stream(request, shown, self._story_then_live(rid, history), renderer, None, skip)

    async def _story_then_live(self, rid: str, history: list) -> AsyncIterator:
        """A request's events so far, then (unless it has ended) the rest as they come."""
        yield history
        if any(isinstance(ev, Final) for _, ev in history):
            return
        sub = await self.mux.subscribe(rid, history[-1][0])
        try:
            async for batch in self._events(sub):
                yield batch
        finally:
            await sub.close()

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
            if not await self.bus.request_exists(c):
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
            self._token_bytes,
            bool(first.continuous_usage),
            first.n,
            request_ids=ids,
        )
        subs = [await self.mux.subscribe(c, b"0") for c in choices.request_ids]
        try:
            return await self._stream(request, shown, self._merged(subs), choices, None, skip)
        finally:
            for sub in subs:
                await sub.close()

    # ------------------------------------------------------------------ aborts

    async def abort_requests(self, request: web.Request) -> web.Response:
        """Publish one abort and answer at once (``?wait=S``: the old synchronous answer)."""
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
            await self._body(request),
            valid_request_id,
            valid_engine_id,
            MAX_IDS_PER_ABORT,
            all_valid_request_ids,
        )
        abort_id = f"abort-{uuid.uuid4().hex[:16]}"
        caller = request[CALLER]
        if body.abort_all:
            if not caller.admin:  # (every tenant's requests)
                raise unauthorized("abort_all needs the admin key (Authorization: Bearer <admin key>).")
            await self.bus.publish(
                self.bus.keys.control, AbortAll(engine=body.engine, source="http", abort_id=abort_id)
            )
            return _json(
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
        targets = await abort_targets(self.bus, caller, body.request_ids)
        await self._publish_abort(tuple(t for t in targets if t is not None), abort_id)
        if timeout is not None:
            return _json(await self._wait_final(tuple(targets), timeout, body.request_ids))
        return _json(
            {
                "abort_id": abort_id,
                "accepted": list(body.request_ids),
                "rejected": [{"request_id": r, "reason": why} for r, why in body.rejected],
            }
        )

    # ------------------------------------------------------------------ stored responses

    async def _response_story(self, request: web.Request) -> tuple[str, str, list]:
        """The story of a Responses API request (``/v1/responses/{id}``), or a 404: the output
        lives in its stream for the story's TTL, which is how long it can be retrieved. Its id
        in the event log, the client's, and the story; another tenant's is a 404 too."""
        shown = request.match_info["id"]
        if not valid_request_id(shown):
            raise bad_request("Invalid response id.", "id", "invalid_request_id")
        request[RID] = shown
        rid, history = await story(self.bus, request[CALLER], shown)
        first = history[0][1] if history else None
        if not isinstance(first, Accepted) or first.endpoint != "responses":
            raise not_found(
                f"No response with id '{shown}' (never made here, or expired).", "id", "response_not_found"
            )
        return rid, shown, history

    def _response_renderer(self, rid: str, first: Accepted) -> ResponsesRenderer:
        return ResponsesRenderer(rid, first.model, first.created, first.prompt_tokens, self._token_bytes)

    def _snapshot(self, rid: str, history: list) -> dict:
        r = self._response_renderer(rid, history[0][1])
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
        rid, shown, history = await self._response_story(request)
        if request.query.get("stream", "").lower() not in ("true", "1"):
            return _json(self._snapshot(shown, history), headers={"X-Request-Id": shown})
        renderer = self._response_renderer(shown, history[0][1])
        after = request.query.get("starting_after")
        if after is not None:
            try:
                renderer.starting_after = int(after)
            except ValueError:
                raise bad_request(
                    "'starting_after' must be a sequence number.", "starting_after", "invalid_value"
                ) from None
        return await self._stream(request, shown, self._story_then_live(rid, history), renderer, None, None)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items``: the conversation it was given (after that of
        the response it continued), as kept for ``previous_response_id``."""
        rid, shown, _history = await self._response_story(request)
        items = await self.bus.conversation(rid)
        if items is None:
            raise not_found(
                f"Response '{shown}' was made with store false, or its input expired.",
                "id",
                "response_not_found",
            )
        return _json({"object": "list", "data": items, "has_more": False}, headers={"X-Request-Id": shown})

    async def cancel_response(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: abort it and answer with the Response once the
        abort's final is in (or, past CANCEL_WAIT_S, as it stands)."""
        rid, shown, history = await self._response_story(request)
        if not any(isinstance(ev, Final) for _eid, ev in history):
            await self._publish_abort((rid,), f"abort-{uuid.uuid4().hex[:16]}")
            await self._wait_final((rid,), CANCEL_WAIT_S)
            history = await self.bus.read_req(rid, b"0")
        return _json(self._snapshot(shown, history), headers={"X-Request-Id": shown})

    async def cancel_request(self, request: web.Request) -> web.Response:
        """``POST /v1/requests/{id}/cancel``: abort one request; answers at once."""
        shown = request.match_info["id"]
        if not valid_request_id(shown):
            raise bad_request("Invalid request id.", "id", "invalid_request_id")
        abort_id = f"abort-{uuid.uuid4().hex[:16]}"
        # (another tenant's id: aborted where an unknown one would be, as abort_requests does)
        targets = await abort_targets(self.bus, request[CALLER], (shown,))
        await self._publish_abort(tuple(t for t in targets if t is not None), abort_id)
        return _json({"abort_id": abort_id, "accepted": [shown], "rejected": []})

    async def _publish_abort(self, ids: tuple[str, ...], abort_id: str) -> None:
        """One XADD, or a few in one round trip if the ids overflow one field."""
        if not ids:
            return
        batches, cur, size = [], [], 0
        for rid in ids:
            if cur and size + len(rid) + 1 > MAX_FIELD_BYTES // 2:
                batches.append(tuple(cur))
                cur, size = [], 0
            cur.append(rid)
            size += len(rid) + 1
        batches.append(tuple(cur))
        control = self.bus.keys.control
        events = [(control, Abort(request_ids=b, source="http", abort_id=abort_id)) for b in batches]
        if len(events) == 1:
            await self.bus.publish(*events[0])
        else:
            await self.bus.publish_many(events)

    async def _wait_final(
        self, ids: tuple[str | None, ...], timeout: float, shown: tuple[str, ...] | None = None
    ) -> dict:
        """The pre-refactor answer: which requests reached their final within ``timeout``,
        named as the client named them (``shown``; by default the log's ids). None: no
        request's (a tenant's id too long for its space)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def one(rid: str | None) -> Final | None:
            if rid is None:
                return None
            history = await self.bus.read_req(rid, b"0")
            if not history:
                return None
            first = history[0][1]
            if isinstance(first, Accepted) and first.choices and first.choices > 1:
                # a response of n choices: done when every choice is, its tokens theirs summed
                finals = await asyncio.gather(*(one(c) for c in choice_ids(rid, first.choices)))
                if any(f is None for f in finals):
                    return None
                n = sum(int((f.usage or {}).get("completion_tokens") or 0) for f in finals)
                return Final(
                    request_id=rid, finish_reason=finals[0].finish_reason, usage={"completion_tokens": n}
                )
            for _eid, ev in history:
                if isinstance(ev, Final):
                    return ev
            sub = await self.mux.subscribe(rid, history[-1][0])
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
        aborted, missing = [], []
        for rid, fin in zip(shown or ids, finals):
            if fin is None:
                missing.append(rid)
            else:
                n = (fin.usage or {}).get("completion_tokens", 0)
                aborted.append({"request_id": rid, "output_token_count": n if isinstance(n, int) else 0})
        return {"aborted": aborted, "not_found": missing}

    # ------------------------------------------------------------------ info

    async def openapi(self, request: web.Request) -> web.Response:
        return _json(self._openapi)

    def _model_cards(self) -> list[dict[str, Any]]:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "fd",
                "root": self.cfg.model_name,
                "parent": None,
                "max_model_len": self.cfg.max_model_len,
            }
            for name in (self.cfg.model_name, *self.cfg.model_aliases)
        ]
        # each LoRA adapter as vLLM lists it: its path as root, the base as parent
        adapters = {**self.cfg.lora_modules, **self.runtime_loras.names}
        return cards + [
            {**cards[0], "id": name, "root": path, "parent": self.cfg.model_name}
            for name, path in adapters.items()
        ]

    async def models(self, request: web.Request) -> web.Response:
        await self.runtime_loras.refresh()
        return _json({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve (``client.models.retrieve``): one served name's card."""
        await self.runtime_loras.refresh()
        name = request.match_info["model"]
        for card in self._model_cards():
            if card["id"] == name:
                return _json(card)
        raise not_found(f"The model '{name}' does not exist.", "model", "model_not_found")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids = protocol.parse_tokenize(body, self.limits, self.tokenizer)
        out = {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": list(ids)}
        if protocol._opt(body, "return_token_strs", protocol._is_bool, "a boolean", False):
            out["token_strs"] = self.tokenizer.token_strs(ids)  # (vLLM's)
        return _json(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = protocol.parse_detokenize(await self._body(request), self.limits)
        return _json({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": _VERSION})

    async def health(self, request: web.Request) -> web.Response:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):  # (not wait_for: see _merged)
                engines = await self.bus.engines()
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self.redis_failed()
            raise unavailable(f"Redis is unreachable: {e or type(e).__name__}") from None
        if not engines:
            raise unavailable("No engine is alive (no engine heartbeat in Redis).")
        return _json({"status": "ok", "api": self.cfg.api_id, "engines": engines})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if not self.metrics.engine_in_process:
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):  # (not wait_for: see _merged)
                    self.metrics.set_engine_gauges_from(await self.bus.engines())
            except (RedisError, OSError, asyncio.TimeoutError) as e:
                log.warning("metrics: could not read engine heartbeats: %s", e)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


def make_app(cfg: ApiConfig, bus: Bus, mux: StreamMux, tokenizer, metrics: Metrics) -> web.Application:
    """The API node's aiohttp app. It starts ``mux`` if nobody has (and then stops it).

    ``handler_cancellation`` is what lets :mod:`fd.api.cancellation` see a client leave while
    its request is still queued; it is set here, on the app, so every runner gets it.
    """
    api = Api(cfg, bus, mux, tokenizer, metrics)
    middlewares = [_errors, api.auth]
    if cfg.cors is not None:
        middlewares.insert(0, _preflight(cfg.cors))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=cfg.max_body_bytes + 1,
        handler_args={"handler_cancellation": True},
    )
    if cfg.cors is not None:
        app.on_response_prepare.append(_cors_headers(cfg.cors))
    app[API_KEY] = api
    generating = {
        "/v1/chat/completions": api.chat,
        "/v1/completions": api.completions,
        "/v1/responses": api.responses,
        "/v1/embeddings": api.embeddings,
    }
    # vLLM's scoring routes, by each name it serves them under
    generating.update({path: api.score for path in ("/score", "/v1/score")})
    generating.update({path: api.rerank for path in ("/rerank", "/v1/rerank", "/v2/rerank")})
    for path, handler in generating.items():  # every generating endpoint is guarded, by construction
        app.router.add_post(path, api.cancellation.guard(handler))
    if cfg.runtime_lora:  # (as vLLM: the routes exist only when allowed)
        app.router.add_post("/v1/load_lora_adapter", api.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", api.unload_lora_adapter)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.model)  # (names like "org/model")
    app.router.add_get("/health", api.health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) liveness route: /health's answer
        app.router.add_route(method, "/ping", api.health)
    app.router.add_get("/metrics", api.metrics_endpoint)
    app.router.add_post("/v1/abort_requests", api.abort_requests)
    app.router.add_get("/v1/requests/{id:[^/]+}/stream", api.stream_request)
    app.router.add_post("/v1/requests/{id:[^/]+}/cancel", api.cancel_request)
    app.router.add_get("/v1/responses/{id:[^/]+}", api.get_response)
    app.router.add_post("/v1/responses/{id:[^/]+}/cancel", api.cancel_response)
    app.router.add_get("/v1/responses/{id:[^/]+}/input_items", api.response_input_items)
    app.router.add_get("/openapi.json", api.openapi)
    app.router.add_post("/tokenize", api.tokenize)  # vLLM's, outside /v1 as there
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/version", api.version)
    app.on_startup.append(api.on_startup)
    app.on_cleanup.append(api.on_cleanup)
    return app
