"""What a client sees at the HTTP layer's edges (issue #43): the answers aiohttp makes before
any handler runs have OpenAI's error shape; a connection that never finishes its request head
is closed (while streams and idle kept-alive connections are not); and an abort that waits
names a request that had finished on its own under its finish reason, not as aborted."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
import pytest

from fd.api.config import ApiConfig
from fd.compose import join_in_process, start_api, start_engine
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.timed_runner import TimedRunner

HEAD_S = 1.0  # the server's --header-timeout here
STEP_MS = 20  # each engine step lasts this long (the timed runner): streams take their time


@pytest.fixture
async def api(embedded_redis, keys, tiny_model_dir, tiny_tokenizer):
    """``fd serve`` in this process on the embedded store, with a short header timeout and an
    engine whose steps last STEP_MS (no model: tokens come from the timed runner)."""
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="edges0"),
        runner=TimedRunner.for_tokenizer(tiny_tokenizer, step_ms=STEP_MS, num_blocks=512),
        tokenizer=tiny_tokenizer,
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), header_timeout_s=HEAD_S),
        tokenizer=tiny_tokenizer,
    )
    join_in_process(api, eng)
    yield api
    await api.stop()
    await eng.stop()


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


async def _send(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """``data`` as it is, on a connection of its own; the answer, read to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return _parse(await asyncio.wait_for(reader.read(), 10))
    finally:
        writer.close()


def _assert_openai_error(answer: tuple[int, dict[str, str], bytes], code: str | None = None) -> None:
    status, headers, body = answer
    assert 400 <= status < 500, answer
    assert headers["content-type"].split(";")[0] == "application/json", answer
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] is None
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code


async def test_an_oversized_header_is_an_openai_error(api):
    big_header = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    answer = await _send(api.port, big_header)
    assert answer[0] in (400, 431)
    _assert_openai_error(answer, "header_too_large")
    _assert_openai_error(await _send(api.port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"))
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
    _assert_openai_error(await _send(api.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))


async def test_a_malformed_request_line_is_an_openai_error(api):
    for line in (b"GARBAGE", b"GET /v1/models HTTP/9.9", b"GET /v1/models HTTX/1.1", b"\x16\x03\x01\x00"):
        answer = await _send(api.port, line + b"\r\nHost: x\r\n\r\n")
        assert answer[0] == 400, (line, answer)
        _assert_openai_error(answer, "malformed_request")


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends before it closes the connection (waited for 10 header timeouts)."""
    try:
        return await asyncio.wait_for(reader.read(), 10 * HEAD_S)
    except ConnectionResetError:  # (a byte sent after the server's close)
        return b""


async def _half_head(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
        return await _closed(reader)
    finally:
        writer.close()


async def _silent(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await _closed(reader)
    finally:
        writer.close()


async def _trickled_head(port: int) -> bytes:
    """A head that grows by a header every quarter of the timeout and never ends."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            while True:
                await asyncio.sleep(HEAD_S / 4)
                writer.write(b"X-Slow: a\r\n")
                await writer.drain()

    task = asyncio.create_task(trickle())
    try:
        return await _closed(reader)
    finally:
        task.cancel()
        writer.close()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status, headers, _ = _parse(head)
    return status, headers, await reader.readexactly(int(headers["content-length"]))


async def _kept_alive_across_idle(port: int) -> list[int]:
    """Two requests on one connection, idle for three header timeouts between them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        writer.write(request)
        first = await _read_answer(reader)
        await asyncio.sleep(3 * HEAD_S)
        writer.write(request)
        second = await _read_answer(reader)
        return [first[0], second[0]]
    finally:
        writer.close()


def _completion(api, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": api.cfg.model_name,
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(api, max_tokens: int) -> tuple[float, list[dict]]:
    """A streamed completion: how long it took, and its chunks."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    chunks = []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{api.url}/v1/completions", json=_completion(api, max_tokens, True)) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(orjson.loads(line[6:]))
    return loop.time() - t0, chunks


async def test_a_half_sent_head_is_closed_and_nothing_else(api):
    """Connections that never finish a head are closed within the timeout (however the head
    dribbles in); meanwhile a stream that outlasts the timeout runs to its end, and a
    kept-alive connection idle for longer than it still serves its next request."""
    half, silent, trickled, kept, (took, chunks) = await asyncio.gather(
        _half_head(api.port),
        _silent(api.port),
        _trickled_head(api.port),
        _kept_alive_across_idle(api.port),
        _stream(api, 150),
    )
    assert half == silent == trickled == b""
    assert kept == [200, 200]
    assert took > 2 * HEAD_S  # (150 steps of STEP_MS: the stream outlived the timeout)
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 100
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_abort_wait_lists_a_finished_request_under_its_finish_reason(api):
    async with aiohttp.ClientSession() as session:
        done = await session.post(
            f"{api.url}/v1/completions",
            headers={"X-Request-Id": "done-by-length"},
            json=_completion(api, 3),
        )
        assert (await done.json())["choices"][0]["finish_reason"] == "length"
        async with session.post(
            f"{api.url}/v1/completions",
            headers={"X-Request-Id": "long-one"},
            json=_completion(api, 1000, stream=True),
        ) as stream:
            assert stream.status == 200
            line = b""
            while not line.startswith(b"data: "):  # (it runs: its first token is out)
                line = await asyncio.wait_for(stream.content.readline(), 10)
            resp = await session.post(
                f"{api.url}/v1/abort_requests?wait=5",
                json={"request_ids": ["done-by-length", "long-one", "ghost"]},
            )
            assert resp.status == 200
            answer = await resp.json()
            rest = await asyncio.wait_for(stream.content.read(), 10)
    assert [a["request_id"] for a in answer["aborted"]] == ["long-one"]
    assert answer["aborted"][0]["output_token_count"] >= 1
    assert answer["finished"] == {"length": [{"request_id": "done-by-length", "output_token_count": 3}]}
    assert answer["not_found"] == ["ghost"]
    assert b'"finish_reason":"abort"' in rest.replace(b" ", b"")
