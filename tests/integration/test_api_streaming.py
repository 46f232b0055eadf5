"""The API node against a scripted fake engine: bodies, SSE framing, replay/resume, aborts,
disconnects, health and metrics, as a client and an operator see them.

Most tests use the real redis-server; those taking ``bus`` also run on the embedded server
that ``fd serve`` uses."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fd.api import ApiConfig, make_app
from fd.control.events import Abort, Final, Tokens, decode
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from tests.kit.api import (
    CHAT_BODY,
    WORDS,
    FakeEngine,
    FakeTokenizer,
    control_events,
    parse_sse,
    setup,
    wait_for,
)

EVENT_IDS = {"X-Event-Ids": "1"}  # (a client that will resume asks for the frames' ids)


async def test_chat_non_stream(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT_BODY, headers={"X-Request-Id": "my-req.1"})
        assert resp.status == 200
        body = await resp.json()
        assert resp.headers["X-Request-Id"] == "my-req.1" == body["id"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
        assert choice["finish_reason"] == "stop"
        prompt = len(FakeTokenizer().apply_chat_template(CHAT_BODY["messages"]))
        assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}
        # the same id again is a conflict, not a second request
        resp = await client.post("/v1/chat/completions", json=CHAT_BODY, headers={"X-Request-Id": "my-req.1"})
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "duplicate_request_id"
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 1


async def test_completion_non_stream_generated_id_and_length(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        )
        body = await resp.json()
        assert resp.status == 200, body
        assert body["id"].startswith("cmpl-") and resp.headers["X-Request-Id"] == body["id"]
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == "Hello,"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == 3
        # what reached the engine
        ((_eid, fields),) = await real_bus.redis.xrange(real_bus.keys.requests)
        req = decode(fields)
        assert req.data.prompt_token_ids == (1, 2, 3) and req.data.sampling.max_tokens == 2
        assert req.data.model == "tiny"


async def test_sampling_extras_reach_the_engine_and_are_left_out_when_not_asked_for(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        for rid, extra in (
            (
                "pen1",
                {
                    "presence_penalty": 0.5,
                    "frequency_penalty": -1,
                    "repetition_penalty": 1.2,
                    "logit_bias": {"9": -100, "4": 2.5},
                    "min_p": 0.1,
                    "min_tokens": 1,
                },
            ),
            ("pen0", {"presence_penalty": 0, "frequency_penalty": None, "logit_bias": {}}),
        ):
            resp = await client.post(
                "/v1/completions",
                headers={"X-Request-Id": rid},
                json={"model": "tiny", "prompt": "x", "max_tokens": 2, **extra},
            )
            assert resp.status == 200, await resp.text()
        # (response_format "text" is what every chat answer is anyway)
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT_BODY, "response_format": {"type": "text"}}
        )
        assert resp.status == 200, await resp.text()
        entries = {decode(f).request_id: f for _eid, f in await real_bus.redis.xrange(real_bus.keys.requests)}
        sp = decode(entries["pen1"]).data.sampling
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
        assert (sp.logit_bias, sp.min_p, sp.min_tokens) == (((4, 2.5), (9, -100.0)), 0.1, 1)
        assert decode(entries["pen0"]).data.sampling.plain is True
        # an engine of a release before these still takes a request that uses none of them
        raw = orjson.loads(entries["pen0"][b"data"])
        assert not {
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "min_p",
            "min_tokens",
        } & set(raw["sampling"])


async def test_chat_stream_sse_format(bus):
    async with setup(bus, FakeEngine(bus)) as client:
        resp = await client.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "s1"},
            json={**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"] == "s1"
        events = parse_sse(await resp.read())
        assert events[-1] == (None, "[DONE]")
        chunks = [orjson.loads(d) for _, d in events[:-1]]
        ids = [eid for eid, _ in events[:-1]]
        assert not any(ids) and all(c["id"] == "s1" for c in chunks)  # data: lines only, as OpenAI
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "Hello, world!"
        assert all(
            c["choices"][0]["delta"].get("content", "x") for c in chunks[1:] if c["choices"]
        )  # no empty deltas
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
        assert all(c["usage"] is None for c in chunks[:-1])
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        # asked for, ids are the stream's entry ids, in order
        again = parse_sse(await (await client.get("/v1/requests/s1/stream", headers=EVENT_IDS)).read())
        ids = [eid for eid, _ in again[:-1]]
        entry_ids = [eid.decode() for eid, _ in await bus.redis.xrange(bus.keys.req("s1"))]
        assert all(ids) and set(ids) <= set(entry_ids)
        assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
        assert [d for _, d in again] == [d for _, d in events]


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(real_bus):
    """vLLM's stream_options.continuous_usage_stats; a replay from the stream renders the same."""
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        for path, body in (
            ("/v1/chat/completions", CHAT_BODY),
            ("/v1/completions", {"model": "tiny", "prompt": "hey"}),
        ):
            resp = await client.post(
                path,
                headers={"X-Request-Id": f"cu{len(path)}"},
                json={
                    **body,
                    "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
            )
            original = parse_sse(await resp.read())
            chunks = [orjson.loads(d) for _, d in original[:-1]]
            prompt = chunks[-1]["usage"]["prompt_tokens"]
            assert prompt > 0 and chunks[-1]["choices"] == []
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert counts == sorted(counts) and counts[-1] == 5
            assert all(
                c["usage"] == {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
                for c, n in zip(chunks, counts)
            )
            texts = [
                c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                for c in chunks[:-1]
            ]
            assert "".join(t for t in texts if t) == "Hello, world!"
            # a token a word (WORDS): each chunk counts the tokens up to its own, the third
            # (no text, no chunk) too
            assert [n for t, n in zip(texts, counts) if t] == [1, 2, 4, 5]
            replay = parse_sse(await (await client.get(f"/v1/requests/cu{len(path)}/stream")).read())
            assert replay == original
        # without include_usage it asks for nothing (as in vLLM)
        resp = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hey",
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
        )
        assert all("usage" not in orjson.loads(d) for _, d in parse_sse(await resp.read())[:-1])


async def test_completion_stream_without_usage(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hey", "stream": True})
        events = parse_sse(await resp.read())
        assert events[-1][1] == "[DONE]"
        chunks = [orjson.loads(d) for _, d in events[:-1]]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world!"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert resp.headers["X-Request-Id"] == chunks[0]["id"]


async def test_engine_error_reaches_the_client(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, fail="CUDA out of memory")) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert resp.status == 500
        err = (await resp.json())["error"]
        assert err["message"] == "CUDA out of memory" and err["type"] == "server_error"
        resp = await client.post("/v1/chat/completions", json={**CHAT_BODY, "stream": True})
        events = parse_sse(await resp.read())
        assert events[-1][1] == "[DONE]"
        assert orjson.loads(events[-2][1])["error"]["message"] == "CUDA out of memory"


async def test_replay_and_resume_exactly(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "r1", "X-Event-Ids": "1"},  # (ids to resume from)
            json={**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}},
        )
        original = parse_sse(await resp.read())
        replay = parse_sse(await (await client.get("/v1/requests/r1/stream", headers=EVENT_IDS)).read())
        assert replay == original

        def key(eid):
            return tuple(map(int, eid.split("-")))

        for cut in range(len(original) - 1):  # resume after every id the client could have seen
            last_id = original[cut][0]
            r = await client.get("/v1/requests/r1/stream", headers={"Last-Event-ID": last_id})
            rest = parse_sse(await r.read())
            assert rest == [e for e in original if e[0] is None or key(e[0]) > key(last_id)]
        r = await client.get(f"/v1/requests/r1/stream?last_event_id={original[1][0]}")
        assert parse_sse(await r.read()) == original[2:]
        r = await client.get("/v1/requests/nope/stream")
        assert r.status == 404 and "error" in await r.json()
        r = await client.get("/v1/requests/r1/stream", headers={"Last-Event-ID": "garbage"})
        assert r.status == 400


async def test_replay_follows_a_live_request(real_bus):
    engine = FakeEngine(real_bus, hold=True)
    async with setup(real_bus, engine) as client:
        live = await client.post(
            "/v1/completions",
            headers={"X-Request-Id": "live1"},
            json={"model": "tiny", "prompt": "x", "stream": True, "background": True},
        )
        assert await wait_for(lambda: _has(real_bus, "live1", Tokens, 4))
        watcher = asyncio.create_task(client.get("/v1/requests/live1/stream?include_usage=false"))
        await asyncio.sleep(0.1)
        r = await client.post("/v1/requests/live1/cancel")
        assert r.status == 200 and (await r.json())["accepted"] == ["live1"]
        original = parse_sse(await live.read())
        replay = parse_sse(await (await watcher).read())
        assert replay == original
        assert orjson.loads(original[-2][1])["choices"][0]["finish_reason"] == "abort"


async def _has(bus, rid, cls, n=1):
    return sum(isinstance(ev, cls) for _, ev in await bus.read_req(rid)) >= n


async def test_abort_requests_answers_at_once(real_bus):
    metrics = Metrics()
    async with setup(real_bus, metrics=metrics) as client:  # no engine: nothing to wait on
        ids = [f"req-{i}" for i in range(1000)]
        t0 = time.perf_counter()
        resp = await client.post("/v1/abort_requests", json={"req_ids": ids + ["bad id", "req-1"]})
        elapsed = time.perf_counter() - t0
        body = await resp.json()
        assert resp.status == 200
        assert body["accepted"] == ids
        assert body["rejected"] == [{"request_id": "bad id", "reason": body["rejected"][0]["reason"]}]
        assert body["abort_id"]
        assert elapsed < 0.5
        (ev,) = await control_events(real_bus)
        assert isinstance(ev, Abort) and list(ev.request_ids) == ids
        assert ev.source == "http" and ev.abort_id == body["abort_id"]
        resp = await client.post("/v1/abort_requests", json={"request_ids": ["one"]})
        assert (await resp.json())["accepted"] == ["one"]
        resp = await client.post("/v1/abort_requests", json={"abort_all": True})
        body = await resp.json()
        assert resp.status == 200 and body["abort_all"] is True
        evs = await control_events(real_bus)
        assert [e.TYPE for e in evs] == ["abort", "abort", "abort_all"]


async def test_abort_wait_keeps_old_shape(real_bus):
    engine = FakeEngine(real_bus, hold=True)
    async with setup(real_bus, engine) as client:
        resp = asyncio.create_task(
            client.post(
                "/v1/completions", headers={"X-Request-Id": "w1"}, json={"model": "tiny", "prompt": "x"}
            )
        )
        assert await wait_for(lambda: _has(real_bus, "w1", Tokens, 4))
        r = await client.post("/v1/abort_requests?wait=3", json={"req_ids": ["w1", "ghost"]})
        body = await r.json()
        assert r.status == 200
        assert body == {"aborted": [{"request_id": "w1", "output_token_count": 1}], "not_found": ["ghost"]}
        done = await resp
        assert (await done.json())["choices"][0]["finish_reason"] == "abort"


async def _disconnect_after(client, path: str, body: dict, rid: str, until) -> None:
    """Send a request on a raw socket, wait for ``until()``, then drop the connection."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    payload = orjson.dumps(body)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    assert await wait_for(until)
    writer.close()
    await writer.wait_closed()


async def _disconnect_aborts(bus, rid) -> list:
    return [e for e in await control_events(bus) if isinstance(e, Abort) and rid in e.request_ids]


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_while_queued_aborts_once(bus, stream):
    async with setup(bus) as client:  # no engine: the request stays queued
        rid = f"q-{stream}"
        await _disconnect_after(
            client, "/v1/chat/completions", {**CHAT_BODY, "stream": stream}, rid, lambda: _queued(bus)
        )
        assert await wait_for(lambda: _count(bus, rid, 1))
        await asyncio.sleep(0.2)
        (ev,) = await _disconnect_aborts(bus, rid)
        assert ev.source == "disconnect" and ev.request_ids == (rid,)


async def _queued(bus):
    return await bus.redis.xlen(bus.keys.requests) >= 1


async def _count(bus, rid, n):
    return len(await _disconnect_aborts(bus, rid)) >= n


async def test_disconnect_mid_stream_aborts_once(bus):
    engine = FakeEngine(bus, hold=True)
    async with setup(bus, engine) as client:
        await _disconnect_after(
            client,
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "stream": True},
            "mid1",
            lambda: _has(bus, "mid1", Tokens, 4),
        )
        assert await wait_for(lambda: _has(bus, "mid1", Final))
        await asyncio.sleep(0.2)
        (ev,) = await _disconnect_aborts(bus, "mid1")
        assert ev.source == "disconnect"
        final = [e for _, e in await bus.read_req("mid1") if isinstance(e, Final)]
        assert final[0].finish_reason == "abort"


async def test_background_survives_disconnect(real_bus):
    engine = FakeEngine(real_bus, words=WORDS, delay=0.1)
    async with setup(real_bus, engine) as client:
        await _disconnect_after(
            client,
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "stream": True, "background": True},
            "bg1",
            lambda: _has(real_bus, "bg1", Tokens, 1),
        )
        assert await wait_for(lambda: _has(real_bus, "bg1", Final))
        await asyncio.sleep(0.2)
        assert await _disconnect_aborts(real_bus, "bg1") == []
        # the client comes back and gets the whole answer
        events = parse_sse(await (await client.get("/v1/requests/bg1/stream")).read())
        text = "".join(
            orjson.loads(d)["choices"][0]["text"] for _, d in events[:-1] if orjson.loads(d)["choices"]
        )
        assert text == "Hello, world!"


async def test_no_abort_after_final(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        resp = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "x", "stream": True},
            headers={"X-Request-Id": "fin1"},
        )
        await resp.read()
        resp.close()
        await asyncio.sleep(0.2)
        assert await control_events(real_bus) == []


async def test_health(real_bus):
    async with setup(real_bus) as client:
        resp = await client.get("/health")
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "service_unavailable"
        await real_bus.heartbeat(
            "e1", {"blocks_total": 100, "blocks_free": 40, "running": 2, "waiting": 1}, 10
        )
        resp = await client.get("/health")
        body = await resp.json()
        assert resp.status == 200 and body["status"] == "ok" and "e1" in body["engines"]


async def test_health_503_when_redis_is_down(real_bus):
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.keys import Keys

    dead = connect("redis://127.0.0.1:1")  # nothing listens there
    mux = StreamMux(dead, Keys("x"), "api-dead", block_ms=100)
    app = make_app(
        ApiConfig(model_dir="tiny", max_model_len=64), Bus(dead, Keys("x")), mux, FakeTokenizer(), Metrics()
    )
    # the mux is not started: a dead Redis must not keep the API from answering health checks
    app.on_startup.clear()
    app.on_cleanup.clear()
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/health")
        assert resp.status == 503
        assert "error" in await resp.json()
    await dead.aclose()


async def test_metrics_names_and_engine_gauges(real_bus):
    metrics = Metrics()
    async with setup(real_bus, FakeEngine(real_bus), metrics=metrics) as client:
        await (await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})).read()
        await real_bus.heartbeat(
            "e1", {"blocks_total": 100, "blocks_free": 40, "running": 2, "waiting": 1}, 10
        )
        await real_bus.heartbeat(
            "e2", {"blocks_total": 50, "blocks_free": 10, "running": 1, "waiting": 0}, 10
        )
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = (await resp.read()).decode()
        for name in (
            "fd_requests_total",
            "fd_abort_requests_total",
            "fd_abort_release_seconds",
            "fd_kv_blocks_total",
            "fd_kv_blocks_free",
            "fd_num_requests_running",
            "fd_num_requests_waiting",
            "fd_time_to_first_token_seconds",
            "fd_inter_token_latency_seconds",
            "fd_e2e_request_latency_seconds",
            "fd_dead_letters_total",
        ):
            assert name in text, name
        assert 'fd_requests_total{finish_reason="stop"} 1.0' in text
        assert "fd_kv_blocks_total 150.0" in text and "fd_kv_blocks_free 50.0" in text
        assert "fd_num_requests_running 3.0" in text
        assert "fd_time_to_first_token_seconds_count 1.0" in text
        assert "fd_inter_token_latency_seconds_count 4.0" in text


async def test_a_write_to_a_closing_connection_aborts_once_and_logs_no_error(caplog):
    """A stream's write that meets a connection the client already closed (before aiohttp has
    cancelled the handler) is a hang-up like any other: one abort, answered with nginx's 499,
    and no "Error handling request" traceback in the server's log (one per hang-up, each a
    millisecond of the loop, under a wave of them)."""
    from aiohttp import web

    from fd.api.cancellation import CLIENT_CLOSED, Cancellation, watch_of

    aborted: list[tuple[str, ...]] = []

    async def on_disconnect(ids: tuple[str, ...]) -> None:
        aborted.append(ids)

    async def handler(request: web.Request) -> web.StreamResponse:
        watch_of(request).request_id = "closing-1"
        raise ConnectionResetError("Cannot write to closing transport")

    guard = Cancellation(on_disconnect)
    app = web.Application()
    app.router.add_post("/v1/completions", guard.guard(handler))
    with caplog.at_level("DEBUG", logger="aiohttp"):
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={})
            assert resp.status == CLIENT_CLOSED
            await guard.drain()
    assert aborted == [("closing-1",)]
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


async def _guarded_stream_server(order: list[str]):
    """A guarded streaming handler that writes one chunk and waits; what happens is told in
    ``order``: the abort the guard publishes on a hang-up (its task's first step), the
    handler's cancellation."""
    from aiohttp import web

    from fd.api.cancellation import Cancellation, watch_of

    async def on_disconnect(ids: tuple[str, ...]) -> None:
        order.append(f"abort {ids[0]}")

    async def handler(request: web.Request) -> web.StreamResponse:
        watch_of(request).request_id = request.query["id"]
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            order.append(f"cancelled {request.query['id']}")
            raise
        return resp

    guard = Cancellation(on_disconnect)
    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_get("/stream", guard.guard(handler))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, guard, runner.addresses[0][1]


async def _open_stream(port: int, rid: str):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /stream?id={rid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    got = b""
    while b"data: first" not in got:
        got += await asyncio.wait_for(reader.read(4096), 5)
    return reader, writer


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_hang_up_is_told_to_the_engine_before_the_handler_unwinds(how):
    """The peer's end of the connection (its FIN, or a reset) is heard in the loop turn that
    reads it, not two turns later when aiohttp has closed the connection and the cancelled
    handler runs: under load a turn is every other stream's token writes. One abort, on its
    way (its task started the turn after the hang-up was heard) before the handler's
    cancellation."""
    import socket
    import struct

    order: list[str] = []
    runner, guard, port = await _guarded_stream_server(order)
    try:
        _, writer = await _open_stream(port, "h-1")
        if how == "reset":  # SO_LINGER 0: close sends a RST
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        for _ in range(200):
            if "cancelled h-1" in order and "abort h-1" in order:
                break
            await asyncio.sleep(0.01)
        await guard.drain()
        assert order.index("abort h-1") < order.index("cancelled h-1"), order
        assert order.count("abort h-1") == 1, order
    finally:
        await runner.cleanup()


async def test_on_a_kept_alive_connection_a_hang_up_aborts_the_request_it_runs():
    """The connection's ear serves one request after another: a hang-up during the second
    aborts the second, once, and says nothing of the first (finished) one or of a request on
    another connection."""
    order: list[str] = []
    runner, guard, port = await _guarded_stream_server(order)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # one request that finishes on the connection, then a streaming one on it
        writer.write(b"GET /missing HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 404")
        length = int(
            next(ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")).split(b":")[1]
        )
        await reader.readexactly(length)
        writer.write(b"GET /stream?id=k-2 HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        got = b""
        while b"data: first" not in got:
            got += await asyncio.wait_for(reader.read(4096), 5)
        _, writer2 = await _open_stream(port, "s-3")
        writer.close()  # k-2's client hangs up; s-3's stays
        for _ in range(200):
            if "cancelled k-2" in order:
                break
            await asyncio.sleep(0.01)
        assert order.index("abort k-2") < order.index("cancelled k-2"), order
        await guard.drain()
        assert order.count("abort k-2") == 1 and not any("s-3" in o for o in order), order
        writer2.close()
    finally:
        await runner.cleanup()
