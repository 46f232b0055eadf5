"""bench/repeat.py: each run's goals, judged from its own figures, counted over runs; with
``--env`` the two halves of an A/B are counted apart."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench._common import goal
from bench.repeat import tally

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "value,op,limit,met",
    [
        (4.9, "<", 5.0, True),
        (5.0, "<", 5.0, False),
        (5.0, "<=", 5.0, True),
        (5.1, "<=", 5.0, False),
        (0.9, ">=", 0.9, True),
        (0.89, ">=", 0.9, False),
        (0, "==", 0, True),
        (1, "==", 0, False),
    ],
)
def test_a_goal_holds_or_not_by_its_operator(value, op, limit, met):
    g = goal("g", "here", value, op, limit)
    assert g == {"goal": "g", "at": "here", "value": value, "op": op, "limit": limit, "met": met}


def test_tally_counts_runs_and_marks_a_limit_that_moves_between_runs():
    runs = [
        [goal("ratio", "32 streams", 0.95, ">=", 0.9), goal("release", "128", 9.0, "<=", 10.0)],
        [goal("ratio", "32 streams", 0.85, ">=", 0.9), goal("release", "128", 12.0, "<=", 11.0)],
        [goal("ratio", "32 streams", 1.05, ">=", 0.9), goal("release", "128", 8.0, "<=", 9.0)],
    ]
    ratio, release = tally(runs)
    assert ratio == ["ratio", "32 streams", ">= 0.90", "2 of 3", 0.95, "0.85 – 1.05"]
    assert release == ["release", "128", "<= (per run)", "2 of 3", 9.0, "8.00 – 12.00"]


FAKE_BENCH = textwrap.dedent("""
    import json, os, sys
    out = sys.argv[sys.argv.index("--output-json") + 1]
    value = float(os.environ.get("FAKE_VALUE", "1"))
    json.dump({"goals": [{"goal": "g", "at": "x", "value": value, "op": "<", "limit": 2.0,
                          "met": value < 2.0}], "args": sys.argv[1:]}, open(out, "w"))
""")


def test_repeat_runs_the_script_and_counts_each_half_of_an_ab(tmp_path):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    out = tmp_path / "repeat.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "repeat.py"),
            "-n",
            "2",
            "--env",
            "FAKE_VALUE=3",
            "--output-json",
            str(out),
            str(script),
            "--its-own",
            "arg",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    rep = json.loads(out.read_text())
    assert rep["args"] == ["--its-own", "arg"] and rep["ab_env"] == "FAKE_VALUE=3"
    assert [[g["value"] for g in run] for run in rep["runs"]["A"]] == [[1.0], [1.0]]
    assert [[g["value"] for g in run] for run in rep["runs"]["B"]] == [[3.0], [3.0]]
    assert "| g | x | < 2.00 | 2 of 2 |" in rep["tables"]["A"]
    assert "| g | x | < 2.00 | 0 of 2 |" in rep["tables"]["B"]


def test_repeat_stops_on_a_script_that_judges_no_goal(tmp_path):
    script = tmp_path / "no_goals.py"
    script.write_text(
        "import json, sys\njson.dump({}, open(sys.argv[sys.argv.index('--output-json') + 1], 'w'))\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "repeat.py"),
            "-n",
            "1",
            "--output-json",
            str(tmp_path / "r.json"),
            str(script),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "wrote no goals" in res.stderr
