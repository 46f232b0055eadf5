"""Dead letters: what a reader does with a stream entry it cannot use.

Nothing that arrives on a stream may crash a reader (DESIGN.md §3). An entry that does not
decode, or that decodes to an event that does not belong on its stream, is copied to
``P:dead`` with a ``reason`` (and the stream and entry id it came from), logged, counted,
and skipped; the reader acks it where a consumer group applies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from fd.control.bad_event import BadEvent
from fd.control.events import Event, RawFields, decode
from fd.control.store import RedisClient

# (the bus's logger: dead letters are written by the bus's readers, and filtered as theirs)
log = logging.getLogger("fd.control.bus")

#: Dead letters keep at most this much of each original field: enough to see what went
#: wrong, without letting an oversize junk entry be copied whole into P:dead.
DEAD_FIELD_KEEP_BYTES = 64 * 1024
_DEAD_RESERVED = (b"reason", b"stream", b"entry_id")
DEAD_SEEN_MAX = 4096


#: The event types a stream allows, and so what its reader gets back
E = TypeVar("E", bound=Event)


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def check_event(
    stream: str | bytes, ev: Event, allowed: tuple[type[E], ...], request_id: str | None = None
) -> E:
    """Reject an event that decoded fine but has no business on this stream."""
    if not isinstance(ev, allowed):
        raise BadEvent(f"event type {ev.TYPE!r} does not belong on {_b(stream).decode()}", "type")
    if request_id is not None:
        own = getattr(ev, "request_id", request_id)
        if own != request_id:
            raise BadEvent(f"event for {own!r} on the stream of {request_id!r}", "request_id")
    return ev


class DeadLetters:
    """One client's writer of ``P:dead``: the letters it wrote, and the entries it wrote them
    for (the last :data:`DEAD_SEEN_MAX`), so an entry read again gets no second letter."""

    def __init__(self, redis: RedisClient, stream: str, maxlen: int):
        self.redis = redis
        self.stream = stream
        self.maxlen = maxlen
        self.count = 0
        #: called once per dead letter written (e.g. a Prometheus counter's ``inc``)
        self.on_write: Callable[[], Any] | None = None
        self._seen: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()

    async def write(
        self, source_stream: str | bytes, entry_id: bytes | str | None, fields: RawFields, reason: str
    ) -> None:
        """Copy a rejected entry to ``P:dead`` with why, and count it."""
        stream = _b(source_stream)
        eid = _b(entry_id) if entry_id is not None else b""
        # Readers without a cursor of their own (read_req) see a bad entry again on every
        # re-read; one dead letter per entry is enough.
        if eid and (stream, eid) in self._seen:
            return
        log.warning(
            "dead letter: %s %s: %s",
            stream.decode(errors="replace"),
            eid.decode(errors="replace") or "-",
            reason,
        )
        out: dict[bytes, bytes] = {b"reason": _b(reason), b"stream": stream, b"entry_id": eid}
        truncated = []
        for k, v in (fields or {}).items():
            name = _b(k) if isinstance(k, (bytes, str)) else str(k).encode()
            value = v if isinstance(v, bytes) else str(v).encode()
            if name in _DEAD_RESERVED or name.startswith(b"orig."):
                name = b"orig." + name
            if len(value) > DEAD_FIELD_KEEP_BYTES:
                value = value[:DEAD_FIELD_KEEP_BYTES]
                truncated.append(name)
            out[name] = value
        if truncated:
            out[b"truncated"] = b",".join(truncated)
        await self.redis.xadd(self.stream, out, maxlen=self.maxlen, approximate=True)
        # Seen only once written: an XADD that failed (Redis stalled, a connection killed)
        # leaves a P:requests entry pending, and whoever claims it back writes the letter then.
        if eid:
            self._seen[(stream, eid)] = None
            if len(self._seen) > DEAD_SEEN_MAX:
                self._seen.popitem(last=False)
        self.count += 1
        if self.on_write is not None:
            self.on_write()

    async def decode_or_dead(
        self,
        stream: str | bytes,
        entry_id: bytes,
        fields: RawFields | None,
        allowed: tuple[type[E], ...],
        request_id: str | None = None,
    ) -> E | None:
        """The entry's event if it belongs on ``stream``; else None, with its dead letter written."""
        if fields is None:  # an entry trimmed or deleted while pending
            await self.write(stream, entry_id, {}, "entry deleted from the stream while pending")
            return None
        try:
            return check_event(stream, decode(fields, entry_id), allowed, request_id)
        except BadEvent as e:
            await self.write(stream, entry_id, fields, str(e))
            return None
