"""The routes about the served model and the replica rather than about one request (vLLM's
``OpenAIServingModels`` and ``OpenAIServingTokenization``, with its health and metrics
routes): models and their LoRA adapters, tokenize and detokenize, version, health, metrics,
and the OpenAPI spec.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from fd.api import lora_admin, openapi, protocol
from fd.api.context import ApiContext, json_response
from fd.api.errors import not_found, unavailable
from fd.api.validation import is_bool, opt
from fd.control.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fd.control.outage import reason

log = logging.getLogger("fd.api")

try:
    _VERSION = importlib.metadata.version("fd")
except importlib.metadata.PackageNotFoundError:  # (run from a checkout that was not installed)
    _VERSION = "unknown"

HEALTH_TIMEOUT_S = 2.0


class ServingAdmin:
    """Model cards, adapters, the tokenizer's routes, health, metrics and the spec."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx
        self.started = int(time.time())  # the model cards' ``created``
        cfg = ctx.cfg
        self._openapi = openapi.build(
            cfg.model_name,
            cfg.max_model_len,
            cfg.max_body_bytes,
            ctx.limits.vocab_size,
            tuple(cfg.model_aliases),
            cfg.runtime_lora,
        )

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(self._openapi)

    # ------------------------------------------------------------------ models and adapters

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's, on every engine (fd.api.lora_admin)."""
        ctx = self.ctx
        taken = ctx.served | set(ctx.cfg.lora_modules)
        return web.Response(
            text=await lora_admin.load(ctx.bus, await ctx.body(request), taken, ctx.runtime_loras)
        )

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        return web.Response(
            text=await lora_admin.unload(
                ctx.bus, await ctx.body(request), set(ctx.cfg.lora_modules), ctx.runtime_loras
            )
        )

    def _model_cards(self) -> list[dict[str, Any]]:
        cfg = self.ctx.cfg
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "fd",
                "root": cfg.model_name,
                "parent": None,
                "max_model_len": cfg.max_model_len,
            }
            for name in (cfg.model_name, *cfg.model_aliases)
        ]
        # each LoRA adapter as vLLM lists it: its path as root, the base as parent
        adapters = {**cfg.lora_modules, **self.ctx.runtime_loras.names}
        return cards + [
            {**cards[0], "id": name, "root": path, "parent": cfg.model_name}
            for name, path in adapters.items()
        ]

    async def models(self, request: web.Request) -> web.Response:
        await self.ctx.runtime_loras.refresh()
        return json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's retrieve (``client.models.retrieve``): one served name's card."""
        await self.ctx.runtime_loras.refresh()
        name = request.match_info["model"]
        for card in self._model_cards():
            if card["id"] == name:
                return json_response(card)
        raise not_found(f"The model '{name}' does not exist.", "model", "model_not_found")

    # ------------------------------------------------------------------ the tokenizer

    async def tokenize(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        body = await ctx.body(request)
        ids = protocol.parse_tokenize(body, ctx.limits, ctx.tokenizer)
        out = {"count": len(ids), "max_model_len": ctx.cfg.max_model_len, "tokens": list(ids)}
        if opt(body, "return_token_strs", is_bool, "a boolean", False):
            out["token_strs"] = ctx.tokenizer.token_strs(ids)  # (vLLM's)
        return json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = protocol.parse_detokenize(await self.ctx.body(request), self.ctx.limits)
        return json_response({"prompt": self.ctx.tokenizer.decode(ids, skip_special_tokens=False)})

    # ------------------------------------------------------------------ the replica

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": _VERSION})

    async def health(self, request: web.Request) -> web.Response:
        ctx = self.ctx
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):  # (not wait_for: see fd.api.streaming.merged)
                # A write, not a ping: a Redis out of memory, read-only or failing its saves
                # answers pings and reads while it refuses every request's story.
                await ctx.bus.health_probe(ctx.cfg.api_id)
                engines = await ctx.bus.engines()
        except (TimeoutError, RedisError, OSError) as e:
            ctx.redis_failed(e)
            raise unavailable(f"Redis is unavailable: {reason(e)}") from None
        ctx.redis_ok()
        if not engines:
            raise unavailable("No engine is alive (no engine heartbeat in Redis).")
        return json_response({"status": "ok", "api": ctx.cfg.api_id, "engines": engines})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        metrics = self.ctx.metrics
        if not metrics.engine_in_process:
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):  # (not wait_for: see fd.api.streaming.merged)
                    metrics.set_engine_gauges_from(await self.ctx.bus.engines())
            except (TimeoutError, RedisError, OSError) as e:
                log.warning("metrics: could not read engine heartbeats: %s", e)
        return web.Response(body=metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})
