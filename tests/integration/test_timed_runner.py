"""The timed executor: deterministic tokens, steps that last at least step_ms, and a whole
engine (scheduler, streams, aborts) running on it."""

from __future__ import annotations

import asyncio
import time

from fd.compose import start_engine
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.timed_runner import TimedRunner


def _step(step: int, *seqs: tuple[str, tuple[int, ...], int]) -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return SchedulerOutput(
        step=step, seqs=tuple(ScheduledSeq(rid, toks, start, (0,), True, sp, 0) for rid, toks, start in seqs)
    )


def test_tokens_are_deterministic_and_avoid_eos():
    a = TimedRunner(64, step_ms=0, eos_token_ids=(1, 3), vocab_size=64)
    b = TimedRunner(64, step_ms=0, eos_token_ids=(1, 3), vocab_size=64)
    out = _step(0, ("r1", (5, 6, 7), 0), ("r2", (9,), 12))
    ra, rb = a.execute(out), b.execute(out)
    assert ra.sampled == rb.sampled and set(ra.sampled) == {"r1", "r2"}
    assert ra.sampled["r1"] == a.token_at("r1", 3) and ra.sampled["r2"] == a.token_at("r2", 13)
    toks = {a.token_at(f"r{i}", p) for i in range(20) for p in range(20)}
    assert not toks & {0, 1, 2, 3} and len(toks) > 20  # no specials, no EOS; spread out


def test_text_tokens_with_a_tokenizer(tiny_tokenizer):
    r = TimedRunner.for_tokenizer(tiny_tokenizer, step_ms=0)
    assert r.max_model_len == tiny_tokenizer.max_model_len
    assert r.eos_token_ids == tiny_tokenizer.eos_token_ids
    for t in r.token_ids:
        assert not tiny_tokenizer.is_special(t)
        assert tiny_tokenizer.id_to_bytes(t).decode("utf-8").strip()


def test_a_step_takes_at_least_step_ms():
    r = TimedRunner(64, step_ms=20, per_token_ms=1.0)
    t0 = time.perf_counter()
    r.execute(_step(0, ("r1", (5,), 0)))
    assert time.perf_counter() - t0 >= 0.020
    t0 = time.perf_counter()
    r.execute(_step(1, ("r1", tuple(range(4, 14)), 0)))  # 10 tokens: 20 + 10 ms
    assert time.perf_counter() - t0 >= 0.030
    t0 = time.perf_counter()
    assert r.execute(SchedulerOutput(step=2, seqs=())).sampled == {}  # nothing to run: no wait
    assert r.steps == 2


async def test_an_engine_runs_on_it(embedded_redis, keys, tiny_tokenizer):
    """Requests through a real EngineNode on the timed runner: tokens come from the runner,
    ``length`` finishes, an abort mid-decode releases every block."""
    runner = TimedRunner.for_tokenizer(tiny_tokenizer, step_ms=5, num_blocks=64)
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir="unused", engine_id="timed0"),
        runner=runner,
        tokenizer=tiny_tokenizer,
    )
    bus = eng.node.bus
    try:
        from fd.control.events import Accepted, Request

        prompt = tuple(tiny_tokenizer.encode("Hello there"))

        async def submit(rid: str, n: int) -> None:
            data = RequestData(
                prompt_token_ids=prompt,
                arrival_ts=int(time.time() * 1000),
                sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            )
            await bus.submit(
                Request(request_id=rid, data=data), Accepted(request_id=rid, prompt_tokens=len(prompt))
            )

        async def story(rid: str) -> list:
            for _ in range(500):
                evs = [e for _, e in await bus.read_req(rid)]
                if evs and evs[-1].TYPE == "final":
                    return evs
                await asyncio.sleep(0.01)
            raise AssertionError(f"{rid}: no final: {[e.TYPE for e in evs]}")

        await submit("done", 6)
        await submit("long", 400)
        evs = await story("done")
        toks = [t for e in evs if e.TYPE == "tokens" for t in e.token_ids]
        n = len(prompt)
        assert toks == [runner.token_at("done", n + i) for i in range(6)]
        assert evs[-1].finish_reason == "length"

        from fd.control.events import Abort

        await bus.publish(bus.keys.control, Abort(request_ids=("long",), source="cli"))
        evs = await story("long")
        assert evs[-1].finish_reason == "abort"
        assert [e.TYPE for e in evs if e.TYPE != "tokens"][-3:] == ["drained", "blocks_released", "final"]
        for _ in range(100):
            if eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks == 64
        assert runner.steps >= 6
    finally:
        await eng.stop()
