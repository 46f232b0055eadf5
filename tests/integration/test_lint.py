"""The code is ruff-clean, lint and format, and mypy-clean where pyproject.toml's [tool.mypy]
lists it (strict), under pyproject.toml's settings (CI runs this file with the rest of the
suite, so a change that breaks any of them does not land)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_importing_fd_changes_nothing_of_the_process():
    """No import-time side effects: a program that imports fd's engine and control plane keeps
    its environment and its warning filters; fd's processes call fd.engine.runner.process.tune."""
    code = (
        "import os, warnings; env = dict(os.environ); filters = list(warnings.filters); "
        "import fd.engine.runner.worker, fd.engine.node.node, fd.control.bus, fd.cli.main; "
        "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items()); "
        "assert warnings.filters == filters"
    )
    env = {k: v for k, v in os.environ.items() if k != "MKL_DEBUG_CPU_TYPE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
