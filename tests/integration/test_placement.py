"""Prefix-aware placement on real Redis (DESIGN.md §4c): a request waits on the lane of the
engine that holds its prompt's prefix and is started there when that engine can admit it; a
busy preferred engine loses it to another after the steal bound; a dead one costs a miss, not
the request; abort, abort_all, drain and failover reach requests waiting on a lane; the
scheduler's decisions still replay."""

from __future__ import annotations

import asyncio
import time

from fd.api.placement import Placement
from fd.control.events import Abort, AbortAll, Claimed, Drain, Request, RequestAccepted
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from tests.kit.engine import story, submit, tokens_of
from tests.kit.faults import all_blocks_free, engines, kill, wait_for  # noqa: F401

SYSTEM = [(7 * i + 3) % 200 + 5 for i in range(96)]  # six full blocks of 16


def prompt(i: int) -> list[int]:
    return [*SYSTEM, 300 + i, 301 + i, 302 + i]


class Pin:
    """A placer that places every request on one engine (the declared protocol's other kind)."""

    def __init__(self, engine: str):
        self.engine = engine

    def choose(self, request: Request) -> str | None:
        return self.engine


async def acquainted(*engs) -> None:
    """Until each engine has seen the others' lanes (within its poll while alone)."""
    await wait_for(lambda: all(e.node.admission.lanes.peers for e in engs), what="engines see each other")


def engine_of(evs) -> list[str]:
    return [e.engine for e in evs if isinstance(e, Claimed)]


async def cards_hold(placement: Placement, engine: str, blocks: int) -> None:
    async def ready() -> bool:
        await placement.refresh()
        card = placement.cards.get(engine)
        return card is not None and len(card.blocks) >= blocks

    deadline = time.monotonic() + 10
    while not await ready():
        assert time.monotonic() < deadline, f"{engine}'s card never held {blocks} blocks"
        await asyncio.sleep(0.02)


async def lifecycle_lanes(bus) -> dict[str, str | None]:
    _, evs = await bus.read_lifecycle(b"0-0", None)
    return {e.request_id: e.lane for _, e in evs if isinstance(e, RequestAccepted)}


async def test_a_request_lands_on_the_engine_holding_its_prefix(real_bus, engines):
    a = await engines.start("A")
    b = await engines.start("B")
    await acquainted(a, b)
    real_bus.placer = Pin("A")
    await submit(real_bus, "warm", prompt(0), max_tokens=4)
    assert engine_of(await story(real_bus, "warm")) == ["A"]
    placement = Placement(real_bus)
    real_bus.placer = placement
    await cards_hold(placement, "A", 6)
    await cards_hold(placement, "B", 0)
    hits = a.node.sched.num_cache_hits
    for i in range(1, 5):
        await submit(real_bus, f"turn{i}", prompt(i), max_tokens=4)
    for i in range(1, 5):
        assert engine_of(await story(real_bus, f"turn{i}")) == ["A"], i
    # each took the six cached blocks instead of computing them
    assert a.node.sched.num_cache_hits - hits >= 4 * 96
    lanes = await lifecycle_lanes(real_bus)
    assert [lanes[f"turn{i}"] for i in range(1, 5)] == ["A"] * 4 and lanes["warm"] == "A"
    # a prompt nobody holds goes by load: to B, which runs nothing
    await submit(real_bus, "cold", [9] * 40, max_tokens=4)
    assert engine_of(await story(real_bus, "cold")) == ["B"]
    await all_blocks_free(a.node)
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    assert await real_bus.redis.xlen(real_bus.keys.lane("A")) == 0
    report = replay(await load_journal_from_redis(real_bus, "A"))
    assert report.divergence is None and not report.analysis.violations
    assert b.node.admission.lanes.stolen == 0


async def test_a_busy_preferred_engine_loses_the_request_after_the_bound(real_bus, engines):
    a = await engines.start("A", gated=True, max_num_seqs=1)
    b = await engines.start("B", steal_after_ms=300)
    await acquainted(a, b)
    real_bus.placer = Pin("A")
    engines.gates["A"].close()
    await submit(real_bus, "hog", prompt(0), max_tokens=4)  # A's one slot, its step held
    await wait_for(lambda: a.node.sched.num_running == 1, what="hog running on A")
    t0 = time.monotonic()
    await submit(real_bus, "r", prompt(1), max_tokens=4)
    evs = await story(real_bus, "r", until=Claimed)
    waited = time.monotonic() - t0
    assert engine_of(evs) == ["B"] and b.node.admission.lanes.stolen == 1
    assert waited >= 0.3  # not before the bound (the server's clock: the lane entry's id)
    assert len(tokens_of(await story(real_bus, "r"))) == 4
    engines.gates["A"].open()
    assert engine_of(await story(real_bus, "hog")) == ["A"]


async def test_a_dead_preferred_engine_costs_a_miss_not_the_request(real_bus, engines):
    a = await engines.start("A")
    b = await engines.start("B", steal_after_ms=60_000)  # only death lets it take at once
    await kill(a)
    real_bus.placer = Pin("A")  # (a placement whose cards are a moment old)
    await submit(real_bus, "r", prompt(0), max_tokens=4)
    evs = await story(real_bus, "r")
    assert engine_of(evs) == ["B"] and evs[-1].finish_reason == "length"
    assert b.node.admission.lanes.stolen == 1
    # the dead engine's emptied lane left the registry

    async def dropped() -> bool:
        return b"A" not in await real_bus.redis.smembers(real_bus.keys.lanes)

    await wait_for(dropped, what="A's lane dropped")


async def test_abort_and_abort_all_reach_requests_waiting_on_a_lane(real_bus, engines):
    a = await engines.start("A", gated=True, max_num_seqs=1)
    await engines.start("B", steal_after_ms=60_000)
    real_bus.placer = Pin("A")
    engines.gates["A"].close()
    await submit(real_bus, "hog", prompt(0), max_tokens=4)
    await wait_for(lambda: a.node.sched.num_running == 1, what="hog running on A")
    await submit(real_bus, "one", prompt(1), max_tokens=4)
    await submit(real_bus, "two", prompt(2), max_tokens=4)
    await real_bus.publish(real_bus.keys.control, Abort(request_ids=("one",)))
    one = await story(real_bus, "one")
    assert one[-1].finish_reason == "abort" and not engine_of(one)
    await real_bus.publish(real_bus.keys.control, AbortAll())
    two = await story(real_bus, "two")
    assert two[-1].finish_reason == "abort" and not engine_of(two)
    engines.gates["A"].open()
    assert (await story(real_bus, "hog"))[-1].finish_reason == "abort"
    # the lane's entries were taken and met their tombstones: nothing left anywhere
    await wait_for(lambda: a.node.sched.num_running == 0, what="A idle")
    await all_blocks_free(a.node)

    async def empty() -> bool:
        lane = await real_bus.redis.xlen(real_bus.keys.lane("A"))
        return lane == 0 and await real_bus.redis.xlen(real_bus.keys.requests) == 0

    await wait_for(empty, what="lane and P:requests empty")


async def test_a_drain_gives_its_lane_to_the_others(real_bus, engines):
    a = await engines.start("A", gated=True, max_num_seqs=1, drain_timeout_s=5)
    b = await engines.start("B", steal_after_ms=60_000)
    real_bus.placer = Pin("A")
    engines.gates["A"].close()
    await submit(real_bus, "hog", prompt(0), max_tokens=4)
    await wait_for(lambda: a.node.sched.num_running == 1, what="hog running on A")
    await submit(real_bus, "r", prompt(1), max_tokens=4)
    await real_bus.publish(real_bus.keys.control, Drain(engine="A"))
    evs = await story(real_bus, "r")
    assert engine_of(evs) == ["B"] and b.node.admission.lanes.stolen == 0  # released, not stolen
    assert not await real_bus.redis.exists(real_bus.keys.card("A"))
    engines.gates["A"].open()
    assert engine_of(await story(real_bus, "hog")) == ["A"]


async def test_failover_of_a_request_taken_from_a_lane(real_bus, engines):
    a = await engines.start("A", delay=0.05)
    b = await engines.start("B", steal_after_ms=60_000)
    real_bus.placer = Pin("A")
    await submit(real_bus, "r", prompt(0), max_tokens=40, ignore_eos=True)
    await story(real_bus, "r", until=Claimed)
    await asyncio.sleep(0.2)
    await kill(a)
    evs = await story(real_bus, "r", timeout=30)
    assert engine_of(evs) == ["A", "B"] and len(tokens_of(evs)) == 40
    await all_blocks_free(b.node)


async def test_the_empty_lane_of_a_dead_engine_leaves_the_registry(real_bus, engines, monkeypatch):
    from fd.engine.node import lanes

    monkeypatch.setattr(lanes, "PRUNE_S", 0.2)
    a = await engines.start("A")
    b = await engines.start("B")
    await acquainted(a, b)
    await kill(a)
    # (a kill in this process still lets A leave; one that could not, as SIGKILL, is this)
    await real_bus.redis.sadd(real_bus.keys.lanes, "A")

    async def dropped() -> bool:
        return await real_bus.redis.smembers(real_bus.keys.lanes) == {b"B"}

    await wait_for(dropped, what="A's lane dropped")
    assert b.node.admission.lanes.stolen == 0
