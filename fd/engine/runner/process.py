"""Settings of a process that runs the model, applied where such a process starts (``fd``'s
commands, the model worker, the tests' and benchmarks' processes), never as a side effect of an
import: a library that imports ``fd.engine`` keeps its environment and its warning filters."""

from __future__ import annotations

import os
import warnings


def _amd_cpu() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


def tune() -> None:
    """Before Paddle is imported: MKL's code path on AMD CPUs, and Paddle's import warning.

    Paddle's CPU wheel does its matmuls with Intel MKL, which on AMD CPUs picks a generic code
    path unless told otherwise: on this project's AMD EPYC machines a [1280,128]x[128,512]
    matmul ran at 37 GFLOPS, and at 88 with the AVX2 path (2.4x; a 32-prompt prefill 35 -> ~15
    ms). MKL reads the variable when it loads, so this must come first; a value the user set
    wins. Paddle warns at import that ccache is missing, which only matters to people compiling
    custom operators and would greet every ``fd serve`` user."""
    if _amd_cpu():
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    warnings.filterwarnings("ignore", message="No ccache found")
