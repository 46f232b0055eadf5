"""The abort protocol (DESIGN.md §4) end to end through a real engine node on real Redis.

Each case asserts the exact story on ``P:req:<id>``, that every KV block is free afterwards,
and, for requests aborted before they ran, that no batch ever contained them.
"""

from __future__ import annotations

import asyncio

import pytest

from fd.compose import start_engine
from fd.control.connect import connect
from fd.control.events import Abort, AbortAll, AbortRequested, Claimed, Drained, Final, Tokens
from fd.control.metrics import Metrics
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.node.node_config import EngineConfig, SchedulerSettings
from tests.kit.engine import GatedRunner, _pair, story, submit, submit_together, tokens_of, types
from tests.kit.faults import wait_for

STORY = ["accepted", "claimed", "abort_requested", "drained", "blocks_released", "final"]
PROMPT = list(range(10, 30))


@pytest.fixture
async def engines(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    started = []

    async def start(**kw):
        gated = GatedRunner(tiny_runner)
        metrics = kw.pop("metrics", None)
        cfg = EngineConfig(
            model_dir=str(tiny_model_dir),
            engine_id=f"e{len(started)}",
            scheduler=SchedulerSettings(
                max_num_seqs=kw.pop("max_num_seqs", 8),
                max_num_batched_tokens=kw.pop("max_num_batched_tokens", 256),
            ),
            **kw,
        )
        eng = await start_engine(
            lambda: connect(redis_server.url),
            keys,
            cfg,
            runner=gated,
            tokenizer=tiny_tokenizer,
            metrics=metrics,
        )
        started.append(eng)
        return eng, gated

    yield start
    for eng in started:
        # let any gated step finish so the engine can stop
        eng.node.runner.open()
        await eng.stop()


async def _abort(bus, *rids, source="redis"):
    await bus.publish(bus.keys.control, Abort(request_ids=tuple(rids), source=source))


async def _all_free(node, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if node.sched.num_free_blocks == node.sched.num_total_blocks and not node.sched.has_work():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not all free: {node.sched.num_free_blocks}/{node.sched.num_total_blocks}")


async def test_decoding_in_flight_abort_waits_for_the_step(real_bus, engines):
    eng, gated = await engines()
    await submit(real_bus, "dec", PROMPT, max_tokens=500, ignore_eos=True)
    # let a few decode steps happen (not quietly fewer: a held prefill would leave the story
    # short of the tokens asserted below), then hold one in flight
    await wait_for(lambda: gated.steps_done >= 4, timeout=30, what="4 steps of dec")
    gated.close()
    held = await gated.wait_entered(lambda out: any(s.request_id == "dec" for s in out.seqs))
    # and the step behind it decided (async scheduling), as it is once the loop has folded in
    # the step before the held one: the oldest in flight is the held one. (Two in flight alone
    # is not enough: the step before can have ended, its result not yet folded in, and the
    # abort would then land behind that fold-in with one step, not two, left to discard.)
    in_flight = eng.node.sched.config.max_steps_in_flight

    def held_and_behind() -> bool:
        steps = eng.node.sched.snapshot()["steps_in_flight"]
        return len(steps) == in_flight and steps[0] == held.step

    await wait_for(held_and_behind, what=f"{in_flight} steps in flight, the held one first")
    await _abort(real_bus, "dec")
    evs = await story(real_bus, "dec", until=AbortRequested)
    # the step is still running: nothing may be released yet
    await asyncio.sleep(0.05)
    evs = [e for _, e in await real_bus.read_req("dec")]
    assert types(evs)[-1] == "abort_requested"
    assert "drained" not in types(evs) and "blocks_released" not in types(evs)
    assert eng.node.sched.num_free_blocks < eng.node.sched.num_total_blocks
    gated.open()
    evs = await story(real_bus, "dec")
    t = [x for x in types(evs) if x != "tokens"]
    assert t == STORY
    drained = next(e for e in evs if isinstance(e, Drained))
    # the held step's token was dropped, and with async scheduling that of the step queued
    # behind it (decided before the abort arrived) too
    assert drained.discarded_tokens == eng.node.sched.config.max_steps_in_flight
    final = evs[-1]
    assert final.finish_reason == "abort"
    assert final.usage["completion_tokens"] == len(tokens_of(evs)) >= 3
    # no tokens after abort_requested
    i = types(evs).index("abort_requested")
    assert "tokens" not in types(evs)[i:]
    released = next(e for e in evs if e.TYPE == "blocks_released")
    assert released.count >= 1
    await _all_free(eng.node)
    # The blocks came back as the runner's result came in (the scheduler's `finished`), not
    # when the loop folded that step in: in the journal, before that step's `update`. (The
    # final can reach the stream before that fold-in: wait for it, then read the journal.)
    await wait_for(lambda: not eng.node.sched.snapshot()["steps_in_flight"], what="no step in flight")
    await eng.node._flush()
    journal = await load_journal_from_redis(real_bus, "e0")
    report = replay(journal)
    assert report.ok, report.divergence and report.divergence.describe()
    calls = [c for e in journal for c in getattr(e, "data", {}).get("calls", ())]
    at = next(
        i
        for i, c in enumerate(calls)
        if any(d[0] == "blocks_released" and d[1] == "dec" for d in c.get("ev", ()))
    )
    assert calls[at]["op"] == "finished"
    assert any(c["op"] == "update" and c["step"] == calls[at]["step"] for c in calls[at + 1 :])


async def test_queued_unclaimed_abort_is_prompt_and_never_prefilled(real_bus, engines):
    # the only engine is full (one slot, taken), so "late" stays unclaimed in P:requests
    eng, gated = await engines(max_num_seqs=1)
    gated.close()
    await submit(real_bus, "busy", PROMPT, max_tokens=400, ignore_eos=True)
    await gated.wait_entered(lambda out: any(s.request_id == "busy" for s in out.seqs))
    await submit(real_bus, "late", PROMPT, max_tokens=4)
    await asyncio.sleep(0.1)
    assert eng.node.sched.can_admit() == 0
    await _abort(real_bus, "late")
    evs = await story(real_bus, "late", timeout=5)  # promptly, while the engine is still full
    assert types(evs) == ["accepted", "abort_requested", "drained", "blocks_released", "final"]
    assert evs[-1].finish_reason == "abort" and evs[-2].count == 0
    assert gated.held is not None  # the engine never got capacity in the meantime
    gated.open()
    await _abort(real_bus, "busy")
    await story(real_bus, "busy")
    # once the engine has room it reads "late", loses the claim to the tombstone, and acks
    # and deletes it: P:requests ends empty
    for _ in range(200):
        pending = await real_bus.redis.xpending(real_bus.keys.requests, "engines")
        length = await real_bus.redis.xlen(real_bus.keys.requests)
        if pending["pending"] == 0 and length == 0:
            break
        await asyncio.sleep(0.01)
    assert pending["pending"] == 0 and length == 0
    await _all_free(eng.node)
    assert "late" not in gated.scheduled_ids()  # never prefilled
    late = [e for _, e in await real_bus.read_req("late")]
    assert types(late).count("final") == 1 and types(late)[-1] == "final"


async def test_waiting_in_engine_abort_is_immediate(real_bus, engines):
    # a 16-token budget: "run"'s prefill chunks fill the held step and the one queued behind
    # it (async scheduling), so "w" waits in the engine
    eng, gated = await engines(max_num_batched_tokens=16)
    gated.close()
    await submit_together(
        real_bus,
        [
            ("run", list(range(10, 58)), {"max_tokens": 400, "ignore_eos": True}),
            ("w", PROMPT, {"max_tokens": 4}),
        ],
    )
    held = await gated.wait_entered(lambda out: any(s.request_id == "run" for s in out.seqs))
    assert [s.request_id for s in held.seqs] == ["run"]
    await story(real_bus, "w", until=Claimed)  # claimed, while "run"'s step is held
    assert eng.node.sched.knows("w") and not eng.node.sched.in_flight("w")
    await _abort(real_bus, "w")
    evs = await story(real_bus, "w")  # while the other step is still held in flight
    assert types(evs) == STORY
    assert evs[-2].count == 0 and evs[3].discarded_tokens == 0
    assert gated.held is not None
    gated.open()
    await _abort(real_bus, "run")
    await story(real_bus, "run")
    await _all_free(eng.node)
    assert "w" not in gated.scheduled_ids()


async def test_the_gauges_show_an_abort_release_before_the_next_step_ends(real_bus, engines):
    # What a client polling /metrics sees: running + waiting fall the moment an abort gives
    # the blocks back, not when a later step is folded in (the heartbeat, which also sets the
    # gauges, is out of the way: once at start, then after 60 s)
    metrics = Metrics()
    eng, gated = await engines(max_num_batched_tokens=16, metrics=metrics, heartbeat_s=60.0)
    gated.close()
    await submit_together(
        real_bus,
        [
            ("run", list(range(10, 58)), {"max_tokens": 400, "ignore_eos": True}),
            ("w", PROMPT, {"max_tokens": 4}),
        ],
    )
    await gated.wait_entered(lambda out: any(s.request_id == "run" for s in out.seqs))
    await story(real_bus, "w", until=Claimed)
    await _abort(real_bus, "w")
    await story(real_bus, "w")
    sched = eng.node.sched

    def gauge(name: str) -> float:
        line = next(x for x in metrics.render().decode().splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert gated.held is not None  # no step has ended since the abort
    assert (gauge("fd_num_requests_running"), gauge("fd_num_requests_waiting")) == (1.0, 0.0)
    assert gauge("fd_kv_blocks_free") == sched.num_free_blocks < sched.num_total_blocks
    gated.open()
    await _abort(real_bus, "run")
    await story(real_bus, "run")
    await _all_free(eng.node)
    assert gauge("fd_num_requests_running") + gauge("fd_num_requests_waiting") == 0
    assert gauge("fd_kv_blocks_free") == sched.num_total_blocks


async def test_mid_chunked_prefill_abort(real_bus, engines):
    eng, gated = await engines(max_num_batched_tokens=16)
    # 8 chunks of 16 tokens: with async scheduling the chunk after the held one is already
    # queued behind it, and it must not be the last one either
    long_prompt = list(range(5, 5 + 128))
    await submit(real_bus, "chunky", long_prompt, max_tokens=8)
    for _ in range(15_000):  # (polled often: the chunks are ~1 ms steps, 8 in all)
        if gated.steps_done >= 2:
            break
        await asyncio.sleep(0.002)
    else:
        raise AssertionError("chunky's first 2 chunks did not run")
    gated.close()
    out = await gated.wait_entered(lambda out: any(s.request_id == "chunky" for s in out.seqs))
    seq = next(s for s in out.seqs if s.request_id == "chunky")
    assert not seq.sample and seq.start_pos > 0  # genuinely mid-prefill
    await _abort(real_bus, "chunky")
    await story(real_bus, "chunky", until=AbortRequested)
    gated.open()
    evs = await story(real_bus, "chunky")
    assert types(evs) == STORY
    assert evs[3].discarded_tokens == 0 and evs[4].count >= 1
    assert evs[-1].usage["completion_tokens"] == 0
    await _all_free(eng.node)
    assert not any(s.sample for o in gated.batches for s in o.seqs if s.request_id == "chunky")


async def test_finished_duplicate_unknown_aborts(real_bus, engines, keys):
    eng, gated = await engines()
    await submit(real_bus, "done", PROMPT, max_tokens=3)
    before = await story(real_bus, "done")
    assert before[-1].finish_reason == "length"
    # finished: no-op; duplicate: no-op; unknown: tombstone that wins over a late request
    await _abort(real_bus, "done")
    await submit(real_bus, "dup", PROMPT, max_tokens=500, ignore_eos=True)
    await story(real_bus, "dup", until=Tokens)
    await _abort(real_bus, "dup")
    await _abort(real_bus, "dup", source="cli")
    await _abort(real_bus, "ghost")
    # an unknown id costs a tombstone (one small key with a TTL), not a stream
    for _ in range(200):
        if await real_bus.owner("ghost"):
            break
        await asyncio.sleep(0.01)
    assert await real_bus.owner("ghost") == "aborted:redis"
    assert 0 < await real_bus.redis.ttl(keys.owner("ghost")) <= eng.node.cfg.tombstone_ttl_s
    assert not await real_bus.redis.exists(keys.req("ghost"))
    dup = await story(real_bus, "dup")
    await asyncio.sleep(0.1)
    dup = [e for _, e in await real_bus.read_req("dup")]
    assert types(dup).count("abort_requested") == 1 and types(dup).count("final") == 1
    after = [e for _, e in await real_bus.read_req("done")]
    assert types(after) == types(before)  # the finished request's story is unchanged
    # the ghost's request arrives after its abort: never submitted, never prefilled, and its
    # story is whole: accepted, then the abort, then its one final
    assert await real_bus.submit(*_pair("ghost", PROMPT, max_tokens=4)) is False
    ghost = await story(real_bus, "ghost")
    assert types(ghost) == ["accepted", "abort_requested", "drained", "blocks_released", "final"]
    assert ghost[-1].finish_reason == "abort" and ghost[1].source == "redis"
    # a second submission of the same id writes nothing more
    assert await real_bus.submit(*_pair("ghost", PROMPT, max_tokens=4)) is False
    await asyncio.sleep(0.1)
    assert len(await real_bus.read_req("ghost")) == 5
    assert "ghost" not in gated.scheduled_ids()
    await _all_free(eng.node)


async def test_abort_all(real_bus, engines):
    eng, gated = await engines()
    rids = [f"all{i}" for i in range(4)]
    for rid in rids:
        await submit(real_bus, rid, PROMPT[: 5 + int(rid[-1])], max_tokens=500, ignore_eos=True)
    for rid in rids:
        await story(real_bus, rid, until=Tokens)
    await real_bus.publish(real_bus.keys.control, AbortAll(source="cli"))
    for rid in rids:
        evs = await story(real_bus, rid)
        assert [x for x in types(evs) if x != "tokens"] == STORY
        assert evs[-1].finish_reason == "abort"
        assert isinstance(evs[-1], Final)
    await _all_free(eng.node)


async def test_a_tombstone_nobody_knows_it_laid_still_gets_its_story(real_bus, engines, keys):
    """An abort's tombstone is down on a queued request's owner key, but no engine knows it
    laid it (its SET NX went through, a dropped connection lost the reply, and the retry
    found the tombstone: every engine took it for another's). The next abort of the id that
    meets the tombstone with the story in place flips it and writes the story, once."""
    eng, gated = await engines()
    await real_bus.redis.set(keys.owner("lost"), "aborted:http", ex=60)
    _, acc = _pair("lost", PROMPT, max_tokens=4)
    await real_bus.publish(keys.req("lost"), acc)
    await _abort(real_bus, "lost", source="http")
    evs = await story(real_bus, "lost")
    assert types(evs) == ["accepted", "abort_requested", "drained", "blocks_released", "final"]
    assert evs[1].source == "http" and evs[-1].finish_reason == "abort"
    assert await real_bus.owner("lost") == "aborted-final"
    await _abort(real_bus, "lost", source="cli")  # (a second abort: nothing more)
    await asyncio.sleep(0.2)
    assert len(await real_bus.read_req("lost")) == 5
    assert "lost" not in gated.scheduled_ids()


async def test_a_retried_flip_whose_reply_was_lost_is_still_its_callers(real_bus, keys):
    """The flip of a tombstone went through but its reply was lost (a dropped connection); the
    caller's retry finds ``aborted-final``. It is still that caller's story to write (no one
    else will); anyone else's call is not. (Had another flipped it meanwhile, both would
    write, and the fence keeps the first story's batch alone: nothing after a final.)"""
    await real_bus.redis.set(keys.owner("flipped"), "aborted:cli", ex=60)
    seen: list[str] = []
    assert await real_bus.take_abort_story("flipped", seen) == "cli"
    assert await real_bus.owner("flipped") == "aborted-final"
    assert await real_bus.take_abort_story("flipped", seen) == "cli"  # the retry
    assert await real_bus.take_abort_story("flipped", []) is None  # another caller
    assert await real_bus.take_abort_story("flipped") is None


async def test_engine_that_meets_a_tombstone_writes_the_story_once(real_bus, engines, keys):
    """The abort laid its tombstone before the request's stream existed; the request was
    submitted anyway (it checked before the tombstone landed). The engine that claims it loses
    to the tombstone, never prefills it, and writes its abort story exactly once."""
    eng, gated = await engines()
    [(won, _, exists)] = await real_bus.tombstone_many(["raced"], "http", 60)
    assert won and not exists
    req, acc = _pair("raced", PROMPT, max_tokens=4)
    await real_bus.publish_many([(keys.req("raced"), acc), (keys.requests, req)])
    evs = await story(real_bus, "raced")
    assert types(evs) == ["accepted", "abort_requested", "drained", "blocks_released", "final"]
    assert evs[1].source == "http" and evs[-1].finish_reason == "abort"
    assert await real_bus.owner("raced") == "aborted-final"
    assert await real_bus.take_abort_story("raced") is None  # nobody can write it again
    for _ in range(200):
        if await real_bus.redis.xlen(keys.requests) == 0:
            break
        await asyncio.sleep(0.01)
    assert await real_bus.redis.xlen(keys.requests) == 0  # acked and deleted
    assert "raced" not in gated.scheduled_ids()
