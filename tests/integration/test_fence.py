"""The fence (fd/control/fence.py): an engine's events reach a request's story only while its
owner key holds the writer's token, and nothing ever follows a final.

The bus-level tests run on a real Redis (the Lua script), on the embedded server's in-process
client (its direct equivalent under the server lock) and through the embedded server's TCP
door (the same script, run by fakeredis' Lua); the engine-level ones run an engine whose owner
key is taken from it while a step is in flight, on a real Redis and on the embedded server."""

from __future__ import annotations

import pytest

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import Final, JournalStep, Tokens
from fd.control.fence import Refused
from fd.control.keys import GROUP_ENGINES, owner_token
from fd.engine.journal.journal_reader import load_journal_from_redis
from tests.kit.engine import submit, tokens_of, types
from tests.kit.faults import Engines, all_blocks_free, wait_for

PROMPT = [5, 17, 33, 9, 41, 12, 7, 19]


def toks(rid: str, *ids: int) -> list[Tokens]:
    return [Tokens(request_id=rid, token_ids=(i,), text=f"t{i}", step=i) for i in ids]


def on(bus: Bus, evs) -> list[tuple[str, Tokens]]:
    """Each event on its request's story."""
    return [(bus.keys.req(ev.request_id), ev) for ev in evs]


async def story_types(bus: Bus, rid: str) -> list[str]:
    return types([ev for _, ev in await bus.read_req(rid)])


async def claimed_entry(bus: Bus, rid: str) -> bytes:
    """Put ``rid`` on P:requests and read it as engine ``A`` would: its pending entry."""
    await bus.ensure_group()
    await submit(bus, rid, PROMPT, max_tokens=4)
    got = await bus.claim_requests("A", 100, None)
    return next(entry for entry, req in got if req.request_id == rid)


async def pending(bus: Bus) -> int:
    return (await bus.redis.xpending(bus.keys.requests, GROUP_ENGINES))["pending"]


async def check_the_fence(bus: Bus) -> None:
    mine, theirs = owner_token("A", 1), owner_token("B", 2)
    await bus.redis.set(bus.keys.owner("r"), mine)
    entry = await claimed_entry(bus, "r")
    refused = await bus.publish_owned(on(bus, toks("r", 1, 2)), {"r": mine})
    assert refused == {}
    assert await story_types(bus, "r") == ["accepted", "tokens", "tokens"]

    # taken over: A's next step, final and ack are all turned away
    await bus.redis.set(bus.keys.owner("r"), theirs)
    final = Final(request_id="r", finish_reason="length", engine="A")
    refused = await bus.publish_owned(
        on(bus, toks("r", 3)) + [(bus.keys.req("r"), final)], {"r": mine}, ack=[("r", entry)]
    )
    assert refused == {"r": Refused("owner", theirs)}
    assert await story_types(bus, "r") == ["accepted", "tokens", "tokens"]
    assert await pending(bus) == 1  # B runs it now: its entry stays for B's final (or failover)

    # the same engine winning it again holds a new attempt: the old one's token is refused
    await bus.redis.set(bus.keys.owner("r"), owner_token("A", 3))
    assert (await bus.publish_owned(on(bus, toks("r", 3)), {"r": mine}))["r"].why == "owner"
    assert await story_types(bus, "r") == ["accepted", "tokens", "tokens"]

    # a story event with no token at all is never written
    assert "r" in await bus.publish_owned(on(bus, toks("r", 3)), {})

    # the owner's final goes through, acks its entry and renews both keys' TTL ...
    now = owner_token("A", 3)
    await bus.redis.expire(bus.keys.req("r"), 10_000_000)
    await bus.redis.expire(bus.keys.owner("r"), 10_000_000)
    journal = bus.keys.journal("A")
    step = JournalStep(engine="A", step=1, seq=0, data={"calls": []})
    refused = await bus.publish_owned(
        on(bus, toks("r", 3)) + [(bus.keys.req("r"), final), (journal, step)], {"r": now}, ack=[("r", entry)]
    )
    assert refused == {}
    evs = [ev for _, ev in await bus.read_req("r")]
    assert types(evs) == ["accepted", "tokens", "tokens", "tokens", "final"]
    assert tokens_of(evs) == [1, 2, 3]
    assert await bus.redis.xlen(journal) == 1  # (not a story: written as it is)
    assert await pending(bus) == 0 and await bus.redis.xlen(bus.keys.requests) == 0
    for key in (bus.keys.req("r"), bus.keys.owner("r")):
        assert 0 < await bus.redis.ttl(key) <= bus.req_ttl_s

    # ... and nothing follows it, even from the owner's own token
    refused = await bus.publish_owned(on(bus, toks("r", 4)), {"r": now})
    assert refused == {"r": Refused("final", now)}
    assert await story_types(bus, "r") == ["accepted", "tokens", "tokens", "tokens", "final"]

    # a batch sent again after it landed (its reply lost; or its write sat in a stalled
    # Redis's socket while the engine's retry went out on a new connection) is answered as
    # written and appended once, its final's batch too. (An engine's events carry the ts they
    # were made at: a resend is the same fields.)
    await bus.redis.set(bus.keys.owner("q"), now)
    ts = 1_700_000_000_000
    first = [Tokens(request_id="q", token_ids=(7, 8), text="ab", step=9, ts=ts)]
    second = [Tokens(request_id="q", token_ids=(9,), text="c", step=10, ts=ts + 5)]
    last = [
        Tokens(request_id="q", token_ids=(4,), text="d", step=11, ts=ts + 9),
        Final(request_id="q", finish_reason="length", engine="A", step=11, ts=ts + 9),
    ]
    for batch in (first, second, first, last, second, last):
        assert await bus.publish_owned(on(bus, batch), {"q": now}) == {}
    evs = [ev for _, ev in await bus.read_req("q")]
    assert types(evs) == ["tokens", "tokens", "tokens", "final"]
    assert tokens_of(evs) == [7, 8, 9, 4]

    # a batch that goes on past its own final stops at it
    await bus.redis.set(bus.keys.owner("s"), now)
    f2 = Final(request_id="s", finish_reason="stop", engine="A")
    assert (
        await bus.publish_owned(
            on(bus, toks("s", 1)) + [(bus.keys.req("s"), f2)] + on(bus, toks("s", 2)), {"s": now}
        )
        == {}
    )
    assert await story_types(bus, "s") == ["tokens", "final"]


async def test_the_fence_on_real_redis_and_the_embedded_client(bus):
    await check_the_fence(bus)


async def test_the_fence_through_the_embedded_servers_tcp_door(embedded_redis, keys):
    client = connect(embedded_redis.url)  # fakeredis runs the script (its Lua: lupa)
    try:
        await check_the_fence(Bus(client, keys))
    finally:
        await client.aclose()


async def test_the_fence_survives_a_flushed_script_cache(real_bus):
    tok = owner_token("A", 1)
    await real_bus.redis.set(real_bus.keys.owner("r"), tok)
    assert await real_bus.publish_owned(on(real_bus, toks("r", 1)), {"r": tok}) == {}
    await real_bus.redis.script_flush()  # (a restarted Redis has no scripts)
    assert await real_bus.publish_owned(on(real_bus, toks("r", 2)), {"r": tok}) == {}
    assert tokens_of([ev for _, ev in await real_bus.read_req("r")]) == [1, 2]


# ------------------------------------------------------------------ an engine that lost its request


@pytest.fixture(params=["real", "embedded"])
async def fenced_engines(request, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """Engines on a real Redis or on the embedded server's in-process client, and a bus
    beside them."""
    if request.param == "real":
        url = request.getfixturevalue("redis_server").url
        factory = lambda: connect(url)  # noqa: E731
    else:
        factory = request.getfixturevalue("embedded_redis").client
    e = Engines(factory, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    client = factory()
    yield e, Bus(client, keys)
    await e.stop_all()
    await client.aclose()


@pytest.mark.parametrize("new_owner", ["B#2", "A#2"], ids=["another-engine", "same-engine-again"])
async def test_a_step_that_finishes_after_a_takeover_writes_nothing(fenced_engines, new_owner):
    engines, bus = fenced_engines
    # (no heartbeat check in between: the fence on the step's own publish is what is tested)
    eng = await engines.start("A", gated=True, heartbeat_s=60)
    gate, node = engines.gates["A"], eng.node
    await submit(bus, "r", PROMPT, max_tokens=200, ignore_eos=True)
    await wait_for(lambda: gate.steps_done >= 3, what="a few steps of r")
    gate.close()
    await gate.wait_entered(lambda out: any(s.request_id == "r" for s in out.seqs))
    # what a takeover does: the owner key moves on (to B, or to A's own next attempt)
    assert await bus.owner("r") == "A#1"
    await bus.redis.set(bus.keys.owner("r"), new_owner)
    before = [ev for _, ev in await bus.read_req("r")]
    assert types(before)[:2] == ["accepted", "claimed"] and types(before)[-1] == "tokens"
    gate.open()
    await wait_for(lambda: node.fenced == 1 and not node.sched.knows("r"), what="r dropped")
    await all_blocks_free(node)
    assert [ev for _, ev in await bus.read_req("r")] == before  # nothing written after
    assert await pending(bus) == 1  # nor acknowledged: the new owner's entry stays
    assert node.status()["fenced"] == 1
    # the journal has the scheduler dropping it: an abort, its blocks released
    await node._flush()
    calls = [
        c
        for ev in await load_journal_from_redis(bus, "A")
        if isinstance(ev, JournalStep)
        for c in ev.data["calls"]
    ]
    aborts = [c for c in calls if c["op"] == "abort" and c["rid"] == "r"]
    assert len(aborts) == 1 and aborts[0]["source"] == "engine"
    assert calls[-1]["free"] == node.sched.num_total_blocks  # and every block came back


async def test_a_batch_whose_story_lost_the_writers_last_event_is_refused(bus):
    """``last``: each request's writer's last event on its story. A story that no longer ends
    with it (a failover to a replica that lacked it) refuses the next batch as a ``gap``,
    writing nothing; a batch with nothing to check (the engine's error final) goes through,
    and a resend of a batch that landed is still answered as written."""
    mine = owner_token("A", 1)
    await bus.redis.set(bus.keys.owner("g"), mine)
    await submit(bus, "g", PROMPT, max_tokens=4)
    last: dict = {}
    assert await bus.publish_owned(on(bus, toks("g", 1, 2)), {"g": mine}, last=last) == {}
    entries = await bus.redis.xrange(bus.keys.req("g"))
    assert last["g"] == {k.decode(): v.decode() for k, v in entries[-1][1].items()}  # (t2, as written)
    t3 = on(bus, [Tokens(request_id="g", token_ids=(3,), text="t3", step=3, ts=1003)])
    again = dict(last)
    assert await bus.publish_owned(t3, {"g": mine}, last=last) == {}
    assert await bus.publish_owned(t3, {"g": mine}, last=again) == {}  # (a resend: as written)
    # what the failover lost: the story's last entry, t3
    entries = await bus.redis.xrange(bus.keys.req("g"))
    assert len(entries) == 4  # (accepted, t1, t2, t3: the resend wrote nothing)
    await bus.redis.xdel(bus.keys.req("g"), entries[-1][0])
    refused = await bus.publish_owned(on(bus, toks("g", 4)), {"g": mine}, last=last)
    assert refused["g"].why == "gap" and refused["g"].owner == mine
    assert tokens_of([ev for _, ev in await bus.read_req("g")]) == [1, 2]  # nothing written
    final = Final(request_id="g", finish_reason="error", engine="A", error="lost")
    assert await bus.publish_owned(on(bus, [final]), {"g": mine}) == {}  # (nothing to check)
    assert await story_types(bus, "g") == ["accepted", "tokens", "tokens", "final"]
