"""The journal records a run; replay re-executes it and must agree on every decision.

The run is the real scheduler driven by a deterministic fake model, with scripted arrivals, a
pool small enough to preempt, and every abort case of DESIGN.md §4 that reaches a scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import orjson
import pytest

from fd.control.events import (
    AbortRequested,
    BlocksReleased,
    Drained,
    Final,
    JournalStep,
    Preempted,
    Tokens,
    decode,
)
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.scheduler import Scheduler
from fd.engine.core.sequence import Status
from fd.engine.journal.journal import JournalRecorder, config_from_json, journaled
from fd.engine.journal.journal_check import check_journal
from fd.engine.journal.journal_reader import export_jsonl, load_journal_from_redis, load_journal_jsonl
from fd.engine.journal.replay import main, replay
from tests.kit.journal import CFG, Run, record_run, req


def test_recorded_run_covers_the_cases_and_replays_exactly(tmp_path):
    run = record_run()
    evs = run.events
    assert run.cases == {
        "waiting",
        "mid_prefill",
        "in_flight",
        "duplicate",
        "unknown",
        "finished",
        "released_before_fold_in",
        "abort_all",
    }
    assert any(c["op"] == "finished" and c["ev"] for e in run.entries[1:] for c in e.data["calls"])
    assert any(isinstance(e, Preempted) for e in evs), "the pool is small enough to preempt"
    assert any(isinstance(e, Final) and e.finish_reason == "error" for e in evs)
    assert any(isinstance(e, Final) and e.stop_reason == "</s>" for e in evs)
    assert any(isinstance(e, Drained) and e.discarded_tokens == 1 for e in evs)
    assert not run.rec.has_work()

    path = tmp_path / "journal.jsonl"
    export_jsonl(run.entries, path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(run.entries)
    assert json.loads(lines[0])["type"] == "journal_start"
    assert isinstance(json.loads(lines[1])["data"]["calls"], list)  # nested, readable
    loaded = load_journal_jsonl(path)
    assert loaded == run.entries

    report = replay(loaded)
    assert report.divergence is None, report.divergence.describe()
    assert report.violations == []
    assert report.ok
    assert report.replayed_calls == report.calls > 50
    s = report.summary()
    finals = [e for e in evs if isinstance(e, Final)]
    assert sum(s["finish_reasons"].values()) == len(finals)
    assert s["finish_reasons"]["abort"] == sum(f.finish_reason == "abort" for f in finals)
    assert s["open_requests"] == 0
    assert 0 < s["peak_blocks_in_use"] <= CFG.num_blocks
    assert s["aborts_released"] == sum(
        isinstance(e, BlocksReleased)
        and any(isinstance(a, AbortRequested) and a.request_id == e.request_id for a in evs)
        for e in evs
    )
    # every abort released within its step; the in-flight one waited 5 ms for the step to end
    assert s["abort_release_steps"]["max"] == 0
    assert s["abort_release_ms"]["max"] == 5 and s["abort_release_ms"]["p50"] == 0
    assert s["recorded_ms"] == run.t - run.entries[0].ts


def test_a_timeout_abort_is_journaled_with_its_error_and_replays_to_the_same_final():
    run = Run(Scheduler(CFG), "eng-1")
    run.call("add", "a", req(6, max_tokens=12))
    run.call("add", "b", req(5, max_tokens=12, start=40))
    run.step()

    def time_out_b(r):
        r.call("abort", "b", "timeout", "no progress for 1 s (request timeout)")

    evs = run.call("abort", "a", "timeout", "no progress for 1 s (request timeout)")
    run.step(during=time_out_b)
    for _ in range(20):
        run.step()
    finals = {e.request_id: e for e in run.events if isinstance(e, Final)}
    assert set(finals) == {"a", "b"} and evs[-1] is finals["a"]
    assert all(f.finish_reason == "error" and "request timeout" in f.error for f in finals.values())
    calls = [c for e in run.entries[1:] for c in e.data["calls"] if c["op"] == "abort"]
    assert [c.get("error") for c in calls] == ["no progress for 1 s (request timeout)"] * 2

    report = replay(run.entries)
    assert report.divergence is None, report.divergence.describe()
    assert report.ok and report.summary()["finish_reasons"] == {"error": 2}


def test_events_digested_match_what_the_scheduler_returned():
    run = record_run()
    recorded = [d for e in run.entries[1:] for c in e.data["calls"] for d in c.get("ev", [])]
    emitted = run.events
    assert [(d[0], d[1]) for d in recorded] == [(e.TYPE, e.request_id) for e in emitted]
    toks = [t for d in recorded if d[0] == "tokens" for t in d[2]]
    assert toks == [t for e in emitted if isinstance(e, Tokens) for t in e.token_ids]


def test_at_step_snapshot_is_the_scheduler_state_then(capsys, tmp_path):
    run = record_run()
    path = tmp_path / "j.jsonl"
    export_jsonl(run.entries, path)
    report = replay(run.entries, at=3)
    snap = report.snapshot_at
    assert snap["step"] == 3 and snap["scheduled"]["step"] == 3
    assert snap["scheduled"]["in_flight"] and snap["after_update"]["in_flight"] == []
    assert main([str(path), "--at", "3"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and '"scheduled"' in out


def _tamper(entries, pick):
    """A copy of the journal with one call changed by ``pick`` (returns True once done)."""
    out = []
    done = False
    for e in entries:
        if isinstance(e, JournalStep) and not done:
            data = json.loads(json.dumps(e.data))
            for c in data["calls"]:
                if pick(c, e):
                    done = True
                    break
            e = dataclasses.replace(e, data=data)
        out.append(e)
    assert done
    return out


def test_a_changed_sampled_token_is_named_by_step(tmp_path, capsys):
    run = record_run()

    def change_token(c, e):
        if c["op"] == "update" and c["step"] == 6 and c["sampled"]:
            rid = next(iter(c["sampled"]))
            c["sampled"][rid] = (c["sampled"][rid] + 1) % 90 + 3
            return True
        return False

    bad = _tamper(run.entries, change_token)
    report = replay(bad)
    assert not report.ok
    d = report.divergence
    assert d.step == 6 and d.op == "update"
    assert d.recorded["ev"] != d.replayed["ev"]
    assert "DIVERGED at step 6" in d.describe()
    path = tmp_path / "bad.jsonl"
    export_jsonl(bad, path)
    assert main([str(path)]) == 1
    assert "DIVERGED at step 6" in capsys.readouterr().out


def test_a_changed_batch_digest_is_named_by_step(tmp_path):
    run = record_run()

    def change_batch(c, e):
        if c["op"] == "schedule" and c["out"][0] == 9 and c["out"][2]:
            c["out"][2][0][2] += 1  # one more token fed than the scheduler decided
            return True
        return False

    report = replay(_tamper(run.entries, change_batch))
    assert report.divergence.step == 9 and report.divergence.op == "schedule"
    assert "out" in report.divergence.describe()


class ForgetfulScheduler(Scheduler):
    """A broken scheduler: a request that finishes normally keeps its blocks (and says so)."""

    def _release(self, seq, reason, stop_reason, events, step):
        if reason == "abort":
            return super()._release(seq, reason, stop_reason, events, step)
        if seq.status is Status.RUNNING:
            self._running.remove(seq)
        seq.status = Status.FINISHED
        del self._seqs[seq.request_id]
        events.append(BlocksReleased(request_id=seq.request_id, count=0, step=step))
        events.append(
            Final(request_id=seq.request_id, finish_reason=reason, usage=seq.usage(), stop_reason=stop_reason)
        )


class LyingScheduler(ForgetfulScheduler):
    """Worse: it reports the blocks released but never puts them back in the pool."""

    def _release(self, seq, reason, stop_reason, events, step):
        n = self.blocks.num_held(seq.request_id)
        super()._release(seq, reason, stop_reason, events, step)
        if reason != "abort":
            events[-2] = BlocksReleased(request_id=seq.request_id, count=n, step=step)


def _leaky_run(cls):
    run = Run(cls(CFG), "leaky")
    run.call("add", "x", req(6, max_tokens=3))
    run.call("add", "y", req(6, max_tokens=4, start=40))
    for _ in range(8):
        run.step()
    return run


@pytest.mark.parametrize("cls", [ForgetfulScheduler, LyingScheduler])
def test_a_leaking_scheduler_is_caught_by_the_journal_alone(cls, tmp_path, capsys):
    run = _leaky_run(cls)
    # the journal-only check: no re-execution, so the broken scheduler cannot hide it
    a = check_journal(run.entries)
    assert any("leak" in v for v in a.violations), a.violations
    # its own code replays "fine", but fd replay still fails on the invariant
    self_replay = replay(run.entries, scheduler_factory=cls)
    assert self_replay.divergence is None and not self_replay.ok
    # the correct scheduler disagrees with the recorded decisions
    report = replay(run.entries)
    assert report.divergence is not None
    assert (
        report.divergence.recorded["free"] != report.divergence.replayed["free"]
        or report.divergence.recorded["ev"] != report.divergence.replayed["ev"]
    )
    path = tmp_path / "leak.jsonl"
    export_jsonl(run.entries, path)
    assert main([str(path), "--json"]) == 1
    out = orjson.loads(capsys.readouterr().out)
    assert out["ok"] is False and any("leak" in v for v in out["violations"])


def test_double_final_and_missing_entries_are_violations():
    run = record_run()
    entries = list(run.entries)
    # a second final for a finished request
    last = entries[-1]
    data = json.loads(json.dumps(last.data))
    data["calls"].append(
        {
            "op": "abort",
            "rid": "a",
            "source": "http",
            "ev": [["final", "a", "abort", 0, None, None]],
            "free": 14,
        }
    )
    a = check_journal(entries[:-1] + [dataclasses.replace(last, data=data)])
    assert any("final #2" in v for v in a.violations)
    # a gap in the entries (trimming, a lost write) is reported, not silently replayed
    a = check_journal(entries[:3] + entries[4:])
    assert any("expected" in v for v in a.violations)
    # a journal whose start was trimmed away
    a = check_journal(entries[5:])
    assert any("truncated" in v for v in a.violations)
    assert not replay(entries[5:]).ok


def test_restart_under_the_same_id_is_a_new_segment():
    one = record_run().entries
    two = record_run().entries
    report = replay(one + two)
    assert report.ok and report.segments == 2 and report.calls == 2 * replay(one).calls


def test_journal_flag_and_passthrough():
    bare = Scheduler(CFG)
    assert journaled(bare, "e", enabled=False) is bare
    rec = journaled(Scheduler(CFG), "e")
    assert isinstance(rec, JournalRecorder) and rec.drain() is None
    assert rec.can_admit() == bare.can_admit() and rec.num_total_blocks == CFG.num_blocks
    assert config_from_json(rec.start_record().config) == CFG
    rec.knows("x"), rec.in_flight("x"), rec.snapshot()
    assert rec.drain() is None  # read-only queries are not recorded
    rec.add("x", req(3))
    ev = rec.drain()
    assert ev.seq == 0 and [c["op"] for c in ev.data["calls"]] == ["add"]
    # round trip through the wire codec
    assert decode(ev.encode()).data == ev.data
    assert decode(rec.start_record().encode()).config == rec.start_record().config


async def test_journal_through_real_redis(real_bus, redis_server):
    run = record_run()
    bus = real_bus
    key = bus.keys.journal("eng-1")
    # as the node does: the start, then each step's entry with the step's other events
    await bus.publish_many([(key, run.entries[0])])
    for ev in run.entries[1:]:
        await bus.publish_many([(key, ev), (bus.keys.req("a"), Tokens(request_id="a", token_ids=(5,)))])
    loaded = await load_journal_from_redis(bus, "eng-1")
    assert loaded == run.entries
    assert replay(loaded).ok
    argv = ["--engine", "eng-1", "--redis-url", redis_server.url, "--prefix", bus.keys.prefix]
    assert await asyncio.to_thread(main, argv) == 0
    assert (
        await asyncio.to_thread(
            main, ["--engine", "nope", "--redis-url", redis_server.url, "--prefix", bus.keys.prefix]
        )
        == 2
    )


async def test_export_all_engines_then_replay_the_file(real_bus, redis_server, tmp_path, capsys):
    from fd.engine.journal.replay import export_main

    bus = real_bus
    for eng in ("e1", "e2"):
        run = record_run()
        items = [(bus.keys.journal(eng), dataclasses.replace(e, engine=eng)) for e in run.entries]
        await bus.publish_many(items)
    out = tmp_path / "all.jsonl"
    base = ["--redis-url", redis_server.url, "--prefix", bus.keys.prefix]
    assert await asyncio.to_thread(export_main, ["--out", str(out)] + base) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["engine"] for r in rows} == {"e1", "e2"}
    assert all(r["stream"].endswith(r["engine"]) and r["id"] for r in rows)
    html = tmp_path / "t.html"
    assert main([str(out), "--html", str(html)]) == 0
    assert (tmp_path / "t.e1.html").exists() and (tmp_path / "t.e2.html").exists()
    assert await asyncio.to_thread(export_main, ["--out", str(out), "--engine", "e2"] + base) == 0
    assert {json.loads(x)["engine"] for x in out.read_text().splitlines()} == {"e2"}


def _shared_prefix_run(caching: bool, async_: bool) -> Run:
    """Requests whose prompts share prefixes, coming while others run, in a pool small enough
    to evict and preempt, one aborted while it shares blocks."""
    cfg = dataclasses.replace(
        CFG, num_blocks=12, enable_prefix_caching=caching, max_steps_in_flight=2 if async_ else 1
    )
    run = Run(Scheduler(cfg), "eng-cache")
    system = tuple(range(20, 29))  # 9 tokens: two full blocks of 4
    run.call(
        "add", "p0", RequestData(prompt_token_ids=system + (1, 2), sampling=SamplingParams(max_tokens=8))
    )
    run.step()
    for i in range(1, 7):
        run.call(
            "add",
            f"p{i}",
            RequestData(
                prompt_token_ids=system + (i, i + 1, i + 2), sampling=SamplingParams(max_tokens=6 + i)
            ),
        )
        run.step()
        if i == 3:
            run.call("abort", "p2", "http")
        if i == 4:  # the system prompt's second block's tokens, at the start: other contents
            run.call(
                "add",
                "p7",
                RequestData(prompt_token_ids=system[4:8] * 2 + (9,), sampling=SamplingParams(max_tokens=5)),
            )
    for _ in range(80):
        if not run.rec.has_work():
            break
        run.step()
    return run


@pytest.mark.parametrize("async_", [False, True])
def test_shared_prefixes_give_the_same_tokens_and_replay_clean(async_, tmp_path):
    """The fake model samples from what the KV blocks hold, so a block shared before its step
    filled it, or handed out while shared, would change tokens. With the cache the tokens are
    the same as without it, fewer prompt tokens are fed, and the journal replays with no
    violation (shared blocks are read-only, not 'held by two requests')."""
    plain, cached = _shared_prefix_run(False, async_), _shared_prefix_run(True, async_)

    def tokens(run):
        out: dict[str, list[int]] = {}
        for e in run.events:
            if isinstance(e, Tokens):
                out.setdefault(e.request_id, []).extend(e.token_ids)
        return out

    a, b = tokens(cached), tokens(plain)
    assert sorted(a) == sorted(b) == [f"p{i}" for i in range(8)]
    # p2 was aborted after as many steps either way, further along with the cache
    x, y = a.pop("p2"), b.pop("p2")
    assert x[: len(y)] == y and len(x) >= len(y)
    assert a == b
    assert cached.rec.scheduler.num_cache_hits > 0
    assert cached.rec.num_free_blocks == cached.rec.scheduler.num_total_blocks
    cached.rec.scheduler.blocks.check()

    def fed(run):  # tokens fed to the model, from the journal's batch digests
        return sum(c["out"][1] for e in run.entries[1:] for c in e.data["calls"] if c["op"] == "schedule")

    assert fed(cached) < fed(plain)
    report = replay(cached.entries)
    assert report.divergence is None, report.divergence.describe()
    assert report.violations == []


def test_a_priority_policy_replays_clean(tmp_path):
    """The policy is in the journal's config and each request's priority in its data: the
    log replays to the same decisions, preemptions by priority included."""
    cfg = dataclasses.replace(CFG, num_blocks=8, scheduling_policy="priority")
    run = Run(Scheduler(cfg), "eng-prio")
    for i, p in enumerate((3, 0, 2, 0, 1)):
        run.call(
            "add",
            f"r{i}",
            RequestData(
                prompt_token_ids=tuple(range(20 * i, 20 * i + 6)),
                sampling=SamplingParams(max_tokens=10),
                priority=p,
            ),
        )
        run.step()
    for _ in range(200):
        if not run.rec.has_work():
            break
        run.step()
    assert any(isinstance(e, Preempted) for e in run.events)
    starts = [e.request_id for e in run.events if isinstance(e, Tokens)]
    assert list(dict.fromkeys(starts))[:2] == ["r0", "r1"]  # (r0 ran alone before r1 came)
    assert run.entries[0].config["scheduling_policy"] == "priority"
    report = replay(run.entries)
    assert report.divergence is None, report.divergence.describe()
    assert report.violations == []
    tampered = [
        dataclasses.replace(run.entries[0], config={**run.entries[0].config, "scheduling_policy": "fcfs"}),
        *run.entries[1:],
    ]
    assert replay(tampered).divergence is not None  # (the policy is what decided)
