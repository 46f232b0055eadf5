"""Entries written in-process reach the same process's stream reader without a read-back
(``StreamMux._local``, the embedded server's ``fd_listen``): same entry ids, same events
(``ts`` included) as a reader decoding them, nothing twice, nothing skipped — also for a
subscriber that is behind, or joins mid-stream, and for a second reader elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from control import events as E
from control import mux as mux_mod
from control.bus import Bus
from control.connect import connect
from control.mux import StreamMux


def story(rid: str, n: int) -> list[E.Event]:
    evs: list[E.Event] = [E.Accepted(request_id=rid, prompt_tokens=3), E.Claimed(request_id=rid, engine="e1")]
    evs += [E.Tokens(request_id=rid, token_ids=(i, i + 1), text=f"t{i}", step=i) for i in range(n)]
    evs.append(E.Final(request_id=rid, finish_reason="length", usage={"completion_tokens": n}))
    return evs


async def take_all(sub, timeout: float = 5.0) -> list[tuple[bytes, E.Event]]:
    return [x async for x in _bounded(sub, timeout)]


async def _bounded(sub, timeout):
    while True:
        try:
            yield await asyncio.wait_for(sub.__anext__(), timeout)
        except StopAsyncIteration:
            return


@pytest.fixture
async def pair(embedded_redis, keys):
    """An engine-side bus and an API-side mux on two in-process clients of one server, as in
    ``fd serve``; decodes by the mux are counted."""
    writer, reader = embedded_redis.client(), embedded_redis.client()
    mux = StreamMux(reader, keys, "api-local", block_ms=5000)
    await mux.start()
    yield Bus(writer, keys), mux
    await mux.stop()
    await writer.aclose()
    await reader.aclose()


@pytest.fixture
def decodes(monkeypatch):
    n = [0]
    real = mux_mod.decode

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(mux_mod, "decode", counting)
    return n


async def wait_blocked(mux: StreamMux) -> None:
    for _ in range(400):
        if mux._shards and all(s.blocked for s in mux._shards):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the mux never blocked")


async def test_live_subscriber_gets_each_entry_once_without_decoding(pair, decodes, keys):
    bus, mux = pair
    rid = "loc1"
    sub = await mux.subscribe(rid)
    await wait_blocked(mux)
    evs = story(rid, 20)
    ids = []
    for i in range(0, len(evs), 3):  # flush by flush, as the engine does
        ids += await bus.publish_many([(keys.req(rid), e) for e in evs[i : i + 3]])
        await asyncio.sleep(0)
    got = await take_all(sub)
    assert [i for i, _ in got] == ids
    assert decodes[0] == 0  # nothing was read back: the events were handed over
    assert mux.events == len(evs)
    await asyncio.sleep(0.05)  # the blocked read, woken by each write, found nothing new
    assert decodes[0] == 0 and mux.events == len(evs)
    stored = await bus.read_req(rid)  # what any other reader decodes from the stream
    assert [ev for _, ev in got] == [ev for _, ev in stored]  # ts included


async def test_subscriber_behind_is_served_by_the_read_with_no_gap(pair, keys):
    """Entries written before the subscription (the API's own `accepted`, a resume from an
    old id) come from the read; later ones are handed over only once it has caught up."""
    bus, mux = pair
    rid = "loc2"
    evs = story(rid, 10)
    ids = await bus.publish_many([(keys.req(rid), e) for e in evs[:5]])
    sub = await mux.subscribe(rid)  # after=0: behind by five entries
    ids += await bus.publish_many([(keys.req(rid), e) for e in evs[5:8]])  # not contiguous yet
    got = [await asyncio.wait_for(sub.__anext__(), 5) for _ in range(8)]
    ids += await bus.publish_many([(keys.req(rid), e) for e in evs[8:]])
    got += await take_all(sub)
    assert [i for i, _ in got] == ids
    assert [ev for _, ev in got] == [ev for _, ev in await bus.read_req(rid)]


async def test_two_subscribers_one_behind_each_get_the_whole_story(pair, keys):
    bus, mux = pair
    rid = "loc3"
    evs = story(rid, 12)
    live = await mux.subscribe(rid)
    await wait_blocked(mux)
    ids = await bus.publish_many([(keys.req(rid), e) for e in evs[:6]])
    first = [await asyncio.wait_for(live.__anext__(), 5) for _ in range(6)]
    late = await mux.subscribe(rid, after=ids[1])  # a resume with Last-Event-ID
    ids += await bus.publish_many([(keys.req(rid), e) for e in evs[6:]])  # final among them
    rest, late_got = await asyncio.gather(take_all(live), take_all(late))
    assert [i for i, _ in first + rest] == ids
    assert [i for i, _ in late_got] == ids[2:]
    assert [ev for _, ev in late_got] == [ev for _, ev in first + rest][2:]
    assert mux._where == {}  # both ended: the key is no longer read


async def test_entries_from_the_tcp_door_are_still_read(pair, embedded_redis, keys):
    """A hand-written XADD (another process, redis-cli) is not handed over: the read gets
    it, in order with the in-process ones."""
    bus, mux = pair
    rid = "loc4"
    sub = await mux.subscribe(rid)
    await wait_blocked(mux)
    a = await bus.publish_many([(keys.req(rid), e) for e in story(rid, 2)[:3]])
    tcp = connect(embedded_redis.url)
    try:
        b = await tcp.xadd(
            keys.req(rid), {"type": "tokens", "request_id": rid, "token_ids": "7", "text": "x", "step": "5"}
        )
    finally:
        await tcp.aclose()
    c = await bus.publish_many([(keys.req(rid), story(rid, 2)[-1])])
    got = await take_all(sub)
    assert [i for i, _ in got] == a + [b] + c
    assert got[3][1] == E.Tokens(request_id=rid, token_ids=(7,), text="x", step=5, ts=got[3][1].ts)


async def test_stopped_mux_is_not_told(pair, embedded_redis, keys):
    bus, mux = pair
    sub = await mux.subscribe("loc5")
    await mux.stop()
    assert embedded_redis._listeners == []
    await bus.publish_many([(keys.req("loc5"), e) for e in story("loc5", 1)])
    with pytest.raises(mux_mod.MuxStopped):
        await take_all(sub)
