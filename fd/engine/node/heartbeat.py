"""The engine's signs of life: its heartbeat hash (``P:engine:<id>``, with a TTL), the gauges of
its scheduler, and the once-a-second look at whether it still owns what it runs.

Peers read the heartbeat to tell a live engine from a dead one (failover takes a request over
only from an engine whose hash is gone), an API node reads it for the adapters an engine has
loaded (``/v1/load_lora_adapter`` waits on it, so a load's outcome is written at once:
:meth:`Heartbeat.beat_now`), and ``fd status`` prints it. The same beat checks each owner key
against this engine's token: a request another engine took over (this one looked dead to it)
is dropped before its next write meets the fence, and the owner keys and stories of those
still held are renewed every quarter TTL, so a request may outlive the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fd.control.bus import Bus
from fd.control.events import EngineLoad
from fd.control.fence import Refused
from fd.control.logs import StatsLine
from fd.control.outage import is_outage, reason
from fd.engine.core.protocol import SchedulerLike
from fd.engine.node.redis_link import RETRYABLE, RedisLink
from fd.engine.node.request_table import RequestTable

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class Heartbeat:
    def __init__(
        self,
        engine_id: str,
        bus: Bus,
        sched: SchedulerLike,
        requests: RequestTable,
        link: RedisLink,
        status: Callable[[], dict[str, Any]],
        lose: Callable[[str, Refused], None],
        wake: asyncio.Event,
        interval_s: float,
        ttl_s: int,
        metrics: Any = None,
    ) -> None:
        self.engine_id = engine_id
        self.bus = bus
        self.sched = sched
        self.requests = requests
        self.link = link
        self.status = status  # what the hash says (EngineNode.status)
        self.lose = lose  # a request whose owner key moved on: the node drops it
        self.wake = wake
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.metrics = metrics
        self._beats: set[asyncio.Task] = set()  # heartbeats written at once (an adapter loaded)

    async def run(self, sleep: Callable[[float], Awaitable[None]], stopping: Callable[[], bool]) -> None:
        while not stopping():
            try:
                await self.bus.heartbeat(self.engine_id, self.status(), self.ttl_s)
                self.link.ok()
                await self.check_ownership()
            except RETRYABLE as e:
                self.link.failed("heartbeat", e)
            except Exception:
                log.exception("heartbeat failed", extra={"engine": self.engine_id})
            self.publish_gauges()
            await sleep(self.interval_s)

    def beat_now(self) -> None:
        """Write the heartbeat now (an API node waits on it for an adapter's load)."""
        task = asyncio.get_running_loop().create_task(
            self.bus.heartbeat(self.engine_id, self.status(), self.ttl_s)
        )
        self._beats.add(task)
        task.add_done_callback(self._beats.discard)

    async def forget(self) -> None:
        """Delete the heartbeat on the way out: peers take this engine's requests over at once,
        not once the hash expires."""
        try:
            async with asyncio.timeout(2.0):  # (not wait_for: see EngineNode._step_loop)
                await self.bus.delete_heartbeat(self.engine_id)
        except Exception as e:  # Redis down: the key expires on its own
            log.warning("could not delete heartbeat: %s", e, extra={"engine": self.engine_id})

    async def log_throughput(
        self,
        every_s: float,
        tokens: Callable[[], tuple[int, int]],
        sleep: Callable[[float], Awaitable[None]],
        stopping: Callable[[], bool],
    ) -> None:
        """vLLM's throughput line every ``every_s`` while busy (fd.control.logs.StatsLine), from
        the gauges this publishes and ``tokens()``: the prompt and generated tokens so far."""
        line = StatsLine(log)
        while not stopping():
            await sleep(every_s)
            if stopping():
                return
            sched = self.sched
            total = sched.num_total_blocks
            prompt, generated = tokens()
            line.tick(
                prompt_tokens=prompt,
                generation_tokens=generated,
                running=sched.num_running,
                waiting=sched.num_waiting,
                kv_usage=(total - sched.num_free_blocks) / total if total else 0.0,
                cache_queries=sched.num_cache_queries,
                cache_hits=sched.num_cache_hits,
                engine=self.engine_id,
            )

    def load(self) -> EngineLoad:
        """This engine's load now, for ``P:lifecycle``."""
        sched = self.sched
        return EngineLoad(
            engine=self.engine_id,
            step=sched.step,
            running=sched.num_running,
            waiting=sched.num_waiting,
            blocks_free=sched.num_free_blocks,
            blocks_total=sched.num_total_blocks,
            prefix_blocks=sched.num_cached_blocks,
            ts=int(time.time() * 1000),
        )

    def publish_gauges(self) -> None:
        if self.metrics is not None:
            sched = self.sched
            self.metrics.set_engine_gauges(
                blocks_total=sched.num_total_blocks,
                blocks_free=sched.num_free_blocks,
                running=sched.num_running,
                waiting=sched.num_waiting,
                cache_queries=sched.num_cache_queries,
                cache_hits=sched.num_cache_hits,
            )

    async def check_ownership(self) -> None:
        """A request whose owner key no longer holds this engine's token was taken over (this
        engine looked dead to a peer): stop running it, silently, before its next write would
        meet the fence. Those still held get their owner key's and story's TTL renewed every
        quarter TTL, so a request that runs for longer than the TTL keeps them (the fence
        refuses a write once its owner key is gone)."""
        requests, sched, keys = self.requests, self.sched, self.bus.keys
        rids = [r for r, live in requests.items() if not live.silent and sched.knows(r)]
        if not rids:
            return
        owners = await self.bus.owners_or_errors(rids)
        now = time.monotonic()
        due: list[str] = []
        for rid, owner in zip(rids, owners, strict=False):
            if isinstance(owner, Exception) and is_outage(owner):
                raise owner
            live = requests.get(rid)
            if live is None or live.silent or not sched.knows(rid):
                continue
            if isinstance(owner, Exception):  # (a key of another type: this one's alone)
                self.lose(rid, Refused("error", None, reason(owner)))
                continue
            if owner != requests.tokens.get(rid):
                self.lose(rid, Refused("owner", owner))
            elif now - live.renewed > self.bus.req_ttl_s / 4:
                live.renewed = now
                due += [keys.owner(rid), keys.req(rid)]
                req = live.request
                if req.data.parent:  # (a choice: its response's story too)
                    due += [keys.owner(req.data.parent), keys.req(req.data.parent)]
        if due:  # (not atomic with the GET: at worst it renews a new owner's keys, as it would)
            await self.bus.renew(list(dict.fromkeys(due)))
        self.wake.set()
