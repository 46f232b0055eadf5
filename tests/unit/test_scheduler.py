"""The scheduler as a state machine: scripted calls in, batches and events out."""

import json

import pytest

from fd.control.events import Final, Preempted, Tokens
from fd.control.request_data import RequestData
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import RunnerOutput
from fd.engine.core.scheduler import Scheduler
from tests.kit.scheduler import EOS, make, reference, req


def kinds(events):
    return [type(e).__name__ for e in events]


def step(sched, runner, **kw):
    out = sched.schedule()
    events = list(out.events)
    if not out.empty:
        events += sched.update(out, runner.run(out, **kw))
    return out, events


def run_all(sched, runner, limit=1000):
    events = []
    for _ in range(limit):
        if not sched.has_work():
            return events
        events += step(sched, runner)[1]
    raise AssertionError("did not finish")


def tokens_of(events, rid):
    return [t for e in events if isinstance(e, Tokens) and e.request_id == rid for t in e.token_ids]


def final_of(events, rid):
    (f,) = [e for e in events if isinstance(e, Final) and e.request_id == rid]
    return f


# --------------------------------------------------------------------------- abort


def test_abort_waiting_request_is_immediate_and_never_scheduled():
    sched, runner = make(max_num_seqs=1)
    assert sched.add("x", req(5, max_tokens=3)) == []
    sched.add("a", req(5))
    step(sched, runner)
    assert sched.num_waiting == 1
    evs = sched.abort("a", "http").events
    assert kinds(evs) == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert evs[0].source == "http" and evs[1].discarded_tokens == 0 and evs[2].count == 0
    assert evs[3].finish_reason == "abort"
    assert evs[3].usage == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert all(e.request_id == "a" for e in evs)
    assert not sched.knows("a")
    run_all(sched, runner)
    assert not runner.seen("a")
    assert sched.num_free_blocks == sched.num_total_blocks


def test_abort_decoding_request_between_steps_releases_its_blocks_at_once():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=10))
    _, e1 = step(sched, runner)
    _, e2 = step(sched, runner)
    assert kinds(e1 + e2) == ["Tokens", "Tokens"]
    held = len(sched.snapshot()["requests"][0]["block_table"])
    assert held == 2 and sched.num_free_blocks == sched.num_total_blocks - 2
    evs = sched.abort("a", "disconnect").events
    assert kinds(evs) == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert evs[2].count == 2
    assert evs[3].usage["completion_tokens"] == 2
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work()


def test_abort_in_flight_waits_for_the_step_and_discards_its_token():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=10))
    step(sched, runner)
    out = sched.schedule()
    assert sched.in_flight("a")
    table = out.seqs[0].block_table
    free = sched.num_free_blocks
    evs = sched.abort("a", "cli").events
    assert kinds(evs) == ["AbortRequested"]
    # the step may still be writing a's KV: nothing goes back to the pool yet
    assert sched.num_free_blocks == free
    assert sched.snapshot()["requests"][0]["block_table"] == list(table)
    assert sched.abort("a", "cli").events == []  # duplicate while draining
    evs = sched.update(out, runner.run(out))
    assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
    assert evs[0].discarded_tokens == 1 and evs[1].count == len(table)
    assert evs[2].finish_reason == "abort" and evs[2].usage["completion_tokens"] == 1
    assert all(e.step == out.step for e in evs[:2])  # Final has no step field
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.in_flight("a") and not sched.knows("a")
    assert sched.schedule().empty


def test_an_abort_with_an_error_ends_with_an_error_final_between_steps_and_in_flight():
    """The watchdog's timeout is an abort that failed the request: the same stages, and the
    scheduler's own final says error and why (nothing rewrites it later)."""
    sched, runner = make()
    sched.add("a", req(6, max_tokens=10))
    sched.add("b", req(5, max_tokens=10, start=40))
    step(sched, runner)
    evs = sched.abort("a", "timeout", "no progress for 2 s (request timeout)").events
    assert kinds(evs) == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert evs[0].source == "timeout"
    assert evs[-1].finish_reason == "error" and evs[-1].error == "no progress for 2 s (request timeout)"
    assert evs[-1].usage["completion_tokens"] == 1
    out = sched.schedule()
    assert sched.in_flight("b")
    assert kinds(sched.abort("b", "timeout", "late").events) == ["AbortRequested"]
    evs = sched.update(out, runner.run(out))
    assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
    assert evs[-1].finish_reason == "error" and evs[-1].error == "late"
    assert sched.num_free_blocks == sched.num_total_blocks and not sched.has_work()


def test_abort_mid_chunked_prefill_between_steps_and_in_flight():
    sched, runner = make(max_num_batched_tokens=8)
    sched.add("a", req(20))
    sched.add("b", req(20, start=40))
    out, evs = step(sched, runner)  # a: tokens 0..7
    assert [(s.request_id, s.start_pos, len(s.token_ids), s.sample) for s in out.seqs] == [("a", 0, 8, False)]
    assert evs == []
    evs = sched.abort("a", "http").events
    assert kinds(evs) == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert evs[2].count == 2
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["b"] and not out.seqs[0].sample
    assert kinds(sched.abort("b", "http").events) == ["AbortRequested"]
    evs = sched.update(out, runner.run(out))
    assert kinds(evs) == ["Drained", "BlocksReleased", "Final"]
    assert evs[0].discarded_tokens == 0 and evs[1].count == 2
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work()


def test_abort_wins_over_a_finish_in_the_same_step():
    sched, runner = make()
    sched.add("a", req(4, max_tokens=1))
    sched.add("b", req(4, max_tokens=5))
    out = sched.schedule()
    sched.abort("a", "http")
    sched.abort("b", "http")
    evs = sched.update(out, runner.run(out, override={"b": EOS}, stopped={"a": "x"}))
    assert "Tokens" not in kinds(evs)
    assert [f.finish_reason for f in evs if isinstance(f, Final)] == ["abort", "abort"]
    assert sched.num_free_blocks == sched.num_total_blocks


def test_unknown_finished_and_duplicate_aborts_are_noops():
    sched, runner = make()
    assert sched.abort("nope", "http").events == []
    sched.add("a", req(4, max_tokens=1))
    evs = run_all(sched, runner)
    assert final_of(evs, "a").finish_reason == "length"
    assert sched.abort("a", "http").events == []
    sched.add("b", req(4))
    assert len(sched.abort("b", "http").events) == 4
    assert sched.abort("b", "http").events == []
    assert sched.abort_all("cli").events == []


def test_abort_all_covers_every_state_in_arrival_order():
    sched, runner = make(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add(rid, req(4, max_tokens=10))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    evs = sched.abort_all("cli").events
    assert [(type(e).__name__, e.request_id) for e in evs] == [
        ("AbortRequested", "a"),
        ("AbortRequested", "b"),
        ("AbortRequested", "c"),
        ("Drained", "c"),
        ("BlocksReleased", "c"),
        ("Final", "c"),
    ]
    evs = sched.update(out, runner.run(out))
    assert [(type(e).__name__, e.request_id) for e in evs] == [
        ("Drained", "a"),
        ("BlocksReleased", "a"),
        ("Final", "a"),
        ("Drained", "b"),
        ("BlocksReleased", "b"),
        ("Final", "b"),
    ]
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_work() and sched.num_running == 0 and sched.num_waiting == 0


# --------------------------------------------------------------------------- batching


def test_chunked_prefill_splits_the_prompt_and_samples_only_at_the_end():
    sched, runner = make(max_num_batched_tokens=8)
    prompt = req(20, max_tokens=2)
    sched.add("a", prompt)
    shapes, evs = [], []
    for _ in range(3):
        out, e = step(sched, runner)
        (s,) = out.seqs
        shapes.append((s.start_pos, len(s.token_ids), s.sample, len(s.block_table)))
        assert s.token_ids == prompt.prompt_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
        evs += e
    assert shapes == [(0, 8, False, 2), (8, 8, False, 4), (16, 4, True, 5)]
    assert kinds(evs) == ["Tokens"]
    evs += run_all(sched, runner)
    assert tokens_of(evs, "a") == reference(prompt.prompt_token_ids, 2)


def test_decodes_go_first_then_prefills_within_the_budget():
    sched, runner = make(max_num_batched_tokens=8)
    sched.add("a", req(4, max_tokens=10))
    step(sched, runner)
    sched.add("b", req(30, start=50))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.seqs] == [("a", 1, True), ("b", 7, False)]
    assert out.num_batched_tokens == 8


def test_long_prefill_threshold_caps_a_chunk():
    sched, runner = make(long_prefill_threshold=5)
    sched.add("a", req(12))
    sched.add("b", req(3, start=40))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 5), ("b", 3)]


def test_prefill_beside_decodes_is_capped_per_decode_and_a_wave_goes_in_slices():
    """With ``prefill_per_decode`` 3 (block size 4): beside one decode a step prefills a block's
    worth (4), beside two 6, beside none the whole budget; the sliced prompts come out whole."""
    sched, runner = make(prefill_per_decode=3)
    sched.add("a", req(4, max_tokens=12))
    out, evs = step(sched, runner)  # no decodes yet: the whole prompt
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 4)]
    prompts = {"b": req(10, start=40), "c": req(9, start=60)}
    for rid, r in prompts.items():
        sched.add(rid, r)
    shapes = []
    for _ in range(4):
        out, e = step(sched, runner)
        evs += e
        shapes.append([(s.request_id, len(s.token_ids)) for s in out.seqs])
    assert shapes == [
        [("a", 1), ("b", 4)],  # one decode: a block's worth (3 < 4)
        [("a", 1), ("b", 4)],
        [("a", 1), ("b", 2), ("c", 2)],  # b's last 2 and c's first 2
        [("a", 1), ("b", 1), ("c", 6)],  # two decodes: 6
    ]
    evs += run_all(sched, runner)
    assert tokens_of(evs, "a") == reference(req(4).prompt_token_ids, 12)
    for rid, r in prompts.items():
        assert tokens_of(evs, rid) == reference(r.prompt_token_ids, 4), rid
    # two prompts mid-prefill and the cap spent on the first: the second waits, nobody is
    # preempted for it
    two, _ = make(prefill_per_decode=3, long_prefill_threshold=4)
    two.add("a", req(4, max_tokens=12))
    two.add("b", req(12, start=40))
    two.add("c", req(12, start=60))
    out, _ = step(two, runner)  # no decodes: a whole, b and c a chunk each
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 4), ("b", 4), ("c", 4)]
    out, e = step(two, runner)  # one decode: 4 prompt tokens, all b's
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 1), ("b", 4)]
    assert "Preempted" not in kinds(e)
    off, _ = make()
    off.add("a", req(4, max_tokens=12))
    step(off, runner)
    off.add("b", req(40, start=40))
    assert [len(s.token_ids) for s in off.schedule().seqs] == [1, 40]  # (0: only the budget)
    with pytest.raises(ValueError, match="prefill_per_decode"):
        SchedulerConfig(num_blocks=4, prefill_per_decode=-1)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_whole():
    sched, runner = make(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=16)
    sched.add("a", req(10))
    sched.add("b", req(10, start=40))
    out, _ = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 10)]
    out, _ = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 1), ("b", 10)]
    with pytest.raises(ValueError):
        SchedulerConfig(
            num_blocks=4, enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16
        )


def test_one_step_in_flight_at_a_time():
    sched, runner = make()
    sched.add("a", req(4))
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.schedule()
    ro = runner.run(out)
    sched.update(out, ro)
    with pytest.raises(RuntimeError):
        sched.update(out, ro)  # a step is folded in once


def test_runner_output_missing_a_sample_is_an_error():
    sched, runner = make()
    sched.add("a", req(4))
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(out, RunnerOutput(step=out.step, sampled={}))


# --------------------------------------------------------------------------- finishing


def _finish(override=None, stopped=None, eos=(EOS,), max_model_len=256, **sp):
    sched, runner = make(eos_token_ids=eos, max_model_len=max_model_len)
    sched.add("a", req(4, **sp))
    evs = []
    for _ in range(100):
        if not sched.has_work():
            break
        evs += step(sched, runner, override=override, stopped=stopped)[1]
    assert sched.num_free_blocks == sched.num_total_blocks
    assert kinds(evs[-2:]) == ["BlocksReleased", "Final"] and kinds(evs[-3:-2]) == ["Tokens"]
    return evs, evs[-1]


def test_eos_stops():
    evs, f = _finish(override={"a": EOS}, max_tokens=5)
    assert (f.finish_reason, f.stop_reason) == ("stop", None)
    assert tokens_of(evs, "a") == [EOS]
    assert f.usage == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


def test_ignore_eos_runs_to_max_tokens():
    evs, f = _finish(override={"a": EOS}, max_tokens=3, ignore_eos=True)
    assert (f.finish_reason, tokens_of(evs, "a")) == ("length", [EOS] * 3)


def test_stop_token_ids_stop_with_the_token_as_reason():
    evs, f = _finish(override={"a": 77}, max_tokens=5, stop_token_ids=(77,), ignore_eos=True)
    assert (f.finish_reason, f.stop_reason, tokens_of(evs, "a")) == ("stop", "77", [77])


def test_max_tokens_gives_length():
    evs, f = _finish(max_tokens=3)
    assert f.finish_reason == "length" and f.stop_reason is None
    assert tokens_of(evs, "a") == reference(range(10, 14), 3)
    assert [e.step for e in evs if isinstance(e, Tokens)] == [1, 2, 3]


def test_stop_string_from_the_detokenizer_stops():
    evs, f = _finish(stopped={"a": "###"}, max_tokens=5)
    assert (f.finish_reason, f.stop_reason, f.usage["completion_tokens"]) == ("stop", "###", 1)


def test_max_model_len_gives_length():
    evs, f = _finish(max_tokens=50, max_model_len=7)
    assert f.finish_reason == "length" and f.usage["total_tokens"] == 7


def test_prompts_that_can_never_run_are_rejected_with_error():
    sched, _ = make(max_model_len=8, num_blocks=2)
    (f,) = sched.add("long", req(8))
    assert (f.finish_reason, f.request_id) == ("error", "long") and "max_model_len" in f.error
    sched, _ = make(num_blocks=2, block_size=4)
    (f,) = sched.add("big", req(8))  # 9 tokens need 3 blocks
    assert f.finish_reason == "error" and f.usage["prompt_tokens"] == 8
    assert not sched.knows("big") and not sched.has_work()
    assert sched.add("ok", req(7)) == []


# --------------------------------------------------------------------------- preemption


def test_preemption_recomputes_and_gives_the_same_tokens():
    sched, runner = make(num_blocks=10, block_size=4, max_num_batched_tokens=32)
    prompts = {f"r{i}": req(5 + i, max_tokens=12, start=20 * i) for i in range(4)}
    for rid, data in prompts.items():
        sched.add(rid, data)
    evs = run_all(sched, runner)
    preempted = [e for e in evs if isinstance(e, Preempted)]
    assert preempted, "the pool is small enough to force preemption"
    assert preempted[0].request_id == "r3"  # the most recent arrival goes first
    assert all(e.count > 0 for e in preempted)
    for rid, data in prompts.items():
        assert tokens_of(evs, rid) == reference(data.prompt_token_ids, 12)
        assert final_of(evs, rid).finish_reason == "length"
    assert sched.num_free_blocks == sched.num_total_blocks


def test_recompute_prefill_feeds_prompt_and_generated_tokens():
    sched, runner = make(num_blocks=4, block_size=4)
    sched.add("a", req(5, max_tokens=20))
    sched.add("b", req(5, max_tokens=20, start=40))
    outs = []
    evs = []
    while not any(isinstance(e, Preempted) for e in evs):
        out, e = step(sched, runner)
        outs.append(out)
        evs += e
    (p,) = [e for e in evs if isinstance(e, Preempted)]
    assert p.request_id == "b" and sched.num_waiting == 1
    assert sched.snapshot()["requests"][1]["block_table"] == []
    generated = tokens_of(evs, "b")
    while True:  # b returns once a frees its blocks
        out, e = step(sched, runner)
        evs += e
        seq = [s for s in out.seqs if s.request_id == "b"]
        if seq:
            break
    (s,) = seq
    assert s.start_pos == 0 and s.sample
    assert s.token_ids == tuple(range(40, 45)) + tuple(generated)
    assert s.num_generated == len(generated)
    assert tokens_of(e, "b") == reference(range(40, 45), len(generated) + 1)[-1:]


def test_a_request_outgrowing_the_whole_pool_finishes_with_length():
    sched, runner = make(num_blocks=2, block_size=4)
    sched.add("a", req(4, max_tokens=50))
    evs = run_all(sched, runner)
    assert kinds(evs) == ["Tokens"] * 5 + ["BlocksReleased", "Final"]
    assert evs[-2].count == 2
    assert evs[-1].finish_reason == "length" and evs[-1].usage["completion_tokens"] == 5
    assert sched.num_free_blocks == 2 and not sched.has_work()


# --------------------------------------------------------------------------- admission, state


def test_can_admit_respects_seqs_waiting_queue_and_blocks():
    sched, runner = make(max_num_seqs=4, max_num_waiting=2, num_blocks=16)
    assert sched.can_admit() == 2
    sched.add("a", req(4))
    sched.add("b", req(4))
    assert sched.can_admit() == 0  # waiting queue full
    step(sched, runner)
    assert (sched.num_running, sched.num_waiting, sched.can_admit()) == (2, 0, 2)
    sched.add("c", req(4))
    sched.add("d", req(4))
    step(sched, runner)
    assert sched.num_running == 4 and sched.can_admit() == 0  # max_num_seqs
    sched, _ = make(num_blocks=3, block_size=4)
    sched.add("big", req(10))  # 11 tokens: all 3 blocks spoken for
    assert sched.can_admit() == 0


def test_same_calls_give_the_same_outputs():
    def script():
        sched, runner = make(num_blocks=8, block_size=4, max_num_batched_tokens=12)
        log = []
        for i in range(6):
            log += sched.add(f"r{i}", req(3 + 2 * i, max_tokens=6, start=i))
        for n in range(200):
            if not sched.has_work():
                break
            out = sched.schedule()
            log.append(out)
            log += out.events
            if n == 3:
                log += sched.abort("r1", "http").events
            if n == 5:
                log += sched.abort("r4", "http").events
            if not out.empty:
                log += sched.update(out, runner.run(out))
            log.append(json.dumps(sched.snapshot()))
        return log

    a, b = script(), script()
    assert a == b
    assert any(isinstance(x, Preempted) for x in a)


def test_snapshot_is_json_and_reflects_state():
    sched, runner = make()
    sched.add("a", req(6, max_tokens=5))
    sched.add("b", req(3))
    sched.schedule()
    snap = json.loads(json.dumps(sched.snapshot()))
    assert snap["step"] == 1 and snap["in_flight"] == ["a", "b"]
    assert snap["num_free_blocks"] == snap["num_total_blocks"] - 3
    (a,) = [r for r in snap["requests"] if r["request_id"] == "a"]
    assert a["status"] == "running" and len(a["block_table"]) == 2


def test_add_with_generated_tokens_resumes_where_another_engine_stopped():
    # a failover: the first 5 tokens came from a dead engine; this scheduler continues
    data = req(6, max_tokens=12)
    full = reference(data.prompt_token_ids, 12)
    sched, runner = make()
    assert sched.add("r", data, generated=tuple(full[:5])) == []
    out, evs = step(sched, runner)
    (s,) = out.seqs
    assert s.start_pos == 0 and s.token_ids == data.prompt_token_ids + tuple(full[:5])
    assert s.num_generated == 5  # seeded sampling goes on with the 6th token's key
    evs += run_all(sched, runner)
    assert tokens_of(evs, "r") == full[5:]  # only the missing 7 tokens: max_tokens holds
    f = final_of(evs, "r")
    assert f.finish_reason == "length"
    assert f.usage == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}
    assert sched.num_free_blocks == sched.num_total_blocks


def test_add_with_generated_tokens_that_already_finished_ends_at_once():
    sched, _ = make()
    evs = sched.add("done", req(4, max_tokens=3), generated=(50, 51, 52))
    assert kinds(evs) == ["BlocksReleased", "Final"]
    assert evs[-1].finish_reason == "length" and evs[-1].usage["completion_tokens"] == 3
    evs = sched.add("eos", req(4, max_tokens=9), generated=(50, EOS))
    assert evs[-1].finish_reason == "stop"
    assert not sched.has_work() and not sched.knows("done")


def test_token_ids_outside_the_vocabulary_end_the_request_before_it_runs():
    sched, runner = make(vocab_size=100)
    (f,) = sched.add("p", req(3, start=98))
    assert f.finish_reason == "error" and "prompt token id 100" in f.error
    (f,) = sched.add("b", req(3, logit_bias=((5, 1.0), (100, -3.0))))
    assert f.finish_reason == "error" and "logit_bias token id 100" in f.error
    assert sched.add("ok", req(3, logit_bias=((99, 1.0),))) == []
    assert not runner.seen("p") and not runner.seen("b")
    run_all(sched, runner)
    assert runner.seen("ok") and not runner.seen("b")


# ----------------------------------------------------------------------------- prefix caching


def _cached_cfg(**kw):
    from fd.engine.core.config import SchedulerConfig

    base = dict(
        num_blocks=16,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_prefix_caching=True,
    )
    return SchedulerConfig(**{**base, **kw})


def _run_one_step(s, sampled_token=5):
    from fd.engine.core.outputs import RunnerOutput

    out = s.schedule()
    return out, list(out.events) + s.update(
        out,
        RunnerOutput(step=out.step, sampled={ss.request_id: sampled_token for ss in out.seqs if ss.sample}),
    )


def test_a_prompt_prefix_computed_before_is_shared_not_recomputed():
    from fd.control.request_data import RequestData
    from fd.control.sampling import SamplingParams

    s = Scheduler(_cached_cfg())
    prompt = tuple(range(10, 20))  # 10 tokens: blocks [10-13] [14-17] and 2 more
    s.add("a", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=3)))
    out, _ = _run_one_step(s)
    assert [(ss.start_pos, len(ss.token_ids)) for ss in out.seqs] == [(0, 10)]
    # same prompt, and one that shares only its first block
    s.add("b", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=3)))
    s.add("c", RequestData(prompt_token_ids=prompt[:4] + (99,) * 6, sampling=SamplingParams(max_tokens=3)))
    out, _ = _run_one_step(s)
    fed = {ss.request_id: (ss.start_pos, len(ss.token_ids), ss.block_table) for ss in out.seqs}
    ta = s.blocks.table("a")
    assert fed["b"][:2] == (8, 2) and fed["b"][2][:2] == ta[:2]  # two blocks taken, two tokens fed
    assert fed["c"][:2] == (4, 6) and fed["c"][2][:1] == ta[:1] and fed["c"][2][1] != ta[1]
    assert s.blocks.refs(ta[0]) == 3 and s.blocks.refs(ta[1]) == 2
    assert (s.num_cache_queries, s.num_cache_hits) == (30, 12)
    s.abort("b", "http")  # a sharer's release leaves the shared blocks with the others
    assert s.blocks.refs(ta[0]) == 2 and s.blocks.refs(ta[1]) == 1
    while s.has_work():
        _run_one_step(s)
    assert s.num_free_blocks == s.num_total_blocks
    s.blocks.check()


def test_a_block_is_shared_only_once_a_finished_step_has_filled_it():
    """A request that comes while the step computing a prefix is in flight (or in the same
    batch) computes it itself: that KV is not written yet."""
    from fd.control.request_data import RequestData
    from fd.control.sampling import SamplingParams
    from fd.engine.core.outputs import RunnerOutput

    s = Scheduler(_cached_cfg(max_steps_in_flight=2))
    prompt = tuple(range(10, 19))
    s.add("a", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)))
    s.add("same-step", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)))
    first = s.schedule()
    assert {ss.request_id: ss.start_pos for ss in first.seqs} == {"a": 0, "same-step": 0}
    s.add("next-step", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)))
    second = s.schedule()  # decided while `first` runs: nothing is registered yet
    assert {ss.request_id: ss.start_pos for ss in second.seqs if ss.request_id == "next-step"} == {
        "next-step": 0
    }
    s.update(first, RunnerOutput(step=first.step, sampled={"a": 5, "same-step": 5}))
    s.add("after", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)))
    s.update(
        second, RunnerOutput(step=second.step, sampled={ss.request_id: 5 for ss in second.seqs if ss.sample})
    )
    third = s.schedule()
    assert {ss.request_id: ss.start_pos for ss in third.seqs}["after"] == 8
    s.blocks.check()


def test_a_request_scoring_its_prompt_computes_all_of_it():
    from fd.control.request_data import RequestData
    from fd.control.sampling import SamplingParams

    s = Scheduler(_cached_cfg())
    prompt = tuple(range(10, 20))
    s.add("a", RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2)))
    _run_one_step(s)
    s.add(
        "score",
        RequestData(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1, prompt_logprobs=0)),
    )
    out, _ = _run_one_step(s)
    assert [ss.start_pos for ss in out.seqs if ss.request_id == "score"] == [0]


def test_a_preempted_request_takes_its_own_cached_blocks_back():
    from fd.control.events import Preempted
    from fd.control.request_data import RequestData
    from fd.control.sampling import SamplingParams

    s = Scheduler(_cached_cfg(num_blocks=8, max_num_batched_tokens=32))
    s.add(
        "old",
        RequestData(
            prompt_token_ids=tuple(range(10, 22)), sampling=SamplingParams(max_tokens=12, ignore_eos=True)
        ),
    )
    s.add(
        "new",
        RequestData(
            prompt_token_ids=tuple(range(40, 48)), sampling=SamplingParams(max_tokens=12, ignore_eos=True)
        ),
    )
    events = []
    resumed = None
    while s.has_work():
        out, evs = _run_one_step(s)
        events += evs
        for ss in out.seqs:
            if (
                ss.request_id == "new"
                and any(isinstance(e, Preempted) and e.request_id == "new" for e in events)
                and resumed is None
                and ss.start_pos > 0
                and len(ss.token_ids) > 1
            ):
                resumed = ss.start_pos
    assert any(isinstance(e, Preempted) for e in events), "the pool is small enough to preempt"
    assert resumed is not None and resumed % 4 == 0  # its recompute began after cached blocks
    assert s.num_free_blocks == s.num_total_blocks
    s.blocks.check()


# --------------------------------------------------------------------------- priority


def _prio(n, priority, max_tokens=4, start=10):
    d = req(n, max_tokens=max_tokens, start=start)
    return RequestData(prompt_token_ids=d.prompt_token_ids, sampling=d.sampling, priority=priority)


@pytest.mark.parametrize("policy,order", [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])])
def test_the_policy_says_who_starts_first(policy, order):
    """vLLM's --scheduling-policy: fcfs starts requests in arrival order; priority by
    (priority, arrival), lower first (each finishing before the next: one slot)."""
    sched, runner = make(max_num_seqs=1, scheduling_policy=policy)
    for rid, p in (("a", 5), ("b", 0), ("c", 1)):
        sched.add(rid, _prio(4, p, start=10 + 10 * ord(rid)))
    evs = run_all(sched, runner)
    firsts = [e.request_id for e in evs if isinstance(e, Tokens)]
    assert list(dict.fromkeys(firsts)) == order
    for rid in "abc":
        assert final_of(evs, rid).finish_reason == "length"
    assert sched.num_free_blocks == sched.num_total_blocks


@pytest.mark.parametrize("policy,victim", [("fcfs", "b"), ("priority", "a")])
def test_the_policy_says_who_is_preempted_first(policy, victim):
    """Out of blocks, fcfs preempts the latest arrival; priority the greatest (priority,
    arrival): here the earlier request with the lower priority. Tokens stay the reference's."""
    sched, runner = make(num_blocks=4, block_size=4, scheduling_policy=policy)
    sched.add("a", _prio(5, 9, max_tokens=10))
    sched.add("b", _prio(5, 0, max_tokens=10, start=40))
    evs = run_all(sched, runner)
    preempted = [e.request_id for e in evs if isinstance(e, Preempted)]
    assert preempted and preempted[0] == victim
    assert tokens_of(evs, "a") == reference(range(10, 15), 10)
    assert tokens_of(evs, "b") == reference(range(40, 45), 10)
    assert sched.num_free_blocks == sched.num_total_blocks
