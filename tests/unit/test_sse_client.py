"""bench/sse_client.py, the benchmarks' streaming client: a chunked SSE response, however
the bytes are split, gives the frames in order, and an error response its status and body."""

from __future__ import annotations

import asyncio
import random

from bench.sse_client import _Exchange


def _chunked(body: bytes, sizes) -> bytes:
    out, i = b"", 0
    for n in sizes:
        part = body[i : i + n]
        if not part:
            break
        out += b"%x\r\n" % len(part) + part + b"\r\n"
        i += n
    if i < len(body):
        out += b"%x\r\n" % (len(body) - i) + body[i:] + b"\r\n"
    return out + b"0\r\n\r\n"


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name):
        return None

    def close(self) -> None:
        self.closed = True


async def test_frames_come_out_in_order_however_the_bytes_are_split():
    frames = [(b"1-0", b'{"n": 1}'), (b"1-1", b'{"n": 2}'), (None, b"[DONE]")]
    body = b"".join((b"id: " + i + b"\n" if i else b"") + b"data: " + d + b"\n\n" for i, d in frames)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    rng = random.Random(0)
    for _ in range(50):
        wire = head + _chunked(body, [rng.randint(1, 9) for _ in range(40)])
        seen: list = []
        ex = _Exchange(
            b"POST / HTTP/1.1\r\n\r\n", lambda i, d, seen=seen: seen.append((i, d)) or d == b"[DONE]"
        )
        tr = _Transport()
        ex.connection_made(tr)
        at = 0
        while at < len(wire) and not ex.done.done():
            n = rng.randint(1, 7)
            ex.data_received(wire[at : at + n])
            at += n
        assert seen == frames and ex.done.done() and tr.closed
        assert tr.written == b"POST / HTTP/1.1\r\n\r\n"


async def test_an_error_response_keeps_its_status_and_body():
    ex = _Exchange(b"", lambda i, d: False)
    ex.connection_made(_Transport())
    ex.data_received(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 22\r\n\r\n")
    ex.data_received(b'{"error": {"code": 1}}')
    ex.connection_lost(None)
    assert ex.status == 400 and bytes(ex.body) == b'{"error": {"code": 1}}'
    assert (await asyncio.wait_for(ex.done, 1)) is None


async def test_a_kept_alive_connection_carries_one_exchange_after_another():
    """A response's end (its last chunk, whose CRLF may come with the next response's head)
    ends the exchange without closing the connection; the next request goes down it."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    def response(n: int) -> bytes:
        body = b'data: {"n": %d}\n\ndata: [DONE]\n\n' % n
        return head + _chunked(body, [5, 11])

    def on(seen):
        return lambda i, d: seen.append(d) or ("done" if d == b"[DONE]" else None)

    first: list = []
    ex = _Exchange(b"GET /1\r\n\r\n", on(first), keep_alive=True)
    tr = _Transport()
    ex.connection_made(tr)
    one = response(1)
    ex.data_received(one[:-2])  # all but the last chunk's CRLF
    assert ex.done.done() and first == [b'{"n": 1}', b"[DONE]"] and not tr.closed
    second: list = []
    ex.again(b"GET /2\r\n\r\n", on(second))
    assert not ex.done.done()
    for b in one[-2:] + response(2):  # the CRLF, then the next response, a byte at a time
        ex.data_received(bytes([b]))
    assert ex.done.done() and second == [b'{"n": 2}', b"[DONE]"] and not tr.closed
    assert ex.status == 200 and tr.written == b"GET /1\r\n\r\nGET /2\r\n\r\n"


async def test_a_kept_alive_client_hanging_up_closes_the_connection():
    ex = _Exchange(b"", lambda i, d: "hang_up", keep_alive=True)
    tr = _Transport()
    ex.connection_made(tr)
    ex.data_received(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b'data: {"n": 1}\n\n', [100])[:-5]
    )
    assert ex.done.done() and tr.closed
