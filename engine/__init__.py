"""The engine node: a sans-IO scheduler over a PaddlePaddle model, and its I/O shell."""

import os
import warnings

# PaddlePaddle warns at import that ccache is missing; it only matters to people compiling
# custom operators, and it would greet every `fd serve` user.
warnings.filterwarnings("ignore", message="No ccache found")


def _amd_cpu() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


# Paddle's CPU wheel does its matmuls with Intel MKL, which on AMD CPUs picks a generic code
# path unless told otherwise: on this project's AMD EPYC machines a [1280,128]x[128,512] matmul
# ran at 37 GFLOPS, and at 88 with the AVX2 path (2.4x; a 32-prompt prefill 35 -> ~15 ms). The
# variable must be set before MKL loads, i.e. before paddle is imported; every engine module
# imports paddle after this package. A value the user set wins.
if _amd_cpu():
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
