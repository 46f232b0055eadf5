"""``fd replay``: re-execute an engine journal on a fresh scheduler and check every decision.

Two independent checks, because either alone can be fooled:

- :func:`replay` feeds every recorded call to a fresh :class:`Scheduler` built from the
  journal's config and compares each result's digest with the recorded one; the first
  mismatch names the step and shows both decisions. It proves *this* scheduler code makes the
  recorded decisions, e.g. that an incident reproduces on a laptop, or that a fix changes it.
- :func:`~fd.engine.journal.journal_check.check_journal` reads only the recorded digests: block tables, released counts and the
  free count after every call. It finds a leak (a request that ended still holding blocks, a
  release that returned fewer blocks than the request held, blocks in use that no request
  holds), double allocation, and requests with other than one ``final`` even if the scheduler
  that wrote the journal is the one that is broken, and without re-executing anything.

A journal is a list of :class:`JournalStart` / :class:`JournalStep` events of one engine; a
JournalStart begins a segment (an engine restart), replayed from a fresh scheduler. It is read
from Redis or from a JSONL file by fd/engine/journal/journal_reader.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fd.control.events import Event, JournalStart, JournalStep
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.journal.journal import Digester, config_from_json
from fd.engine.journal.journal_check import Analysis, check_journal
from fd.engine.journal.journal_reader import (
    by_engine,
    journal_engines,
    jsonl_line,
    load_journal_from_redis,
    load_journal_jsonl,
    read_journal,
    segments,
)

OUTPUT_KEYS = ("raised", "ev", "out", "free")


# --------------------------------------------------------------------------- re-execution


@dataclass
class Divergence:
    segment: int
    entry: int  # index of the JournalStep in its segment (its seq)
    step: int  # the scheduler step when the call was made
    call: int  # index of the call in the entry
    op: str
    inputs: dict[str, Any]
    recorded: dict[str, Any]
    replayed: dict[str, Any]

    def describe(self) -> str:
        lines = [
            f"DIVERGED at step {self.step} (segment {self.segment}, entry {self.entry}, "
            f"call {self.call}: {self.op})"
        ]
        if self.inputs:
            lines.append(f"  input:    {_short(self.inputs)}")
        for k in OUTPUT_KEYS:
            r, g = self.recorded.get(k), self.replayed.get(k)
            if r != g:
                lines.append(f"  {k}: recorded {_short(r)}")
                lines.append(f"  {' ' * len(k)}  replayed {_short(g)}")
        return "\n".join(lines)


def _short(x: Any, limit: int = 600) -> str:
    s = orjson.dumps(x).decode()
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


@dataclass
class ReplayReport:
    engine: str
    segments: int
    entries: int
    calls: int
    replayed_calls: int
    divergence: Divergence | None
    analysis: Analysis
    recorded_ms: int
    replay_ms: float
    snapshot_at: dict[str, Any] | None = None

    @property
    def violations(self) -> list[str]:
        return self.analysis.violations

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.violations and self.entries > 0

    def summary(self) -> dict[str, Any]:
        a = self.analysis
        lat_s, lat_ms = sorted(a.abort_release_steps), sorted(a.abort_release_ms)
        return {
            "engine": self.engine,
            "ok": self.ok,
            "segments": self.segments,
            "entries": self.entries,
            "steps": a.steps,
            "calls": self.calls,
            "replayed_calls": self.replayed_calls,
            "divergence": None
            if self.divergence is None
            else {**dataclasses.asdict(self.divergence), "text": self.divergence.describe()},
            "violations": list(a.violations),
            "requests": len(a.requests),
            "finish_reasons": dict(a.finish_reasons),
            "open_requests": sum(1 for t in a.requests.values() if not t.finals),
            "total_blocks": a.total_blocks,
            "peak_blocks_in_use": a.peak_blocks_in_use,
            "aborts_released": len(lat_s),
            "abort_release_steps": _dist(lat_s),
            "abort_release_ms": _dist(lat_ms),
            "recorded_ms": self.recorded_ms,
            "replay_ms": round(self.replay_ms, 3),
            "speedup": round(self.recorded_ms / self.replay_ms, 1) if self.replay_ms > 0 else None,
        }

    def to_json(self) -> dict[str, Any]:
        d = self.summary()
        if self.snapshot_at is not None:
            d["snapshot_at"] = self.snapshot_at
        return d

    def format(self) -> str:
        s = self.summary()
        lines = [
            f"engine {s['engine'] or '(unnamed)'}: {'OK' if s['ok'] else 'FAILED'} - "
            f"{s['entries']} entries, {s['steps']} steps, {s['calls']} calls "
            f"({s['replayed_calls']} replayed, {s['segments']} segment(s))",
            f"requests {s['requests']} (finish reasons {s['finish_reasons']}, "
            f"{s['open_requests']} still open); peak blocks in use "
            f"{s['peak_blocks_in_use']}/{s['total_blocks']}",
        ]
        if s["aborts_released"]:
            st, ms = s["abort_release_steps"], s["abort_release_ms"]
            lines.append(
                f"abort -> release: {s['aborts_released']} aborts, steps p50 {st['p50']} "
                f"max {st['max']}; ms p50 {ms['p50']} max {ms['max']}"
            )
        if s["speedup"] is not None:
            lines.append(
                f"replayed in {s['replay_ms']:.1f} ms; recorded over {s['recorded_ms']} ms ({s['speedup']}x)"
            )
        if self.divergence is not None:
            lines.append(self.divergence.describe())
        if not self.entries:
            lines.append("no journal entries")
        for v in s["violations"]:
            lines.append(f"VIOLATION: {v}")
        return "\n".join(lines)


def _dist(xs: list) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(xs),
        "p50": xs[len(xs) // 2],
        "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
        "max": xs[-1],
    }


def _request_data(d: dict[str, Any]) -> RequestData:
    # Built by hand, not RequestData.from_json: the journal also holds what the API would have
    # rejected (an empty prompt reached add() and got its error final); replay feeds it as is.
    return RequestData(
        prompt_token_ids=tuple(d.get("prompt_token_ids") or ()),
        sampling=SamplingParams.from_dict(d.get("sampling") or {}),
        arrival_ts=int(d.get("arrival_ts") or 0),
        model=str(d.get("model") or ""),
        api=str(d.get("api") or ""),
        background=bool(d.get("background", False)),
        parent=str(d.get("parent") or ""),
        priority=int(d.get("priority") or 0),
    )


class _Replayer:
    """Re-executes one segment's calls; the digests come from a Digester of its own."""

    def __init__(self, sched: Scheduler):
        self.s = sched
        self.dig = Digester()
        self.outs: dict[int, SchedulerOutput] = {}  # steps in flight (two with async scheduling)

    def apply(self, c: dict[str, Any]) -> dict[str, Any]:
        s, op = self.s, c["op"]
        got: dict[str, Any] = {}
        try:
            if op == "schedule":
                out = s.schedule()
                if not out.empty:
                    self.outs[out.step] = out
                got["ev"] = self.dig.events(list(out.events))
                got["out"] = self.dig.batch(out)
            else:
                if op == "add":
                    evs = s.add(c["rid"], _request_data(c["data"]), tuple(c.get("gen") or ()))
                elif op == "abort":
                    evs = s.abort(c["rid"], c["source"], c.get("error")).events
                elif op == "abort_all":
                    evs = s.abort_all(c["source"]).events
                elif op == "skip":
                    evs = s.skipped(c["step"], list(c["rids"]))
                elif op == "finished":
                    evs = s.finished(c["step"])
                elif op == "update":
                    out = self.outs.pop(c["step"], None) or SchedulerOutput(step=c["step"], seqs=())
                    result = RunnerOutput(
                        step=c.get("rstep", c["step"]),
                        sampled={k: int(v) for k, v in c["sampled"].items()},
                        stopped=dict(c.get("stopped") or {}),
                        failed=dict(c.get("failed") or {}),
                    )
                    evs = s.update(out, result)
                else:
                    raise ValueError(f"unknown journal op {op!r}")
                got["ev"] = self.dig.events(evs)
        except Exception as e:
            got = {"raised": type(e).__name__}
        got["free"] = s.num_free_blocks
        return got


def replay(
    entries: list[Event],
    *,
    at: int | None = None,
    scheduler_factory: Callable[[SchedulerConfig], Scheduler] = Scheduler,
) -> ReplayReport:
    """Re-execute a journal (one engine's entries, oldest first) and check it; see module doc."""
    analysis = check_journal(entries)
    segs, _ = segments(entries)
    divergence: Divergence | None = None
    snapshot: dict[str, Any] | None = None
    calls = replayed = n_entries = 0
    recorded_ms = 0
    t0 = time.perf_counter()
    for si, (start, steps) in enumerate(segs):
        n_entries += 1 + len(steps)
        if steps:
            recorded_ms += max(0, steps[-1].ts - start.ts)
        rp = _Replayer(scheduler_factory(config_from_json(start.config)))
        for _ei, st in enumerate(steps):
            for ci, c in enumerate(st.data.get("calls", ())):
                calls += 1
                if divergence is not None and divergence.segment == si:
                    continue
                step_before = rp.s.step
                got = rp.apply(c)
                replayed += 1
                if any(c.get(k) != got.get(k) for k in OUTPUT_KEYS):
                    step = got["out"][0] if "out" in got else step_before
                    inputs = {k: v for k, v in c.items() if k not in OUTPUT_KEYS and k not in ("op", "t")}
                    divergence = divergence or Divergence(
                        si, st.seq, step, ci, c["op"], inputs, {k: c[k] for k in OUTPUT_KEYS if k in c}, got
                    )
                if at is not None:
                    if c["op"] == "schedule" and rp.s.step == at and "out" in got:
                        snapshot = {"step": at, "scheduled": rp.s.snapshot()}
                    elif c["op"] == "update" and c["step"] == at and snapshot is not None:
                        snapshot.setdefault("after_update", rp.s.snapshot())
    replay_ms = (time.perf_counter() - t0) * 1000
    engine = next((e.engine for e in entries if isinstance(e, (JournalStart, JournalStep))), "")
    if at is not None and snapshot is None:
        snapshot = {"step": at, "error": f"step {at} was never scheduled in this journal"}
    return ReplayReport(
        engine=engine,
        segments=len(segs),
        entries=n_entries,
        calls=calls,
        replayed_calls=replayed,
        divergence=divergence,
        analysis=analysis,
        recorded_ms=recorded_ms,
        replay_ms=replay_ms,
        snapshot_at=snapshot,
    )


# --------------------------------------------------------------------------- CLI


def _redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("FD_REDIS_URL"))
    p.add_argument("--prefix", default=os.environ.get("FD_PREFIX", "fd"))


def _default_bus(url: str, prefix: str):
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.keys import Keys

    return Bus(connect(url), Keys(prefix))


async def _with_bus(args, bus_factory, fn):
    if not args.redis_url:
        raise SystemExit("error: --redis-url (or FD_REDIS_URL) is required to read a journal from Redis")
    bus = (bus_factory or _default_bus)(args.redis_url, args.prefix)
    try:
        return await fn(bus)
    finally:
        await bus.aclose()


def main(argv: list[str] | None = None, bus_factory=None) -> int:
    """``fd replay (--engine ID | FILE.jsonl) [--at STEP] [--html OUT] [--json]``.

    Exit status: 0 every decision reproduced and no invariant broken; 1 a divergence or a
    violated invariant; 2 nothing to replay.
    """
    p = argparse.ArgumentParser(prog="fd replay", description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", help="a JSONL journal from `fd events export`")
    p.add_argument("--engine", help="replay P:journal:<ENGINE> straight from Redis")
    p.add_argument(
        "--at", type=int, default=None, metavar="STEP", help="print the scheduler's snapshot at STEP"
    )
    p.add_argument("--html", default=None, metavar="OUT", help="write the timeline page here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _redis_args(p)
    args = p.parse_args(argv)
    if (args.file is None) == (args.engine is None):
        p.error("give exactly one of FILE.jsonl or --engine ID")
    if args.engine is not None:
        entries = asyncio.run(
            _with_bus(args, bus_factory, lambda bus: load_journal_from_redis(bus, args.engine))
        )
        groups = {args.engine: entries} if entries else {}
    else:
        try:
            groups = by_engine(load_journal_jsonl(args.file))
        except OSError as e:  # (a path that is not there: one line, not a traceback)
            print(f"error: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
            return 2
    if not groups:
        print("no journal entries found", file=sys.stderr)
        return 2
    status = 0
    out_json = []
    for engine, entries in groups.items():
        report = replay(entries, at=args.at)
        if not report.ok:
            status = 1
        if args.json:
            out_json.append(report.to_json())
        else:
            print(report.format())
            if report.snapshot_at is not None:
                print(orjson.dumps(report.snapshot_at, option=orjson.OPT_INDENT_2).decode())
        if args.html:
            from fd.engine.journal.timeline import render_html

            path = Path(args.html)
            if len(groups) > 1:
                path = path.with_name(f"{path.stem}.{engine or 'engine'}{path.suffix or '.html'}")
            path.write_text(render_html(entries, report), encoding="utf-8")
            print(f"timeline: {path}", file=sys.stderr)
    if args.json:
        body = out_json[0] if len(out_json) == 1 else out_json
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    return status


def export_main(argv: list[str] | None = None, bus_factory=None) -> int:
    """``fd events export --out FILE.jsonl [--engine ID]``: journals (all engines by default)."""
    p = argparse.ArgumentParser(prog="fd events export")
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--engine", default=None, help="only this engine's journal")
    _redis_args(p)
    args = p.parse_args(argv)

    async def dump(bus) -> int:
        engines = [args.engine] if args.engine else await journal_engines(bus)
        n = 0
        with open(args.out, "wb") as f:
            for engine in engines:
                key = bus.keys.journal(engine)
                for eid, ev in await read_journal(bus, key):
                    f.write(jsonl_line(ev, eid, key))
                    n += 1
        print(f"wrote {n} journal entries of {len(engines)} engine(s) to {args.out}", file=sys.stderr)
        return n

    n = asyncio.run(_with_bus(args, bus_factory, dump))
    return 0 if n else 2
