"""fd/control/store.py's contract: the store does the same thing on every server fd runs on — a
real redis-server, a 3-master Redis Cluster, the embedded server through its in-process client
(fd/control/embedded_store.py, its direct path), and the embedded server through its TCP door
(fd/control/resp.py's RESP, as another process's engine or redis-cli reaches it: the commands)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ResponseError

from fd.control import story
from fd.control.connect import connect
from fd.control.embedded_store import EmbeddedStore
from fd.control.fence import Refused
from fd.control.store import Ack, Append, Fenced, RedisStore, store_for
from tests.kit.cluster import cluster_url  # noqa: F401  (the fixture)


@pytest.fixture(params=["real", "cluster", "embedded", "embedded-tcp"])
async def client_store(request):
    kind = request.param
    if kind == "real":
        client = connect(request.getfixturevalue("redis_server").url)
    elif kind == "cluster":
        client = connect(request.getfixturevalue("cluster_url"))
        await client.initialize()
    elif kind == "embedded":
        client = request.getfixturevalue("embedded_redis").client()
    else:
        client = connect(request.getfixturevalue("embedded_redis").url)
    store = store_for(client)
    assert type(store) is (EmbeddedStore if kind == "embedded" else RedisStore)
    yield client, store
    await client.aclose()


@pytest.fixture
def k():
    """Key names of this test's own, each in a slot of its own (hash tags: across the masters
    of a cluster), on servers the session shares."""
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"store-{tag}:{{{name}}}"


async def test_get_and_exists(client_store, k):
    client, store = client_store
    await client.set(k("s"), "v")
    await client.set(k("gone"), "v", px=1)
    await client.xadd(k("x"), {"a": "b"})
    await asyncio.sleep(0.01)
    assert await store.get(k("s")) == b"v"
    assert await store.get(k("none")) is None
    assert await store.get(k("gone")) is None
    assert [await store.exists(k(n)) for n in ("s", "x", "none", "gone")] == [True, True, False, False]
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await store.get(k("x"))


async def test_expire_sets_the_ttl_of_the_keys_that_exist(client_store, k):
    client, store = client_store
    await client.set(k("s"), "v")
    await client.xadd(k("x"), {"a": "b"})
    await store.expire([k("s"), k("x"), k("none")], 120)
    assert 0 < await client.ttl(k("s")) <= 120
    assert 0 < await client.ttl(k("x")) <= 120
    assert await client.exists(k("none")) == 0
    await store.expire([], 120)


async def test_set_nx_get_sets_only_new_keys_and_says_the_old_value(client_store, k):
    client, store = client_store
    await client.set(k("taken"), "aborted:http")
    olds = await store.set_nx_get([k("new"), k("taken"), k("new")], "e1", 60)
    assert olds == [None, b"aborted:http", b"e1"]  # the same key twice: the second sees the first
    assert await client.get(k("new")) == b"e1" and 0 < await client.ttl(k("new")) <= 60
    assert await client.get(k("taken")) == b"aborted:http" and await client.ttl(k("taken")) == -1
    await client.xadd(k("stream"), {"a": "b"})
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await store.set_nx_get([k("stream")], "e1", 60)


async def test_tombstones_pair_each_owner_key_with_its_request_key(client_store, k):
    client, store = client_store
    await client.set(k("o2"), "e7")
    await client.xadd(k("r2"), {"type": "accepted"})
    res = await store.tombstones([k("o1"), k("o2"), k("o1")], "aborted:http", 30, [k("r1"), k("r2"), k("r1")])
    assert res == [(None, False), (b"e7", True), (b"aborted:http", False)]
    assert await client.get(k("o1")) == b"aborted:http" and 0 < await client.ttl(k("o1")) <= 30
    assert await client.get(k("o2")) == b"e7"
    assert await store.tombstones([], "aborted:http", 30, []) == []


async def test_read_group_claims_each_entry_once_and_ack_delete_removes_it(client_store, k):
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="0", mkstream=True)
    ids = [await client.xadd(q, {"n": str(i)}) for i in range(5)]
    first = await store.read_group(q, "g", "c1", 3, None)
    assert [(s, [e for e, _ in es]) for s, es in first] == [(q.encode(), ids[:3])]
    assert [f for _, f in first[0][1]] == [{b"n": str(i).encode()} for i in range(3)]
    rest = await store.read_group(q, "g", "c2", 10, None)
    assert [e for e, _ in rest[0][1]] == ids[3:]
    assert await store.read_group(q, "g", "c1", 10, None) == []
    await store.ack_delete(q, "g", ids[:2])
    assert (await client.xpending(q, "g"))["pending"] == 3
    assert [e for e, _ in await client.xrange(q)] == ids[2:]
    await store.ack_delete(k("none"), "g", [ids[0]])  # (no such stream: nothing to do)


async def test_a_read_group_poll_at_the_end_finds_nothing_until_an_entry_or_a_rewound_group(client_store, k):
    # (the embedded store answers such polls from the stream's and group's last ids)
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="0", mkstream=True)
    first = await client.xadd(q, {"n": "0"})
    assert [e for e, _ in (await store.read_group(q, "g", "c1", 10, None))[0][1]] == [first]
    assert await store.read_group(q, "g", "c1", 10, None) == []
    assert await store.read_group(q, "g", "new-consumer", 10, None) == []
    second = await client.xadd(q, {"n": "1"})
    assert [e for e, _ in (await store.read_group(q, "g", "c1", 10, None))[0][1]] == [second]
    await client.xdel(q, second)  # (the last id stays the deleted entry's: still nothing new)
    assert await store.read_group(q, "g", "c1", 10, None) == []
    await client.xgroup_setid(q, "g", id="0")
    assert [e for e, _ in (await store.read_group(q, "g", "c1", 10, None))[0][1]] == [first]


async def test_read_group_blocks_until_a_write_or_the_timeout(client_store, k):
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="$", mkstream=True)
    assert await store.read_group(q, "g", "c1", 1, 50) == []
    reader = asyncio.create_task(store.read_group(q, "g", "c1", 1, 5000))
    await asyncio.sleep(0.05)
    assert not reader.done()
    eid = await client.xadd(q, {"n": "1"})
    got = await asyncio.wait_for(reader, 5)
    assert [e for e, _ in got[0][1]] == [eid]


async def test_read_group_without_the_group_says_nogroup(client_store, k):
    client, store = client_store
    with pytest.raises(ResponseError, match="NOGROUP"):
        await store.read_group(k("none"), "g", "c1", 1, None)
    await client.xadd(k("q"), {"a": "b"})
    with pytest.raises(ResponseError, match="NOGROUP"):
        await store.read_group(k("q"), "nogroup", "c1", 1, None)


async def test_append_many_appends_in_order_then_expires_then_acks(client_store, k):
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="0", mkstream=True)
    queued = await client.xadd(q, {"n": "0"})
    await store.read_group(q, "g", "c1", 1, None)
    ids = await store.append_many(
        [Append(k("a"), {"n": "1"}), Append(k("b"), {"n": "2"}), Append(k("a"), {"n": "3"})],
        expire=[k("a"), k("none")],
        ttl_s=90,
        ack=Ack(q, "g", [queued]),
    )
    assert [e for e, _ in await client.xrange(k("a"))] == [ids[0], ids[2]]
    assert [f for _, f in await client.xrange(k("b"))] == [{b"n": b"2"}]
    assert 0 < await client.ttl(k("a")) <= 90 and await client.ttl(k("b")) == -1
    assert (await client.xpending(q, "g"))["pending"] == 0 and await client.xlen(q) == 0
    assert await store.append_many([]) == []


async def test_append_many_caps_a_stream_at_its_maxlen(client_store, k):
    client, store = client_store
    for _ in range(5):
        await store.append_many([Append(k("cap"), {"n": str(i)}, maxlen=100) for i in range(100)])
    n = await client.xlen(k("cap"))
    assert 100 <= n < 500  # MAXLEN ~: whole nodes at a time, never below the cap
    assert (await client.xrevrange(k("cap"), count=1))[0][1] == {b"n": b"99"}


async def test_plain_appends_to_old_and_new_streams_keep_their_order_and_wake_a_reader(client_store, k):
    """(The embedded store appends to a stream that exists on the server's objects, and leaves
    the rest, from the first stream still to create, to the commands.)"""
    client, store = client_store
    ka, kb = k("p") + ":a", k("p") + ":b"  # (one slot)
    first = await client.xadd(ka, {"n": "0"})
    reader = asyncio.create_task(store.read({ka: first}, 10, 5000))
    await asyncio.sleep(0.05)
    ids = await store.append_many(
        [Append(ka, {"n": "1"}), Append(kb, {"n": "2"}), Append(ka, {"n": "3"}, maxlen=10)]
    )
    got = await asyncio.wait_for(reader, 5)
    assert got[0][1][0] == (ids[0], {b"n": b"1"})
    assert await client.xrange(ka) == [(first, {b"n": b"0"}), (ids[0], {b"n": b"1"}), (ids[2], {b"n": b"3"})]
    assert await client.xrange(kb) == [(ids[1], {b"n": b"2"})]
    assert (await store.append_many([Append(ka, {"n": "4"})]))[0] == (await client.xrevrange(ka, count=1))[0][
        0
    ]


def _batch(k, rid: str, token: str, types: list[str], ack=None, renew=(), step: int = 0) -> Fenced:
    """One step's events (each step's differ, as an engine's do: they carry the step)."""
    fields = [{"type": t, "request_id": rid, "step": str(step), "n": str(i)} for i, t in enumerate(types)]
    return Fenced(k(rid) + ":owner", k(rid) + ":req", token, fields, 120, ack, tuple(renew))  # (one slot)


async def test_fenced_append_writes_only_for_the_owner_and_never_after_a_final(client_store, k):
    client, store = client_store
    await client.set(k("a") + ":owner", "e1#1")
    await client.set(k("b") + ":owner", "e2#1")
    plain = Append(k("journal"), {"type": "step"})
    got = await store.fenced_append(
        [_batch(k, "a", "e1#1", ["tokens", "tokens"]), _batch(k, "b", "e1#1", ["tokens"])], [plain]
    )
    assert got == [None, Refused("owner", "e2#1")]
    assert [f[b"n"] for _, f in await client.xrange(k("a") + ":req")] == [b"0", b"1"]
    assert await client.exists(k("b") + ":req") == 0
    assert await client.xlen(k("journal")) == 1
    # unfenced entries go with every flush: to a stream that exists and to one that does not
    got = await store.fenced_append(
        [_batch(k, "a", "e1#1", ["tokens"], step=1)],
        [Append(k("journal"), {"type": "step", "n": "2"}, maxlen=100), Append(k("other"), {"n": "3"})],
    )
    assert got == [None]
    assert [f for _, f in await client.xrange(k("journal"))] == [
        {b"type": b"step"},
        {b"type": b"step", b"n": b"2"},
    ]
    assert [f for _, f in await client.xrange(k("other"))] == [{b"n": b"3"}]
    # a final ends the story: the same owner's next batch is refused, nothing appended
    assert await store.fenced_append([_batch(k, "a", "e1#1", ["final"], step=2)]) == [None]
    assert await store.fenced_append([_batch(k, "a", "e1#1", ["tokens"], step=3)]) == [
        Refused("final", "e1#1")
    ]
    assert await client.xlen(k("a") + ":req") == 4
    # a resend of a batch that landed is not appended again
    assert await store.fenced_append([_batch(k, "a", "e1#1", ["final"], step=2)]) == [None]
    assert await client.xlen(k("a") + ":req") == 4


async def test_a_final_that_gets_through_acks_its_entry_and_renews_its_keys(client_store, k):
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="0", mkstream=True)
    mine, theirs = await client.xadd(q, {"n": "a"}), await client.xadd(q, {"n": "b"})
    await store.read_group(q, "g", "c1", 2, None)
    await client.set(k("a") + ":owner", "e1#1")
    await client.set(k("b") + ":owner", "e9#3")  # taken over: its ack must not happen
    await client.set(k("parent-a"), "x")
    got = await store.fenced_append(
        [
            _batch(k, "a", "e1#1", ["tokens", "final"], Ack(q, "g", [mine]), [k("parent-a")]),
            _batch(k, "b", "e1#1", ["final"], Ack(q, "g", [theirs])),
        ]
    )
    assert got == [None, Refused("owner", "e9#3")]
    assert [e for e, _ in await client.xrange(q)] == [theirs]
    assert 0 < await client.ttl(k("a") + ":req") <= 120 and 0 < await client.ttl(k("a") + ":owner") <= 120
    assert 0 < await client.ttl(k("parent-a")) <= 120


async def test_a_batch_is_written_up_to_its_final_and_ends_the_story_there(client_store, k):
    """Events after a final in one batch are not written, and the final renews and acks as the
    batch's last one would."""
    client, store = client_store
    q = k("q")
    await client.xgroup_create(q, "g", id="0", mkstream=True)
    queued = await client.xadd(q, {"n": "a"})
    await store.read_group(q, "g", "c1", 1, None)
    await client.set(k("a") + ":owner", "e1#1")
    await client.xadd(k("a") + ":req", {"type": "accepted"})
    batch = _batch(k, "a", "e1#1", ["tokens", "final", "tokens"], Ack(q, "g", [queued]))
    assert await store.fenced_append([batch]) == [None]
    assert [f[b"type"] for _, f in await client.xrange(k("a") + ":req")] == [b"accepted", b"tokens", b"final"]
    assert 0 < await client.ttl(k("a") + ":req") <= 120 and 0 < await client.ttl(k("a") + ":owner") <= 120
    assert await client.xlen(q) == 0


async def test_start_story_writes_once_and_knows_a_resend_from_another_request(client_store, k):
    client, store = client_store
    accepted = [{"type": "accepted", "request_id": "r", "n": "1"}]
    request = Append(k("requests"), {"type": "request", "request_id": "r"})
    got, queued = await store.start_story(k("r") + ":req", accepted, 60, request)
    assert got == story.WRITTEN
    assert await client.xlen(k("requests")) == (1 if queued else 0)
    assert 0 < await client.ttl(k("r") + ":req") <= 60
    assert (await store.start_story(k("r") + ":req", accepted, 60, request))[0] == story.DONE
    other = [{"type": "accepted", "request_id": "r", "n": "2"}]
    assert (await store.start_story(k("r") + ":req", other, 60, request))[0] == story.TAKEN
    assert await client.xlen(k("r") + ":req") == 1


async def test_read_takes_many_streams_and_blocks_until_a_write(client_store, k):
    client, store = client_store
    ka, kb = k("s") + ":a", k("s") + ":b"  # (one slot: a cluster's XREAD names one)
    a = await client.xadd(ka, {"n": "1"})
    await client.xadd(kb, {"n": "2"})
    got = dict(await store.read({ka: b"0", kb: b"0"}, 10, None))
    assert [e for e, _ in got[ka.encode()]] == [a] and len(got[kb.encode()]) == 1
    assert await store.read({ka: a}, 10, 50) == []
    reader = asyncio.create_task(store.read({ka: a}, 10, 5000))
    await asyncio.sleep(0.05)
    assert not reader.done()
    c = await client.xadd(ka, {"n": "3"})
    got = await asyncio.wait_for(reader, 5)
    assert [e for e, _ in got[0][1]] == [c]


async def test_listen_tells_this_processs_appends_with_the_entry_before_each(client_store, k):
    """The embedded store tells a listener of every event it appends (fenced or plain), with
    the stream's last id before it; appends that went through the commands (a stream created,
    the TCP door's) are not told. A server others write to cannot say what came before: no
    listening there."""
    client, store = client_store
    told = []
    stop = store.listen(lambda *item: told.append(item))
    if not isinstance(store, EmbeddedStore):
        assert stop is None
        return
    story_key = k("a") + ":req"
    await client.set(k("a") + ":owner", "e1#1")
    first = await client.xadd(story_key, {"type": "accepted"})
    batch = _batch(k, "a", "e1#1", ["tokens", "final"])
    events = [object(), object()]  # (what the bus hands along: the store does not look inside)
    batch = Fenced(batch.owner_key, batch.story, batch.token, batch.fields, batch.ttl_s, events=events)
    note, plain = object(), Append(story_key, {"type": "note"})
    assert await store.fenced_append([batch]) == [None]
    noted, _ = await store.append_many([Append(story_key, {"type": "note"}, event=note), plain])
    ids = [i for i, _ in await client.xrange(story_key)]
    assert ids[0] == first and ids[3] == noted
    assert told == [
        (story_key.encode(), ids[0], ids[1], events[0], batch.fields[0]),
        (story_key.encode(), ids[1], ids[2], events[1], batch.fields[1]),
        (story_key.encode(), ids[2], ids[3], note, {"type": "note"}),
    ]  # (the plain append without an event is not told)
    stop()
    await store.append_many([Append(story_key, {"type": "note"}, event=note)])
    assert len(told) == 3


async def test_the_embedded_store_uses_the_commands_on_a_fakeredis_its_direct_path_was_not_verified_on(
    monkeypatch, caplog, k
):
    """On a fakeredis release outside ``VERIFIED_FAKEREDIS`` the embedded store says so in one
    log line and does everything with the commands: slower, still right, and nothing told."""
    from fd.control import embedded_store
    from fd.control.embedded import EmbeddedRedis

    monkeypatch.setattr(embedded_store, "fakeredis_version", lambda: "99.0.0")
    with caplog.at_level("WARNING", logger="fd.control.embedded"), EmbeddedRedis() as server:
        clients = [server.client(), server.client()]
        client = clients[0]
        try:
            store = store_for(client)
            assert store._direct is None and store_for(clients[1])._direct is None
            assert store.listen(lambda *item: None) is None
            await client.set(k("a") + ":owner", "e1#1")
            await client.xadd(k("a") + ":req", {"type": "accepted"})
            assert await store.fenced_append([_batch(k, "a", "e1#1", ["tokens"])]) == [None]
            assert await client.xlen(k("a") + ":req") == 2
            got = await store.read({k("a") + ":req": b"0"}, 10, None)
            assert len(got[0][1]) == 2
        finally:
            for c in clients:
                await c.aclose()
    said = [r.getMessage() for r in caplog.records if "not a release" in r.getMessage()]
    assert len(said) == 1 and "fakeredis 99.0.0" in said[0]
