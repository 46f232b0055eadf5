"""Engine failover on real Redis: a live engine continues the requests of a dead one from the
tokens already on their streams, never takes a request from a live engine, and gives up on a
request that failed ``max_attempts`` times."""

from __future__ import annotations

import asyncio
import signal

from fd.control.bus import compare_and_set as cas_owner
from fd.control.connect import connect
from fd.control.events import Abort, Claimed, Final, Preempted, Tokens
from fd.control.sampling import SamplingParams
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.node.failover import History
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, text_of, tokens_of, types
from tests.kit.faults import all_blocks_free, engines, kill, reap, spawn_engine, wait_for  # noqa: F401

PROMPT = [5, 17, 33, 9, 41, 12, 7, 19]


def _reference(runner, tokenizer, max_tokens, prompt=PROMPT):
    return LLM(runner, tokenizer).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )[0]


async def _n_tokens(bus, rid):
    return len(tokens_of([e for _, e in await bus.read_req(rid)]))


async def test_dead_engines_request_is_continued_exactly(real_bus, engines, tiny_runner, tiny_tokenizer):
    # 100 tokens at >= 20 ms a step: A is still at it when it is killed (with 40, a fast
    # model finished them all within the 0.8 s below)
    n = 100
    ref = _reference(tiny_runner, tiny_tokenizer, n)
    a = await engines.start("A", delay=0.02)
    await submit(real_bus, "r", PROMPT, max_tokens=n, ignore_eos=True)
    await wait_for(lambda: _n_tokens(real_bus, "r"), what="A's first tokens")
    b = await engines.start("B")
    # B scans for orphans every 0.2 s, but A is alive: B never takes its request
    await asyncio.sleep(0.8)
    evs = [e for _, e in await real_bus.read_req("r")]
    assert [e.engine for e in evs if isinstance(e, Claimed)] == ["A"]
    assert 0 < len(tokens_of(evs)) < n
    await kill(a)
    evs = await story(real_bus, "r", timeout=20)
    claims = [e for e in evs if isinstance(e, Claimed)]
    assert [(c.engine, c.attempt) for c in claims] == [("A", 1), ("B", 2)]
    assert tokens_of(evs) == ref.token_ids  # no token lost, none repeated
    assert text_of(evs) == ref.text
    assert types(evs).count("final") == 1 and types(evs)[-1] == "final"
    assert evs[-1].finish_reason == "length" and evs[-1].engine == "B"
    assert evs[-1].usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": n,
        "total_tokens": len(PROMPT) + n,
    }
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    assert await real_bus.owner("r") == "B#2"  # (the owner token: engine, attempt)
    await all_blocks_free(b.node)
    assert b.node.taken_over == 1
    report = replay(await load_journal_from_redis(real_bus, "B"))
    assert report.divergence is None and not report.analysis.violations


async def test_max_attempts_ends_with_an_error(real_bus, engines):
    a = await engines.start("A", delay=0.02)
    await submit(real_bus, "r", PROMPT, max_tokens=100, ignore_eos=True)
    await wait_for(lambda: _n_tokens(real_bus, "r"), what="A's first tokens")
    b = await engines.start("B", max_attempts=1)
    await kill(a)
    evs = await story(real_bus, "r", timeout=20)
    assert types(evs).count("final") == 1 and types(evs).count("claimed") == 1
    final = evs[-1]
    assert final.finish_reason == "error" and "max_attempts=1" in final.error
    assert final.usage["completion_tokens"] == len(tokens_of(evs)) > 0
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    await all_blocks_free(b.node)


async def test_abort_while_the_owner_is_dead_wins_over_the_takeover(real_bus, engines):
    a = await engines.start("A", delay=0.02)
    await submit(real_bus, "r", PROMPT, max_tokens=100, ignore_eos=True)
    await wait_for(lambda: _n_tokens(real_bus, "r"), what="A's first tokens")
    # B is up but, with a long idle threshold, takes nothing over before the abort arrives
    b = await engines.start("B", failover_idle_ms=1500)
    await kill(a)
    await real_bus.publish(real_bus.keys.control, Abort(request_ids=("r",), source="cli"))
    evs = await story(real_bus, "r", timeout=20)
    after_a = types(evs)[types(evs).index("tokens") :]
    assert [t for t in after_a if t != "tokens"] == ["abort_requested", "drained", "blocks_released", "final"]
    assert evs[-1].finish_reason == "abort" and evs[-1].engine == "B"
    assert [e.source for e in evs if e.TYPE == "abort_requested"] == ["cli"]
    await asyncio.sleep(0.5)
    assert types([e for _, e in await real_bus.read_req("r")]) == types(evs)  # nothing after
    await all_blocks_free(b.node)


async def test_a_claim_that_loses_to_a_takeover_leaves_the_entry_with_its_owner(
    real_bus, engines, tiny_runner, tiny_tokenizer
):
    """An engine that read a request and stalled before owning it (paused between its
    XREADGROUP and its SET NX) finds a peer took the idle entry over meanwhile. It must leave
    that entry pending, now the owner's: acknowledged, it would be gone from the pending list,
    and once the owner died no failover scan could find the request again."""
    n = 100
    ref = _reference(tiny_runner, tiny_tokenizer, n)
    await submit(real_bus, "r", PROMPT, max_tokens=n, ignore_eos=True)
    ((entry, req),) = await real_bus.claim_requests("X", 1, None)  # X read it; then X stalled
    a = await engines.start("A", delay=0.02)  # A's scan: pending on X, no owner: an orphan
    await wait_for(lambda: _n_tokens(real_bus, "r"), what="A's takeover's first tokens")
    x = await engines.start("X")
    await x.node.admission.admit(entry, req)  # X's stalled claim goes on: the owner key names A
    pending = await real_bus.redis.xpending_range(real_bus.keys.requests, "engines", "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry, b"A")]
    await kill(a)
    evs = await story(real_bus, "r", timeout=20)
    assert [(c.engine, c.attempt) for c in evs if isinstance(c, Claimed)] == [("A", 1), ("X", 2)]
    assert tokens_of(evs) == ref.token_ids  # no token lost, none repeated
    assert types(evs).count("final") == 1 and evs[-1].finish_reason == "length"
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    await all_blocks_free(x.node)


async def test_owner_takeover_is_a_compare_and_set(redis_server, keys):
    r1, r2 = connect(redis_server.url), connect(redis_server.url)
    try:
        key = keys.owner("x")
        await r1.set(key, "dead")
        wins = await asyncio.gather(
            *[cas_owner(r, key, "dead", f"e{i}", 60) for i, r in enumerate([r1, r2, r1, r2])]
        )
        assert sum(wins) == 1
        assert (await r1.get(key)).decode() == f"e{wins.index(True)}"
        assert not await cas_owner(r1, key, "dead", "late", 60)  # never from a live owner
        assert await cas_owner(r1, key, f"e{wins.index(True)}", None, 60)  # release
        assert await r1.get(key) is None
        assert await cas_owner(r2, key, None, "fresh", 60)
    finally:
        await r1.aclose()
        await r2.aclose()


def test_history_counts_claims_handbacks_and_tokens():
    evs = [
        Claimed(request_id="r", engine="A", attempt=1),
        Tokens(request_id="r", token_ids=(1, 2), text="ab"),
        Preempted(request_id="r", engine="A", handback=True),
        Claimed(request_id="r", engine="B", attempt=2),
        Tokens(request_id="r", token_ids=(3,), text="c"),
    ]
    h = History.of(evs)
    assert h.tokens == [1, 2, 3] and h.text == "abc"
    assert (h.claims, h.handbacks, h.failures, h.final) == (2, 1, 1, False)
    assert History.of(evs + [Final(request_id="r", finish_reason="stop")]).final


async def test_sigkilled_engine_process_is_taken_over(
    real_bus, redis_server, keys, engines, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    ref = _reference(tiny_runner, tiny_tokenizer, 600)
    proc = spawn_engine(redis_server.url, keys, tiny_model_dir, "P")
    try:
        await submit(real_bus, "r", PROMPT, max_tokens=600, ignore_eos=True)
        await wait_for(lambda: _n_tokens(real_bus, "r"), timeout=60, what="P's first tokens")
        proc.send_signal(signal.SIGKILL)
        reap(proc)
        n_before = await _n_tokens(real_bus, "r")
        assert n_before < 600, "P finished before it could be killed"
        # P's heartbeat outlives it by its TTL (5 s); then B takes over
        b = await engines.start("B")
        evs = await story(real_bus, "r", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        reap(proc)
    assert [(c.engine, c.attempt) for c in evs if isinstance(c, Claimed)] == [("P", 1), ("B", 2)]
    assert tokens_of(evs) == ref.token_ids and text_of(evs) == ref.text
    assert types(evs).count("final") == 1 and evs[-1].finish_reason == "length"
    await all_blocks_free(b.node)


async def test_a_pending_entry_that_never_decodes_is_dead_lettered_by_the_scan(real_bus, engines):
    # An engine read the entry (XREADGROUP) and died, or Redis failed its dead letter, before
    # it wrote one: the entry waits in the group, read. A live engine's failover scan, which
    # finds it, writes the dead letter before it acks the entry (and never runs it).
    bus, r = real_bus, real_bus.keys.requests
    await bus.ensure_group()
    bad = await bus.redis.execute_command(
        "XADD", r, "*", "type", "request", "request_id", "x", "data", '{"prompt_token_ids":[5],"sampling":'
    )
    gone = await bus.redis.execute_command("XADD", r, "*", "type", "request")
    await bus.redis.xreadgroup("engines", "dead-engine", {r: ">"}, count=10)
    await engines.start("B")
    await wait_for(lambda: _none_pending(bus), 30, "the scan's acks")
    letters = {f[b"entry_id"]: f[b"reason"] for _, f in await bus.redis.xrange(bus.keys.dead)}
    assert set(letters) == {bad, gone}, letters
    assert letters[bad].startswith(b"data") and letters[gone].startswith(b"request_id")
    assert not await bus.redis.exists(bus.keys.req("x"))


async def _none_pending(bus) -> bool:
    return (await bus.redis.xpending(bus.keys.requests, "engines"))["pending"] == 0
