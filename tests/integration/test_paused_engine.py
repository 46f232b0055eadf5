"""An engine process paused (SIGSTOP) under live streams, its requests taken over by a peer,
then resumed (SIGCONT): the step results it was holding meet the fence (fd/control/fence.py) and
are dropped. Nothing of the old owner's lands on any stream after the takeover, nothing after a
final, every story is the greedy reference, and the old engine gives its blocks back."""

from __future__ import annotations

import os
import signal

from fd.control.events import Claimed, Final, Tokens
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit_together, text_of, tokens_of, types
from tests.kit.faults import Engines, reap, spawn_engine, wait_for

N_STREAMS = 16
MAX_TOKENS = 300  # B, on a quarter of the shared runner's blocks, holds 16 of these


async def _heartbeat(bus, engine_id: str) -> dict[str, str]:
    raw = await bus.redis.hgetall(bus.keys.engine(engine_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


async def _events(bus, rid):
    return [ev for _, ev in await bus.read_req(rid)]


async def test_a_resumed_engine_writes_nothing_into_streams_it_lost(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    bus = real_bus
    rids = [f"s{i}" for i in range(N_STREAMS)]
    prompts = [[5 + i, 17, 33, 9, 41, 12, 7, 19] for i in range(N_STREAMS)]
    sampling = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    refs = LLM(tiny_runner, tiny_tokenizer).generate(prompts, SamplingParams(**sampling))
    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, slices=1)
    proc = spawn_engine(
        redis_server.url, keys, tiny_model_dir, "A", "--num-blocks", "1024", "--max-num-seqs", "32"
    )
    stopped = False
    try:
        await wait_for(lambda: _heartbeat(bus, "A"), timeout=90, what="engine A up")
        await submit_together(bus, [(rid, p, sampling) for rid, p in zip(rids, prompts)])

        async def all_streaming(engine: str) -> bool:
            for rid in rids:
                evs = await _events(bus, rid)
                if not any(isinstance(e, Claimed) and e.engine == engine for e in evs):
                    return False
                if engine == "A" and not tokens_of(evs):
                    return False
            return True

        await wait_for(lambda: all_streaming("A"), timeout=60, what="A streaming all 16")
        b = await engines.start("B", max_num_seqs=N_STREAMS)  # scans for orphans every 0.2 s
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        # A's heartbeat expires (its TTL: 5 s); B takes every request over, mid-stream
        await wait_for(lambda: all_streaming("B"), timeout=30, what="B owning all 16")
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        stories = {rid: await story(bus, rid, timeout=60) for rid in rids}
        # A holds step results for all 16 from before its pause: each meets the fence, and A
        # drops the request and gives its blocks back
        hb = await wait_for(lambda: _beat_when_dropped(bus), timeout=30, what="A dropping all 16")
        assert int(hb["fenced"]) == N_STREAMS and int(hb["blocks_free"]) == int(hb["blocks_total"])
        for rid, ref in zip(rids, refs):
            evs = stories[rid]
            assert [(c.engine, c.attempt) for c in evs if isinstance(c, Claimed)] == [("A", 1), ("B", 2)]
            took_over = next(i for i, e in enumerate(evs) if isinstance(e, Claimed) and e.engine == "B")
            assert all(getattr(e, "engine", "B") == "B" for e in evs[took_over:]), types(evs)
            assert types(evs).count("final") == 1 and types(evs)[-1] == "final"
            final = evs[-1]
            assert isinstance(final, Final) and final.finish_reason == "length"
            assert tokens_of(evs) == ref.token_ids, rid  # none lost, none repeated, none stale
            assert text_of(evs) == ref.text
            assert final.usage["completion_tokens"] == len(tokens_of(evs)) == MAX_TOKENS
            assert all(isinstance(e, Tokens) for e in evs[took_over + 1 : -2])
        # nothing came after: A is done with them, the stories are as they were
        assert {rid: await _events(bus, rid) for rid in rids} == stories
        assert (await bus.redis.xpending(bus.keys.requests, "engines"))["pending"] == 0
        assert b.node.taken_over == N_STREAMS
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        await engines.stop_all()
        proc.terminate()
        reap(proc)


async def _beat_when_dropped(bus) -> dict[str, str] | None:
    hb = await _heartbeat(bus, "A")
    if (
        hb
        and hb.get("running") == "0"
        and hb.get("waiting") == "0"
        and int(hb.get("fenced", 0)) >= N_STREAMS
        and hb.get("blocks_free") == hb.get("blocks_total")
    ):
        return hb
    return None
