"""Journal benchmark: what recording every scheduler call costs, and how fast replay is.

One workload (staggered arrivals, ~10% aborted mid-run, greedy sampling) is driven the way the
engine node drives it (schedule, execute, update, and with the journal on a
``drain()`` plus the wire encoding of its entry every step), alternating bare
:class:`Scheduler` and :class:`JournalRecorder` rounds so both see the same machine noise:

- ``fake``: a runner that costs nothing, so the overhead is the journal against the bare
  scheduler alone (the worst case, far from what an engine pays);
- ``tiny``: the tiny random Llama on CPU through :class:`fd.engine.runner.model_runner.ModelRunner`,
  the engine's real step loop minus Redis.

It also reports the serialisation cost per step (``drain()`` + ``encode()``, bytes per entry),
and replay speed: the recorded tiny-model run re-executed by :func:`fd.engine.journal.replay.replay`
against its recorded wall time. Goals: journal cost <= 3% of engine throughput, replay >= 50x.

Usage: python bench/journal.py [--quick] [--output-json bench/results/journal.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd.control.events import decode  # noqa: E402
from fd.control.request_data import RequestData  # noqa: E402
from fd.control.sampling import SamplingParams  # noqa: E402
from fd.engine.core.config import SchedulerConfig  # noqa: E402
from fd.engine.core.outputs import RunnerOutput  # noqa: E402
from fd.engine.core.scheduler import Scheduler  # noqa: E402
from fd.engine.journal.journal import JournalRecorder  # noqa: E402
from fd.engine.journal.replay import replay  # noqa: E402


class FakeRunner:
    """Costs (almost) nothing: the next token is a cheap function of the position."""

    def __init__(self, num_blocks: int, max_model_len: int = 2048):
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = (1,)

    def execute(self, out):
        return RunnerOutput(
            step=out.step,
            sampled={
                s.request_id: 3 + (s.start_pos * 31 + len(s.token_ids)) % 400 for s in out.seqs if s.sample
            },
        )


def workload(n: int, seed: int = 0, max_prompt: int = 200, max_out: int = 96):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(16, max_prompt)
        reqs.append(
            (
                f"r{i}",
                RequestData(
                    prompt_token_ids=tuple(rng.randint(3, 500) for _ in range(plen)),
                    sampling=SamplingParams(
                        max_tokens=rng.randint(16, max_out), temperature=0.0, ignore_eos=True
                    ),
                ),
            )
        )
    aborts = {rid: rng.randint(2, 40) for rid, _ in rng.sample(reqs, n // 10)}  # rid -> step
    return reqs, aborts


def drive(runner, cfg: SchedulerConfig, reqs, aborts, journal: bool, per_step: int = 8):
    """One run as the node would drive it; returns (seconds, steps, tokens, journal entries,
    seconds spent in drain+encode)."""
    sched = Scheduler(cfg)
    rec = JournalRecorder(sched, "bench", clock=time.time) if journal else sched
    entries = []
    ser_s = 0.0
    if journal:
        entries.append(dataclasses.replace(rec.start_record(), ts=int(time.time() * 1000)).encode())
    pending = list(reqs)
    abort_at: dict[int, list[str]] = {}
    for rid, step in aborts.items():
        abort_at.setdefault(step, []).append(rid)
    tokens = steps = 0
    t0 = time.perf_counter()
    while pending or rec.has_work():
        for _ in range(min(per_step, rec.can_admit(), len(pending))):
            rid, data = pending.pop(0)
            rec.add(rid, data)
        for rid in abort_at.pop(rec.step, ()):
            rec.abort(rid, "http")
        out = rec.schedule()
        if not out.empty:
            res = runner.execute(out)
            for ev in rec.update(out, res):
                if ev.TYPE == "tokens":
                    tokens += len(ev.token_ids)
            steps += 1
        if journal:
            t1 = time.perf_counter()
            ev = rec.drain()
            if ev is not None:
                # what publish_many pays to put it on the wire; only the wire form is kept
                # (like Redis does), so the bench's heap does not grow with the journal
                entries.append(dataclasses.replace(ev, ts=int(time.time() * 1000)).encode())
            ser_s += time.perf_counter() - t1
    return time.perf_counter() - t0, steps, tokens, entries, ser_s


def compare(name, runner, cfg, reqs, aborts, rounds):
    bare, rec, ser, sizes = [], [], [], []
    entries = []
    drive(runner, cfg, reqs[: max(4, len(reqs) // 8)], {}, False)  # warm up
    for i in range(rounds):
        for journal in (False, True) if i % 2 == 0 else (True, False):
            s, steps, toks, ents, ser_s = drive(runner, cfg, reqs, aborts, journal)
            (rec if journal else bare).append(s)
            if journal:
                ser.append(ser_s / max(1, steps))
                entries = ents
                sizes = [sum(len(v) for v in e.values()) for e in ents[1:]]
    b, r = statistics.median(bare), statistics.median(rec)
    return {
        "runner": name,
        "requests": len(reqs),
        "steps": steps,
        "tokens": toks,
        "rounds": rounds,
        "bare_s": round(b, 4),
        "journal_s": round(r, 4),
        "bare_tok_s": round(toks / b, 1),
        "journal_tok_s": round(toks / r, 1),
        "overhead_pct": round((r - b) / b * 100, 2),
        "serialise_us_per_step": round(statistics.median(ser) * 1e6, 1),
        "entry_bytes_mean": round(statistics.mean(sizes), 1) if sizes else 0,
        "entry_bytes_max": max(sizes) if sizes else 0,
    }, entries


def replay_speed(fields):
    entries = [decode(f) for f in fields]
    rep = replay(entries)
    assert rep.ok, rep.format()
    best = min(replay(entries).replay_ms for _ in range(3))
    return {
        "entries": len(entries),
        "calls": rep.calls,
        "recorded_ms": rep.recorded_ms,
        "replay_ms": round(best, 2),
        "speedup": round(rep.recorded_ms / best, 1) if best else None,
        "replay_us_per_call": round(best * 1000 / max(1, rep.calls), 2),
    }


async def served_replay(model_dir: str, runner, n: int) -> dict:
    """Replay speed where it matters: a journal an engine node wrote while serving (embedded
    control plane, tokens published every step), read back from Redis. The recorded span is
    from the first entry to the last, so it includes the node's own I/O, as in production."""
    import asyncio

    from fd.compose import start_engine
    from fd.control.bus import Bus
    from fd.control.embedded import EmbeddedRedis
    from fd.control.keys import Keys
    from fd.control.tokenizer import Tokenizer
    from fd.engine.journal.journal_reader import load_journal_from_redis
    from fd.engine.node.node_config import EngineConfig
    from tests.kit.engine import story, submit_together

    emb = EmbeddedRedis()
    emb.start()
    try:
        keys = Keys("jb")
        tok = Tokenizer.from_dir(model_dir)
        eng = await start_engine(
            emb.client, keys, EngineConfig(model_dir=model_dir, engine_id="jb"), runner=runner, tokenizer=tok
        )
        bus = Bus(emb.client(), keys)
        rng = random.Random(3)
        reqs = [
            (
                f"s{i}",
                [rng.randrange(5, 500) for _ in range(rng.randrange(8, 80))],
                {"max_tokens": rng.randrange(16, 96), "ignore_eos": True},
            )
            for i in range(n)
        ]
        for i in range(0, n, 8):  # staggered arrivals
            await submit_together(bus, reqs[i : i + 8])
            await asyncio.sleep(0.02)
        for rid, _, _ in reqs:
            await story(bus, rid, timeout=300)
        await eng.stop()
        entries = await load_journal_from_redis(bus, "jb")
    finally:
        emb.stop()
    rep = replay(entries)
    assert rep.ok, rep.format()
    best = min(replay(entries).replay_ms for _ in range(3))
    return {
        "entries": len(entries),
        "calls": rep.calls,
        "recorded_ms": rep.recorded_ms,
        "replay_ms": round(best, 2),
        "speedup": round(rep.recorded_ms / best, 1) if best else None,
        "replay_us_per_call": round(best * 1000 / max(1, rep.calls), 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output-json", default="bench/results/journal.json")
    args = p.parse_args(argv)
    results = {"runs": [], "replay": {}}

    n_fake, rounds_fake = (128, 3) if args.quick else (512, 5)
    fake = FakeRunner(num_blocks=2048)
    cfg = SchedulerConfig(
        num_blocks=fake.num_blocks,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        eos_token_ids=(1,),
    )
    reqs, aborts = workload(n_fake)
    row, fake_entries = compare("fake", fake, cfg, reqs, aborts, rounds_fake)
    results["runs"].append(row)
    results["replay"]["fake"] = replay_speed(fake_entries)

    from fd.engine.model.tiny import make_tiny_model
    from fd.engine.runner.model_runner import ModelRunner

    d = Path(tempfile.mkdtemp(prefix="fd-bench-")) / "tiny"
    make_tiny_model(d)
    tiny = ModelRunner(str(d), device="cpu", num_blocks=512, block_size=16)
    cfg = SchedulerConfig(
        num_blocks=tiny.num_blocks,
        block_size=16,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=tiny.max_model_len,
        eos_token_ids=tuple(tiny.eos_token_ids),
    )
    n_tiny, rounds_tiny = (16, 2) if args.quick else (48, 4)
    reqs, aborts = workload(n_tiny, seed=1, max_prompt=120, max_out=48)
    row, tiny_entries = compare("tiny", tiny, cfg, reqs, aborts, rounds_tiny)
    results["runs"].append(row)
    results["replay"]["tiny"] = replay_speed(tiny_entries)
    import asyncio

    results["replay"]["tiny, served (engine node, embedded)"] = asyncio.run(
        served_replay(str(d), tiny, 24 if args.quick else 64)
    )

    cols = [
        "runner",
        "requests",
        "steps",
        "bare_tok_s",
        "journal_tok_s",
        "overhead_pct",
        "serialise_us_per_step",
        "entry_bytes_mean",
        "entry_bytes_max",
    ]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in results["runs"]:
        print(" | ".join(f"{r[c]!s:>14}" for c in cols))
    print()
    for name, r in results["replay"].items():
        print(
            f"replay {name}: {r['calls']} calls in {r['replay_ms']} ms "
            f"({r['replay_us_per_call']} us/call); recorded {r['recorded_ms']} ms -> "
            f"{r['speedup']}x faster"
        )
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
