"""A lean streaming client for the benchmarks: one HTTP/1.1 request per connection, on an
asyncio protocol, with the SSE parsed as bytes arrive.

Why not aiohttp's client: on this project's two-core machines the load generator shares the
cores with the server it measures. aiohttp's client spends ~0.2 ms of CPU opening each
connection and more reading each chunk, so with 32 requests sent at once the last request
body reached ``fd serve`` 8–9 ms after the first was "sent", and all of that counted as the
server's TTFT (the in-process baseline has no client at all). This client does the same
exchange (a new connection, a POST, chunked SSE read to ``[DONE]`` or a hang-up) at a
fraction of the cost, so what the benchmark shows is the server's. ``--client aiohttp``
keeps the old client for comparison.

Understands what ``fd serve`` (and any OpenAI-compatible server) sends back: a status line,
headers, then a chunked, a ``Content-Length`` or a close-delimited body.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable

import orjson


class _Exchange(asyncio.Protocol):
    """One request and its streamed response. ``on_frame(id, data)`` gets each SSE frame's
    last ``id:`` and its ``data:`` payload; the exchange ends at ``[DONE]``, at the end of the
    body, or when the connection goes."""

    def __init__(
        self, request: bytes, on_frame: Callable[[bytes | None, bytes], str | None], keep_alive: bool = False
    ) -> None:
        self.keep_alive = keep_alive
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._reset(request, on_frame)

    def _reset(self, request: bytes, on_frame) -> None:
        self.request = request
        self.on_frame = on_frame
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._read_on = True  # False once [DONE] came on a kept-alive connection
        self.status = 0
        self.body = bytearray()  # a non-200 response's body (its error message)
        self._head = bytearray()
        self._in_body = False
        self._chunked = False
        self._left = -1  # bytes left of the current chunk / Content-Length body; -1: unknown
        self._raw = bytearray()  # undecoded body bytes (chunk framing)
        self._sse = bytearray()  # decoded body not yet split into frames

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def again(self, request: bytes, on_frame) -> None:
        """The next exchange on this kept-alive connection."""
        self._reset(request, on_frame)
        self.transport.write(request)

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self._sse:
            self._frames(final=True)
        if not self.done.done():
            self.done.set_result(exc)

    def finish(self) -> None:
        """Hang up (or stop after ``[DONE]``): close the connection, end the exchange. The
        FIN leaves now, not when this loop next gets to the transport's close (with 128
        streams to read that was up to milliseconds later, and the hang-up's time is taken
        here)."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):  # (already gone)
                    sock.shutdown(socket.SHUT_RDWR)
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head += data
            while self._head[:2] == b"\r\n":  # the end of the last body, kept alive
                del self._head[:2]
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = bytes(self._head[:end]), bytes(self._head[end + 4 :])
            lines = head.split(b"\r\n")
            self.status = int(lines[0].split()[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._chunked = True
                elif name == b"content-length":
                    self._left = int(value)
            self._in_body = True
            if self._chunked:
                self._left = -1
        if self._chunked:
            self._raw += data
            self._dechunk()
        else:
            self._body(data)
            if self._left >= 0:  # a Content-Length body: ends with its last byte
                self._left -= len(data)
                if self._left <= 0:
                    self.finish()

    def _dechunk(self) -> None:
        raw = self._raw
        while raw:
            if self._left < 0:  # at a chunk's size line
                eol = raw.find(b"\r\n")
                if eol < 0:
                    return
                size = int(bytes(raw[:eol]).split(b";")[0], 16)
                del raw[: eol + 2]
                if size == 0:
                    if self.keep_alive:  # what comes next (the CRLF) is before the next head
                        self._in_body = False
                        self._head = raw[:]
                        if not self.done.done():
                            self.done.set_result(None)
                    else:
                        self.finish()
                    return
                self._left = size
            take = min(self._left, len(raw))
            self._body(bytes(raw[:take]))
            del raw[:take]
            self._left -= take
            if self._left == 0:
                if len(raw) < 2:
                    self._left = 0
                    return
                del raw[:2]  # the chunk's CRLF
                self._left = -1
            if self.done.done():
                return

    def _body(self, data: bytes) -> None:
        if self.status != 200:
            self.body += data
            return
        self._sse += data
        self._frames()

    def _frames(self, final: bool = False) -> None:
        buf = self._sse
        while not self.done.done() and self._read_on:
            end = buf.find(b"\n\n")
            if end < 0:
                if not final or not buf:
                    return
                end = len(buf)
            frame = bytes(buf[:end])
            del buf[: end + 2]
            eid = None
            payload = None
            for line in frame.split(b"\n"):
                if line.startswith(b"id:"):
                    eid = line[3:].strip()
                elif line.startswith(b"data:"):
                    payload = line[5:].strip()
            if payload is None:
                continue
            took = self.on_frame(eid, payload)
            if took == "done" and self.keep_alive:
                self._read_on = False  # the body's last chunk ends the exchange
            elif took:
                self.finish()


class Pool:
    """Kept-alive connections to one server, as an HTTP client with a connection pool (the
    ``openai`` client's httpx) holds them: an exchange takes an idle one or opens one, and
    gives it back when the response has ended."""

    def __init__(self) -> None:
        self.idle: list[_Exchange] = []


async def stream_completion_lean(
    base: str,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    hang_up_after: int | None = None,
    model: str | None = None,
    result_type=None,
    pool: Pool | None = None,
):
    """The same exchange and result as ``bench._common.stream_completion`` (which it stands in
    for), on a connection of its own, or on one of ``pool``'s."""
    from bench._common import StreamResult, take_payload

    res = (result_type or StreamResult)(rid)
    hostport = base.split("://", 1)[1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if model:
        body["model"] = model
    payload = orjson.dumps(body)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: "
        + hostport.encode()
        + b"\r\nContent-Type: application/json\r\nX-Request-Id: "
        + rid.encode()
        + (b"" if pool is not None else b"\r\nConnection: close")
        + b"\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )

    def on_frame(eid: bytes | None, data: bytes) -> str | None:
        now = time.perf_counter()
        if eid is not None:
            res.last_event_id = eid.decode()
        return take_payload(res, data, now, hang_up_after)

    loop = asyncio.get_running_loop()
    res.t_send = time.perf_counter()
    ex = None
    while pool is not None and pool.idle:
        ex = pool.idle.pop()
        if not ex.lost:
            ex.again(request, on_frame)
            break
        ex = None
    try:
        if ex is None:
            _, ex = await loop.create_connection(
                lambda: _Exchange(request, on_frame, keep_alive=pool is not None), host, int(port)
            )
        exc = await ex.done
    except OSError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if ex.status != 200:
        res.error = f"HTTP {ex.status}: {bytes(ex.body)[:200].decode(errors='replace')}"
    elif exc is not None and res.t_close is None and res.finish_reason is None:
        res.error = f"connection lost: {exc}"
    elif pool is not None and not ex.lost and res.t_close is None:
        pool.idle.append(ex)
    return res
