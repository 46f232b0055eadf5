"""Graceful drain on real Redis: ``type=drain engine=<id>`` stops claiming, lets running
requests finish within the drain timeout, hands the rest back, and the engine exits; another
engine continues what was handed back without losing or repeating a token."""

from __future__ import annotations

import asyncio
import signal

from fd.control.events import Claimed, Drain, Preempted, Tokens
from fd.control.sampling import SamplingParams
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, text_of, tokens_of, types
from tests.kit.faults import all_blocks_free, engines, reap, spawn_engine, wait_for  # noqa: F401

PROMPT = [5, 17, 33, 9, 41, 12, 7, 19]


async def test_drain_finishes_running_hands_back_the_rest_and_exits(
    real_bus, engines, tiny_runner, tiny_tokenizer
):
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    ref = LLM(tiny_runner, tiny_tokenizer).generate([PROMPT], sp)[0]
    a = await engines.start("A", delay=0.02, drain_timeout_s=0.6)
    await submit(real_bus, "short", PROMPT[:5], max_tokens=8, ignore_eos=True)
    await submit(real_bus, "long", PROMPT, max_tokens=80, ignore_eos=True)
    await wait_for(lambda: a.node.sched.num_running == 2, what="both running on A")
    await real_bus.publish(real_bus.keys.control, Drain(engine="A"))
    await wait_for(lambda: a.node._draining, what="A draining")
    await submit(real_bus, "later", PROMPT[:6], max_tokens=4)  # A claims nothing new
    await asyncio.wait_for(a.task, 10)  # A exits by itself ...
    assert a.task.exception() is None
    assert not await real_bus.redis.exists(real_bus.keys.engine("A"))  # ... and says so
    short = await story(real_bus, "short")
    assert short[-1].finish_reason == "length" and short[-1].engine == "A"  # finished in time
    long_so_far = [e for _, e in await real_bus.read_req("long")]
    assert "final" not in types(long_so_far)  # 80 slow steps do not fit 0.6 s: handed back
    (note,) = [e for e in long_so_far if isinstance(e, Preempted)]
    assert note.handback and note.engine == "A" and note.count > 0
    b = await engines.start("B")
    long = await story(real_bus, "long", timeout=20)
    assert [(c.engine, c.attempt) for c in long if isinstance(c, Claimed)] == [("A", 1), ("B", 2)]
    assert tokens_of(long) == ref.token_ids and text_of(long) == ref.text
    assert types(long).count("final") == 1 and long[-1].finish_reason == "length"
    assert long[-1].usage["completion_tokens"] == 80
    later = await story(real_bus, "later")
    assert [c.engine for c in later if isinstance(c, Claimed)] == ["B"]
    await all_blocks_free(b.node)
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    for eid in ("A", "B"):
        report = replay(await load_journal_from_redis(real_bus, eid))
        assert report.divergence is None and not report.analysis.violations, eid


async def test_drain_of_an_idle_engine_exits_at_once(real_bus, engines):
    a = await engines.start("A")
    await real_bus.publish(real_bus.keys.control, Drain(engine="B"))  # not ours
    await asyncio.sleep(0.2)
    assert not a.task.done()
    await real_bus.publish(real_bus.keys.control, Drain(engine="A"))
    await asyncio.wait_for(a.task, 5)
    assert a.task.exception() is None


async def test_sigterm_drains_fd_engine_and_it_exits_0(real_bus, redis_server, keys, tiny_model_dir):
    proc = spawn_engine(redis_server.url, keys, tiny_model_dir, "P")
    try:
        await submit(real_bus, "r", PROMPT, max_tokens=300, ignore_eos=True)
        await story(real_bus, "r", timeout=60, until=Tokens)
        proc.send_signal(signal.SIGTERM)
        rc, out = await asyncio.to_thread(reap, proc, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out
    evs = await story(real_bus, "r")  # it finished before the engine exited
    assert evs[-1].finish_reason == "length" and len(tokens_of(evs)) == 300
    assert not await real_bus.redis.exists(real_bus.keys.engine("P"))
