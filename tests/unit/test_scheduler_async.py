"""Async scheduling: step N+1 decided while step N is in flight (``max_steps_in_flight=2``).

The fake runner (tests/kit/scheduler.py's) resolves placeholders the way the real one does
(the token it sampled for the request one step earlier), writes KV, and samples from what the
KV holds, so a wrong position, block or placeholder changes the tokens.
"""

from dataclasses import replace

import pytest

from fd.control.events import Final, Tokens
from fd.engine.core.outputs import RunnerOutput
from fd.engine.core.sequence import PLACEHOLDER
from tests.kit.scheduler import EOS, req
from tests.kit.scheduler import make as make_sched


def make(depth=2, **kw):
    return make_sched(max_steps_in_flight=depth, **kw)


def kinds(evs, rid=None):
    return [type(e).__name__ for e in evs if rid is None or e.request_id == rid]


def tokens(evs, rid):
    return [t for e in evs if isinstance(e, Tokens) and e.request_id == rid for t in e.token_ids]


def pipeline(sched, runner, limit=1000):
    """Drive like the engine node: schedule ahead, then fold the oldest step in."""
    evs, flying = [], []
    for _ in range(limit):
        if not sched.has_work() and not flying:
            return evs
        out = sched.schedule()
        evs += out.events
        if not out.empty:
            flying.append((out, runner.run(out)))  # runs in order, as the worker does
        if flying and (len(flying) == sched.config.max_steps_in_flight or out.empty):
            o, r = flying.pop(0)
            evs += sched.update(o, r)
    raise AssertionError("did not finish")


def two_in_flight(*others):
    """``a`` (and ``b``, and so on: ``others``) prefilled, then two decode steps decided: the
    first running, the second queued behind it. Returns the scheduler, the runner, the
    prefill's events and the two steps."""
    sched, runner = make()
    sched.add("a", req(6, max_tokens=10))
    for i, rid in enumerate(others):
        sched.add(rid, req(3, max_tokens=10, start=40 + 10 * i))
    o = sched.schedule()
    seen = sched.update(o, runner.run(o))
    out1, out2 = sched.schedule(), sched.schedule()
    return sched, runner, seen, out1, out2


def test_the_next_decode_is_scheduled_on_a_placeholder_before_the_step_is_folded_in():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=5))
    out1 = sched.schedule()
    assert out1.seqs[0].token_ids == tuple(range(10, 16)) and out1.seqs[0].sample
    out2 = sched.schedule()
    (s,) = out2.seqs
    assert s.token_ids == (PLACEHOLDER,) and s.start_pos == 6 and s.sample
    assert s.num_generated == 1  # the pending token counts: seeded sampling stays per token
    with pytest.raises(RuntimeError):
        sched.schedule()  # two in flight is the most
    with pytest.raises(RuntimeError):
        sched.update(out2, RunnerOutput(step=out2.step, sampled={"a": 5}))  # oldest first
    r1 = runner.run(out1)
    evs = sched.update(out1, r1)
    assert kinds(evs) == ["Tokens"]


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_outputs_equal_one_step_at_a_time_and_no_step_runs_past_max_tokens(max_tokens):
    results = {}
    for depth in (1, 2):
        sched, runner = make(depth, num_blocks=40)
        for i, n in enumerate((3, 9, 5, 14)):
            sched.add(f"r{i}", req(n, max_tokens=max_tokens, start=10 + i))
        evs = pipeline(sched, runner)
        results[depth] = {f"r{i}": tokens(evs, f"r{i}") for i in range(4)}
        fed = sum(1 for o in runner.outputs for s in o.seqs if s.sample)
        assert fed == 4 * max_tokens  # the known end is never scheduled past
        assert all(e.finish_reason == "length" for e in evs if isinstance(e, Final))
        assert sched.num_free_blocks == sched.num_total_blocks
    assert results[1] == results[2]
    assert all(len(t) == max_tokens for t in results[2].values())


def test_a_request_that_stops_while_the_next_step_holds_it_keeps_its_blocks_until_then():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=10))
    out1 = sched.schedule()
    out2 = sched.schedule()  # decodes a's first token, not known to be EOS yet
    free = sched.num_free_blocks
    evs = sched.update(out1, runner.run(out1, override={"a": EOS}))
    assert kinds(evs) == ["Tokens"] and tokens(evs, "a") == [EOS]
    assert sched.num_free_blocks == free and sched.in_flight("a")
    assert sched.discards("a")  # its token from out2 will be dropped
    assert sched.abort("a", "http").events == []  # finished: an abort is a no-op
    assert sched.schedule().seqs == ()  # nothing more for it
    evs = sched.update(out2, runner.run(out2))
    assert kinds(evs) == ["BlocksReleased", "Final"]
    assert evs[1].finish_reason == "stop" and evs[1].usage["completion_tokens"] == 1
    assert sched.num_free_blocks == sched.num_total_blocks and not sched.knows("a")


def test_abort_with_two_steps_in_flight_drains_after_the_last_one():
    sched, runner, seen, out1, out2 = two_in_flight("b")  # both prefilled: one token each
    table = list(out2.seqs[0].block_table)
    evs = sched.abort("a", "disconnect").events
    assert kinds(evs) == ["AbortRequested"]
    evs = sched.update(out1, runner.run(out1))
    seen += evs
    assert kinds(evs, "a") == []  # its token is dropped; no tokens after abort_requested
    assert kinds(evs, "b") == ["Tokens"]
    assert sched.snapshot()["requests"][0]["block_table"] == table  # out2 still writes them
    evs = sched.update(out2, runner.run(out2))
    seen += evs
    assert kinds(evs, "a") == ["Drained", "BlocksReleased", "Final"]
    drained, released, final = [e for e in evs if e.request_id == "a"]
    assert drained.discarded_tokens == 2 and released.count == len(table)
    assert final.finish_reason == "abort" and final.usage["completion_tokens"] == 1
    assert not sched.knows("a")
    rest = pipeline(sched, runner)
    assert len(tokens(seen + rest, "b")) == 10
    assert sched.num_free_blocks == sched.num_total_blocks


def test_a_speculative_schedule_never_preempts_it_waits_for_the_steps_in_flight():
    # 4 blocks of 4: a and b prefill 7 tokens each (2 blocks each); their 9th token needs a
    # third block that only a preemption can give
    sched, runner = make(num_blocks=4, max_num_seqs=2)
    sched.add("a", req(7, max_tokens=8))
    sched.add("b", req(7, max_tokens=8, start=30))
    out1 = sched.schedule()
    assert len(out1.seqs) == 2
    out2 = sched.schedule()  # position 7 fits the held blocks: both decode on placeholders
    assert [s.token_ids for s in out2.seqs] == [(PLACEHOLDER,), (PLACEHOLDER,)]
    seen = sched.update(out1, runner.run(out1))
    stalled = sched.schedule()  # position 8 needs a block: a preemption, not while in flight
    assert stalled.empty and stalled.events == ()
    assert sched.schedule().empty and sched.schedule().step == stalled.step  # still waiting
    seen += sched.update(out2, runner.run(out2))
    out3 = sched.schedule()  # nothing in flight: now it preempts b for a
    assert kinds(out3.events) == ["Preempted"]
    assert [s.request_id for s in out3.seqs] == ["a"]
    evs = seen + sched.update(out3, runner.run(out3)) + pipeline(sched, runner)
    roomy, r1 = make(1, num_blocks=40)  # the same requests, never short of blocks
    roomy.add("a", req(7, max_tokens=8))
    roomy.add("b", req(7, max_tokens=8, start=30))
    ref = pipeline(roomy, r1)
    for rid in "ab":
        assert tokens(evs, rid) == tokens(ref, rid) and len(tokens(evs, rid)) == 8
    assert sched.num_free_blocks == sched.num_total_blocks


def test_an_aborting_request_left_out_of_the_queued_step_is_released_after_the_running_one():
    """The runner may be told of an abort before it starts the step queued behind the running
    one; it leaves the request out and says so (``skipped``): the blocks then wait only for the
    running step."""
    sched, runner, seen, out1, out2 = two_in_flight("b")
    assert kinds(sched.abort("a", "disconnect").events) == ["AbortRequested"]
    assert sched.skipped(out2.step, ["a", "b"]) == []  # b is not aborting: never left out
    assert sched.in_flight("a")  # still in out1, which is running
    evs = sched.update(out1, runner.run(out1))
    seen += evs
    assert kinds(evs, "a") == ["Drained", "BlocksReleased", "Final"]
    assert evs[0].discarded_tokens == 1 and not sched.knows("a")
    free = sched.num_free_blocks
    left_out = replace(out2, seqs=tuple(s for s in out2.seqs if s.request_id != "a"))
    evs = sched.update(out2, runner.run(left_out))  # no token for a: fine, it was left out
    assert kinds(evs) == ["Tokens"] and evs[0].request_id == "b"
    assert sched.num_free_blocks == free
    rest = pipeline(sched, runner)
    assert len(tokens(seen + evs + rest, "b")) == 10
    assert sched.num_free_blocks == sched.num_total_blocks


def test_skipped_after_the_running_step_was_folded_in_releases_at_once():
    sched, runner, _, out1, out2 = two_in_flight()
    sched.update(out1, runner.run(out1))
    sched.abort("a", "http")
    evs = sched.skipped(out2.step, ["a"])
    assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
    assert evs[0].discarded_tokens == 0 and evs[2].usage["completion_tokens"] == 2
    assert sched.num_free_blocks == sched.num_total_blocks
    assert sched.skipped(out2.step, ["a"]) == []  # told twice: no-op
    assert sched.update(out2, RunnerOutput(step=out2.step, sampled={})) == []
    assert not sched.has_work()


def test_finished_releases_an_abort_before_its_steps_are_folded_in_and_changes_nothing_else():
    """The runner has finished both steps holding ``a`` (their results are in) while the engine
    loop has not folded them in: ``finished`` drains and releases ``a`` then. ``b``'s tokens,
    their order, and the blocks in the end are what the same run gives without the call."""
    runs = {}
    for early in (False, True):
        sched, runner, seen, out1, out2 = two_in_flight("b")
        table = list(out2.seqs[0].block_table)
        r1 = runner.run(out1)
        assert kinds(sched.abort("a", "disconnect").events) == ["AbortRequested"]
        assert sched.num_draining == 1
        if early:
            free = sched.num_free_blocks
            assert sched.finished(out1.step) == []  # out2 (running) still writes its KV
            assert sched.num_free_blocks == free
            r2 = runner.run(out2)
            evs = sched.finished(out2.step)
            assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
            drained, released, final = evs
            assert drained.discarded_tokens == 2 and released.count == len(table)
            assert sched.num_free_blocks == free + len(table)
            assert final.finish_reason == "abort" and final.usage["completion_tokens"] == 1
            assert not sched.knows("a") and sched.num_draining == 0
            assert sched.finished(out2.step) == []  # told twice: no-op
            seen += evs
            seen += sched.update(out1, r1)  # a's tokens in both steps are dropped
            seen += sched.update(out2, r2)
        else:
            seen += sched.update(out1, r1)
            seen += sched.update(out2, runner.run(out2))
        seen += pipeline(sched, runner)
        assert sched.num_free_blocks == sched.num_total_blocks
        runs[early] = seen
    assert (
        kinds(runs[True], "a") == kinds(runs[False], "a") == ["Tokens", "Drained", "BlocksReleased", "Final"]
    )  # (its prefill's token, then the abort)
    assert [e for e in runs[True] if e.request_id == "b"] == [e for e in runs[False] if e.request_id == "b"]
    assert len(tokens(runs[True], "b")) == 10


def test_finished_with_only_the_running_step_done_waits_for_the_queued_one():
    sched, runner, _, out1, out2 = two_in_flight()
    r1 = runner.run(out1)
    sched.abort("a", "http")
    assert sched.finished(out1.step) == []
    # the runner left it out of out2 (told in time): only out1, finished, holds it now; the
    # engine says so again after the skip (the scheduler keeps no note of finished steps)
    assert sched.skipped(out2.step, ["a"]) == []
    evs = sched.finished(out1.step)
    assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
    assert evs[0].discarded_tokens == 1  # out1's token, computed and dropped
    assert sched.update(out1, r1) == []
    assert sched.update(out2, RunnerOutput(step=out2.step, sampled={})) == []
    assert not sched.has_work() and sched.num_free_blocks == sched.num_total_blocks


def test_finished_without_an_abort_waiting_changes_nothing():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=3))
    o = sched.schedule()
    before = sched.snapshot()
    assert sched.finished(o.step) == [] and sched.snapshot() == before
    evs = sched.update(o, runner.run(o)) + pipeline(sched, runner)
    assert len(tokens(evs, "a")) == 3


def test_finished_releases_in_the_order_the_aborts_came():
    """The journal replays ``finished`` on a fresh scheduler, maybe in a process with another
    string-hash seed: its events must not depend on set iteration order."""
    sched, runner = make(num_blocks=64)
    rids = ["r5", "r0", "r3", "r1", "r4", "r2"]
    for i, rid in enumerate(sorted(rids)):
        sched.add(rid, req(3, max_tokens=10, start=10 + 5 * i))
    o = sched.schedule()
    sched.update(o, runner.run(o))
    out = sched.schedule()
    for rid in rids:
        sched.abort(rid, "http")
    evs = sched.finished(out.step)
    assert [e.request_id for e in evs if type(e).__name__ == "Final"] == rids
