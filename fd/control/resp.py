"""RESP2, the Redis wire protocol, as far as the embedded server's TCP door speaks it.

:class:`RequestReader` takes the bytes a client sends (arrays of bulk strings, as every client
library and ``redis-cli`` send commands, or an inline command typed into ``telnet``) and yields
each whole command; :func:`encode_reply` writes what a redis-py client of the server returned
(with its response callbacks off) back as the server would have: status replies as simple
strings, errors with their error code, bytes as bulk strings, numbers, nulls and arrays.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis.connection import DefaultParser
from redis.exceptions import ResponseError

#: Replies a Redis gives as simple strings; any other bytes go out as a bulk string.
_STATUS = frozenset({b"OK", b"QUEUED", b"PONG", b"RESET"})

#: redis-py takes an error's code off its message for these classes; put back on the way out.
_CODES = {cls: code for code, cls in DefaultParser.EXCEPTION_CLASSES.items() if isinstance(cls, type)}

#: The longest request line or bulk string header taken before the client is told off.
_MAX_LINE = 64 * 1024


class ProtocolError(ValueError):
    """The client sent something that is not RESP."""


class RequestReader:
    """Whole commands out of a client's bytes, however they were split into reads."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def requests(self) -> Iterator[list[bytes]]:
        while True:
            got = self._one()
            if got is None:
                return
            yield got

    def _one(self) -> list[bytes] | None:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) > _MAX_LINE:
                raise ProtocolError("request line too long")
            return None
        if buf[:1] != b"*":  # an inline command: words on one line
            line = bytes(buf[:end])
            del buf[: end + 2]
            return line.split()
        n = _int(buf[1:end])
        at = end + 2
        args: list[bytes] = []
        for _ in range(n):
            end = buf.find(b"\r\n", at)
            if end < 0:
                return None
            if buf[at : at + 1] != b"$":
                raise ProtocolError("expected a bulk string")
            size = _int(buf[at + 1 : end])
            start, stop = end + 2, end + 2 + size
            if len(buf) < stop + 2:
                return None
            args.append(bytes(buf[start:stop]))
            at = stop + 2
        del buf[:at]
        return args


def _int(raw: bytes | bytearray) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ProtocolError(f"not a length: {bytes(raw)[:20]!r}") from None


def error_line(e: Exception) -> bytes:
    """``-CODE message``: the code redis-py took off, or ``ERR`` where the message has none."""
    message = str(e).replace("\r", " ").replace("\n", " ")
    code = _CODES.get(type(e))
    if code is not None and code != "ERR":
        return f"-{code} {message}\r\n".encode()
    first = message.split(" ", 1)[0]
    if first.isupper() and first.isalpha():  # WRONGTYPE, BUSYGROUP, NOGROUP, ...
        return f"-{message}\r\n".encode()
    return f"-ERR {message}\r\n".encode()


def encode_reply(value: Any, protocol: int = 2, status: bool = True) -> bytes:
    """``value`` as RESP2 or RESP3 (``protocol``, as the connection's ``HELLO`` chose);
    ``status=False``: bytes go out as a bulk string whatever they say."""
    resp3 = protocol == 3
    if value is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    if isinstance(value, Exception):
        return error_line(value if isinstance(value, ResponseError) else ResponseError(str(value)))
    if isinstance(value, bool):
        if resp3:
            return b"#t\r\n" if value else b"#f\r\n"
        return b":1\r\n" if value else b":0\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, float):
        if resp3:
            return b",%s\r\n" % repr(value).encode()
        value = repr(value).encode()
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, (bytes, bytearray)):
        if status and value in _STATUS:
            return b"+" + bytes(value) + b"\r\n"
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, dict):
        items = [x for pair in value.items() for x in pair]
        head = b"%%%d\r\n" % len(value) if resp3 else b"*%d\r\n" % len(items)
        return head + b"".join(encode_reply(v, protocol, status=False) for v in items)
    if isinstance(value, (set, frozenset)):
        head = b"~%d\r\n" if resp3 else b"*%d\r\n"
        return head % len(value) + b"".join(encode_reply(v, protocol, status=False) for v in value)
    if isinstance(value, (list, tuple)):
        return b"*%d\r\n" % len(value) + b"".join(encode_reply(v, protocol, status=False) for v in value)
    raise TypeError(f"cannot encode a reply of type {type(value).__name__}")
