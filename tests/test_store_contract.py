"""control/store.py's contract: each :class:`~control.store.Store` does the same thing on every
server fd runs on — a real redis-server, a 3-master Redis Cluster, the embedded server's
in-process store (its direct operations), and redis-py commands through the embedded
server's TCP door (what the in-process store falls back to)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ResponseError

from control.connect import connect
from control.embedded_store import EmbeddedStore
from control.store import RedisStore, store_for
from tests.test_cluster import cluster_url  # noqa: F401  (the fixture)


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
