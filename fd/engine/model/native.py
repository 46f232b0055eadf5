"""fd's C++ kernels (fd/engine/model/kernels/): compiled on first use, cached, loaded by ctypes.

A kernel library is one source file built with the system's C++ compiler and the flags of the
ISA it is written for, once per source, flags and Paddle install, into ``$FD_KERNEL_CACHE``
(else ``~/.cache/fd/kernels``). It links Paddle's own OpenMP runtime, so the process keeps one
pool of threads. Where a library cannot be had (another CPU, no compiler, a failed build) the
caller gets the reason as a string and keeps its Paddle path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from functools import cache, lru_cache
from pathlib import Path

import paddle

KERNELS = Path(__file__).parent / "kernels"
log = logging.getLogger("fd.engine")


#: the ceilings ``$FD_MAX_CPU_ISA`` takes, each with the flag prefixes it hides
MAX_CPU_ISA = {"avx2": ("avx512", "amx"), "avx512": ("amx",)}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo names them, under ``$FD_MAX_CPU_ISA``'s ceiling.

    ``FD_MAX_CPU_ISA=avx2`` has fd choose as on a CPU without AVX-512 (its kernels' AVX2 builds,
    the composed RMSNorm, no bfloat16 weights) on one that has it, as oneDNN's
    ``ONEDNN_MAX_CPU_ISA`` does for oneDNN's: the way to see here what such a CPU gets."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    ceiling = os.environ.get("FD_MAX_CPU_ISA", "").strip().lower()
    if not ceiling:
        return flags
    if ceiling not in MAX_CPU_ISA:
        log.warning("FD_MAX_CPU_ISA=%s ignored: it takes %s", ceiling, " or ".join(MAX_CPU_ISA))
        return flags
    return frozenset(f for f in flags if not f.startswith(MAX_CPU_ISA[ceiling]))


def has_avx512f() -> bool:
    """Whether AVX-512 code may run here: the CPU has it (Paddle's probe; /proc/cpuinfo where
    there is one), and ``$FD_MAX_CPU_ISA`` allows it."""
    flags = cpu_flags()
    return bool(paddle.base.core.supports_avx512f()) and (not flags or "avx512f" in flags)


def _cache_dir() -> Path:
    return Path(os.environ.get("FD_KERNEL_CACHE") or Path.home() / ".cache" / "fd" / "kernels")


def _omp_dir() -> Path:
    return Path(paddle.__file__).parent / "libs"


def _build(name: str, source: Path, flags: tuple[str, ...]) -> Path:
    """The compiled library; the compile goes to a temporary name first, so concurrent starts
    never load half a file."""
    omp = _omp_dir()
    cmd = ["g++", "-O3", "-fopenmp", "-fPIC", "-shared", *flags, str(source), "-o"]
    link = [f"-L{omp}", "-liomp5", f"-Wl,-rpath,{omp}"]
    # (every file of the folder: a source includes its headers)
    sources = b"".join(f.read_bytes() for f in sorted(KERNELS.iterdir()) if f.suffix in (".cc", ".h"))
    key = hashlib.sha256(sources + " ".join(cmd + link).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # (-fopenmp compiles the pragmas; the link names Paddle's OpenMP runtime, not libgomp)
        subprocess.run([*cmd, tmp, *link], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library(name: str, source: str, needs: tuple[str, ...], flags: tuple[str, ...]) -> ctypes.CDLL | str:
    """Library ``name`` built from ``kernels/<source>`` with ``flags`` on a CPU that has every
    flag of ``needs`` (as /proc/cpuinfo names them), or why there is none."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.machine()} CPU (the kernels are x86)"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return _loaded(name, source, flags)


@cache
def _loaded(name: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL | str:
    if not (_omp_dir() / "libiomp5.so").exists():
        return "this Paddle build has no libiomp5 (a GPU or ARM wheel)"
    try:
        path = _build(name, KERNELS / source, flags)
    except FileNotFoundError:
        return "no C++ compiler (g++) to build the kernels"
    except subprocess.CalledProcessError as e:
        return f"the kernels did not compile: {(e.stderr or '').strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the kernels could not be built: {e}"
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        return f"the kernels did not load: {e}"
