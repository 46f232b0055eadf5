"""Prefix-aware placement (DESIGN.md §4c): which engine's lane a new request waits on.

Every ``refresh_s`` the API reads the engines' cards (fd/control/lanes.py): each one's batch
and the short ids of the blocks its prefix cache holds. A new request's prompt is hashed the
way the engines key their caches (fd/control/prefix.py), and each engine is scored by the
prefill it would still have to do times the batch it would join (LMetric's score, arXiv
2603.15202: ``uncached prompt tokens x (running + waiting + 1)``), counting the requests this
API placed on it since it last read the cards and the requests waiting on its lane. An engine
with a running slot free comes before one without (which could only queue the request: an
engine pulls only what it can start); among those, the lowest score wins; ties go by a hash of
the request id, so cold requests spread. No tuning: a cache hit wins while its engine has room
and a small enough batch, and a hot prefix spills over to a second engine once the first is
full or loaded enough that recomputing the prefix elsewhere is cheaper.

Placement is only a preference. With fewer than two engines carded, cards older than
``stale_s`` (Redis unreachable), or ``--placement blind``, a request goes to ``P:requests``
for whichever engine claims first. The engines keep the rest: each takes from its lane only
when it can admit, and steals from another's once its oldest request has waited the engine's
``--steal-after-ms`` (fd/engine/node/lanes.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from fd.control.bus import Bus
from fd.control.events import Request
from fd.control.lanes import Card
from fd.control.outage import REDIS_FAILURES
from fd.control.prefix import chain, held, short

log = logging.getLogger("fd.api.placement")

#: How often the cards are read while fewer than two engines have one (nothing to choose
#: between): a second engine is placed on within this long of its first card.
ALONE_REFRESH_S = 0.5


@dataclass
class Choice:
    engine: str
    cached_tokens: int  # of the prompt, on that engine's card
    score: int


@dataclass
class Placement:
    bus: Bus
    refresh_s: float = 0.05
    stale_s: float = 1.0
    cards: dict[str, Card] = field(default_factory=dict)
    read_at: float = -1e9
    placed: dict[str, int] = field(default_factory=dict)  # per engine, since the cards were last read
    # metrics: "hit" (an engine holding part of the prompt), "miss" or "none" (P:requests),
    # and the seconds the choice took
    on_choice: Callable[[str, float], None] | None = None
    task: asyncio.Task | None = None  # run(), while the API serves
    _stopped: bool = False

    async def refresh(self) -> None:
        self.cards = {c.engine: c for c in await self.bus.read_cards()}
        self.placed.clear()  # (the lanes' lengths count them now)
        self.read_at = time.monotonic()

    async def run(self) -> None:
        """Read the cards every ``refresh_s`` (every ``ALONE_REFRESH_S`` while fewer than two
        engines have one) until :meth:`close`. Never cancelled: a command cancelled mid-way
        loses its reply on the embedded server's client (DESIGN.md §6)."""
        while not self._stopped:
            try:
                await self.refresh()
            except REDIS_FAILURES as e:  # (stale cards place nothing: P:requests meanwhile)
                log.debug("cards not read: %s", e)
            wait = self.refresh_s if len(self.cards) >= 2 else ALONE_REFRESH_S
            until = time.monotonic() + wait
            while not self._stopped and (left := until - time.monotonic()) > 0:
                await asyncio.sleep(min(left, self.refresh_s))

    async def close(self) -> None:
        """Stop :meth:`run` and wait for it (a refresh at most)."""
        self._stopped = True
        if self.task is not None:
            await self.task

    def choose(self, request: Request) -> str | None:
        """The engine whose lane ``request`` should wait on, or None (``P:requests``)."""
        t0 = time.perf_counter()
        choice = self._choose(request)
        if choice is not None:
            self.placed[choice.engine] = self.placed.get(choice.engine, 0) + 1
        if self.on_choice is not None:
            result = "none" if choice is None else "hit" if choice.cached_tokens else "miss"
            self.on_choice(result, time.perf_counter() - t0)
        return choice.engine if choice is not None else None

    def _choose(self, request: Request) -> Choice | None:
        cards = self.cards
        if len(cards) < 2 or time.monotonic() - self.read_at > self.stale_s:
            return None
        data = request.data
        ids = data.prompt_token_ids
        lora = data.sampling.lora
        chains: dict[int, list[int]] = {}
        best: tuple[int, int, int, int] | None = None
        pick: Choice | None = None
        for e, card in cards.items():
            bs = card.block_size
            if bs not in chains:
                # (the last prompt token is always computed: blocks short of it can be shared)
                chains[bs] = [short(h) for h in chain(ids, bs, lora, limit=max(len(ids) - 1, 0) // bs)]
            cached = held(chains[bs], card.blocks) * bs
            load = card.load + self.placed.get(e, 0)
            score = max(len(ids) - cached, 1) * (load + 1)
            # An engine with no slot free could only queue it (it pulls what it can start):
            # one with a slot comes first, else the one whose queue is shortest for its size.
            full = load // max(card.max_seqs, 1)
            key = (full, score, load, zlib.crc32(f"{request.request_id}/{e}".encode()))
            if best is None or key < best:
                best, pick = key, Choice(e, cached, score)
        return pick
