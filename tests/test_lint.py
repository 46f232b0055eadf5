"""The code is ruff-clean, lint and format, under pyproject.toml's settings (CI runs this file
with the rest of the suite, so a change that breaks either does not land)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_check_finds_nothing():
    out = _ruff("check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_changes_nothing():
    out = _ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr
