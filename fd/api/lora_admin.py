"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, over the event log.

A load is registered in ``P:loras`` (so engines that start later load it too) and told to
every engine with one ``load_lora`` control event; the answer waits until every live engine's
heartbeat lists the adapter (200), or one of them says it could not load it (400, and the
load is taken back on all of them: an adapter is served everywhere or nowhere). An unload is
taken out of ``P:loras`` and told with ``unload_lora``: engines take no new request with it,
and forget it once those running with it end.

API nodes know the adapters by name from ``P:loras`` (:class:`LoraNames`), so a request to
any replica may name one loaded through another.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fd.api.errors import ApiError, bad_request, not_found, unavailable
from fd.control.bus import Bus
from fd.control.events import LoadLora, UnloadLora
from fd.control.keys import valid_request_id

LOAD_WAIT_S = 30.0  # how long a load waits for every engine to say it has the adapter
REFRESH_S = 0.02  # a model name not served here reads P:loras again at most this often


class LoraNames:
    """The run-time adapters (``P:loras``), read again when a request names a model nobody
    here knows (at most every REFRESH_S)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.names: dict[str, str] = {}
        self._read_at = 0.0

    async def refresh(self, force: bool = False) -> dict[str, str]:
        now = time.monotonic()
        if force or now - self._read_at >= REFRESH_S:
            self._read_at = now
            self.names = await self.bus.loras()
        return self.names


def _name(body: Any, key: str = "lora_name") -> str:
    name = body.get(key) if isinstance(body, dict) else None
    if not isinstance(name, str) or not valid_request_id(name):
        raise bad_request(
            f"'{key}' must be an adapter name (letters, digits, '_.:@-', 1-128).", key, "invalid_value"
        )
    return name


async def load(bus: Bus, body: Any, taken: set[str], names: LoraNames) -> str:
    """Load an adapter on every engine; the success message, or an ApiError."""
    name = _name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad_request("'lora_path' is required.", "lora_path", "missing_required_parameter")
    if name in taken or not await bus.register_lora(name, path):
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name", "invalid_value")
    await bus.publish(bus.keys.control, LoadLora(name=name, path=path))
    deadline = time.monotonic() + LOAD_WAIT_S
    waiting: list[str] = []
    while time.monotonic() < deadline:
        state = {e: Bus.lora_state(h) for e, h in (await bus.engines()).items()}
        failed = {e: errors[name] for e, (_, errors) in state.items() if errors.get(name)}
        if failed:
            await _take_back(bus, name)
            engine, why = next(iter(failed.items()))
            raise bad_request(
                f"The lora adapter '{name}' could not be loaded (engine {engine}): {why}",
                "lora_path",
                "invalid_value",
            )
        waiting = [e for e, (ready, _) in state.items() if name not in ready]
        if state and not waiting:
            await names.refresh(force=True)
            return f"Success: LoRA adapter '{name}' added successfully."
        await asyncio.sleep(0.05)
    await _take_back(bus, name)
    raise unavailable(
        f"The lora adapter '{name}' was not loaded in {LOAD_WAIT_S:.0f} s "
        + (f"(engines {', '.join(waiting)} did not say they had it)" if waiting else "(no engine is alive)")
    )


async def _take_back(bus: Bus, name: str) -> None:
    await bus.forget_lora(name)
    await bus.publish(bus.keys.control, UnloadLora(name=name))


async def unload(bus: Bus, body: Any, static: set[str], names: LoraNames) -> str:
    name = _name(body)
    if name in static:
        raise ApiError(
            400,
            f"The lora adapter '{name}' was given at start (--lora-modules) and stays.",
            "invalid_request_error",
            "lora_name",
            "invalid_value",
        )
    if not await bus.forget_lora(name):
        raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name", "lora_not_found")
    await bus.publish(bus.keys.control, UnloadLora(name=name))
    await names.refresh(force=True)
    return f"Success: LoRA adapter '{name}' removed successfully."
