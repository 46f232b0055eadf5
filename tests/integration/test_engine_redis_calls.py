"""The engine speaks to Redis only through the Bus (issue #45): no module under fd/engine/ holds
a Redis client or sends a command itself, and each Bus method the engine's failover, heartbeat,
publisher and journal reader use does what they relied on, on the real redis-server and the
embedded server."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

import fd.engine
from fd.control import events as E
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.keys import GROUP_ENGINES
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.node.outbox import unwritten

ENGINE = Path(fd.engine.__file__).resolve().parent
# The model and its runner never speak to Redis; the rest of the engine does, through its Bus.
NOT_SCANNED = ("runner", "model")
# Commands of a redis-py client (or pipeline) that no other object fd/engine uses has.
COMMANDS = {
    "pipeline",
    "execute_command",
    "xadd",
    "xrange",
    "xrevrange",
    "xread",
    "xreadgroup",
    "xpending",
    "xpending_range",
    "xclaim",
    "xautoclaim",
    "xack",
    "xdel",
    "xgroup_create",
    "scan_iter",
    "hset",
    "hgetall",
    "hsetnx",
    "hdel",
    "evalsha",
}

DATA = RequestData(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4))


def request(rid: str) -> E.Request:
    return E.Request(request_id=rid, data=DATA)


def engine_sources() -> list[Path]:
    return sorted(p for p in ENGINE.rglob("*.py") if p.relative_to(ENGINE).parts[0] not in NOT_SCANNED)


def redis_uses(path: Path, root: Path = ENGINE.parents[1]) -> list[str]:
    """Where ``path`` touches a Redis client: imports redis, reads a ``.redis`` attribute, has a
    name or parameter ``redis``, or calls a client's command (``file:line: what``, the file
    relative to ``root``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "redis" for a in node.names):
            what = "import redis"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "redis":
            what = f"from {node.module} import"
        elif isinstance(node, ast.Attribute) and node.attr == "redis":
            what = ".redis"
        elif isinstance(node, ast.Attribute) and node.attr in COMMANDS:
            what = f".{node.attr}"
        elif isinstance(node, ast.Name) and node.id == "redis":
            what = "redis"
        elif isinstance(node, ast.arg) and node.arg == "redis":
            what = "parameter redis"
        if what is not None:
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}: {what}")
    return found


def test_the_engine_sends_no_redis_command_but_through_the_bus():
    sources = engine_sources()
    assert len(sources) > 10  # (the scan found the engine)
    assert [u for p in sources for u in redis_uses(p)] == []


def test_the_scan_finds_a_raw_command(tmp_path):
    p = tmp_path / "x.py"
    p.write_text(
        "from redis.exceptions import WatchError\n"
        "async def f(bus):\n"
        "    await bus.redis.delete('k')\n"
        "    pipe = bus.client.pipeline(transaction=False)\n"
    )
    got = sorted(redis_uses(p, tmp_path), key=lambda u: int(u.split(":")[1]))
    assert [u.split(": ", 1)[1] for u in got] == ["from redis.exceptions import", ".redis", ".pipeline"]


# ------------------------------------------------------------------ owner keys


async def test_cas_owner_sets_and_deletes_only_from_the_expected_value(bus):
    key = bus.keys.owner("r")
    assert not await bus.cas_owner("r", "dead", "e1", 60)  # expected a value, found none
    assert await bus.redis.get(key) is None
    assert await bus.cas_owner("r", None, "e1", 60)  # absent -> set
    assert (await bus.redis.get(key)) == b"e1"
    assert 0 < await bus.redis.ttl(key) <= 60
    assert not await bus.cas_owner("r", "dead", "e2", 60)  # never from a value it did not see
    assert not await bus.cas_owner("r", "dead", None, 60)
    assert (await bus.redis.get(key)) == b"e1"
    assert await bus.cas_owner("r", "e1", None, 60)  # release
    assert await bus.redis.get(key) is None


async def test_cas_owner_has_one_winner_among_engines_that_saw_the_same_owner(redis_server, keys):
    clients = [connect(redis_server.url) for _ in range(2)]
    try:
        buses = [Bus(c, keys) for c in clients]
        await clients[0].set(keys.owner("x"), "dead")
        wins = await asyncio.gather(*[buses[i % 2].cas_owner("x", "dead", f"e{i}", 60) for i in range(4)])
        assert sum(wins) == 1
        assert await clients[1].get(keys.owner("x")) == f"e{wins.index(True)}".encode()
    finally:
        for c in clients:
            await c.aclose()


async def test_owners_raise_or_keep_an_error_per_key(bus):
    await bus.redis.set(bus.keys.owner("a"), "e1-1")
    await bus.redis.rpush(bus.keys.owner("b"), "not a string")  # WRONGTYPE for GET
    assert await bus.owners([]) == [] and await bus.owners_or_errors([]) == []
    assert await bus.owners(["a", "c"]) == ["e1-1", None]
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await bus.owners(["a", "b", "c"])
    a, b, c = await bus.owners_or_errors(["a", "b", "c"])
    assert (a, c) == ("e1-1", None)
    assert isinstance(b, ResponseError) and "WRONGTYPE" in str(b)


# ------------------------------------------------------------------ heartbeats


async def test_engines_alive_by_heartbeat_hash_and_its_deletion(bus):
    assert await bus.engines_alive([]) == {}
    await bus.heartbeat("e1", {"status": "ok"}, 60)
    assert await bus.engines_alive(["e1", "e2"]) == {"e1": True, "e2": False}
    await bus.delete_heartbeat("e1")
    await bus.delete_heartbeat("e2")  # (none: nothing happens)
    assert await bus.engines_alive(["e1"]) == {"e1": False}


# ------------------------------------------------------------------ P:requests' pending list


async def test_pending_requests_and_moving_one_to_another_consumer(bus):
    await bus.ensure_group()
    await bus.publish(bus.keys.requests, request("r1"))
    await bus.publish(bus.keys.requests, request("r2"))
    (e1, _), (e2, _) = await bus.claim_requests("A", 10, None)
    await asyncio.sleep(0.5)  # (idle long enough that a moved entry's fresh start stands apart)
    assert await bus.pending_requests(0, 10) == [e1, e2]
    assert await bus.pending_requests(0, 1) == [e1]
    assert await bus.pending_requests(60_000, 10) == []  # not idle that long
    await bus.move_pending_request(e1, "B")
    rows = await bus.redis.xpending_range(bus.keys.requests, GROUP_ENGINES, min="-", max="+", count=10)
    assert {(r["message_id"], r["consumer"]) for r in rows} == {(e1, b"B"), (e2, b"A")}
    assert await bus.pending_requests(400, 10) == [e2]  # the move started its idle time over


async def test_request_entries_as_xrange_gives_them(bus):
    e1 = await bus.publish(bus.keys.requests, request("r1"))
    assert await bus.request_entries([]) == []
    rows, gone = await bus.request_entries([e1, b"1-1"])
    assert gone == []
    [(eid, fields)] = rows
    ev = E.decode(fields, eid)
    assert eid == e1 and isinstance(ev, E.Request) and ev.request_id == "r1"


async def test_decode_requests_dead_letters_and_acks_what_is_no_request(bus):
    await bus.ensure_group()
    good = await bus.publish(bus.keys.requests, request("r1"))
    bad = await bus.redis.xadd(bus.keys.requests, {"type": "tokens", "junk": "1"})
    [(_, entries)] = await bus.redis.xreadgroup(GROUP_ENGINES, "A", {bus.keys.requests: ">"})
    got = await bus.decode_requests(entries)
    assert [(e, r.request_id) for e, r in got] == [(good, "r1")]
    # (fakeredis's XPENDING IDLE is strict, Redis's is not: read in this millisecond, an entry
    # is 0 ms idle, which Redis lists for IDLE 0 and fakeredis does not)
    await asyncio.sleep(0.002)
    assert await bus.pending_requests(0, 10) == [good]  # the other acked,
    assert await bus.request_entries([bad]) == [[]]  # removed,
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)  # and kept as a dead letter
    assert dead[b"entry_id"] == bad


# ------------------------------------------------------------------ a batch cut off midway


async def test_tails_and_unwritten_find_what_a_cut_off_batch_left_out(bus):
    k1, k2 = bus.keys.req("o1"), bus.keys.req("o2")
    items = [
        (k1, E.Tokens(request_id="o1", token_ids=(i,), text=f"t{i}", step=i, ts=1000 + i)) for i in range(3)
    ]
    items += [(k2, E.Tokens(request_id="o2", token_ids=(9,), text="x", step=1, ts=2000))]
    items.insert(1, (k2, E.Tokens(request_id="o2", token_ids=(8,), text="w", step=0, ts=1999)))
    assert await bus.tails({}) == {}
    assert await bus.tails({k1: 2}) == {k1: []}
    await bus.publish_many(items[:3])  # o1's first two and o2's first one got through
    tails = await bus.tails({k1: 5, k2: 1})
    assert tails == {k1: [items[0][1].encode(), items[2][1].encode()], k2: [items[1][1].encode()]}
    assert (await bus.tails({k1: 1}))[k1] == [items[2][1].encode()]  # the last, oldest first
    rest = await unwritten(bus, items)
    assert rest == items[3:]
    await bus.publish_many(rest)
    assert await unwritten(bus, items) == []


# ------------------------------------------------------------------ journals


async def test_journal_pages_and_the_engines_with_a_journal(bus):
    assert await bus.journal_engines() == []
    key = bus.keys.journal("e1")
    ids = [await bus.redis.xadd(key, {"n": str(i)}) for i in range(5)]
    await bus.redis.xadd(bus.keys.journal("e0"), {"n": "0"})
    await bus.redis.set(bus.keys.owner("j"), "x")  # (not a journal)
    page = await bus.journal_page(key, "-", 2)
    assert [e for e, _ in page] == ids[:2] and page[0][1] == {b"n": b"0"}
    assert [e for e, _ in await bus.journal_page(key, b"(" + ids[1], 10)] == ids[2:]
    assert [e for e, _ in await bus.journal_page(key, ids[4], 10)] == ids[4:]
    assert await bus.journal_engines() == ["e0", "e1"]


async def test_aclose_closes_the_client_under_the_bus(redis_server, keys):
    bus = Bus(connect(redis_server.url), keys)
    await bus.redis.ping()
    await bus.aclose()
