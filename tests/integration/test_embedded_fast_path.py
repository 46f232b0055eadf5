"""The embedded store's direct path (fd/control/embedded_store.py) against fakeredis's commands.

The same operations, on two fakeredis servers of the installed release: one through
:class:`~fd.control.embedded_store.EmbeddedStore`'s direct path (the server's objects), one
through :class:`~fd.control.store.RedisStore` on fakeredis's own client (its commands and the
fence's Lua script). Every reply, and the data each leaves, must be the same, entry ids
included (the clock is held still, so both servers make the same ones). This is what a
fakeredis release has to pass before it joins ``VERIFIED_FAKEREDIS``
(tests/unit/test_embedded_version.py fails until then)."""

from __future__ import annotations

import time
from typing import Any

import fakeredis

from fd.control import embedded_store
from fd.control.embedded_store import EmbeddedStore
from fd.control.fence import Refused
from fd.control.store import Ack, Append, Fenced, RedisStore


async def _run(store: Any, client: Any) -> list[Any]:
    """The operations, each one's reply (or error) in order, then the data left."""
    out: list[Any] = []

    async def do(what: str, op: Any) -> None:
        try:
            out.append((what, await op))
        except Exception as e:
            out.append((what, "error", type(e).__name__, str(e)))

    await client.set("o:a", "e1#1")
    await client.set("o:b", "e2#1")
    await client.set("o:c", "e1#1")
    await client.xadd("s:a", {"type": "accepted", "request_id": "a"})
    await client.xadd("s:b", {"type": "accepted", "request_id": "b"})
    await client.xadd("journal", {"type": "step", "n": "0"})
    await client.xadd("wrong", {"n": "0"})
    await client.set("str", "v")
    await client.xgroup_create("q", "g", id="0", mkstream=True)
    queued = [await client.xadd("q", {"n": str(i)}) for i in range(3)]

    def batch(rid: str, token: str, types: list[str], step: int, **kw: Any) -> Fenced:
        fields = [{"type": t, "request_id": rid, "step": str(step), "n": str(i)} for i, t in enumerate(types)]
        return Fenced(f"o:{rid}", f"s:{rid}", token, fields, 120, **kw)

    await do("group read", store.read_group("q", "g", "c1", 2, None))
    await do("group idle", store.read_group("q", "g", "c1", 10, None))
    await do("group stranger", store.read_group("q", "g", "c9", 10, None))
    await do("group read rest", store.read_group("q", "g", "c1", 10, None))
    await do("group idle again", store.read_group("q", "g", "c1", 10, None))
    await do("group missing", store.read_group("nope", "g", "c1", 1, None))
    tokens = batch("a", "e1#1", ["tokens", "tokens"], 1)
    await do(
        "fence",
        store.fenced_append(
            [
                tokens,
                batch("b", "e1#1", ["tokens"], 1),  # b is e2's: refused
                batch("c", "e1#1", ["tokens"], 1),  # c's story absent: the script creates it
                Fenced("str", "s:a", "e1#1", [{"type": "tokens"}], 120),  # its owner key holds "v"
            ],
            [Append("journal", {"type": "step", "n": "1"}, maxlen=100), Append("new-journal", {"n": "1"})],
        ),
    )
    await do("fence resend", store.fenced_append([tokens]))
    await do("fence gap", store.fenced_append([batch("a", "e1#1", ["tokens"], 2, after={"type": "x"})]))
    await do("fence after", store.fenced_append([batch("a", "e1#1", ["tokens"], 2, after=tokens.fields[-1])]))
    await do(
        "fence wrongtype owner", store.fenced_append([Fenced("wrong", "s:a", "e1#1", [{"n": "1"}], 120)])
    )
    await do("fence wrongtype story", store.fenced_append([Fenced("o:a", "str", "e1#1", [{"n": "1"}], 120)]))
    # (a final ends the batch too: what follows it is not written)
    final = batch(
        "a", "e1#1", ["tokens", "final", "tokens"], 3, ack=Ack("q", "g", [queued[0]]), renew=("str",)
    )
    await do("fence final", store.fenced_append([final]))
    await do("fence after final", store.fenced_append([batch("a", "e1#1", ["tokens"], 4)]))
    await do("fence final resend", store.fenced_append([final]))
    await do(
        "append many",
        store.append_many(
            [Append("s:b", {"n": "1"}), Append("created", {"n": "2"}), Append("s:b", {"n": "3"}, maxlen=2)],
            expire=["s:b", "none"],
            ttl_s=90,
            ack=Ack("q", "g", [queued[1]]),
        ),
    )
    await do("append many wrongtype", store.append_many([Append("str", {"n": "1"})]))
    await do("ack delete", store.ack_delete("q", "g", [queued[2]]))
    await do("ack delete absent", store.ack_delete("none", "g", [queued[2]]))
    await do("get", store.get("o:a"))
    await do("get absent", store.get("none"))
    await do("get wrongtype", store.get("s:a"))
    await do("exists", [await store.exists(k) for k in ("o:a", "s:a", "none")])
    await do("expire", store.expire(["o:b", "s:c", "none"], 60))
    await do("read", store.read({b"s:a": b"0", "s:c": b"0", b"none": b"0"}, 3, None))
    await do("read after", store.read({b"s:a": b"0-0", b"s:b": b"0"}, None, None))
    last = (await client.xrevrange("s:b", count=1))[0][0]
    await do("read at the end", store.read({b"s:b": last}, None, None))
    await do("read wrongtype", store.read({b"str": b"0"}, None, None))
    await do("read bad id", store.read({b"s:a": b"nonsense"}, None, None))

    for key in sorted(await client.keys("*")):
        kind = await client.type(key)
        ttl = await client.ttl(key)
        data: Any
        if kind == b"stream":
            data = [f for _, f in await client.xrange(key)]
            groups = await client.xinfo_groups(key)
            data = (data, [(g["name"], g["pending"], g["last-delivered-id"]) for g in groups])
        else:
            data = await client.get(key)
        out.append(("key", key, kind, ttl > 0 if ttl >= 0 else ttl, data))
    return out


async def test_the_direct_path_answers_as_the_commands(monkeypatch):
    """(No blocking reads here: fakeredis times those by the clock held still. The store
    contract, tests/integration/test_store_contract.py, blocks on both paths.)"""
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    done: dict[str, int] = {}  # the direct operations that did their work (not left to the commands)
    for name in ("fenced", "append", "scan", "value", "exists", "expire", "ack_delete", "nothing_new"):
        real = getattr(embedded_store._Direct, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            got = _real(self, *args, **kw)
            if got is not None and got is not False and got != (False, None):
                done[_name] = done.get(_name, 0) + 1
            return got

        monkeypatch.setattr(embedded_store._Direct, name, counted)
    direct_server = fakeredis.FakeServer(version=(7, 0))
    direct_client = fakeredis.FakeAsyncRedis(server=direct_server)
    direct = EmbeddedStore(direct_client, direct_server, True)
    commands_client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(version=(7, 0)))
    commands = RedisStore(commands_client)
    told: list[Any] = []
    assert direct.listen(lambda *item: told.append(item)) is not None
    try:
        got = await _run(direct, direct_client)
        want = await _run(commands, commands_client)
    finally:
        await direct_client.aclose()
        await commands_client.aclose()
    assert sorted(done) == sorted(
        ["fenced", "append", "scan", "value", "exists", "expire", "ack_delete", "nothing_new"]
    ), done
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g == w
    assert ("fence", [None, Refused("owner", "e2#1"), None, Refused("owner", "v")]) in got
    assert told == []  # (no events given: nothing to tell; tests/integration/test_store_contract.py tells)
