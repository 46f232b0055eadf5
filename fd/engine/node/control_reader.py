"""The engine's reader of ``P:control``: every engine reads every control event (aborts, drains,
LoRA loads), from a cursor the node fixes at start (its lookback, so an abort made while no
engine ran is seen). It applies the events already there before the engine's first claim
(:meth:`ControlReader.catch_up`), then reads on, blocking, on a connection of its own
(:meth:`ControlReader.run`). What an event means is the node's (its ``handle``); this only reads,
rides out Redis's outages and flushes what the events queued."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from fd.control.bus import Bus
from fd.control.events import Event
from fd.engine.node.redis_link import RETRYABLE, RedisLink, Stopped

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class ControlReader:
    def __init__(
        self,
        engine_id: str,
        bus: Bus,
        link: RedisLink,
        handle: Callable[[Event, bytes | None], Awaitable[None]],
        flush: Callable[[], Awaitable[None]],
        wake: asyncio.Event,
        stopping: Callable[[], bool],
        block_ms: int,
        retry_backoff_s: float,
    ) -> None:
        self.engine_id = engine_id
        self.bus = bus  # (its own connection: a blocked XREAD holds up nothing else)
        self.link = link
        self.handle = handle  # one event (and its entry id): the node decides what it means
        self.flush = flush
        self.wake = wake  # the step loop: an event may have freed blocks or stopped requests
        self.stopping = stopping
        self.block_ms = block_ms
        self.retry_backoff_s = retry_backoff_s

    async def catch_up(self, cursor: bytes) -> bytes:
        """Apply the control events already there (the lookback's) before the first claim: a
        request aborted while no engine ran, by id or by ``abort_all``, meets its tombstone and
        is never claimed and prefilled. The cursor after them."""
        while True:
            before = cursor
            try:
                read = functools.partial(self.bus.read_control, cursor, None)
                cursor, events = await self.link.retry("control read", read)
            except RETRYABLE:  # (a refusal, logged: run() reads on from here)
                break
            await self._apply(events)
            if cursor == before:
                break
        await self.flush()
        return cursor

    async def run(self, cursor: bytes) -> None:
        backoff = self.retry_backoff_s
        while not self.stopping():
            try:
                cursor, events = await self.bus.read_control(cursor, self.block_ms)
                backoff = self.retry_backoff_s
            except RETRYABLE as e:
                self.link.failed("control read", e)
                backoff = await self.link.pause(backoff)
                continue
            except Exception:  # a bug: keep the engine alive, retry shortly
                log.exception("control read failed", extra={"engine": self.engine_id})
                await asyncio.sleep(0.5)
                continue
            try:
                await self._apply(events)
                if events:
                    await self.flush()
                    self.wake.set()
            except Stopped:
                return

    async def _apply(self, events: list[tuple[bytes, Event]]) -> None:
        for entry_id, ev in events:
            try:
                await self.handle(ev, entry_id)
            except RETRYABLE as e:  # (a refusal of its command: the next event)
                self.link.failed("control event", e)
