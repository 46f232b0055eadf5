"""What every handler of the API node shares (DESIGN.md §5): its configuration, the bus, the
stream mux, the tokenizer, the metrics, and the request plumbing over them.

The handlers are grouped by endpoint family, as vLLM's ``OpenAIServing*`` classes are
(:mod:`fd.api.serving_generate`, :mod:`fd.api.serving_responses`,
:mod:`fd.api.serving_embeddings`, :mod:`fd.api.serving_aborts`, :mod:`fd.api.serving_admin`);
each holds the one :class:`ApiContext` of its replica, so what one learns (an adapter loaded
at run time, a Redis outage) every other sees at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from fd.api.config import ApiConfig, new_api_id
from fd.api.errors import bad_request, conflict, id_taken, too_large, unavailable
from fd.api.lora_admin import LoraNames
from fd.api.tenancy import TENANT_ID_MAX, Caller
from fd.api.validation import parse_body
from fd.control.bus import Bus
from fd.control.events import MAX_FIELD_BYTES, Abort
from fd.control.keys import ENGINE_ID_RE, REQUEST_ID_RE, choice_ids, is_tombstone
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from fd.control.outage import kind, reason
from fd.control.tokenizer import TokenizerLike

log = logging.getLogger("fd.api")

IGNORED_NAMES = 256  # distinct ignored request fields remembered, each said once
REDIS_SUSPECT_S = 30.0  # after a Redis error, check with a quick ping before each new request
REDIS_PING_TIMEOUT_S = 0.5
RID = web.RequestKey("fd.rid", str)  # the request id, echoed in X-Request-Id even on errors
CALLER = web.RequestKey("fd.caller", Caller)  # who sent it (fd.api.tenancy), on the routes with keys


def valid_request_id(rid: str) -> bool:
    """The documented id charset, matched in full: ``re.match`` with ``$`` would also pass an
    id ending in a newline, and an id becomes part of Redis key names."""
    return REQUEST_ID_RE.fullmatch(rid) is not None


def valid_engine_id(eid: str) -> bool:
    return ENGINE_ID_RE.fullmatch(eid) is not None


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def new_abort_id() -> str:
    return f"abort-{uuid.uuid4().hex[:16]}"


class ApiContext:
    """One replica's shared state, bound to one bus, one stream mux, one tokenizer and one
    metrics object. ``limits`` is replaced (never mutated) when run-time adapters change, so
    a handler reads it here at each request rather than keeping its own."""

    def __init__(self, cfg: ApiConfig, bus: Bus, mux: StreamMux, tokenizer: TokenizerLike, metrics: Metrics):
        self._redis_suspect_until = 0.0  # see redis_failed()
        self.outage: str | None = None  # why Redis fails now (redis_failed), for /health
        self._outage_kind: str | None = None  # (fd.control.outage.kind) of the outage logged
        self._ignored_said: set[str] = set()  # request fields said to be ignored (say_ignored)
        if cfg.api_id is None:  # (a node of make_app alone, as in the tests: start_api names its own)
            cfg = dataclasses.replace(cfg, api_id=new_api_id())
        self.cfg = cfg
        self.bus = bus
        self.mux = mux
        self.tokenizer = tokenizer
        self.token_bytes = tokenizer.id_to_bytes  # what a token is, for log-probabilities
        self.metrics = metrics
        self.limits = cfg.limits(tokenizer.vocab_size)
        metrics.vllm.configure(cfg.model_name, self.limits.max_model_len)  # (vLLM's labels and buckets)
        self.runtime_loras = LoraNames(bus)  # adapters loaded at run time, from any replica
        self.served = {cfg.model_name, *cfg.model_aliases}
        self._started_mux = False

    async def on_startup(self, app: web.Application) -> None:
        if not self.mux.started:
            await self.mux.start()
            self._started_mux = True

    async def on_cleanup(self, app: web.Application) -> None:
        if self._started_mux:
            await self.mux.stop()

    # ------------------------------------------------------------------ the request

    async def read_body(self, request: web.Request) -> bytes:
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

    async def body(self, request: web.Request) -> dict:
        return parse_body(await self.read_body(request), self.limits)

    def request_id(self, request: web.Request, prefix: str) -> tuple[str, bool]:
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

    async def id_free(self, rid: str, shown: str) -> None:
        """A client's own id for one request: a 409 if a request has it. (An id whose abort
        overtook it is not a conflict: its story already ends in an abort final, which is what
        this client gets.) A tenant's id is in its own space: only its own requests conflict."""
        if await self.bus.request_exists(rid) and not is_tombstone(await self.bus.owner(rid)):
            raise id_taken(shown)

    async def choice_ids(self, rid: str, explicit: bool, n: int, shown: str) -> tuple[str, ...]:
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

    def log_request(self, rid: str, endpoint: str, prompt_ids: tuple[int, ...], sampling: Any) -> None:
        """vLLM's --enable-log-requests line: the request's prompt (as text and token ids, cut
        to --max-log-len) and its sampling parameters; never a key or a header."""
        if not self.cfg.log_requests:
            return
        cut = self.cfg.max_log_len
        ids = prompt_ids if cut is None else prompt_ids[:cut]
        text = self.tokenizer.decode(list(ids))
        log.info(
            "received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            rid,
            text if cut is None else text[:cut],
            sampling,
            list(ids),
            extra={"request_id": rid, "endpoint": endpoint, "prompt_tokens": len(prompt_ids)},
        )

    def say_ignored(self, names: list[str], rid: str) -> None:
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

    async def know_adapters(self, body: dict) -> None:
        """A model name that is not the served model's: an adapter loaded at run time, maybe
        through another replica (``P:loras``, read at most every REFRESH_S)."""
        model = body.get("model")
        if not isinstance(model, str) or model in self.served or model in self.cfg.lora_modules:
            return
        runtime = await self.runtime_loras.refresh()
        names = (*self.cfg.lora_modules, *runtime)
        if names != self.limits.lora_names:
            self.limits = dataclasses.replace(self.limits, lora_names=names)

    # ------------------------------------------------------------------ Redis

    def redis_failed(self, e: BaseException) -> None:
        """Remember that Redis just failed (gone, stalled, or replying "not now":
        fd/control/outage.py): until a quick ping succeeds again, new requests get their 503 at
        once instead of after the client's seconds of connection retries. One log line an
        outage (and one more when its kind changes), not one a request."""
        self._redis_suspect_until = time.monotonic() + REDIS_SUSPECT_S
        self.outage = reason(e)
        if kind(e) != self._outage_kind:
            self._outage_kind = kind(e)
            log.warning("redis unavailable: %s", self.outage, extra={"api": self.cfg.api_id})

    def redis_ok(self) -> None:
        """A Redis call that writes got through."""
        self._redis_suspect_until = 0.0
        if self.outage is not None:
            log.info("redis reachable again", extra={"api": self.cfg.api_id})
            self.outage = self._outage_kind = None

    async def check_redis(self) -> None:
        if time.monotonic() >= self._redis_suspect_until:
            return
        try:
            # (not wait_for: see fd.api.streaming.merged)
            async with asyncio.timeout(REDIS_PING_TIMEOUT_S):
                await self.bus.redis.ping()
        except (TimeoutError, RedisError, OSError) as e:
            self.redis_failed(e)
            raise unavailable(f"The control plane (Redis) is unavailable: {reason(e)}") from None
        # (a ping is no write: an OOM or READONLY outage lasts until a write gets through)
        if self.outage is None:
            self._redis_suspect_until = 0.0

    async def publish_abort(self, ids: tuple[str, ...], abort_id: str) -> None:
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
