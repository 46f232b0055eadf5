"""Requests aiohttp cannot parse (a body that does not decompress, a request line or header
over the limit): answered 400, and logged as one line each, without a traceback."""

from __future__ import annotations

import asyncio
import logging

import orjson

from fd.api.config import ApiConfig
from fd.compose import start_api


async def _raw(port: int, data: bytes) -> tuple[bytes, bytes]:
    """Send ``data`` as it is; the status line and the body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def _aiohttp_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("aiohttp")]


async def test_malformed_requests_are_400_and_one_log_line(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, caplog
):
    api = await start_api(
        embedded_redis.client, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
    )
    caplog.set_level(logging.INFO)
    try:
        junk = b"\x1f\x8b\x08\x00 this is not gzip at all"
        status, body = await _raw(
            api.port,
            (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(junk)
            )
            + junk,
        )
        assert status.split()[1] == b"400"
        assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
        await asyncio.sleep(0.2)  # (aiohttp logs after the answer, as it drains the body)
        [gz] = _aiohttp_records(caplog)
        assert gz.levelno == logging.WARNING and gz.exc_info is None
        assert "content-encoding: gzip" in gz.getMessage() and "\n" not in gz.getMessage()
        caplog.clear()

        status, _ = await _raw(
            api.port,
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\nConnection: close\r\n\r\n",
        )
        assert status.split()[1] == b"400"
        status, _ = await _raw(
            api.port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert status.split()[1] == b"400"
        await asyncio.sleep(0.2)
        records = _aiohttp_records(caplog)
        assert len(records) == 2
        for r in records:
            assert r.levelno == logging.WARNING and r.exc_info is None
            assert r.getMessage().startswith("malformed request from 127.0.0.1 answered 400: Got more than")
        assert "Traceback" not in caplog.text
    finally:
        await api.stop()
