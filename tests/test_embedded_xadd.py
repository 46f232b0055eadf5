"""The embedded server's in-process XADD (control/embedded.py's fast path) against fakeredis'
own XADD, reached through the TCP door, which never takes the fast path: the same stream
contents, TTLs kept, errors, transactions, WATCH and blocked readers all as before."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError


@pytest.fixture
async def clients(embedded_redis):
    fast = embedded_redis.client()
    tcp = aioredis.from_url(embedded_redis.url)
    yield fast, tcp
    await fast.aclose()
    await tcp.aclose()


@pytest.fixture
def k():
    """Key names of this test's own: the embedded server is shared by the whole session."""
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"xadd-{tag}:{name}"


async def test_the_same_entries_as_fakeredis_own_xadd(clients, k, monkeypatch):
    from control import embedded

    taken = []
    real = embedded._xadd
    monkeypatch.setattr(embedded, "_xadd", lambda sock, f: taken.append(real(sock, f)) or taken[-1])
    fast, tcp = clients
    rows = [{"type": "tokens", "text": "x" * i, "n": str(i)} for i in range(300)]
    rows.append({"other": "fields"})  # a different field set: a new stream node
    pipe = fast.pipeline(transaction=False)
    for r in rows:
        pipe.xadd(k("s:fast"), r)
    ids = await pipe.execute()
    for r in rows:
        await tcp.xadd(k("s:tcp"), r)
    got_fast = [f for _, f in await tcp.xrange(k("s:fast"))]
    got_tcp = [f for _, f in await tcp.xrange(k("s:tcp"))]
    assert got_fast == got_tcp == [{a.encode(): b.encode() for a, b in r.items()} for r in rows]
    assert ids == [e for e, _ in await tcp.xrange(k("s:fast"))]
    keys = [tuple(map(int, i.split(b"-"))) for i in ids]
    assert keys == sorted(set(keys))  # strictly increasing
    info_fast, info_tcp = await tcp.xinfo_stream(k("s:fast")), await tcp.xinfo_stream(k("s:tcp"))
    for field in ("length", "entries-added"):  # (node packing depends on the ids' timing)
        assert info_fast[field] == info_tcp[field], field
    assert await fast.type(k("s:fast")) == b"stream"
    assert taken.count(True) == len(rows)  # every in-process XADD took the fast path


async def test_a_ttl_is_kept_and_an_expired_stream_starts_afresh(clients, k):
    fast, tcp = clients
    await fast.xadd(k("s"), {"a": "1"})
    await tcp.expire(k("s"), 100)
    await fast.xadd(k("s"), {"a": "2"})
    assert 0 < await tcp.ttl(k("s")) <= 100 and await tcp.xlen(k("s")) == 2
    await tcp.pexpire(k("s"), 1)
    await asyncio.sleep(0.01)
    await fast.xadd(k("s"), {"a": "3"})
    assert await tcp.xlen(k("s")) == 1 and await tcp.ttl(k("s")) == -1


async def test_other_forms_and_types_take_the_generic_path(clients, k):
    fast, tcp = clients
    await tcp.set(k("str"), "v")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await fast.xadd(k("str"), {"a": "1"})
    for i in range(20):
        await fast.xadd(k("capped"), {"i": str(i)}, maxlen=5, approximate=False)
    assert await tcp.xlen(k("capped")) == 5
    assert await fast.xadd(k("explicit"), {"a": "1"}, id="5-1") == b"5-1"
    with pytest.raises(ResponseError):
        await fast.xadd(k("explicit"), {"a": "1"}, id="5-1")  # not greater than the last id
    async with fast.pipeline(transaction=True) as pipe:  # MULTI/EXEC queues, then runs
        pipe.xadd(k("tx"), {"a": "1"})
        pipe.xadd(k("tx"), {"a": "2"})
        res = await pipe.execute()
    assert len(res) == 2 and await tcp.xlen(k("tx")) == 2


async def test_watch_and_blocked_readers_see_a_fast_xadd(clients, k, embedded_redis):
    fast, tcp = clients
    other = embedded_redis.client()
    try:
        reader = asyncio.create_task(other.xread({k("w"): "$"}, block=5000))
        await asyncio.sleep(0.05)
        await fast.xadd(k("w"), {"a": "1"})
        got = await asyncio.wait_for(reader, 2)
        assert got and got[0][1][0][1] == {b"a": b"1"}
        async with tcp.pipeline(transaction=True) as pipe:
            await pipe.watch(k("w"))
            await fast.xadd(k("w"), {"a": "2"})  # the watched key changed
            pipe.multi()
            pipe.set(k("after"), "1")
            with pytest.raises(WatchError):
                await pipe.execute()
    finally:
        await other.aclose()


async def test_bus_publish_many_appends_directly_in_order(embedded_redis, k):
    """``Bus.publish_many`` on the in-process client appends the entries itself: ids come back
    in item order, every entry is where it belongs, expiries still apply."""
    from control.bus import Bus
    from control.events import Abort, Tokens
    from control.keys import Keys

    client = embedded_redis.client()
    appended = []
    real = client.fd_append
    client.fd_append = lambda stream, fields, event=None: (
        appended.append(stream) or real(stream, fields, event)
    )
    try:
        bus = Bus(client, Keys(k("p")))
        a, b = bus.keys.req("a"), bus.keys.req("b")
        items = [
            (a, Tokens(request_id="a", token_ids=(1,), text="x", step=1)),
            (b, Tokens(request_id="b", token_ids=(2,), text="y", step=1)),
            (bus.keys.control, Abort(request_ids=("a",), source="cli")),  # capped
            (a, Tokens(request_id="a", token_ids=(3,), text="z", step=2)),
        ]
        ids = await bus.publish_many(items, expire=[a])
        assert appended == [a, b, bus.keys.control, a]  # capped streams too (trimmed now and then)
        got_a = [e for e, _ in await client.xrange(a)]
        got_b = [e for e, _ in await client.xrange(b)]
        got_c = [e for e, _ in await client.xrange(bus.keys.control)]
        assert ids == [got_a[0], got_b[0], got_c[0], got_a[1]]
        assert [ev.token_ids for _, ev in await bus.read_req("a")] == [(1,), (3,)]
        assert 0 < await client.ttl(a) <= bus.req_ttl_s and await client.ttl(b) == -1
    finally:
        await client.aclose()


async def test_a_journal_appended_directly_is_still_capped(embedded_redis, k):
    from control.bus import TRIM_EVERY, Bus
    from control.events import JournalStep
    from control.keys import Keys

    client = embedded_redis.client()
    try:
        bus = Bus(client, Keys(k("p")), journal_maxlen=100)
        key = bus.keys.journal("e0")
        for seq in range(3 * TRIM_EVERY + 5):
            await bus.publish_many([(key, JournalStep(engine="e0", step=seq, seq=seq, data={}))])
        n = await client.xlen(key)
        assert 100 <= n <= 100 + TRIM_EVERY  # MAXLEN ~: whole nodes, at most a trim late
        last = await client.xrevrange(key, count=1)
        assert last[0][1][b"seq"] == str(3 * TRIM_EVERY + 4).encode()  # the newest kept
    finally:
        await client.aclose()


async def test_tombstones_laid_directly_match_set_nx_get(embedded_redis, k):
    """``Bus.tombstone_many`` on the in-process client against the same calls through the TCP
    door (SET NX GET EX + EXISTS in a pipeline): winners, owners, streams, TTLs, an id twice,
    WATCH, and a key of another type."""
    from control.bus import Bus
    from control.keys import Keys

    fast_client = embedded_redis.client()
    tcp_client = aioredis.from_url(embedded_redis.url)
    assert not hasattr(tcp_client, "fd_tombstones")
    try:
        results = {}
        for name, client in (("fast", fast_client), ("tcp", tcp_client)):
            bus = Bus(client, Keys(k(name)))
            await client.set(bus.keys.owner("owned"), "engine-1")
            await client.xadd(bus.keys.req("queued"), {"type": "accepted"})
            ids = ["ghost", "owned", "queued", "ghost"]  # one twice
            results[name] = await bus.tombstone_many(ids, "http", 600)
            assert 590 <= await client.ttl(bus.keys.owner("ghost")) <= 600
            assert await client.get(bus.keys.owner("owned")) == b"engine-1"
        assert (
            results["fast"]
            == results["tcp"]
            == [
                (True, "aborted:http", False),
                (False, "engine-1", False),
                (True, "aborted:http", True),
                (False, "aborted:http", False),
            ]
        )
        bus = Bus(fast_client, Keys(k("w")))
        async with tcp_client.pipeline(transaction=True) as pipe:  # take_abort_story's WATCH
            await pipe.watch(bus.keys.owner("x"))
            await bus.tombstone_many(["x"], "cli", 600)
            pipe.multi()
            pipe.set(bus.keys.owner("x"), "other")
            with pytest.raises(WatchError):
                await pipe.execute()
        await tcp_client.xadd(bus.keys.owner("stream-typed"), {"a": "1"})
        with pytest.raises(ResponseError, match="WRONGTYPE"):  # the ordinary path said it
            await bus.tombstone_many(["stream-typed"], "cli", 600)
    finally:
        await fast_client.aclose()
        await tcp_client.aclose()


async def test_the_direct_xread_reads_what_xread_reads(embedded_redis, k):
    """The mux's in-process XREAD against fakeredis' own through the TCP door: the same
    entries for every position, COUNT, missing keys; None for a key of another type; a blocked
    read woken by a write on this loop and by one from another thread (redis-cli's door), and
    an empty answer when the block runs out."""
    fast = embedded_redis.client()
    tcp = aioredis.from_url(embedded_redis.url)
    xread = fast.fd_xread
    try:
        a, b, missing = k("a").encode(), k("b").encode(), k("missing").encode()
        ids = [await tcp.xadd(a, {"n": str(i), "t": "x" * i}) for i in range(12)]
        await tcp.xadd(b, {"only": "one"})
        for after in (b"0", b"0-0", ids[0], ids[5], ids[-1]):
            for count in (None, 1, 5, 100):
                streams = {a: after, b: b"0-0", missing: b"0-0"}
                want = await tcp.xread(streams, count=count)
                got = await xread(streams, count)
                assert got == want, (after, count)
        await tcp.set(k("str"), "v")
        assert await xread({k("str").encode(): b"0-0"}, None) is None
        t = asyncio.get_running_loop().time()
        assert await xread({a: ids[-1]}, None, 50) == []  # nothing new: the block runs out
        assert asyncio.get_running_loop().time() - t >= 0.045
        for writer in (fast, tcp):  # this loop's client, then another thread's connection
            reader = asyncio.create_task(xread({a: ids[-1], b: b"0-0"}, None, 5000))
            await asyncio.sleep(0)
            got = await asyncio.wait_for(reader, 2)
            assert got and got[0][0] == b  # b's old entry is there at once
            reader = asyncio.create_task(xread({a: ids[-1]}, None, 5000))
            await asyncio.sleep(0.05)
            new = await writer.xadd(a, {"late": "1"})
            got = await asyncio.wait_for(reader, 2)
            assert got == [[a, [(new, {b"late": b"1"})]]]
            ids.append(new)
    finally:
        await fast.aclose()
        await tcp.aclose()


async def test_a_pipeline_costs_no_loop_turn_and_hands_its_connection_back(clients, k):
    """redis-py releases a pipeline's connection through asyncio.shield (a task: three loop
    turns); the in-process client's pipeline releases it in place. More pipelines than the
    pool has connections, plain and transactional, WATCHed too: no turn, nothing held."""
    from control.connect import MAX_CONNECTIONS

    fast, _ = clients
    turns = 0
    stop = False

    async def spin():
        nonlocal turns
        while not stop:
            turns += 1
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin())
    await asyncio.sleep(0)
    before = turns
    for i in range(MAX_CONNECTIONS + 10):
        res = await fast.pipeline(transaction=bool(i % 2)).set(k("p"), str(i)).get(k("p")).execute()
        assert res == [True, str(i).encode()]
    assert turns == before  # the spinner never ran: no pipeline gave up the loop
    stop = True
    await spinner
    async with fast.pipeline() as pipe:  # WATCH still works, and gives its connection back
        await pipe.watch(k("p"))
        value = await pipe.get(k("p"))
        pipe.multi()
        pipe.set(k("p"), value + b"!")
        assert await pipe.execute() == [True]
    assert await fast.get(k("p")) == str(MAX_CONNECTIONS + 9).encode() + b"!"
    assert not fast.connection_pool._in_use_connections


async def test_keys_past_their_ttl_leave_memory_without_being_touched(k, monkeypatch):
    """A finished request's stream is never read again: the server drops it when its TTL is
    up, as Redis' active expiry does, not only when something touches or walks the keys."""
    from control.embedded import EmbeddedRedis

    monkeypatch.setattr(EmbeddedRedis, "EXPIRE_EVERY_S", 0.05)
    with EmbeddedRedis() as emb:
        client = emb.client()
        await client.xadd(k("req"), {"type": "final"})
        await client.pexpire(k("req"), 100)
        await client.set(k("kept"), "v")
        stored = emb.fake_server.dbs[0]._dict  # (not iterated: that alone would expire keys)
        assert k("req").encode() in stored
        for _ in range(100):
            if k("req").encode() not in stored:
                break
            await asyncio.sleep(0.02)
        assert k("req").encode() not in stored and k("kept").encode() in stored
        await client.aclose()


async def test_direct_get_exists_and_expire_match_the_commands(clients, k):
    """The in-process client's fd_get / fd_exists / fd_expire (a request's way in: the owner
    check, an explicit id's check, its stream's TTL) against GET / EXISTS / EXPIRE and TTL
    through the TCP door."""
    fast, tcp = clients
    await tcp.set(k("s"), "v")
    await tcp.set(k("gone"), "v", px=1)
    await tcp.xadd(k("x"), {"a": "b"})
    await asyncio.sleep(0.01)
    assert fast.fd_get(k("s")) == (await tcp.get(k("s")),) == (b"v",)
    assert fast.fd_get(k("none")) == (await tcp.get(k("none")),) == (None,)
    assert fast.fd_get(k("gone")) == (None,)
    assert fast.fd_get(k("x")) is None  # another type: the ordinary GET says WRONGTYPE
    with pytest.raises(ResponseError):
        await tcp.get(k("x"))
    for name in ("s", "none", "gone", "x"):
        assert fast.fd_exists(k(name)) == bool(await tcp.exists(k(name)))
    assert fast.fd_expire([k("x"), k("none"), k("s")], 120) == [True, False, True]
    assert 119 <= await tcp.ttl(k("x")) <= 120 and 119 <= await tcp.ttl(k("s")) <= 120
    assert await tcp.ttl(k("none")) == -2
    # a WATCH on another connection sees the key modified, as with EXPIRE
    async with tcp.pipeline() as pipe:
        await pipe.watch(k("x"))
        fast.fd_expire([k("x")], 60)
        pipe.multi()
        pipe.set(k("w"), "1")
        with pytest.raises(WatchError):
            await pipe.execute()
    # the ordinary path, where it must be taken, still works on this client
    assert fast.fd_expire([k("x")], 0) is None


async def test_bus_owner_and_submit_take_the_direct_paths(embedded_redis, k, monkeypatch):
    """Bus.owner, Bus.request_exists and Bus.submit's TTL on the embedded client: the same
    answers and TTLs as on the wire, and no redis-py command for them."""
    from control.bus import Bus
    from control.keys import Keys
    from tests.enginekit import submit

    client = embedded_redis.client()
    bus = Bus(client, Keys(k("p")))
    sent = []
    real = client.execute_command

    async def counted(*args, **kw):
        sent.append(args[0])
        return await real(*args, **kw)

    monkeypatch.setattr(client, "execute_command", counted)
    assert await bus.owner("r1") is None and not await bus.request_exists("r1")
    await submit(bus, "r1", [1, 2, 3], max_tokens=2)
    assert await bus.request_exists("r1")
    assert 0 < await client.ttl(bus.keys.req("r1")) <= bus.req_ttl_s
    await client.set(bus.keys.owner("r1"), "engine-x")
    assert await bus.owner("r1") == "engine-x"
    assert not {"GET", "EXISTS", "EXPIRE"} & set(sent)
    await client.aclose()


async def test_claims_own_their_requests_directly_as_set_nx_get_would(clients, k):
    """fd_set_nx_get (an engine owning a claimed burst) against SET NX GET EX through the TCP
    door: old values where taken, a TTL where set, an id twice sees its first write, and a
    key of another type leaves everything to the ordinary path."""
    from control.bus import Bus
    from control.keys import Keys

    fast, tcp = clients
    await tcp.set(k("taken"), "aborted:http")
    assert fast.fd_set_nx_get([k("new"), k("taken"), k("new")], "e1", 60) == [None, b"aborted:http", b"e1"]
    assert await tcp.get(k("new")) == b"e1" and 59 <= await tcp.ttl(k("new")) <= 60
    assert await tcp.ttl(k("taken")) == -1  # NX: untouched, TTL too
    await tcp.xadd(k("stream"), {"a": "b"})
    assert fast.fd_set_nx_get([k("other"), k("stream")], "e1", 60) is None
    assert await tcp.exists(k("other")) == 0  # nothing written
    bus = Bus(fast, Keys(k("p")))
    await tcp.set(bus.keys.owner("lost"), "e0")
    assert await bus.try_own_many(["won", "lost"], "e1", 60) == [(True, "e1"), (False, "e0")]


async def test_a_direct_claim_and_ack_match_xreadgroup_xack_and_xdel(clients, k):
    """fd_read_group (an engine's claim without BLOCK) and fd_ack_delete (a flush's finished
    requests leaving P:requests) against XREADGROUP, XACK and XDEL through the TCP door, on
    two groups fed the same entries: the same replies, the same pending lists and stream."""
    fast, tcp = clients
    a, b = k("reqs-a"), k("reqs-b")
    for key in (a, b):
        await tcp.xgroup_create(key, "g", id="0", mkstream=True)
    ids = {a: [], b: []}
    for i in range(7):
        for key in (a, b):
            ids[key].append(await tcp.xadd(key, {"type": "request", "n": str(i)}))

    def same(x, y):  # (the two streams' entry ids differ; their order and fields do not)
        return [[f for _, f in es] for _, es in x] == [[f for _, f in es] for _, es in y]

    first = fast.fd_read_group(a, "g", "c1", 3)
    assert same(first, await tcp.xreadgroup("g", "c1", {b: ">"}, count=3))
    assert [e for e, _ in first[0][1]] == ids[a][:3] and first[0][0] == a.encode()
    rest = fast.fd_read_group(a, "g", "c2", None)
    assert same(rest, await tcp.xreadgroup("g", "c2", {b: ">"}))
    assert (
        fast.fd_read_group(a, "g", "c1", 5)
        == []
        == (await tcp.xreadgroup("g", "c1", {b: ">"}, count=5) or [])
    )
    for key in (a, b):  # both groups now hold the same pending entries, per consumer
        p = await tcp.xpending(key, "g")
        assert p["pending"] == 7 and sorted(c["pending"] for c in p["consumers"]) == [3, 4]

    done = [ids[a][0], ids[a][4], b"1-1"]  # (one id that is not there)
    assert fast.fd_ack_delete(a, "g", done) == (2, 2)
    assert (
        await tcp.xack(b, "g", ids[b][0], ids[b][4], b"1-1"),
        await tcp.xdel(b, ids[b][0], ids[b][4], b"1-1"),
    ) == (2, 2)
    assert (await tcp.xpending(a, "g"))["pending"] == (await tcp.xpending(b, "g"))["pending"] == 5
    assert [f for _, f in await tcp.xrange(a)] == [f for _, f in await tcp.xrange(b)]
    assert await tcp.xlen(a) == 5

    # nothing to go on: the ordinary command says what is wrong
    assert fast.fd_read_group(k("none"), "g", "c1", 1) is None
    assert fast.fd_read_group(a, "nogroup", "c1", 1) is None
    await tcp.set(k("str"), "x")
    assert fast.fd_read_group(k("str"), "g", "c1", 1) is None
    assert fast.fd_ack_delete(k("str"), "g", [b"1-1"]) is None
    assert fast.fd_ack_delete(k("none"), "g", [b"1-1"]) == (0, 0)


async def test_an_engine_claims_and_acks_directly_on_the_embedded_client(embedded_redis, k, monkeypatch):
    """Bus.claim_requests without BLOCK and the acks of publish_many take the direct paths
    (no XREADGROUP, XACK or XDEL command reaches fakeredis), and a vanished group is still
    recreated by the ordinary path."""
    from control import events as E
    from control.bus import Bus
    from control.embedded import _DirectConnection
    from control.keys import Keys
    from control.request_data import RequestData
    from control.sampling import SamplingParams

    client = embedded_redis.client()
    try:
        bus = Bus(client, Keys(k("p")))
        await bus.ensure_group()
        sent = []
        real = _DirectConnection.pack_command

        def spy(self, *args):  # every command of the client, alone or in a pipeline
            sent.append(args[0])
            return real(self, *args)

        monkeypatch.setattr(_DirectConnection, "pack_command", spy)
        data = RequestData(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2))
        for rid in ("d1", "d2"):
            await bus.submit(E.Request(request_id=rid, data=data), E.Accepted(request_id=rid))
        got = await bus.claim_requests("e1", 10, None)
        assert [r.request_id for _, r in got] == ["d1", "d2"]
        await bus.publish_many(
            [(bus.keys.req("d1"), E.Final(request_id="d1", finish_reason="length"))], ack=[got[0][0]]
        )
        names = {(c.decode() if isinstance(c, bytes) else c).split()[0].upper() for c in sent}
        assert not {"XREADGROUP", "XACK", "XDEL"} & names, names
        assert await client.xlen(bus.keys.requests) == 1
        assert (await client.xpending(bus.keys.requests, "engines"))["pending"] == 1
        await client.delete(bus.keys.requests)  # FLUSHALL-like: the group is gone
        await bus.submit(E.Request(request_id="d3", data=data), E.Accepted(request_id="d3"))
        assert [r.request_id for _, r in await bus.claim_requests("e1", 10, None)] == ["d3"]
    finally:
        await client.aclose()


@pytest.mark.parametrize("limits", [(100, 4096), (5, 200), (0, 0), (3, 1 << 31)])
def test_the_direct_add_builds_the_stream_fakeredis_add_would(limits):
    """control.embedded._add against XStream.add: the same ids, entries, counters and nodes
    (their master ids and fields, live counts and listpack sizes: what approximate trimming and
    XINFO read), for numbers that listpacks store as integers, long strings and changing
    field sets."""
    import random

    from fakeredis.model._stream import StreamEntryKey, XStream

    from control.embedded import _add

    rnd = random.Random(7)
    values = [
        b"0",
        b"1",
        b"-5",
        b"0123",
        b"9" * 19,
        b"9" * 25,
        b"-",
        b"",
        b"x" * 63,
        b"x" * 64,
        b"y" * 5000,
        b"tokens",
        b"1796012055123",
        "é".encode(),
    ]
    field_sets = [[b"type", b"v", b"ts", b"text"], [b"type", b"v"], [b"other"]]
    a, b = XStream(), XStream()
    ts, seq = 1000, 0
    for _ in range(400):
        if rnd.random() < 0.5:
            ts += rnd.choice((1, 1, 1, 70_000, 2**40))
            seq = 0
        else:
            seq += rnd.choice((1, 1, 300, 2**20))
        key = StreamEntryKey(ts, seq)
        names = rnd.choice(field_sets) if rnd.random() < 0.2 else field_sets[0]
        fields = [x for n in names for x in (n, rnd.choice(values))]
        a.add(fields, key, *limits)
        _add(b, fields, key, *limits)
    assert b._ids == a._ids and b._last_id == a._last_id and b._entries_added == a._entries_added
    assert {k: list(v) for k, v in b._values_dict.items()} == a._values_dict
    assert len(a._nodes) > (3 if limits[0] else 0) and [vars(n) for n in b._nodes] == [
        vars(n) for n in a._nodes
    ]
