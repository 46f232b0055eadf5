"""Where the engine node's writes to Redis wait, and how they go out: the events for the
requests' stories and the engine's journal, the ``P:requests`` acks and the TTLs that go
with a request's final, all in one pipelined, fenced batch a flush.

Why one batch, in order: a request's ack and its parent's expiries must land only if its
events got through the fence (fd/control/fence.py), and the journal/replay reads the events in
the order they were made. Both the step loop and the control loop flush (an abort noted
mid-step is published at once, not after the step); a lock keeps the batches in the order
they were made, since two pipelines on two pooled connections could otherwise overtake each
other. A batch whose connection drops is sent again exactly once (:mod:`fd.engine.node.outbox`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from fd.control.bus import Bus
from fd.control.events import Event
from fd.control.fence import Refused
from fd.engine.journal.journal import JournalRecorder
from fd.engine.node.outbox import unwritten
from fd.engine.node.redis_link import RETRYABLE, RedisLink, Stopped
from fd.engine.node.request_table import RequestTable

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class Publisher:
    def __init__(
        self,
        bus: Bus,
        engine_id: str,
        requests: RequestTable,
        link: RedisLink,
        lose: Callable[[str, Refused], None],
        journal: JournalRecorder | None = None,
    ) -> None:
        self.bus = bus
        self.engine_id = engine_id
        self.requests = requests  # the owner tokens the fence checks, and whose go when
        self.link = link
        self.lose = lose  # a request whose events the fence refused: the node drops it
        self.journal = journal
        self._outbox: list[tuple[str, Event]] = []
        # (request id, key) and (request id, P:requests entry): done only if the request's
        # events got through the fence
        self._expire: list[tuple[str, str]] = []
        self._ack: list[tuple[str, bytes]] = []
        # Requests whose final is in the outbox: their tokens go once that flush is done.
        self._ended: list[str] = []
        # Each request's last event on its story, as written: the fence checks that nothing of
        # the story went missing since (fd/control/fence.py's gap).
        self._last: dict[str, Mapping[str, str]] = {}
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ queueing

    def put(self, stream: str, ev: Event) -> None:
        """Queue an event, its ``ts`` already fixed (:mod:`fd.engine.node.outbox` compares on it)."""
        self._outbox.append((stream, ev))

    def ack(self, rid: str, entry: bytes) -> None:
        """Acknowledge (and delete) a ``P:requests`` entry with the request's next events."""
        self._ack.append((rid, entry))

    def expire(self, rid: str, key: str) -> None:
        """Give ``key`` the finished-story TTL with the request's next events."""
        self._expire.append((rid, key))

    def ended(self, rid: str) -> None:
        """The request's final is queued: its owner token goes once it is out."""
        self._ended.append(rid)

    def _note_last(self, items: list[tuple[str, Event]], refused: Mapping[str, Refused]) -> None:
        keys = self.bus.keys
        for stream, ev in items:
            rid = getattr(ev, "request_id", None)
            if rid is not None and rid not in refused and stream == keys.req(rid):
                self._last[rid] = ev.encode()

    # ------------------------------------------------------------------ flushing

    async def flush(self) -> None:
        """Publish everything queued (and the journal's entry for the steps since the last
        flush), in one batch; raises :class:`Stopped` if Redis is away while stopping."""
        async with self._lock:
            if self.journal is not None:
                entry = self.journal.drain()
                if entry is not None:
                    self._outbox.append(
                        (self.bus.keys.journal(self.engine_id), replace(entry, ts=int(time.time() * 1000)))
                    )
            if not self._outbox and not self._ack:
                return
            items, self._outbox = self._outbox, []
            expire, self._expire = self._expire, []
            ack, self._ack = self._ack, []
            done, self._ended = self._ended, []
            announced = set(self.requests.unannounced)  # (their `claimed` is among the items)
            await self._publish(items, expire, ack)
            self.requests.release(done)  # their finals are out (or refused)
            for rid in done:
                self._last.pop(rid, None)
            if announced:
                self.requests.unannounced -= announced

    async def _publish(
        self, items: list[tuple[str, Event]], expire: list[tuple[str, str]], ack: list[tuple[str, bytes]]
    ) -> None:
        """One pipelined batch, exactly once: after a failure only what is not on its stream
        yet is sent again (:mod:`fd.engine.node.outbox`). Nothing else is published meanwhile (the
        lock), so the order of events is kept across an outage. Every event on a request's
        story goes through the fence: a request whose events it refuses is dropped
        (``lose``)."""
        link = self.link
        backoff = link.backoff_s
        failed = False
        made = items
        while True:
            try:
                if failed:
                    items = await unwritten(self.bus, items)
                refused = await self.bus.publish_owned(
                    items, self.requests.tokens, expire=expire, ack=ack, last=self._last
                )
                link.ok()
                if failed:  # (what had landed before the failure is not in items any more)
                    self._note_last(made, refused)
                for rid, why in refused.items():
                    self._last.pop(rid, None)  # (a gap's final goes with nothing to check)
                    self.lose(rid, why)
                return
            except RETRYABLE as e:
                failed = True
                link.failed("publish", e)
                if link.stopping():
                    log.error(
                        "stopping with %d events unpublished", len(items), extra={"engine": self.engine_id}
                    )
                    raise Stopped("publish") from e
                backoff = await link.pause(backoff)
