"""An engine node on real Redis: claims, tokens, finals, acks, heartbeats, dead letters."""

from __future__ import annotations

import asyncio

from fd.compose import start_engine
from fd.control.connect import connect
from fd.control.sampling import SamplingParams
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, text_of, tokens_of, types
from tests.kit.faults import engines, wait_for  # noqa: F401  (engines: a fixture)


async def _start(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, **kw):
    opts = EngineConfig(model_dir=str(tiny_model_dir), engine_id=kw.pop("engine_id", "e0"), **kw)
    return await start_engine(
        lambda: connect(redis_server.url), keys, opts, runner=tiny_runner, tokenizer=tiny_tokenizer
    )


async def test_served_greedy_equals_offline_and_story_is_whole(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    prompts = [
        tiny_tokenizer.encode(p)
        for p in [
            "Hello there",
            "The quick brown fox",
            "a",
            "Once upon a time in a land far away",
            "1 2 3 4 5 6 7 8 9 10 11 12 13",
            "What is the capital",
        ]
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(tiny_runner, tiny_tokenizer).generate(prompts, sp)
    eng = await _start(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        for i, p in enumerate(prompts):
            await submit(real_bus, f"g{i}", p, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(prompts):
            evs = await story(real_bus, f"g{i}")
            t = types(evs)
            assert t[0] == "accepted" and t[1] == "claimed" and t[-1] == "final"
            assert t[-2] == "blocks_released"
            assert tokens_of(evs) == ref[i].token_ids
            assert text_of(evs) == ref[i].text
            assert evs[-1].finish_reason == "length"
            assert evs[-1].usage == {
                "prompt_tokens": len(p),
                "completion_tokens": 12,
                "total_tokens": len(p) + 12,
            }
            assert evs[1].engine == "e0" and evs[1].attempt == 1
        # every request was acked after its final; all blocks came back
        pending = await real_bus.redis.xpending(keys.requests, "engines")
        assert pending["pending"] == 0
        assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks
        # finished streams expire
        assert 0 < await real_bus.redis.ttl(keys.req("g0")) <= real_bus.req_ttl_s
        # the heartbeat reports the engine
        for _ in range(100):
            live = await real_bus.engines()
            if "e0" in live:
                break
            await asyncio.sleep(0.02)
        assert int(live["e0"]["blocks_total"]) == eng.node.sched.num_total_blocks
    finally:
        await eng.stop()


async def test_stop_string_ends_request_without_leaking_it(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    prompt = tiny_tokenizer.encode("The quick brown fox")
    free = LLM(tiny_runner, tiny_tokenizer).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    )[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    eng = await _start(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        await submit(real_bus, "s", prompt, max_tokens=20, ignore_eos=True, stop=(stop,))
        evs = await story(real_bus, "s")
        assert evs[-1].finish_reason == "stop" and evs[-1].stop_reason == stop
        assert text_of(evs) == free.text[: free.text.index(stop)]
    finally:
        await eng.stop()


async def test_bad_events_never_stop_the_engine(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    eng = await _start(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        r = real_bus.redis
        await r.execute_command("XADD", keys.control, "*", "type", "abrot", "request_id", "x")
        await r.execute_command("XADD", keys.control, "*", "type", "abort")
        await r.execute_command(
            "XADD", keys.requests, "*", "type", "request", "request_id", "y", "data", "{not json"
        )
        await r.execute_command(
            "XADD", keys.requests, "*", "type", "request", "request_id", "z", "data", b"\xff\xfe"
        )
        await submit(real_bus, "ok", [5, 6, 7], max_tokens=3)
        evs = await story(real_bus, "ok")
        assert evs[-1].finish_reason == "length"
        for _ in range(100):
            if await r.xlen(keys.dead) >= 4:
                break
            await asyncio.sleep(0.02)
        dead = await r.xrange(keys.dead)
        reasons = [f[b"reason"].decode() for _, f in dead]
        assert len(dead) == 4, reasons
        assert any("abrot" in x for x in reasons) and any("JSON" in x for x in reasons)
        assert not eng.task.done()
    finally:
        await eng.stop()


async def test_dead_letters_are_counted_in_metrics(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    from fd.control.metrics import Metrics

    metrics = Metrics()
    opts = EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-dead")
    eng = await start_engine(
        lambda: connect(redis_server.url),
        keys,
        opts,
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
        metrics=metrics,
    )
    try:
        await real_bus.redis.execute_command("XADD", keys.control, "*", "type", "abrot")
        await real_bus.redis.execute_command("XADD", keys.control, "*", "type", "abort")
        for _ in range(200):
            if await real_bus.redis.xlen(keys.dead) >= 2:
                break
            await asyncio.sleep(0.01)
        assert b"fd_dead_letters_total 2.0" in metrics.render()
    finally:
        await eng.stop()


async def test_journal_can_be_turned_off_and_bounded(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    for journal, maxlen in ((False, 10_000), (True, 500)):
        eid = f"j-{journal}"
        opts = EngineConfig(
            model_dir=str(tiny_model_dir), engine_id=eid, journal=journal, journal_maxlen=maxlen
        )
        eng = await start_engine(
            lambda: connect(redis_server.url), keys, opts, runner=tiny_runner, tokenizer=tiny_tokenizer
        )
        try:
            await submit(real_bus, f"r-{journal}", [5, 6, 7], max_tokens=3)
            await story(real_bus, f"r-{journal}")
        finally:
            await eng.stop()
        n = await real_bus.redis.xlen(keys.journal(eid))
        assert (n > 0) == journal
        assert eng.node.bus.journal_maxlen == maxlen


def _parked_in_step_loop(task: asyncio.Task) -> bool:
    """The task's chain of awaits ends in the step loop's wait for a wake-up (an Event's
    ``wait``, through the engine core's ``wait``, or a ``wait_for`` around it)."""
    coro, names = task.get_coro(), []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        names.append(coro.cr_frame.f_code.co_name)
        coro = coro.cr_await
    if "_step_loop" not in names:
        return False
    tail = names[names.index("_step_loop") + 1 :]
    return bool(tail) and all(n in ("wait_for", "wait") for n in tail)


async def test_a_cancel_that_meets_a_wake_up_still_stops_the_engine(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    # Work that cannot run (here: a scheduler with nothing to give) parks the step loop on its
    # wake-up event. A cancel (a kill, the loop shutting down) that arrives in the same turn as a
    # wake-up must still end the task: asyncio.wait_for of Python 3.11 returns the result then
    # and loses the cancel, and the engine ran on, with its heartbeat, forever.
    from fd.engine.core.outputs import SchedulerOutput

    eng = await _start(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        eng.node.sched.schedule = lambda: SchedulerOutput(step=0, seqs=())
        await submit(real_bus, "w", tiny_tokenizer.encode("waiting"), max_tokens=4)
        for _ in range(10_000):
            if _parked_in_step_loop(eng.task):
                break
            await asyncio.sleep(0)
        assert _parked_in_step_loop(eng.task)
        eng.node._wake.set()
        eng.task.cancel()
        done, _ = await asyncio.wait([eng.task], timeout=10)  # (a bound for a failure, not a timing)
        assert eng.task in done and eng.task.cancelled()
    finally:
        eng.node.stop()
        await asyncio.gather(eng.task, return_exceptions=True)


async def test_a_request_that_comes_while_steps_run_back_to_back_joins_within_a_few_steps(
    real_bus, engines, tiny_tokenizer
):
    """With async scheduling the runner always holds a step, so the engine never drains its
    pipeline while a long request decodes; a request that comes meanwhile must still be
    claimed and start within a few steps, not wait for the long one to end."""
    from fd.control.events import Claimed, Final, Tokens

    a = await engines.start("A", delay=0.01)
    await submit(real_bus, "long", tiny_tokenizer.encode("a long one"), max_tokens=300, ignore_eos=True)
    await story(real_bus, "long", until=Tokens)
    await wait_for(lambda: a.node.steps > 10, what="long decoding")
    await submit(real_bus, "late", tiny_tokenizer.encode("late"), max_tokens=2, ignore_eos=True)
    late = await story(real_bus, "late", until=Final)
    first = next(e for e in late if isinstance(e, Tokens))
    claimed = next(e for e in late if isinstance(e, Claimed))
    long_so_far = [e for _, e in await real_bus.read_req("long")]
    assert not any(isinstance(e, Final) for e in long_so_far)  # the long one still runs
    # claimed and prefilled within a few steps of its arrival (the long one's step then)
    at_claim = max(e.step for e in long_so_far if isinstance(e, Tokens) and e.ts <= claimed.ts)
    assert first.step - at_claim <= 4, (first.step, at_claim)


async def test_a_stopped_engine_decides_no_more_steps(real_bus, engines, tiny_tokenizer):
    """``stop`` is now: the steps in flight are folded in and published, and no new one is
    decided; a request still running is left to a live peer (its heartbeat is gone), not run
    to its end first."""
    from fd.control.events import Final, Tokens

    a = await engines.start("A", delay=0.01)
    await submit(real_bus, "long", tiny_tokenizer.encode("a long one"), max_tokens=400, ignore_eos=True)
    await story(real_bus, "long", until=Tokens)
    a.node.stop()
    await asyncio.wait_for(asyncio.shield(a.task), 10)
    evs = [e for _, e in await real_bus.read_req("long")]
    assert not any(isinstance(e, Final) for e in evs)  # (400 steps of 10 ms: not run out)
    assert sum(len(e.token_ids) for e in evs if isinstance(e, Tokens)) < 100
