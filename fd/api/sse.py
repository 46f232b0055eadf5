"""Server-sent events framing.

Each frame carries the Redis entry id of the event it renders as its ``id:``, so a client that
reconnects with ``Last-Event-ID`` resumes exactly after what it saw, from any API replica.
Frames without an id (``[DONE]``, comments) leave the client's last id where it was.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def frame(data: Any, event_id: bytes | str | None = None, event: str | None = None) -> bytes:
    """One ``data:`` event; ``data`` is JSON-encoded unless already bytes/str. ``event``: its
    type, on an ``event:`` line (the Responses API's frames say theirs)."""
    if isinstance(data, str):
        payload = data.encode()
    elif isinstance(data, bytes):
        payload = data
    else:
        payload = orjson.dumps(data)
    head = b""
    if event_id is not None:
        eid = event_id if isinstance(event_id, bytes) else event_id.encode()
        head = b"id: " + _one_line(eid) + b"\n"
    if event is not None:
        head += b"event: " + _one_line(event.encode()) + b"\n"
    # JSON never contains a raw newline; a str payload might, and each line needs its prefix.
    body = b"".join(b"data: " + line + b"\n" for line in payload.split(b"\n"))
    return head + body + b"\n"


def json_frame(payload: bytes, event_id: bytes | str | None) -> bytes:
    """:func:`frame` of an already serialised JSON value (one line: JSON has no raw newline)."""
    if event_id is None:
        return b"data: " + payload + b"\n\n"
    eid = event_id if isinstance(event_id, bytes) else event_id.encode()
    return b"id: " + _one_line(eid) + b"\ndata: " + payload + b"\n\n"


def comment(text: str = "") -> bytes:
    """A comment line: ignored by clients, keeps idle proxies from closing the connection."""
    return b": " + _one_line(text.encode()) + b"\n\n"


def _one_line(b: bytes) -> bytes:
    return b.replace(b"\r", b" ").replace(b"\n", b" ")
