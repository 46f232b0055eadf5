"""The bus on a real 3-master Redis Cluster: keys of one request share a slot, everything else
is spread over the masters, and no command names keys of two slots."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot

from fd.control import events as E
from fd.control.bus import Bus
from fd.control.connect import connect, redis_timeout
from fd.control.mux import StreamMux
from tests.kit.bus import dead, request, same, story
from tests.kit.cluster import MASTERS, cluster_url  # noqa: F401  (the fixture)


@pytest.fixture
async def cbus(cluster_url, keys):
    client = connect(cluster_url)
    await client.initialize()
    yield Bus(client, keys)
    await client.aclose()


def node_of(bus: Bus, key: str | bytes) -> str:
    return bus.redis.get_node_from_key(key).name


def ids_on_every_master(bus: Bus, key_of, n_per_master: int, stem: str = "r") -> list[str]:
    """Ids whose keys land on every master, ``n_per_master`` each, in distinct slots."""
    per: dict[str, list[str]] = {}
    slots = set()
    i = 0
    while len(per) < MASTERS or min(len(v) for v in per.values()) < n_per_master:
        rid, i = f"{stem}{i}", i + 1
        slot = key_slot(key_of(rid).encode())
        node = node_of(bus, key_of(rid))
        if slot in slots or len(per.get(node, ())) >= n_per_master:
            continue
        slots.add(slot)
        per.setdefault(node, []).append(rid)
    return [rid for rids in per.values() for rid in rids]


def twin(bus: Bus, rid: str) -> str:
    """Another request id whose stream shares the slot of ``rid``'s."""
    slot = key_slot(bus.keys.req(rid).encode())
    return next(
        f"{rid}-{i}" for i in range(1_000_000) if key_slot(bus.keys.req(f"{rid}-{i}").encode()) == slot
    )


# ------------------------------------------------------------------ connect


async def test_connect_picks_the_client_by_scheme(cluster_url, redis_server):
    cluster, plain = connect(cluster_url), connect(redis_server.url)
    try:
        assert isinstance(cluster, RedisCluster) and isinstance(plain, Redis)
        kw = cluster.connection_kwargs
        # (a stalled node is an error after --redis-timeout, as on a single Redis)
        assert kw["socket_timeout"] == kw["socket_connect_timeout"] == redis_timeout(None)
        assert kw["protocol"] == 2 and kw["max_connections"] >= 256
        assert cluster.retry.get_retries() > 0
        await cluster.initialize()
        assert len(cluster.get_primaries()) == MASTERS
        assert await cluster.ping() and await plain.ping()
    finally:
        await cluster.aclose()
        await plain.aclose()


# ------------------------------------------------------------------ Bus


async def test_stories_round_trip_across_slots_and_masters(cbus):
    rids = ids_on_every_master(cbus, cbus.keys.req, 4)
    items = [(cbus.keys.req(rid), ev) for rid in rids for ev in story(rid)]
    ids = await cbus.publish_many(items, expire=[cbus.keys.req(r) for r in rids])
    assert len(ids) == len(items) and all(isinstance(i, bytes) for i in ids)
    for rid in rids:
        got = await cbus.read_req(rid)
        want = story(rid)
        assert len(got) == len(want) and all(same(a, b) for a, (_, b) in zip(want, got))
        assert 0 < await cbus.redis.ttl(cbus.keys.req(rid)) <= cbus.req_ttl_s


async def test_submit_claim_and_ack_with_the_final(cbus):
    await cbus.ensure_group()
    rids = ids_on_every_master(cbus, cbus.keys.req, 2)
    for rid in rids:
        assert await cbus.submit(request(rid), E.Accepted(request_id=rid, prompt_tokens=3))
    claimed = await cbus.claim_requests("e1", 100, None)
    assert sorted(r.request_id for _, r in claimed) == sorted(rids)
    for entry_id, req in claimed:
        ((_, acc),) = await cbus.read_req(req.request_id)
        assert isinstance(acc, E.Accepted)
        final = E.Final(request_id=req.request_id, finish_reason="stop")
        await cbus.publish_many(
            [(cbus.keys.req(req.request_id), final)], expire=[cbus.keys.req(req.request_id)], ack=[entry_id]
        )
        assert isinstance((await cbus.read_req(req.request_id))[-1][1], E.Final)
    assert await cbus.redis.xlen(cbus.keys.requests) == 0
    assert (await cbus.redis.xpending(cbus.keys.requests, "engines"))["pending"] == 0


async def test_the_fence_per_request_on_every_master(cbus):
    """fd/control/fence.py's script names only the request's own slot: each request's batch is
    fenced on its own master, the refused one writes and acknowledges nothing, the others'
    finals are acknowledged after them."""
    from fd.control.fence import Refused
    from fd.control.keys import owner_token

    await cbus.ensure_group()
    rids = ids_on_every_master(cbus, cbus.keys.req, 2)
    for rid in rids:
        assert await cbus.submit(request(rid), E.Accepted(request_id=rid, prompt_tokens=3))
    entries = {req.request_id: entry for entry, req in await cbus.claim_requests("e1", 100, None)}
    mine = {rid: owner_token("e1", 1) for rid in rids}
    for rid in rids:
        await cbus.redis.set(cbus.keys.owner(rid), mine[rid])
    lost = rids[0]
    await cbus.redis.set(cbus.keys.owner(lost), owner_token("e2", 2))
    items = []
    for rid in rids:
        items += [
            (cbus.keys.req(rid), E.Tokens(request_id=rid, token_ids=(7,), text="x", step=1)),
            (cbus.keys.req(rid), E.Final(request_id=rid, finish_reason="stop", engine="e1")),
        ]
    refused = await cbus.publish_owned(items, mine, ack=[(rid, entries[rid]) for rid in rids])
    assert refused == {lost: Refused("owner", owner_token("e2", 2))}
    for rid in rids:
        got = [type(ev).__name__ for _, ev in await cbus.read_req(rid)]
        assert got == (["Accepted"] if rid == lost else ["Accepted", "Tokens", "Final"])
    pend = await cbus.redis.xpending_range(cbus.keys.requests, "engines", min="-", max="+", count=100)
    assert [p["message_id"] for p in pend] == [entries[lost]]  # e2's, still pending
    again = await cbus.publish_owned(items[2:4], mine)
    assert again == {rids[1]: Refused("final", mine[rids[1]])}


async def test_try_own_tombstone_and_expire(cbus):
    rid = "own-1"
    assert key_slot(cbus.keys.req(rid).encode()) == key_slot(cbus.keys.owner(rid).encode())
    assert await cbus.try_own(rid, "e1", 60) == (True, "e1")
    assert await cbus.try_own(rid, "e2", 60) == (False, "e1")
    assert await cbus.owner(rid) == "e1"
    await cbus.publish(cbus.keys.req(rid), E.Accepted(request_id=rid))
    await cbus.publish_many([], expire=[cbus.keys.req(rid), cbus.keys.owner(rid)])  # a final's renewal
    assert 0 < await cbus.redis.ttl(cbus.keys.owner(rid)) <= cbus.req_ttl_s
    assert 0 < await cbus.redis.ttl(cbus.keys.req(rid)) <= cbus.req_ttl_s
    # a tombstoned id is not submitted; its story is written instead (compare-and-set on the
    # owner key works on a cluster), and only once
    assert await cbus.try_own("own-2", "aborted", 60) == (True, "aborted")
    assert not await cbus.submit(request("own-2"), E.Accepted(request_id="own-2"))
    assert not await cbus.submit(request("own-2"), E.Accepted(request_id="own-2"))
    assert [ev.TYPE for _, ev in await cbus.read_req("own-2")] == [
        "accepted",
        "abort_requested",
        "drained",
        "blocks_released",
        "final",
    ]
    assert await cbus.redis.xlen(cbus.keys.requests) == 0


async def test_junk_is_dead_lettered_on_a_cluster(cbus):
    await cbus.ensure_group()
    rid = "junk-1"
    await cbus.redis.xadd(cbus.keys.req(rid), {"type": "no-such-event"})
    await cbus.publish(cbus.keys.req(rid), E.Accepted(request_id=rid))
    await cbus.redis.xadd(cbus.keys.requests, {"type": "request", "request_id": "x"})  # no data
    assert [type(ev) for _, ev in await cbus.read_req(rid)] == [E.Accepted]
    assert await cbus.claim_requests("e1", 10, None) == []
    reasons = [(f[b"stream"], f[b"reason"]) for f in await dead(cbus)]
    assert [s for s, _ in reasons] == [cbus.keys.req(rid).encode(), cbus.keys.requests.encode()]
    assert await cbus.redis.xlen(cbus.keys.requests) == 0


async def test_engines_sees_heartbeats_on_every_master(cbus):
    eids = ids_on_every_master(cbus, cbus.keys.engine, 2, stem="eng")
    for eid in eids:
        await cbus.heartbeat(eid, {"free_blocks": 7}, 30)
    assert len({node_of(cbus, cbus.keys.engine(e)) for e in eids}) == MASTERS
    got = await cbus.engines()
    assert sorted(got) == sorted(eids) and all(h["free_blocks"] == "7" for h in got.values())


# ------------------------------------------------------------------ StreamMux


async def _drain(sub) -> list[E.Event]:
    return [ev async for _, ev in sub]


async def _stream_all(bus: Bus, mux: StreamMux, rids: list[str]) -> None:
    subs = {rid: await mux.subscribe(rid) for rid in rids}
    await asyncio.sleep(0.05)  # readers are blocked now: the rest arrives while they wait

    async def write(rid):
        for ev in story(rid, n_tokens=5):
            await bus.publish(bus.keys.req(rid), ev)

    _, got = await asyncio.gather(
        asyncio.gather(*map(write, rids)), asyncio.wait_for(asyncio.gather(*map(_drain, subs.values())), 10)
    )
    for rid, evs in zip(rids, got):
        want = story(rid, n_tokens=5)
        assert len(evs) == len(want) and all(same(a, b) for a, b in zip(want, evs)), rid


async def test_mux_reads_streams_of_every_slot_and_master(cbus):
    rids = ids_on_every_master(cbus, cbus.keys.req, 4)
    mux = StreamMux(cbus.redis, cbus.keys, "api-1", block_ms=5000)
    await mux.start()
    try:
        t0 = time.monotonic()
        await _stream_all(cbus, mux, rids)
        assert time.monotonic() - t0 < 3  # doorbells in each slot, not the 5 s BLOCK
        # every shard retires once its slot has nothing left, and takes its doorbell along
        for _ in range(100):
            if not mux._shards:
                break
            await asyncio.sleep(0.02)
        assert mux._shards == [] and mux._by_slot == {}
        assert [k async for k in cbus.redis.scan_iter(match=f"{cbus.keys.prefix}:wake:*")] == []
        # a later subscription to a slot seen before is served by a new shard
        await _stream_all(cbus, mux, [twin(cbus, rid) for rid in rids[:3]])
    finally:
        await mux.stop()


async def test_mux_late_subscription_rings_the_doorbell_of_its_slot(cbus):
    mux = StreamMux(cbus.redis, cbus.keys, "api-1", block_ms=5000)
    await mux.start()
    try:
        first = await mux.subscribe("late-0")
        await asyncio.sleep(0.05)
        # same slot as late-0 (a key the reader is blocked on without it): needs the doorbell
        twin_id = twin(cbus, "late-0")
        sub = await mux.subscribe(twin_id)
        assert len(mux._shards) == 1
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await cbus.publish(cbus.keys.req(twin_id), E.Final(request_id=twin_id, finish_reason="stop"))
        got = await asyncio.wait_for(_drain(sub), 5)
        assert [type(ev) for ev in got] == [E.Final]
        assert time.monotonic() - t0 < 2
        await first.close()
        await mux.stop()
        assert [k async for k in cbus.redis.scan_iter(match=f"{cbus.keys.prefix}:wake:*")] == []
    finally:
        await mux.stop()


async def test_mux_readers_take_turns_beyond_the_read_limit(cbus):
    rids = ids_on_every_master(cbus, cbus.keys.req, 4)
    idle, busy = rids[:4], rids[4:]
    mux = StreamMux(cbus.redis, cbus.keys, "api-1", block_ms=5000, cluster_readers=2)
    await mux.start()
    try:
        for rid in idle:  # streams nothing is written to hold the two reads first
            await mux.subscribe(rid)
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await _stream_all(cbus, mux, busy)
        # idle reads parked for their whole 5 s BLOCK would keep the busy streams waiting
        assert time.monotonic() - t0 < 3
    finally:
        await mux.stop()
