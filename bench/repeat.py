"""Run a benchmark several times and count how often each of its goals held.

On two shared cores one run of ``bench/abort.py`` or ``bench/api.py`` says little about a goal
that sits within a few milliseconds of its limit: the same tree moved +TTFT p50 between 5 and
10 ms from one run to the next. This runs the script ``-n`` times, one after another, each
with its own ``--output-json``, reads the ``goals`` each run judged from its own figures
(``bench._common.goal``), and prints per goal how many runs met it and the median and range
of what they measured. Nothing is timed here.

With ``--env VAR=VALUE`` every other run (the second, fourth, ...) gets that variable in its
environment, and the goals are counted for the two halves apart: an A/B comparison whose
halves share the machine's noise, for a change behind a switch.

Usage: python bench/repeat.py [-n 5] [--env VAR=VALUE] [--output-json FILE]
                              bench/abort.py [its arguments ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import RESULTS, fmt, print_table, write_json  # noqa: E402


def tally(runs: list[list[dict]]) -> list[list]:
    """One row per goal, in the order the first run listed them. A limit that depends on the
    run (abort's "one engine step + 5 ms": each run's own step) shows as "per run"."""
    order: dict[tuple[str, str], dict] = {}
    for goals in runs:
        for g in goals:
            row = order.setdefault(
                (g["goal"], g["at"]), {"op": g["op"], "limits": set(), "values": [], "met": 0}
            )
            row["limits"].add(g["limit"])
            row["values"].append(g["value"])
            row["met"] += bool(g["met"])
    rows = []
    for (name, at), r in order.items():
        vs = r["values"]
        limit = fmt(next(iter(r["limits"])), 2) if len(r["limits"]) == 1 else "(per run)"
        rows.append(
            [
                name,
                at,
                f"{r['op']} {limit}",
                f"{r['met']} of {len(vs)}",
                statistics.median(vs),
                f"{fmt(min(vs), 2)} – {fmt(max(vs), 2)}",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=5, help="runs (with --env: runs of each half)")
    ap.add_argument("--env", default=None, help="VAR=VALUE set for every other run (an A/B)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("script", help="a bench script that writes goals to its --output-json")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = ap.parse_args()
    if args.env is not None and "=" not in args.env:
        ap.error("--env takes VAR=VALUE")
    halves = ("A", "B") if args.env else ("",)
    tmp = tempfile.mkdtemp(prefix="fd-bench-repeat-")
    runs: dict[str, list[list[dict]]] = {h: [] for h in halves}
    logs = []
    with tqdm(total=args.n * len(halves), desc=f"repeat {Path(args.script).name}", unit="run") as bar:
        for i in range(args.n):
            for h in halves:
                env = dict(os.environ)
                if h == "B":
                    var, _, value = args.env.partition("=")
                    env[var] = value
                out = os.path.join(tmp, f"run{i}{h}.json")
                log = os.path.join(tmp, f"run{i}{h}.log")
                with open(log, "w") as fh:
                    rc = subprocess.run(
                        [sys.executable, args.script, *args.args, "--output-json", out],
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                    ).returncode
                logs.append(log)
                if rc != 0:
                    sys.exit(f"run {i + 1}{h} of {args.script} failed (exit {rc}); its output: {log}")
                goals = json.loads(Path(out).read_text()).get("goals")
                if not goals:
                    sys.exit(
                        f"{args.script} wrote no goals (with these arguments it may measure "
                        f"none of them); its output: {log}"
                    )
                runs[h].append(goals)
                bar.update(1)
    tables = {}
    for h in halves:
        title = f"{Path(args.script).name} run {args.n} times"
        if h:
            title += f", half {h}" + (f" ({args.env})" if h == "B" else " (as is)")
        tables[h or "all"] = print_table(
            title, ["goal", "at", "needs", "met in", "median", "range"], tally(runs[h]), nd=2
        )
    name = Path(args.script).stem
    write_json(
        args.output_json or RESULTS / f"repeat-{name}.json",
        {
            "script": args.script,
            "args": args.args,
            "n": args.n,
            "ab_env": args.env,
            "runs": runs,
            "tables": tables,
            "logs": logs,
        },
    )


if __name__ == "__main__":
    main()
