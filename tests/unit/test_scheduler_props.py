"""Random arrivals, aborts (also in flight) and steps against a tiny KV pool.

The fake runner keeps a KV store and samples from what the blocks hold, so a block handed to
two requests, or freed while a step still writes it, shows up as wrong tokens.

Every run is made twice: one step in flight at a time, and async scheduling (two in flight:
step N+1 decided before step N is folded in, its decodes fed placeholders that the fake runner
fills in from step N's samples, as the real one does). A step "runs" (writes its KV, samples)
as late as it can: just before its results are folded in.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd.control.events import AbortRequested, BlocksReleased, Drained, Final, Preempted, Tokens
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import RunnerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.core.sequence import PLACEHOLDER

EOS = 0


def model(ctx):
    return (sum((i + 1) * t for i, t in enumerate(ctx)) * 31 + len(ctx)) % 23  # EOS sometimes


def reference(prompt, sp, max_model_len):
    toks = list(prompt)
    out = []
    while True:
        t = model(toks)
        toks.append(t)
        out.append(t)
        if t == EOS and not sp.ignore_eos or len(out) >= sp.max_tokens:
            return out
        if len(toks) >= max_model_len:
            return out


class Harness:
    def __init__(self, cfg):
        self.cfg = cfg
        self.flying = []  # steps scheduled and not folded back yet, oldest first
        self.last_sampled = {}  # the previous step's samples: what a placeholder stands for
        self.left_out = {}  # step -> aborting requests the "runner" left out of it (skipped)
        self.sched = Scheduler(cfg)
        self.bs = cfg.block_size
        self.kv = [[None] * self.bs for _ in range(cfg.num_blocks)]
        self.data = {}  # rid -> RequestData, admitted ones
        self.events = {}  # rid -> its events, in order
        self.aborted = set()
        self.n = 0

    # -------------------------------------------------------------- checks

    def record(self, evs):
        for e in evs:
            story = self.events.setdefault(e.request_id, [])
            assert not any(isinstance(x, Final) for x in story), f"{e} after Final"
            if isinstance(e, Tokens):
                assert not any(isinstance(x, AbortRequested) for x in story), f"{e} after abort"
            if isinstance(e, AbortRequested):
                assert e.request_id not in self.aborted
                self.aborted.add(e.request_id)
            if isinstance(e, Drained):
                assert any(isinstance(x, AbortRequested) for x in story)
            if isinstance(e, BlocksReleased):
                assert e.count >= 0
                assert not any(
                    e.request_id == x.request_id
                    for o in self.flying
                    for x in o.seqs
                    if x.request_id not in self.left_out.get(o.step, ())
                ), f"{e.request_id}'s blocks released while a step in flight holds them"
            if isinstance(e, Final):
                assert isinstance(story[-1], BlocksReleased) if story else e.finish_reason == "error"
                toks = [t for x in story if isinstance(x, Tokens) for t in x.token_ids]
                assert e.usage["completion_tokens"] == len(toks)
                if e.finish_reason == "abort":
                    assert any(isinstance(x, Drained) for x in story)
            story.append(e)
        self.invariants()

    def invariants(self):
        s = self.sched
        s.blocks.check()  # no block owned twice; free + owned == total
        for rid in s.blocks.tables():
            assert s.knows(rid), f"{rid} holds blocks but is gone"
        assert s.num_running <= self.cfg.max_num_seqs

    # -------------------------------------------------------------- calls

    def add(self, plen, max_tokens, ignore_eos):
        rid = f"r{self.n}"
        self.n += 1
        prompt = tuple((self.n * 7 + i) % 19 + 1 for i in range(plen))
        data = RequestData(
            prompt_token_ids=prompt,  # (a priority only the priority policy reads)
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
            priority=(self.n * 5) % 3,
        )
        evs = self.sched.add(rid, data)
        if evs:
            assert [type(e) for e in evs] == [Final] and evs[0].finish_reason == "error"
        else:
            self.data[rid] = data
        self.record(evs)

    def abort(self, k):
        if not self.n:
            return
        rid = f"r{k % self.n}"
        s = self.sched
        table, free, flying = s.blocks.table(rid), s.num_free_blocks, s.in_flight(rid)
        again = rid in self.aborted
        # It stopped (EOS, max_tokens) on a step already folded in while a step ahead still
        # holds it: its final comes with that step, and there is nothing left to abort.
        seq = s._seqs.get(rid)
        finishing = seq is not None and seq.finishing is not None
        evs = s.abort(rid, "http").events
        if again or finishing:
            assert evs == []
        elif flying:
            assert [type(e) for e in evs] == [AbortRequested]
            assert s.blocks.table(rid) == table and s.num_free_blocks == free
        elif evs:
            assert [type(e) for e in evs] == [AbortRequested, Drained, BlocksReleased, Final]
            assert evs[2].count == len(table)
        self.record(evs)

    def abort_all(self):
        self.record(self.sched.abort_all("cli").events)

    def step(self, abort_in_flight=()):
        s = self.sched
        depth = self.cfg.max_steps_in_flight
        out = s.schedule() if len(self.flying) < depth else None
        if out is None or out.empty:
            if self.flying:  # nothing more to schedule ahead: retire the oldest
                for k in abort_in_flight:
                    self.abort(k)
                self.retire()
                return
            if out is None:
                return
        pending = list(out.events)
        self.record(pending)
        # a request preempted to make room is not started again in the same step (it would
        # only take back the blocks it just gave up)
        batch = {x.request_id for x in out.seqs}
        assert not any(isinstance(e, Preempted) and e.request_id in batch for e in pending)
        assert len(out.seqs) <= self.cfg.max_num_seqs
        assert out.num_batched_tokens == sum(len(x.token_ids) for x in out.seqs)
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        assert len({x.request_id for x in out.seqs}) == len(out.seqs)
        for x in out.seqs:
            assert x.request_id not in self.aborted, "an aborted request was scheduled"
        for x in out.seqs:
            assert (PLACEHOLDER in x.token_ids) == (x.start_pos == len(self.tokens_of(x.request_id))), x
        if not out.empty:
            self.flying.append(out)
        for k in abort_in_flight:
            self.abort(k)
        queued = self.flying[-1] if abort_in_flight and len(self.flying) == 2 else None
        # the runner heard of the aborts before starting the queued step: it leaves them out,
        # and says so before or after the running step's results are folded in
        late = bool(abort_in_flight) and abort_in_flight[0] % 2 == 1
        if queued is not None and not late:
            self.skip(queued)
        if len(self.flying) >= depth:
            self.retire()
        if queued is not None and late:
            self.skip(queued)

    def skip(self, queued):
        rids = [x.request_id for x in queued.seqs if x.request_id in self.aborted]
        if rids:
            self.left_out[queued.step] = set(rids)
            self.record(self.sched.skipped(queued.step, rids))

    def tokens_of(self, rid):
        """The request's tokens as far as the events told (prompt + emitted)."""
        emitted = [t for e in self.events.get(rid, ()) if isinstance(e, Tokens) for t in e.token_ids]
        return list(self.data[rid].prompt_token_ids) + emitted

    def retire(self):
        """Run the oldest step in flight (after any aborts that arrived: it still writes KV),
        then fold its results in."""
        s = self.sched
        out = self.flying[0]
        sampled = {}
        left_out = self.left_out.pop(out.step, set())
        for x in out.seqs:
            if x.request_id in left_out:
                continue  # never written: its blocks may already be someone else's
            end = x.start_pos + len(x.token_ids)
            assert len(x.block_table) * self.bs >= end
            assert x.block_table == s.blocks.table(x.request_id)[: len(x.block_table)]
            for i, t in enumerate(x.token_ids):
                if t == PLACEHOLDER:
                    assert len(x.token_ids) == 1
                    t = self.last_sampled[x.request_id]
                p = x.start_pos + i
                self.kv[x.block_table[p // self.bs]][p % self.bs] = t
            if x.sample:
                ctx = [self.kv[x.block_table[p // self.bs]][p % self.bs] for p in range(end)]
                sampled[x.request_id] = model(ctx)
        self.last_sampled = sampled
        self.flying.pop(0)
        self.record(s.update(out, RunnerOutput(step=out.step, sampled=sampled)))

    def finish(self):
        for _ in range(2000):
            if not self.sched.has_work() and not self.flying:
                break
            self.step()
        s = self.sched
        assert not s.has_work() and s.num_free_blocks == s.num_total_blocks
        for rid, data in self.data.items():
            story = self.events[rid]
            finals = [e for e in story if isinstance(e, Final)]
            assert len(finals) == 1 and story[-1] is finals[0]
            f = finals[0]
            toks = [t for e in story if isinstance(e, Tokens) for t in e.token_ids]
            ref = reference(data.prompt_token_ids, data.sampling, self.cfg.max_model_len)
            assert toks == ref[: len(toks)], (rid, toks, ref)
            if f.finish_reason == "stop":
                assert toks == ref
            elif f.finish_reason == "length":
                capacity = self.cfg.num_blocks * self.cfg.block_size
                assert toks == ref or len(data.prompt_token_ids) + len(toks) >= capacity
            else:
                assert f.finish_reason == "abort" and rid in self.aborted


def configs(depth):
    return st.builds(
        lambda nb, bs, seqs, budget, mml, chunked, thr, policy: SchedulerConfig(
            num_blocks=nb,
            block_size=bs,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget if chunked else max(budget, mml),
            max_model_len=mml,
            eos_token_ids=(EOS,),
            enable_chunked_prefill=chunked,
            long_prefill_threshold=thr,
            max_num_waiting=4,
            max_steps_in_flight=depth,
            scheduling_policy=policy,
        ),
        st.integers(4, 10),
        st.integers(1, 3),
        st.integers(1, 4),
        st.integers(1, 16),
        st.integers(8, 40),
        st.booleans(),
        st.sampled_from([0, 0, 3]),
        st.sampled_from(["fcfs", "priority"]),
    )


add = st.tuples(st.just("add"), st.integers(1, 7), st.integers(1, 12), st.booleans())
step = st.tuples(st.just("step"), st.just([]))
step_abort = st.tuples(st.just("step"), st.lists(st.integers(0, 30), min_size=1, max_size=2))
abort = st.tuples(st.just("abort"), st.integers(0, 30))
abort_all = st.tuples(st.just("abort_all"))
# weights by repetition: mostly arrivals and steps, some aborts, abort_all rarely
ops = st.tuples(
    st.lists(add, min_size=1, max_size=6),
    st.lists(st.one_of(add, add, step, step, step, step, step, step_abort, abort, abort_all), max_size=40),
).map(lambda parts: parts[0] + parts[1])


def run_script(cfg, script):
    h = Harness(cfg)
    for op in script:
        if op[0] == "add":
            h.add(*op[1:])
        elif op[0] == "step":
            h.step(op[1])
        elif op[0] == "abort":
            h.abort(op[1])
        else:
            h.abort_all()
    h.finish()
    return h


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(1), ops)
def test_random_runs_keep_the_pool_and_the_stories_consistent(cfg, script):
    run_script(cfg, script)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(2), ops)
def test_random_runs_with_async_scheduling_keep_the_pool_and_the_stories_consistent(cfg, script):
    run_script(cfg, script)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_crowded_pool_does_preempt(depth):
    """Guards the property tests above from passing only because nothing ever preempted."""
    h = Harness(
        SchedulerConfig(
            num_blocks=6,
            block_size=2,
            max_num_seqs=4,
            max_num_batched_tokens=8,
            max_model_len=40,
            eos_token_ids=(EOS,),
            max_steps_in_flight=depth,
        )
    )
    for _ in range(4):
        h.add(3, 12, True)
    h.finish()
    assert any(isinstance(e, Preempted) for story in h.events.values() for e in story)
