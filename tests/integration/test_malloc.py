"""The model's process keeps step-sized buffers on the heap (fd/engine/runner/malloc.py).

Each check runs in a fresh interpreter: glibc's thresholds are per process and move with
its allocation history. "On the heap" is read from /proc/self/maps: a 4 MiB malloc either
lands inside the ``[heap]`` mapping or in an mmap of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    {setup}
    p = libc.malloc({size})
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            print("heap" if lo <= p < hi else "mmap")
            break
    else:
        print("mmap")
""")


def probe(setup: str, env_extra: dict[str, str] | None = None, size: int = 4 << 20) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra or {})
    env["PYTHONPATH"] = ROOT
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup, size=size)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1]


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc malloc thresholds are Linux-only"
)


def test_default_glibc_puts_four_megabytes_in_an_mmap():
    # The control: without the setting, a buffer this size is a fresh mapping every time.
    assert probe("pass") == "mmap"


def test_pinned_thresholds_put_it_on_the_heap():
    assert probe("from fd.engine.runner.malloc import pin_thresholds; assert pin_thresholds()") == "heap"


def test_the_model_runner_pins_them(tiny_model_dir):
    # Loading Paddle alone moves glibc's dynamic threshold past 1 MiB (checked: without the
    # pin this probe says "mmap" after the same load), hence 4 MiB.
    setup = (
        "from fd.engine.runner.model_runner import ModelRunner; "
        f"ModelRunner({str(tiny_model_dir)!r}, device='cpu', num_blocks=8)"
    )
    assert probe(setup) == "heap"


def test_an_operator_setting_wins():
    setup = "from fd.engine.runner.malloc import pin_thresholds; assert not pin_thresholds()"
    assert probe(setup, {"MALLOC_MMAP_THRESHOLD_": "65536"}) == "mmap"
