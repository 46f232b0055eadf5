"""A recorded run of the real scheduler for the journal tests: a deterministic fake model,
scripted arrivals, a pool small enough to preempt, and every abort case of DESIGN.md §4 that
reaches a scheduler (tests/integration/test_journal_replay.py and test_timeline.py)."""

from __future__ import annotations

import dataclasses

import pytest

from fd.control.events import AbortRequested, Event
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import Aborted, RunnerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.journal.journal import JournalRecorder

EOS = 2
CFG = SchedulerConfig(
    num_blocks=14,
    block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    eos_token_ids=(EOS,),
    long_prefill_threshold=8,
)


def model(ctx):
    """Next token from the whole context; never EOS unless the context says so."""
    return (sum((i + 1) * t for i, t in enumerate(ctx)) + 7 * len(ctx)) % 97 + 3


class FakeRunner:
    """Writes fed tokens (with their positions, as RoPE puts them in K) into their KV slots and
    samples from what the KV holds, so a wrong block table changes the tokens (and so the
    journal)."""

    def __init__(self, cfg: SchedulerConfig):
        self.bs = cfg.block_size
        self.kv = [[None] * self.bs for _ in range(cfg.num_blocks)]

    def execute(self, out, stopped=None):
        sampled = {}
        for s in out.seqs:
            end = s.start_pos + len(s.token_ids)
            for i, t in enumerate(s.token_ids):
                p = s.start_pos + i
                self.kv[s.block_table[p // self.bs]][p % self.bs] = (p, t)
            if s.sample:
                kv = [self.kv[s.block_table[p // self.bs]][p % self.bs] for p in range(end)]
                sampled[s.request_id] = model([t if q == p else t + 1000 for p, (q, t) in enumerate(kv)])
        return RunnerOutput(step=out.step, sampled=sampled, stopped=dict(stopped or {}))


def req(n, max_tokens=6, start=10, **sp):
    return RequestData(
        prompt_token_ids=tuple(range(start, start + n)), sampling=SamplingParams(max_tokens=max_tokens, **sp)
    )


class Run:
    """Drives a (recorded) scheduler like the engine node does, stamping entries like it."""

    def __init__(self, sched, engine_id, t0=1_700_000_000_000):
        self.rec = JournalRecorder(sched, engine_id, clock=lambda: self.t / 1000)
        self.runner = FakeRunner(sched.config)
        self.entries: list[Event] = [dataclasses.replace(self.rec.start_record(), ts=t0)]
        self.events: list[Event] = []
        self.t = t0  # fake wall clock, ms: a step takes 7 ms, and an abort lands 2 ms into it
        self.cases: set[str] = set()

    def call(self, name, *args):
        evs = getattr(self.rec, name)(*args)
        if isinstance(evs, Aborted):  # (an abort's answer: its events, and what the runner drops)
            evs = evs.events
        self.events += evs
        return evs

    def step(self, during=None, stopped=None, finished=False):
        """``finished``: the engine tells the scheduler the step is done before folding it in
        (as it does while an abort waits)."""
        out = self.rec.schedule()
        self.events += out.events
        self.t += 2
        if not out.empty:
            if during:
                during(self)
            result = self.runner.execute(out, stopped)
            self.t += 5
            if finished:
                self.call("finished", out.step)
            self.events += self.rec.update(out, result)
        else:
            self.t += 5
        ev = self.rec.drain()
        if ev is not None:
            self.entries.append(dataclasses.replace(ev, ts=self.t))
        return out


def abort_case(run, rid, case, expect):
    """Abort ``rid``, checking it really is in the state ``case`` names."""
    evs = run.call("abort", rid, "http")
    assert [type(e).__name__ for e in evs if getattr(e, "request_id", None) == rid] == expect, case
    run.cases.add(case)


def record_run(sched_cls=Scheduler) -> Run:
    run = Run(sched_cls(CFG), "eng-1")
    s = run.rec
    run.call("add", "a", req(6, max_tokens=12))
    run.call("add", "b", req(7, max_tokens=10, start=30))
    run.call("add", "long", req(20, max_tokens=3, start=50))  # chunked: 8 per step
    run.call("add", "empty", RequestData(prompt_token_ids=()))  # error final at add
    with pytest.raises(ValueError):
        s.add("a", req(3))  # duplicate add raises; the journal records that too
    run.step()
    run.call("add", "c", req(9, max_tokens=20, start=70))
    run.call(
        "add",
        "d",
        req(
            5,
            max_tokens=20,
            start=90,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            logit_bias=((3, 1.0), (7, -2.5)),
            min_p=0.1,
            min_tokens=2,
            logprobs=2,
            prompt_logprobs=1,
        ),
    )
    run.step()
    # 'long' has had one or two 8-token chunks of 20: abort it between steps, mid-prefill
    snap = {r["request_id"]: r for r in s.snapshot()["requests"]}
    assert 0 < snap["long"]["num_computed_tokens"] < 20
    abort_case(run, "long", "mid_prefill", ["AbortRequested", "Drained", "BlocksReleased", "Final"])
    run.call("add", "w1", req(30, max_tokens=4, start=5))
    run.call("add", "w2", req(4, max_tokens=4, start=15))
    run.step()
    assert s.snapshot()["waiting"] == ["w1", "w2"]  # w1 does not fit yet; w2 queues behind it
    abort_case(run, "w2", "waiting", ["AbortRequested", "Drained", "BlocksReleased", "Final"])

    def in_flight(r):
        rid = next(x for x in ("c", "d", "b") if r.rec.in_flight(x))
        abort_case(r, rid, "in_flight", ["AbortRequested"])
        abort_case(r, rid, "duplicate", [])

    for _ in range(4):
        run.step()
    run.step(during=in_flight)
    abort_case(run, "ghost", "unknown", [])
    stop_done = False
    for _ in range(60):
        if not s.has_work():
            break
        if not stop_done and s.knows("b") and s.num_running:
            stop_done = True
            run.step(stopped={"b": "</s>"})  # the node's detokenizer found a stop string
            continue
        run.step()
        if not s.knows("a") and "finished" not in run.cases:
            abort_case(run, "a", "finished", [])
        if s.step == 14:
            run.call("add", "late1", req(6, max_tokens=30, start=3))
            run.call("add", "late2", req(6, max_tokens=30, start=4))
        if s.step == 16 and "released_before_fold_in" not in run.cases:

            def finished_early(r):
                rid = next(x for x in ("late1", "late2", "c", "d") if r.rec.in_flight(x))
                abort_case(r, rid, "released_before_fold_in", ["AbortRequested"])
                r.early = rid

            run.step(during=finished_early, finished=True)
            # released by `finished`, before the step was folded in: its token dropped there
            mine = [type(e).__name__ for e in run.events if e.request_id == run.early]
            assert mine[mine.index("AbortRequested") :] == [
                "AbortRequested",
                "Drained",
                "BlocksReleased",
                "Final",
            ]
        if s.step == 18:
            evs = run.call("abort_all", "engine")
            assert any(isinstance(e, AbortRequested) for e in evs)
            run.cases.add("abort_all")
    run.step()
    return run
