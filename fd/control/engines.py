"""The engines' registry: their heartbeats (``P:engine:<id>``) and the LoRA adapters loaded at
run time (``P:loras``), which engines that start later load too.

A heartbeat is a hash an engine rewrites every few seconds with an EXPIRE a few heartbeats
long: an engine that stops beating drops out of :meth:`EngineRegistry.engines` on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from fd.control.keys import Keys

HEALTH_PROBE_TTL_S = 60


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


class EngineRegistry:
    """The registry's reads and writes, part of :class:`fd.control.bus.Bus`, whose client and
    keys they use."""

    redis: Any
    keys: Keys

    async def heartbeat(self, engine_id: str, fields: Mapping[str, str | int | float], ttl_s: int) -> None:
        key = self.keys.engine(engine_id)
        pipe = self.redis.pipeline(transaction=False)
        if fields:
            pipe.hset(key, mapping=dict(fields))
        pipe.expire(key, ttl_s)
        await pipe.execute()

    async def health_probe(self, api_id: str) -> None:
        """One small write that expires (``SET P:health:<api_id>``): raises what Redis says
        when it takes no writes (out of memory, read-only, failing its saves)."""
        await self.redis.set(self.keys.health(api_id), b"1", ex=HEALTH_PROBE_TTL_S)

    @staticmethod
    def lora_fields(ready: Iterable[str], errors: Mapping[str, str]) -> dict[str, str]:
        """An engine's heartbeat fields for its LoRA adapters: ``loras`` (the names it serves,
        comma-separated) and ``lora_errors`` (JSON, the loads that failed; "" for none)."""
        return {
            "loras": ",".join(sorted(ready)),
            "lora_errors": orjson.dumps(dict(errors)).decode() if errors else "",
        }

    @staticmethod
    def lora_state(heartbeat: Mapping[str, str]) -> tuple[set[str], dict[str, str]]:
        """:meth:`lora_fields` read back from a heartbeat (an engine of an earlier release: none)."""
        ready = {n for n in heartbeat.get("loras", "").split(",") if n}
        try:
            errors = orjson.loads(heartbeat["lora_errors"]) if heartbeat.get("lora_errors") else {}
        except orjson.JSONDecodeError:
            errors = {}
        return ready, errors if isinstance(errors, dict) else {}

    async def register_lora(self, name: str, path: str) -> bool:
        """Add a run-time LoRA adapter to ``P:loras``; False if the name is taken."""
        return bool(await self.redis.hsetnx(self.keys.loras, name, path))

    async def forget_lora(self, name: str) -> bool:
        return bool(await self.redis.hdel(self.keys.loras, name))

    async def loras(self) -> dict[str, str]:
        """The run-time LoRA adapters, name -> path."""
        got = await self.redis.hgetall(self.keys.loras)
        return {_b(k).decode(): _b(v).decode() for k, v in got.items()}

    async def engines(self) -> dict[str, dict[str, str]]:
        """Every engine with a live heartbeat, by id."""
        keys = [k async for k in self.redis.scan_iter(match=self.keys.engine_pattern(), count=1000)]
        if not keys:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(k)
        head = len(self.keys.engine(""))
        out = {}
        for k, h in zip(keys, await pipe.execute(), strict=False):
            if h:  # expired between SCAN and HGETALL
                out[_b(k)[head:].decode()] = {
                    _b(a).decode(errors="replace"): _b(b).decode(errors="replace") for a, b in h.items()
                }
        return out
