"""Reading an engine journal: from Redis (``P:journal:<engine>``) or from a JSONL file, and
into its segments (one per JournalStart: an engine restarted under the same id).

The JSONL form is the journal's wire fields, one event a line, with nested JSON left as
JSON so that a person can read it; ``fd events export`` writes the same shape.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import orjson

from fd.control.bad_event import BadEvent
from fd.control.bus import Bus
from fd.control.events import Event, JournalStart, JournalStep, decode

# (``fd replay``'s logger: a journal entry that does not decode is its finding)
log = logging.getLogger("fd.engine.journal.replay")


async def read_journal(bus: Bus, key: str, page: int = 1000) -> list[tuple[str, Event]]:
    """``(entry id, event)`` of every journal event on ``key``, oldest first; an entry that
    does not decode is logged and left out."""
    out: list[tuple[str, Event]] = []
    start = "-"
    while True:
        rows = await bus.journal_page(key, start, page)
        for entry_id, fields in rows:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                ev = decode(fields, eid)
            except BadEvent as e:  # the seq gap it leaves is reported by the replay
                log.warning("journal entry %s of %s does not decode: %s", eid, key, e)
                continue
            if isinstance(ev, (JournalStart, JournalStep)):
                out.append((eid, ev))
        if len(rows) < page:
            return out
        start = "(" + (rows[-1][0].decode() if isinstance(rows[-1][0], bytes) else rows[-1][0])


async def load_journal_from_redis(bus: Bus, engine_id: str) -> list[Event]:
    """The whole ``P:journal:<engine_id>`` stream, oldest first."""
    return [ev for _, ev in await read_journal(bus, bus.keys.journal(engine_id))]


async def journal_engines(bus: Bus) -> list[str]:
    """Engine ids that have a journal under the bus's prefix."""
    return await bus.journal_engines()


def jsonl_line(ev: Event, entry_id: str | None = None, stream: str | None = None) -> bytes:
    """One JSONL line of ``ev``: its wire fields, after its entry id and stream when given."""
    fields: dict[str, Any] = ev.encode()
    for name in ("data", "config"):  # nested JSON stays readable instead of an escaped string
        if name in fields:
            fields[name] = orjson.loads(fields[name])
    head = {}
    if stream is not None:
        head["stream"] = stream
    if entry_id is not None:
        head["id"] = entry_id
    return orjson.dumps({**head, **fields}) + b"\n"


def export_jsonl(events: Iterable[Event], path: str | os.PathLike) -> int:
    """Write journal events as JSON lines (one event per line, its wire fields); returns count."""
    n = 0
    with open(path, "wb") as f:
        for ev in events:
            f.write(jsonl_line(ev))
            n += 1
    return n


def load_journal_jsonl(path: str | os.PathLike) -> list[Event]:
    """Events from a JSONL file written by :func:`export_jsonl` or ``fd events export``."""
    out: list[Event] = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = orjson.loads(line)
            entry_id = obj.pop("id", None)
            obj.pop("stream", None)
            fields = {k: (v if isinstance(v, str) else orjson.dumps(v).decode()) for k, v in obj.items()}
            try:
                out.append(decode(fields, entry_id))
            except BadEvent as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    return out


def by_engine(events: Iterable[Event]) -> dict[str, list[Event]]:
    """Journal events by the engine that wrote them (a file may hold several engines' journals)."""
    groups: dict[str, list[Event]] = {}
    for ev in events:
        if isinstance(ev, (JournalStart, JournalStep)):
            groups.setdefault(ev.engine, []).append(ev)
    return groups


def segments(entries: list[Event]) -> tuple[list[tuple[JournalStart, list[JournalStep]]], int]:
    """Split at each JournalStart; also the number of leading steps with no start (trimmed)."""
    segs: list[tuple[JournalStart, list[JournalStep]]] = []
    orphans = 0
    for ev in entries:
        if isinstance(ev, JournalStart):
            segs.append((ev, []))
        elif isinstance(ev, JournalStep):
            if segs:
                segs[-1][1].append(ev)
            else:
                orphans += 1
    return segs, orphans
