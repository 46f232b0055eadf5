"""The code is ruff-clean, lint and format, and mypy-clean where pyproject.toml's [tool.mypy]
lists it (strict), under pyproject.toml's settings (CI runs this file with the rest of the
suite, so a change that breaks any of them does not land)."""

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


def test_mypy_strict_finds_nothing(tmp_path: Path):
    # No file arguments: mypy checks what [tool.mypy] ``files`` lists. Its cache goes under
    # the test's own directory, so a run never reads one left by another mypy or version.
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
