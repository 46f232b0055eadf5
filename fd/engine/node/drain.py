"""An engine's drain (DESIGN.md §1; ``type=drain engine=<id>``, or SIGTERM in ``fd engine``):
claim nothing new, hand back what never started at once, let running requests finish for
``drain_timeout_s``, then hand back the rest, and exit.

The engine core asks :meth:`Draining.due` between steps, with no step in flight, and aborts what
it names silently (its blocks come back at once); :meth:`Draining.hand_back` then writes each one's
``preempted handback=1`` note and re-queues it on ``P:requests``, where whichever engine claims
it continues it from the tokens on its stream.
"""

from __future__ import annotations

import logging
import time

from fd.control.bus import Bus
from fd.control.events import Preempted, Request
from fd.engine.core.protocol import SchedulerLike
from fd.engine.node import failover
from fd.engine.node.publisher import Publisher
from fd.engine.node.redis_link import RedisLink
from fd.engine.node.request_table import Live, RequestTable

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class Draining:
    def __init__(
        self,
        engine_id: str,
        bus: Bus,
        link: RedisLink,
        sched: SchedulerLike,
        requests: RequestTable,
        publisher: Publisher,
        timeout_s: float,
    ) -> None:
        self.engine_id = engine_id
        self.bus = bus
        self.link = link
        self.sched = sched
        self.requests = requests
        self.publisher = publisher
        self.timeout_s = timeout_s
        self.active = False
        self.handed_back = 0  # requests re-queued for another engine
        self._deadline: float | None = None
        #: what the step hands back now: each one's record and owner token (the step that hands
        #: them back ends their records)
        self._due: dict[str, tuple[Live | None, str | None]] = {}

    def start(self) -> bool:
        """True if this starts it (a second drain event changes nothing)."""
        if self.active:
            return False
        log.info("draining", extra={"engine": self.engine_id})
        self.active = True
        return True

    def due(self) -> list[str]:
        """Between steps (nothing in flight): what to hand back now — what waits at once, and
        everything once the drain timeout is up."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.timeout_s
            rids = list(self.sched.snapshot()["waiting"])
        elif now >= self._deadline and self.sched.has_work():
            snap = self.sched.snapshot()
            rids = list(snap["running"]) + list(snap["waiting"])
        else:
            return []
        requests = self.requests
        self._due = {
            rid: (requests.get(rid), requests.tokens.get(rid)) for rid in rids if not requests.silent(rid)
        }
        return list(self._due)

    async def hand_back(self, released: dict[str, int]) -> None:
        """Requests the step handed back (``released``: the blocks each gave back): a
        ``preempted handback=1`` note on each story, then each re-queued on ``P:requests``."""
        back: list[tuple[str, bytes, Request, str]] = []
        due, self._due = self._due, {}
        for rid, count in released.items():
            live, token = due[rid]
            if live is None:
                continue
            self.publisher.put(
                self.bus.keys.req(rid),
                Preempted(
                    request_id=rid,
                    count=count,
                    engine=self.engine_id,
                    step=self.sched.step,
                    handback=True,
                    ts=int(time.time() * 1000),
                ),
            )
            if token is not None:
                back.append((rid, live.entry, live.request, token))
        await self.publisher.flush()  # the notes (and every token before them) first
        self.handed_back += await failover.hand_back(self.bus, self.link, self.engine_id, back)
