"""Publishing the engine's events exactly once across a lost connection.

A pipeline whose connection drops may or may not have been applied, in whole or in part (Redis
runs commands as they arrive, so what was applied is a prefix of the pipeline, and per stream
a prefix of that stream's events). Re-sending it all would repeat tokens on a client's stream;
dropping it would lose them. So after a failure the engine asks each stream for its tail and
re-sends only what is not there. Every event in the outbox has its ``ts`` fixed when it was
made, so an event already written compares equal, field for field, to the one about to be
re-sent; two different events never do (they differ in step, tokens, type or ts).

This is why the engine's Redis client must not retry pipelines by itself (fd.compose turns the
client's own retries off): a silent re-send is exactly the duplicate this module prevents.
"""

from __future__ import annotations

from collections.abc import Sequence

from fd.control.bus import Bus
from fd.control.events import Event


async def unwritten(bus: Bus, items: Sequence[tuple[str, Event]]) -> list[tuple[str, Event]]:
    """The items not yet on their streams, in order."""
    per: dict[str, list[int]] = {}
    for i, (stream, _) in enumerate(items):
        per.setdefault(stream, []).append(i)
    tails = await bus.tails({stream: len(idx) for stream, idx in per.items()})
    written: set[int] = set()
    for stream, idx in per.items():
        tail = tails[stream]  # oldest first
        mine = [items[i][1].encode() for i in idx]
        # the longest prefix of ours that the stream ends with
        for k in range(min(len(mine), len(tail)), 0, -1):
            if tail[len(tail) - k :] == mine[:k]:
                written.update(idx[:k])
                break
    return [it for i, it in enumerate(items) if i not in written]
