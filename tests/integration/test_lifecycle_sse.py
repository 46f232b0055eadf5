"""``GET /v1/lifecycle``: the lifecycle stream (``P:lifecycle``) as server-sent events, as a
dashboard sees it. Events are published straight onto the stream with the bus, as the API and
the engines write them; what the client reads must be them, field for field. The tests that take
``bus`` run on the real redis-server and on the embedded server (``fd serve``'s)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest

from fd.api import serving_lifecycle
from fd.control.events import EngineLoad, FirstToken, RequestAccepted, RequestClaimed, RequestFinished
from tests.kit.api import api_client, assert_openai_error

PATH = "/v1/lifecycle"
TS = 1_700_000_000_123  # (given, so that what the client reads is known to the millisecond)
EVENTS = [
    EngineLoad(
        engine="e1",
        step=812,
        running=2,
        waiting=1,
        blocks_free=100,
        blocks_total=512,
        prefix_blocks=40,
        ts=TS,
    ),
    RequestAccepted(request_id="r-1", api="a1", endpoint="chat", prompt_tokens=12, ts=TS + 1),
    RequestClaimed(request_id="r-1", engine="e1", attempt=1, ts=TS + 2),
    FirstToken(request_id="r-1", engine="e1", ts=TS + 3),
    RequestFinished(
        request_id="r-1",
        engine="e1",
        finish_reason="length",
        prompt_tokens=12,
        completion_tokens=64,
        ts=TS + 4,
    ),
]


def as_json(ev) -> dict:
    """What the event's ``data:`` must be: its type and every field that is set, typed."""
    return {"type": ev.TYPE, **{k: v for k, v in dataclasses.asdict(ev).items() if v is not None}}


def admin(key: str | None = "admin") -> dict:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


async def next_event(resp, timeout: float = 10.0) -> dict:
    """The next SSE event's lines (``id``, ``event``, ``data``; comments as ``comment``)."""
    out: dict = {}
    async with asyncio.timeout(timeout):
        while True:
            line = (await resp.content.readline()).decode()
            assert line, f"the stream ended; read so far: {out}"
            line = line.rstrip("\n")
            if not line:
                if out:
                    return out
                continue
            if line.startswith(":"):
                out["comment"] = line[1:].strip()
            else:
                name, _, value = line.partition(": ")
                out[name] = value


async def publish(bus, events) -> list[str]:
    return [(await bus.publish(bus.keys.lifecycle, ev)).decode() for ev in events]


def _handler_tasks() -> list[asyncio.Task]:
    """Tasks whose chain of awaits is in the lifecycle handler."""
    found = []
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        while coro is not None and getattr(coro, "cr_frame", None) is not None:
            code = coro.cr_frame.f_code
            if code.co_name == "lifecycle" and code.co_filename.endswith("serving_lifecycle.py"):
                found.append(task)
                break
            coro = coro.cr_await
    return found


def _reads() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "fd-lifecycle-read"]


async def until(pred, timeout: float = 10.0) -> bool:
    """Whether ``pred()`` came true within ``timeout`` (looked at every 10 ms)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# --------------------------------------------------------------------------- who may read it


@pytest.mark.parametrize(
    "cfg,refused,opened",
    [
        ({"api_key": "user", "admin_key": "admin"}, [None, "user", "wrong"], ["admin"]),
        ({"admin_key": "admin"}, [None, "wrong"], ["admin"]),  # (no API key: /v1 open, this not)
        ({"api_key": ["t1", "t2"]}, [None, "t1", "t2"], []),  # tenants, and no admin key: nobody
        ({"api_key": "user"}, [None, "wrong"], ["user"]),  # one key and no admin key: it is the admin's
        ({}, [], [None]),  # no key at all: the server is open
    ],
)
async def test_only_the_admin_key_reads_the_stream(real_bus, cfg, refused, opened):
    async with api_client(real_bus, **cfg) as client:
        for token in refused:
            resp = await client.get(PATH, headers=admin(token))
            assert resp.status == 401, (token, await resp.text())
            err = assert_openai_error(await resp.json())
            assert err["type"] == "authentication_error"
        for token in opened:
            resp = await client.get(PATH, headers=admin(token))
            assert resp.status == 200, (token, await resp.text())
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert resp.headers["Cache-Control"] == "no-cache"
            resp.close()


# --------------------------------------------------------------------------- what it carries


async def test_each_entry_is_one_event_with_its_id_type_and_fields(bus):
    await publish(bus, [EngineLoad(engine="old", ts=TS)])  # before the client: not sent
    async with api_client(bus, admin_key="admin") as client:
        resp = await client.get(PATH, headers=admin())
        assert resp.status == 200
        # the answer's head is sent once the stream's end is known: all that follows is sent
        ids = await publish(bus, EVENTS)
        got = [await next_event(resp) for _ in EVENTS]
        resp.close()
    assert [g["id"] for g in got] == ids
    assert [g["event"] for g in got] == [ev.TYPE for ev in EVENTS]
    assert [json.loads(g["data"]) for g in got] == [as_json(ev) for ev in EVENTS]
    load = json.loads(got[0]["data"])
    assert load == {
        "type": "engine_load",
        "v": 1,
        "ts": TS,
        "engine": "e1",
        "step": 812,
        "running": 2,
        "waiting": 1,
        "blocks_free": 100,
        "blocks_total": 512,
        "prefix_blocks": 40,
    }


async def test_a_client_resumes_after_the_last_id_it_saw(real_bus):
    ids = await publish(real_bus, EVENTS[:3])
    marker = EngineLoad(engine="marker", ts=TS + 9)
    async with api_client(real_bus, admin_key="admin") as client:

        async def read(headers=None, params=None, n=2) -> list[dict]:
            resp = await client.get(PATH, headers={**admin(), **(headers or {})}, params=params)
            assert resp.status == 200, await resp.text()
            out = [await next_event(resp) for _ in range(n)]
            resp.close()
            return out

        # after the first: the other two, and then only what comes (the marker, published now)
        resp = await client.get(PATH, headers={**admin(), "Last-Event-ID": ids[0]})
        assert [(await next_event(resp))["id"] for _ in range(2)] == ids[1:]
        (marker_id,) = await publish(real_bus, [marker])
        after = await next_event(resp)
        assert after["id"] == marker_id and json.loads(after["data"]) == as_json(marker)
        resp.close()

        assert [e["id"] for e in await read(params={"since": ids[1]}, n=2)] == [ids[2], marker_id]
        assert [e["id"] for e in await read(params={"since": "0"}, n=4)] == [*ids, marker_id]
        # an EventSource reconnects to the URL it was given, with the last id it saw: the id wins
        got = await read(headers={"Last-Event-ID": ids[2]}, params={"since": "0"}, n=1)
        assert [e["id"] for e in got] == [marker_id]

        for params, headers in (
            ({"since": "nope"}, {}),
            ({}, {"Last-Event-ID": "1-2-3"}),
            ({"since": "-1"}, {}),
        ):
            resp = await client.get(PATH, headers={**admin(), **headers}, params=params)
            assert resp.status == 400, await resp.text()
            err = assert_openai_error(await resp.json())
            assert err["param"] == ("since" if params else "Last-Event-ID")


async def test_a_quiet_stream_sends_keep_alive_comments(real_bus, monkeypatch):
    monkeypatch.setattr(serving_lifecycle, "KEEPALIVE_S", 0.0)
    monkeypatch.setattr(serving_lifecycle, "BLOCK_MS", 20)
    async with api_client(real_bus, admin_key="admin") as client:
        resp = await client.get(PATH, headers=admin())
        assert await next_event(resp) == {"comment": "keep-alive"}
        (eid,) = await publish(real_bus, EVENTS[:1])
        while (got := await next_event(resp)).get("comment"):
            pass
        assert got["id"] == eid
        resp.close()


# --------------------------------------------------------------------------- a client that leaves


async def test_a_client_that_hangs_up_ends_the_handler_at_once(bus, monkeypatch, caplog):
    # A read long enough that the handler, had it waited for it, would still be there.
    monkeypatch.setattr(serving_lifecycle, "BLOCK_MS", 4000)
    async with api_client(bus, admin_key="admin") as client:
        resp = await client.get(PATH, headers=admin())
        await publish(bus, EVENTS[:1])
        await next_event(resp)
        assert await until(lambda: _reads()), "the handler is not reading"
        assert len(_handler_tasks()) == 1
        resp.close()
        # well within the read's BLOCK: the hang-up ends the handler, not the read's end
        assert await until(lambda: not _handler_tasks(), 3.0), "the handler outlived its client"
        assert _reads(), "the read was cancelled"
        # its read is left to end by itself (never cancelled, DESIGN.md §6): an entry ends it now
        await publish(bus, EVENTS[1:2])
        assert await until(lambda: not _reads()), "a read outlived its handler"
        # the server goes on serving
        again = await client.get(PATH, headers=admin())
        assert again.status == 200
        again.close()
    assert await until(lambda: not _handler_tasks() and not _reads())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
