"""Fixed glibc malloc thresholds for the process that runs the model.

Paddle's CPU kernels take each step's activations from ``malloc``. glibc serves a request
above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh ``mmap`` and unmaps it on ``free``;
it raises the threshold only when such a chunk is freed, so whether a step's larger buffers
(attention scores grow with the context) come from the heap or from new zero-filled pages
depended on the process's allocation history. On the tiny model the same batch-32 decode step
took 2 ms of CPU in one run and 7-9 ms in the next, mostly page faults; the in-process ``LLM``
was always in the slow mode (7.8k tok/s at 32 sequences against 16.3k with fixed thresholds).
Pinning both thresholds keeps step buffers on the heap: memory freed by one step is reused by
the next instead of being handed back to the kernel and faulted in again.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment win (glibc reads
them at start; we leave such a process alone). Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the setting on 64-bit
TRIM_THRESHOLD = 256 << 20

_done: bool | None = None


def pin_thresholds() -> bool:
    """Set both thresholds once per process; True when they are (or were) set here."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or any(
        k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done


def release_free() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``), once the model
    is loaded: loading holds every weight in float32 while the model makes its own copies (a
    quantized one a quarter of the size), and the high trim threshold above keeps what that
    freed in the middle of the heap, resident, for the life of the process. True if it ran."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
