"""Placement's keys on each server (a real Redis, the embedded one, a 3-master Cluster): a
request placed for an engine waits on its lane; a take moves it onto ``P:requests`` (its
acceptance kept in ``queued``) and reads it for the taker there; ``abort_all``'s scan finds it
on the lane and after; a release empties the lane for anyone; cards round-trip."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from fd.control import events as E
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.lanes import Card
from tests.kit.bus import request
from tests.kit.cluster import cluster_url  # noqa: F401  (the fixture)


class Pin:
    def __init__(self, engine: str | None):
        self.engine = engine

    def choose(self, request: E.Request) -> str | None:
        return self.engine


@pytest.fixture
async def cbus(cluster_url, keys):  # noqa: F811
    client = connect(cluster_url)
    await client.initialize()
    yield Bus(client, keys)
    await client.aclose()


async def place(bus: Bus, engine: str | None, *rids: str) -> None:
    bus.placer = Pin(engine)
    for rid in rids:
        assert await bus.submit(request(rid), E.Accepted(request_id=rid, prompt_tokens=3))


async def lanes_round_trip(bus: Bus) -> None:
    await bus.ensure_group()
    await place(bus, "e1", "a", "b", "c")
    await place(bus, "e2", "d")
    await place(bus, None, "s")
    assert await bus.redis.xlen(bus.keys.lane("e1")) == 3 and await bus.redis.xlen(bus.keys.requests) == 1
    heads, now_ms = await bus.lane_heads("e3")
    assert heads["e3"] is None and now_ms > 0
    assert set(heads) == {"e1", "e2", "e3"} and heads["e1"] is not None and heads["e2"] is not None
    # every request placed is in abort_all's scan, wherever it waits
    control = await bus.publish(bus.keys.control, E.AbortAll())
    assert sorted(rid for _, rid in await bus.queued_until(control)) == ["a", "b", "c", "d", "s"]
    # e1 takes two: P:requests first, then its lane's oldest, moved and read for it
    got, last = await bus.take("e1", 2, "e1")
    assert [r.request_id for _, r in got] == ["s", "a"]
    assert got[1][1].queued is not None and last == got[1][0]
    pending = await bus.redis.xpending_range(bus.keys.requests, "engines", "-", "+", 10)
    assert sorted(p["consumer"] for p in pending) == [b"e1", b"e1"]
    # a request taken after the abort_all was published still counts as accepted before it
    assert sorted(rid for _, rid in await bus.queued_until(control)) == ["a", "b", "c", "d", "s"]
    # e2 steals the rest of e1's lane (e1 "dead": pruned once empty)
    got, _ = await bus.take("e2", 5, "e1", prune=True)
    assert [r.request_id for _, r in got] == ["b", "c"]
    assert await bus.redis.smembers(bus.keys.lanes) == {b"e2"}
    # a release hands e2's lane to anyone
    await bus.write_card(Card("e2", 16, 1, 0, 10, 20, 8, 1, frozenset({1, 2, 3})), 5)
    assert [c.blocks for c in await bus.read_cards()] == [frozenset({1, 2, 3})]
    await bus.release_lane("e2")
    assert await bus.read_cards() == [] and await bus.redis.smembers(bus.keys.lanes) == set()
    assert await bus.lane_heads("e3") == ({"e3": None}, 0)  # alone: one round trip
    got = await bus.claim_requests("e3", 5, None)
    assert [r.request_id for _, r in got] == ["d"]


async def test_lanes_round_trip(bus):
    await lanes_round_trip(bus)


async def test_lanes_round_trip_on_a_cluster(cbus):
    k = cbus.keys
    slot = key_slot(k.requests.encode())
    assert key_slot(k.lane("e1").encode()) == slot and key_slot(k.lanes.encode()) == slot
    await lanes_round_trip(cbus)


def test_a_lane_key_takes_no_brace_from_an_engine_id(keys):
    with pytest.raises(ValueError):
        keys.lane("e{1}")
