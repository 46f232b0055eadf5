"""The engine's side of placement (fd/control/lanes.py, DESIGN.md §4c): what it claims from,
and the card it publishes.

Where to claim from, each time the engine can admit ``n`` requests:

- While no other engine has a lane (one engine, as in a plain ``fd serve``) and its own lane is
  empty, ``P:requests`` through the group read, as ever.
- Otherwise its own lane through the take script (``P:requests`` first, then its lane, in one
  round trip), then, if it still has room, a steal from each other lane whose oldest request
  has waited ``steal_after_ms`` by the server's clock, or whose engine is dead (that lane is
  emptied and dropped).

The lanes are looked at (the registry, each lane's oldest id, the server's clock) at most every
``poll_s`` while the engine has room. The card is written every ``card_s`` while its contents
change, and at least every third of its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from fd.control.bus import Bus
from fd.control.entry_ids import entry_id_key
from fd.control.events import Request
from fd.control.lanes import Card
from fd.control.prefix import short
from fd.engine.core.protocol import SchedulerLike

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")

Claimed = list[tuple[bytes, Request]]

#: How often an engine with no lane in use (alone, as in ``fd serve``) looks for one (one
#: round trip): a second engine's first requests on its lane wait at most this long.
ALONE_POLL_S = 0.1
#: How often the empty lanes of dead engines are looked for (and dropped from the registry).
PRUNE_S = 5.0


class LaneClaims:
    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        steal_after_ms: int,
        poll_s: float = 0.02,
    ) -> None:
        self.bus = bus
        self.engine_id = engine_id
        self.steal_after_ms = steal_after_ms
        self.poll_s = poll_s
        self._polled = -1e9
        self._heads: dict[str, bytes | None] = {}
        self._now_ms = 0  # the server's clock at the last look
        self._after = b"$"  # where an idle wait for new P:requests entries starts
        self.stolen = 0  # requests taken from another engine's lane
        self._pruned = time.monotonic()

    @property
    def peers(self) -> bool:
        """Whether another engine has a lane (placement has engines to choose from)."""
        return any(e != self.engine_id for e in self._heads)

    @property
    def active(self) -> bool:
        """Whether lanes are in use: another engine has one, or this one's has requests."""
        return self.peers or self._heads.get(self.engine_id) is not None

    async def look(self) -> bool:
        """Look at the lanes if ``poll_s`` has passed since the last look (``ALONE_POLL_S``
        while no lane is in use); whether it did."""
        now = time.monotonic()
        if now - self._polled < (self.poll_s if self.active else ALONE_POLL_S):
            return False
        self._polled = now
        self._heads, self._now_ms = await self.bus.lane_heads(self.engine_id)
        return True

    async def claim(self, n: int, block_ms: int | None) -> Claimed:
        """Up to ``n`` requests for this engine (see the module's docstring)."""
        looked = await self.look()
        if not self.active:
            return await self.bus.claim_requests(self.engine_id, n, block_ms)
        got, self._after = await self.bus.take(self.engine_id, n, self.engine_id)
        if len(got) < n and looked:
            got += await self._steal(n - len(got))
        if looked:
            await self._prune()
        if not got and block_ms:
            self._after = await self.bus.wait_for_work(self.engine_id, self._after, block_ms)
            self._polled = -1e9  # (look again at once: something came, or time passed)
        return got

    async def _steal(self, n: int) -> Claimed:
        overdue = [
            e
            for e, head in self._heads.items()
            if e != self.engine_id
            and head is not None
            and self._now_ms - entry_id_key(head)[0] >= self.steal_after_ms
        ]
        waiting = [e for e, head in self._heads.items() if e != self.engine_id and head is not None]
        alive = await self.bus.engines_alive(waiting) if waiting else {}
        dead = [e for e in waiting if not alive.get(e, False)]
        got: Claimed = []
        for e in dict.fromkeys([*dead, *overdue]):
            if len(got) >= n:
                break
            taken, self._after = await self.bus.take(self.engine_id, n - len(got), e, prune=e in dead)
            if taken:
                self._heads[e] = None  # (looked at again at the next poll)
                self.stolen += len(taken)
                log.info(
                    "stole %d request(s) from %s's lane",
                    len(taken),
                    e,
                    extra={"engine": self.engine_id, "lane": e, "dead": e in dead},
                )
            got += taken
        return got

    async def _prune(self) -> None:
        """Every ``PRUNE_S``: the empty lanes of dead engines leave the registry (a non-empty
        one is stolen from, and dropped once emptied)."""
        now = time.monotonic()
        if now - self._pruned < PRUNE_S:
            return
        self._pruned = now
        idle = [e for e, head in self._heads.items() if e != self.engine_id and head is None]
        alive = await self.bus.engines_alive(idle) if idle else {}
        for e in idle:
            if not alive.get(e, False):
                await self.bus.drop_lane(e)
                self._heads.pop(e, None)


class CardWriter:
    """Publishes this engine's placement card (fd/control/lanes.py ``Card``): every ``every_s``
    while it changes, at least every third of its TTL; and while the engine is alone
    (``alone()``: no other engine has a lane) at that slower pace only, as an API places
    nothing with one engine."""

    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        sched: SchedulerLike,
        ttl_s: int,
        alone: Callable[[], bool],
        every_s: float = 0.05,
    ):
        self.bus = bus
        self.engine_id = engine_id
        self.sched = sched
        self.ttl_s = ttl_s
        self.alone = alone
        self.every_s = every_s
        self.seq = 0
        self.gone = False  # left placement (a drain): no card any more

    def card(self) -> Card:
        s = self.sched
        self.seq += 1
        return Card(
            engine=self.engine_id,
            block_size=s.config.block_size,
            running=s.num_running,
            waiting=s.num_waiting,
            blocks_free=s.num_free_blocks,
            blocks_total=s.num_total_blocks,
            max_seqs=s.config.max_num_seqs,
            seq=self.seq,
            blocks=frozenset(short(h) for h in s.cached_block_hashes()),
        )

    def _state(self) -> tuple[int, int, int, int]:
        s = self.sched
        return (s.num_running, s.num_waiting, s.num_free_blocks, s.num_cached_blocks)

    async def run(self, sleep: Callable[[float], Awaitable[None]], stopping: Callable[[], bool]) -> None:
        last: tuple[int, int, int, int] | None = None
        written = 0.0
        while not stopping():
            state = self._state()
            now = time.monotonic()
            due = now - written > self.ttl_s / 3
            if not self.gone and (due or state != last and not self.alone()):
                try:
                    await self.bus.write_card(self.card(), self.ttl_s)
                    last, written = state, now
                except Exception as e:  # (an outage: the next turn writes it)
                    log.debug("card not written: %s", e, extra={"engine": self.engine_id})
            await sleep(self.every_s)

    async def leave(self) -> None:
        """No more placements for this engine: its card goes and its lane's requests go to
        ``P:requests`` (a drain, a stop)."""
        self.gone = True
        try:
            async with asyncio.timeout(2.0):
                await self.bus.release_lane(self.engine_id)
        except Exception as e:  # Redis down: the card expires, the lane is stolen from
            log.warning("could not release the lane: %s", e, extra={"engine": self.engine_id})
