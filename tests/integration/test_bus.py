"""The bus against a real redis-server and the embedded server: what lands on which stream,
what readers see, and what happens to junk."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time

import pytest

from fd.control import events as E
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.keys import GROUP_ENGINES
from fd.control.mux import MuxStopped, StreamMux
from tests.kit.bus import DATA, dead, request, same, story

# ------------------------------------------------------------------ publishing and reading


async def test_publish_then_read_req_round_trip(bus):
    evs = story("r1")
    ids = [await bus.publish(bus.keys.req("r1"), ev) for ev in evs[:2]]
    ids += await bus.publish_many([(bus.keys.req("r1"), ev) for ev in evs[2:]])
    assert all(isinstance(i, bytes) for i in ids) and ids == sorted(
        ids, key=lambda x: tuple(map(int, x.split(b"-")))
    )
    got = await bus.read_req("r1")
    assert [i for i, _ in got] == ids
    assert all(same(a, b) for a, (_, b) in zip(evs, got)) and len(got) == len(evs)
    # after is exclusive
    assert [i for i, _ in await bus.read_req("r1", after=ids[2])] == ids[3:]
    assert await bus.read_req("r1", after=ids[-1]) == []


async def test_publish_many_expires_in_the_same_round_trip(bus):
    key = bus.keys.req("r2")
    await bus.publish_many([(key, E.Accepted(request_id="r2"))], expire=[key])
    assert 0 < await bus.redis.ttl(key) <= bus.req_ttl_s


async def test_submit_writes_accepted_then_request(bus):
    await bus.ensure_group()
    await bus.submit(request("r1"), E.Accepted(request_id="r1", api="api-1", prompt_tokens=3))
    ((_, acc),) = await bus.read_req("r1")
    assert isinstance(acc, E.Accepted) and acc.api == "api-1"
    assert 0 < await bus.redis.ttl(bus.keys.req("r1")) <= bus.req_ttl_s
    ((_, req),) = await bus.claim_requests("e1", 10, None)
    assert req.request_id == "r1" and req.data == DATA


async def test_streams_are_trimmed_approximately(redis_client, keys):
    bus = Bus(redis_client, keys, control_maxlen=10)
    await bus.publish_many([(keys.control, E.Drain(engine="e1"))] * 1000)
    assert await redis_client.xlen(keys.control) <= 250
    for _i in range(5):  # a request's story is never trimmed
        await bus.publish_many([(keys.req("r1"), E.Tokens(request_id="r1", token_ids=(1,)))] * 100)
    assert await redis_client.xlen(keys.req("r1")) == 500


# ------------------------------------------------------------------ control


async def test_hand_typed_abort_is_read_by_read_control(bus):
    cursor = await bus.control_cursor()
    assert cursor == b"0-0"
    entry = await bus.redis.execute_command(
        "XADD", bus.keys.control, "*", "type", "abort", "request_id", "r1"
    )
    cursor, evs = await bus.read_control(cursor, block_ms=None)
    assert cursor == entry
    ((eid, ev),) = evs
    assert eid == entry and ev == E.Abort(request_ids=("r1",), ts=int(entry.split(b"-")[0]))
    assert await bus.read_control(cursor, block_ms=None) == (cursor, [])


async def test_control_cursor_skips_history(bus):
    await bus.publish(bus.keys.control, E.AbortAll())
    cursor = await bus.control_cursor()
    new = await bus.publish(bus.keys.control, E.Drain(engine="e1"))
    cursor2, evs = await bus.read_control(cursor, block_ms=None)
    assert cursor2 == new and [type(e) for _, e in evs] == [E.Drain]


async def test_blocked_read_control_wakes_on_publish(bus):
    cursor = await bus.control_cursor()

    async def later():
        await asyncio.sleep(0.05)
        await bus.publish(bus.keys.control, E.Abort(request_ids=("a", "b")))

    t0 = time.perf_counter()
    task = asyncio.create_task(later())
    _, evs = await bus.read_control(cursor, block_ms=3000)
    await task
    assert time.perf_counter() - t0 < 1.5
    assert [e.request_ids for _, e in evs] == [("a", "b")]


async def test_bad_control_events_are_dead_lettered_and_reading_goes_on(bus, caplog):
    c = bus.keys.control
    x = bus.redis.execute_command
    await x("XADD", c, "*", "type", "explode", "request_id", "r1")
    await x("XADD", c, "*", "type", "abort")
    await x("XADD", c, "*", "type", "abort", "request_id", b"\xff\xfe")
    await x("XADD", c, "*", "type", "tokens", "request_id", "r1", "token_ids", "1")  # wrong stream
    good = await x("XADD", c, "*", "type", "abort", "request_id", "r9")
    with caplog.at_level(logging.WARNING, logger="fd.control.bus"):
        cursor, evs = await bus.read_control(b"0-0", block_ms=None)
    assert cursor == good
    assert [e.request_ids for _, e in evs] == [("r9",)]
    assert bus.dead_letters == 4
    letters = await dead(bus)
    assert [f[b"stream"] for f in letters] == [c.encode()] * 4
    reasons = [f[b"reason"].decode() for f in letters]
    assert "type" in reasons[0] and "explode" in reasons[0]
    assert "request_id" in reasons[1]
    assert "UTF-8" in reasons[2]
    assert "does not belong" in reasons[3]
    assert letters[2][b"request_id"] == b"\xff\xfe"  # the original bytes, kept
    assert letters[0][b"type"] == b"explode" and letters[0][b"request_id"] == b"r1"
    assert sum("dead letter" in r.message for r in caplog.records if r.name == "fd.control.bus") == 4


async def test_dead_letter_prefixes_clashing_fields(bus):
    await bus.dead_letter("src", b"1-1", {"reason": "mine", "x": "1"}, "because")
    (f,) = await dead(bus)
    assert f == {
        b"reason": b"because",
        b"stream": b"src",
        b"entry_id": b"1-1",
        b"orig.reason": b"mine",
        b"x": b"1",
    }


# ------------------------------------------------------------------ requests (group)


async def test_bad_requests_are_dead_lettered_acked_and_skipped(bus):
    await bus.ensure_group()
    await bus.ensure_group()  # idempotent
    r = bus.keys.requests
    x = bus.redis.execute_command
    await x("XADD", r, "*", "type", "request", "request_id", "r1", "data", "{not json")
    await x("XADD", r, "*", "type", "request", "data", '{"prompt_token_ids":[1]}')
    await x("XADD", r, "*", "type", "request", "request_id", "r3", "data", "x" * (E.MAX_FIELD_BYTES + 1))
    await bus.publish(r, E.Abort(request_ids=("r1",)))  # wrong stream
    good = await bus.publish(r, request("ok"))
    got = await bus.claim_requests("e1", 100, None)
    assert [(i, e.request_id) for i, e in got] == [(good, "ok")]
    assert bus.dead_letters == 4
    pending = await bus.redis.xpending(r, GROUP_ENGINES)
    assert pending["pending"] == 1  # only the good one, until its engine acks it
    await bus.ack_request(good)
    assert (await bus.redis.xpending(r, GROUP_ENGINES))["pending"] == 0
    letters = await dead(bus)
    assert [f[b"reason"].split(b":")[0] for f in letters] == [b"data", b"request_id", b"data", b"type"]
    assert letters[2][b"truncated"] == b"data" and len(letters[2][b"data"]) < E.MAX_FIELD_BYTES


async def test_a_dead_letter_that_failed_to_write_is_written_when_the_entry_comes_back(real_bus):
    # Redis fails the dead letter's XADD (a stall, a killed connection): the entry stays
    # pending, and whoever claims it back next (here the same bus, through the failover's
    # autoclaim) writes the dead letter then, instead of taking it for one already written.
    from redis.exceptions import TimeoutError as RedisTimeoutError

    bus = real_bus
    await bus.ensure_group()
    r = bus.keys.requests
    bad = await bus.redis.execute_command(
        "XADD", r, "*", "type", "request", "request_id", "r1", "data", "{not json"
    )
    real_xadd = bus.redis.xadd
    fails = [1]

    async def xadd(name, *a, **kw):
        if name == bus.keys.dead and fails:
            fails.pop()
            raise RedisTimeoutError("Timeout reading from socket")
        return await real_xadd(name, *a, **kw)

    bus.redis.xadd = xadd
    with pytest.raises(RedisTimeoutError):
        await bus.claim_requests("e1", 10, None)
    assert await dead(bus) == []
    assert (await bus.redis.xpending(r, GROUP_ENGINES))["pending"] == 1  # still there to come back to
    assert await bus.autoclaim("e1", min_idle_ms=0) == []
    (letter,) = await dead(bus)
    assert letter[b"entry_id"] == bad and letter[b"reason"].startswith(b"data")
    assert bus.dead_letters == 1
    assert (await bus.redis.xpending(r, GROUP_ENGINES))["pending"] == 0


async def test_two_consumers_share_requests_without_duplicates(bus):
    await bus.ensure_group()
    ids = await bus.publish_many([(bus.keys.requests, request(f"r{i}")) for i in range(60)])
    seen: dict[str, list[bytes]] = {"a": [], "b": []}

    async def consume(name):
        while True:
            got = await bus.claim_requests(name, 7, None)
            if not got:
                return
            seen[name] += [i for i, _ in got]
            for i, _ in got:
                await bus.ack_request(i)
            await asyncio.sleep(0)  # the other consumer's turn (the embedded client never yields)

    await asyncio.gather(consume("a"), consume("b"))
    assert seen["a"] and seen["b"]
    assert sorted(seen["a"] + seen["b"]) == sorted(ids)
    assert not set(seen["a"]) & set(seen["b"])


async def test_blocked_claim_wakes_on_new_request(bus):
    await bus.ensure_group()

    async def later():
        await asyncio.sleep(0.05)
        await bus.publish(bus.keys.requests, request("late"))

    task = asyncio.create_task(later())
    got = await bus.claim_requests("e1", 1, block_ms=3000)
    await task
    assert [e.request_id for _, e in got] == ["late"]


async def test_claim_recreates_a_vanished_group(bus):
    await bus.ensure_group()
    await bus.redis.delete(bus.keys.requests)
    await bus.publish(bus.keys.requests, request("r1"))
    assert [e.request_id for _, e in await bus.claim_requests("e1", 10, None)] == ["r1"]


async def test_claim_recreates_the_group_of_a_deleted_stream(bus):
    """A claim on a P:requests that is gone altogether (not only its group) recreates both:
    fakeredis words that NOGROUP otherwise (fd/control/store.py)."""
    await bus.ensure_group()
    await bus.redis.delete(bus.keys.requests)
    assert await bus.claim_requests("e1", 10, 10) == []
    await bus.publish(bus.keys.requests, request("r1"))
    assert [e.request_id for _, e in await bus.claim_requests("e1", 10, None)] == ["r1"]


async def test_autoclaim_takes_over_a_dead_consumers_requests(bus):
    await bus.ensure_group()
    await bus.publish_many([(bus.keys.requests, request(f"r{i}")) for i in range(3)])
    taken = await bus.claim_requests("dead-engine", 10, None)
    assert len(taken) == 3
    assert await bus.autoclaim("e2", min_idle_ms=10_000) == []  # not idle long enough
    await asyncio.sleep(0.15)
    got = await bus.autoclaim("e2", min_idle_ms=100)
    assert [(i, e.request_id) for i, e in got] == [(i, e.request_id) for i, e in taken]
    detail = await bus.redis.xpending_range(bus.keys.requests, GROUP_ENGINES, "-", "+", 10)
    assert {d["consumer"] for d in detail} == {b"e2"}
    assert all(d["times_delivered"] == 2 for d in detail)


# ------------------------------------------------------------------ ownership, TTLs, engines


async def test_try_own_first_wins(bus):
    assert await bus.owner("r1") is None
    assert await bus.try_own("r1", "e1", 60) == (True, "e1")
    assert await bus.try_own("r1", "e2", 60) == (False, "e1")
    assert await bus.owner("r1") == "e1"
    assert 0 < await bus.redis.ttl(bus.keys.owner("r1")) <= 60


async def test_try_own_many_matches_try_own_one_by_one(bus):
    await bus.try_own("taken", "e1", 60)
    got = await bus.try_own_many(["free1", "taken", "free2", "free1"], "aborted", 30)
    # the repeated id loses to its own first tombstone, as a second try_own would
    assert got == [(True, "aborted"), (False, "e1"), (True, "aborted"), (False, "aborted")]
    assert await bus.owner("free2") == "aborted" and await bus.owner("taken") == "e1"
    assert 0 < await bus.redis.ttl(bus.keys.owner("free1")) <= 30
    assert await bus.try_own_many([], "aborted", 30) == []


async def test_publish_many_sets_ttl(bus):
    await bus.publish(bus.keys.req("r1"), E.Accepted(request_id="r1"))
    await bus.try_own("r1", "e1", 10_000_000)
    assert await bus.redis.ttl(bus.keys.req("r1")) == -1
    await bus.publish_many([], expire=[bus.keys.req("r1"), bus.keys.owner("r1")])
    assert 0 < await bus.redis.ttl(bus.keys.req("r1")) <= bus.req_ttl_s
    assert 0 < await bus.redis.ttl(bus.keys.owner("r1")) <= bus.req_ttl_s


async def test_heartbeat_and_engines(bus):
    assert await bus.engines() == {}
    await bus.heartbeat("e1", {"running": 2, "kv_free": 0.5, "state": "up"}, ttl_s=30)
    await bus.heartbeat("e2", {"running": 0}, ttl_s=30)
    assert await bus.engines() == {
        "e1": {"running": "2", "kv_free": "0.5", "state": "up"},
        "e2": {"running": "0"},
    }
    assert 0 < await bus.redis.ttl(bus.keys.engine("e1")) <= 30


async def test_read_req_dead_letters_junk_and_foreign_events(bus):
    key = bus.keys.req("r1")
    await bus.publish(key, E.Accepted(request_id="r1"))
    await bus.redis.execute_command("XADD", key, "*", "type", "tokens", "request_id", "r1", "token_ids", "x")
    await bus.publish(key, E.Tokens(request_id="other", token_ids=(1,)))
    await bus.publish(key, E.Final(request_id="r1", finish_reason="stop"))
    assert [e.TYPE for _, e in await bus.read_req("r1")] == ["accepted", "final"]
    assert bus.dead_letters == 2


async def test_read_req_waits_past_trailing_junk_and_dead_letters_it_once(bus):
    key = bus.keys.req("r1")
    acc = await bus.publish(key, E.Accepted(request_id="r1"))
    await bus.redis.execute_command("XADD", key, "*", "type", "tokens", "request_id", "r1")
    for _ in range(2):  # a caller resuming after its last good event sees the junk again
        t0 = time.perf_counter()
        assert await bus.read_req("r1", after=acc, block_ms=200) == []
        assert time.perf_counter() - t0 >= 0.15  # it blocked past the junk instead of spinning
    assert await bus.read_req("r1", after=acc) == []
    assert bus.dead_letters == 1 and await bus.redis.xlen(bus.keys.dead) == 1

    async def later():
        await asyncio.sleep(0.05)
        await bus.publish(key, E.Final(request_id="r1", finish_reason="stop"))

    task = asyncio.create_task(later())
    assert [e.TYPE for _, e in await bus.read_req("r1", after=acc, block_ms=3000)] == ["final"]
    await task


# ------------------------------------------------------------------ StreamMux


async def _collect(sub):
    return [(i, e) async for i, e in sub]


async def test_mux_many_subscriptions_each_get_their_story(bus, keys):
    mux = StreamMux(bus.redis, keys, "api-1", shard_size=8, block_ms=500)
    await mux.start()
    try:
        rids = [f"r{i}" for i in range(30)]
        subs = [await mux.subscribe(r) for r in rids]
        readers = [asyncio.create_task(_collect(s)) for s in subs]
        stories = {r: story(r, n_tokens=1 + i % 4) for i, r in enumerate(rids)}
        for step in range(max(len(s) for s in stories.values())):  # interleaved, as engines would
            await bus.publish_many([(keys.req(r), s[step]) for r, s in stories.items() if step < len(s)])
        results = await asyncio.wait_for(asyncio.gather(*readers), 10)
        for r, got in zip(rids, results):
            assert len(got) == len(stories[r])
            assert all(same(a, b) for a, (_, b) in zip(stories[r], got))
            assert [i for i, _ in got] == [i for i, _ in await bus.read_req(r)]
        assert len(mux._shards) == 4
    finally:
        await mux.stop()


async def test_mux_subscription_while_blocked_is_served_promptly(bus, keys):
    mux = StreamMux(bus.redis, keys, "api-1", block_ms=5000)
    await mux.start()
    try:
        first = await mux.subscribe("r0")
        await asyncio.sleep(0.1)  # the shard is now parked in a 5 s XREAD without r1
        assert mux._shards[0].blocked
        sub = await mux.subscribe("r1")
        t0 = time.perf_counter()
        await bus.publish(keys.req("r1"), E.Accepted(request_id="r1"))
        _, ev = await asyncio.wait_for(sub.__anext__(), 2)
        assert isinstance(ev, E.Accepted)
        assert time.perf_counter() - t0 < 1.0
        await first.close()
        await sub.close()
        assert [x async for x in sub] == []
    finally:
        t0 = time.perf_counter()
        await mux.stop()
    assert time.perf_counter() - t0 < 1.0  # the doorbell also ends a blocked read on stop
    assert await bus.redis.exists(keys.wake("api-1.0")) == 0


async def test_mux_takes_this_processs_appends_as_told_and_reads_the_rest(embedded_redis, keys):
    """On the embedded server's in-process client a subscription that has seen everything takes
    an engine's fenced events as the store tells them (no read back), an entry written through
    the TCP door (another process) comes by the read, and the story the subscription sees is
    the stream's own: the same ids, the same events, ``ts`` included, each once, in order."""
    client = embedded_redis.client()
    door = connect(embedded_redis.url)
    bus = Bus(client, keys)
    mux = StreamMux(client, keys, "api-told", block_ms=5000)
    await mux.start()
    assert mux.hear_in_process()  # (fd serve's composition wires it)
    try:
        await bus.publish(keys.req("r"), E.Accepted(request_id="r", prompt_tokens=3))
        sub = await mux.subscribe("r")
        reader = asyncio.create_task(_collect(sub))
        await client.set(keys.owner("r"), "e1#1")
        owners = {"r": "e1#1"}
        tokens = [E.Tokens(request_id="r", token_ids=(i,), text=f"t{i}", step=i) for i in range(3)]
        for ev in tokens[:2]:
            assert await bus.publish_owned([(keys.req("r"), ev)], owners) == {}
            await asyncio.sleep(0.05)  # (the subscription is current before the next one)
        # another process's entry: the one after it is not told to a reader that has not read it
        await door.xadd(keys.req("r"), E.Claimed(request_id="r", engine="e2").encode())
        final = E.Final(request_id="r", finish_reason="length", usage={"completion_tokens": 3})
        assert await bus.publish_owned([(keys.req("r"), tokens[2]), (keys.req("r"), final)], owners) == {}
        got = await asyncio.wait_for(reader, 5)
        assert got == await bus.read_req("r")
        assert [type(e).__name__ for _, e in got] == [
            "Accepted",
            "Tokens",
            "Tokens",
            "Claimed",
            "Tokens",
            "Final",
        ]
        assert mux.told >= 2  # (the first two tokens at least: the subscription was current)
        assert mux.told <= 4
    finally:
        await mux.stop()
        await door.aclose()
        await client.aclose()


async def test_a_subscription_behind_reads_what_one_that_is_current_is_told(embedded_redis, keys):
    """Two subscriptions of one story: one current, one resuming from the start while entries
    are told. Each gets the whole story once, in order; the one behind by the reads."""
    client = embedded_redis.client()
    bus = Bus(client, keys)
    mux = StreamMux(client, keys, "api-behind", block_ms=5000)
    await mux.start()
    assert mux.hear_in_process()
    try:
        await client.set(keys.owner("r"), "e1#1")
        owners = {"r": "e1#1"}
        await bus.publish(keys.req("r"), E.Accepted(request_id="r", prompt_tokens=3))
        current = await mux.subscribe("r")
        first = asyncio.create_task(_collect(current))
        for i in range(20):
            ev = E.Tokens(request_id="r", token_ids=(i,), text=f"t{i}", step=i)
            assert await bus.publish_owned([(keys.req("r"), ev)], owners) == {}
            if i == 10:
                behind = await mux.subscribe("r", b"0")
                second = asyncio.create_task(_collect(behind))
            await asyncio.sleep(0)
        final = E.Final(request_id="r", finish_reason="length", usage={"completion_tokens": 20})
        assert await bus.publish_owned([(keys.req("r"), final)], owners) == {}
        want = await bus.read_req("r")
        assert await asyncio.wait_for(first, 5) == want
        assert await asyncio.wait_for(second, 5) == want
        assert mux.told >= 10
    finally:
        await mux.stop()
        await client.aclose()


async def test_mux_doorbell_on_the_embedded_client_is_capped_and_expires(embedded_redis, keys):
    """On the embedded server's in-process client a blocked reader is rung as on Redis: each
    ring wakes it, and the doorbell stays capped and has its TTL."""
    client = embedded_redis.client()
    mux = StreamMux(client, keys, "api-db", block_ms=5000)
    await mux.start()
    wake = keys.wake("api-db.0")
    try:
        subs = []
        for i in range(5 * StreamMux.WAKE_MAXLEN):
            for _ in range(200):
                if mux._shards and mux._shards[0].blocked and not mux._shards[0].rang:
                    break
                await asyncio.sleep(0.005)
            subs.append(await mux.subscribe(f"db{i}"))
            await client.xadd(keys.req(f"db{i}"), {"type": "accepted", "request_id": f"db{i}"})
            _, ev = await asyncio.wait_for(subs[-1].__anext__(), 2)  # woken, and served
            assert isinstance(ev, E.Accepted)
        assert 0 < await client.xlen(wake) <= 2 * StreamMux.WAKE_MAXLEN
        assert 0 < await client.ttl(wake) <= 86400
        for sub in subs:
            await sub.close()
    finally:
        await mux.stop()
        await client.aclose()


async def test_mux_resume_after_entry_id(bus, keys):
    evs = story("r1", n_tokens=4)
    ids = await bus.publish_many([(keys.req("r1"), e) for e in evs])
    mux = StreamMux(bus.redis, keys, "api-1", block_ms=500)
    await mux.start()
    try:
        got = await asyncio.wait_for(_collect(await mux.subscribe("r1", after=ids[2])), 5)
        assert [i for i, _ in got] == ids[3:]
        assert all(same(a, b) for a, (_, b) in zip(evs[3:], got))
        # two subscribers of one request at different points, one shard key
        s_all, s_late = await mux.subscribe("r1"), await mux.subscribe("r1", after=ids[-2].decode())
        got_all, got_late = await asyncio.wait_for(asyncio.gather(_collect(s_all), _collect(s_late)), 5)
        assert [i for i, _ in got_all] == ids and [i for i, _ in got_late] == ids[-1:]
    finally:
        await mux.stop()


async def test_mux_resume_added_while_a_read_is_in_flight_misses_nothing(real_bus, keys):
    """A subscription from an earlier id, made while a read for the same key is on its way
    back (a client resuming with Last-Event-ID while another streams the request live), gets
    no entry of that read — it would skip the ones in between — and the next read serves it
    from its own id. Before: it took the read's entries and lost the four before them."""
    bus = real_bus
    evs = story("rr", n_tokens=8)
    key = keys.req("rr")
    mux = StreamMux(bus.redis, keys, "api-rr", block_ms=5000)
    await mux.start()
    ids = await bus.publish_many([(key, e) for e in evs[:6]])
    live = await mux.subscribe("rr")
    first = [await asyncio.wait_for(live.__anext__(), 5) for _ in range(6)]
    late: list = []
    real_xread = bus.redis.xread

    async def xread(streams, **kw):
        res = await real_xread(streams, **kw)
        if not late and any(k == key.encode() for k, _ in res or ()):
            late.append(await mux.subscribe("rr", after=ids[1]))  # before the read is handed out
        return res

    bus.redis.xread = xread
    try:
        ids += await bus.publish_many([(key, e) for e in evs[6:]])
        rest = await asyncio.wait_for(_collect(live), 5)
        got_late = await asyncio.wait_for(_collect(late[0]), 5)
    finally:
        del bus.redis.xread
        await mux.stop()
    assert [i for i, _ in first + rest] == ids
    assert [i for i, _ in got_late] == ids[2:]


async def test_mux_skips_junk_and_stops_cleanly(bus, keys):
    mux = StreamMux(bus.redis, keys, "api-1", block_ms=500)
    await mux.start()
    sub = await mux.subscribe("r1")
    await bus.publish(keys.req("r1"), E.Accepted(request_id="r1"))
    await bus.redis.execute_command("XADD", keys.req("r1"), "*", "type", "nonsense")
    await bus.publish(keys.req("r1"), E.Tokens(request_id="r1", token_ids=(7,)))
    got = [await asyncio.wait_for(sub.__anext__(), 5) for _ in range(2)]
    assert [e.TYPE for _, e in got] == ["accepted", "tokens"]
    assert mux.dead_letters == 1
    await mux.stop()
    with pytest.raises(MuxStopped):
        await sub.__anext__()
    with pytest.raises(MuxStopped):
        await mux.subscribe("r2")


# ------------------------------------------------------------------ the embedded server's TCP door


async def test_redis_cli_reaches_the_embedded_server(embedded_redis, keys):
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli is not on PATH; install it (`apt-get install redis-tools`)")
    client = embedded_redis.client()
    bus = Bus(client, keys)
    try:
        cursor = await bus.control_cursor()
        out = subprocess.run(
            [
                cli,
                "-p",
                str(embedded_redis.port),
                "XADD",
                keys.control,
                "*",
                "type",
                "abort",
                "request_id",
                "r1",
            ],
            capture_output=True,
            timeout=10,
            check=True,
        )
        cursor, evs = await bus.read_control(cursor, block_ms=1000)
        assert cursor == out.stdout.strip()
        assert [e.request_ids for _, e in evs] == [("r1",)]
    finally:
        await client.aclose()


async def test_tcp_and_in_process_clients_share_data(embedded_redis, keys):
    tcp, local = connect(embedded_redis.url), embedded_redis.client()
    try:
        a, b = Bus(tcp, keys), Bus(local, keys)
        await a.ensure_group()
        await a.submit(request("r1"), E.Accepted(request_id="r1"))
        ((_, got),) = await b.claim_requests("e1", 10, block_ms=None)
        assert got.request_id == "r1"
        # a blocked in-process reader is woken by a TCP writer
        task = asyncio.create_task(b.read_control(b"0-0", block_ms=3000))
        await asyncio.sleep(0.05)
        await a.publish(keys.control, E.AbortAll())
        _, evs = await asyncio.wait_for(task, 5)
        assert [type(e) for _, e in evs] == [E.AbortAll]
    finally:
        await tcp.aclose()
        await local.aclose()
