"""The model's CPU GEMMs over weights packed once, by Intel MKL's packed-GEMM API.

Paddle's eager ``matmul`` on a CPU is MKL's sgemm, which copies the weight into its kernel's
panel layout on every call. At the few rows of a decode step that copy is most of the work:
the weight is read, written and read again where the product needs it read once, so a step
that should be bound by streaming the weights from memory takes about twice as long.
``cblas_sgemm_pack`` makes that copy once, at load; ``cblas_sgemm_compute`` then streams the
packed weight. Whether that wins depends on the machine (on one CPU packed GEMMs took half
the time of eager ones at 8-32 rows, on another eager ones on two threads won), so the model
times both at load and keeps the faster (:func:`fastest_gemms`; bench/README.md, "packed
weights" and "two worker CPUs").

Paddle's CPU wheels ship MKL (``paddle/libs/libmklml_intel.so``) but no Python API for the
packed calls, so they are reached by ctypes, on float32 tensors' own memory (no copy in; the
output is a fresh tensor MKL writes). A build without the library (a GPU or ARM wheel) keeps
every GEMM eager: :func:`available`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import paddle

log = logging.getLogger("fd.engine")

# CBLAS's enums (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _B_MATRIX, _PACKED = 101, 111, 162, 151
#: The rows MKL is told to pack for. The packed layout serves any row count (a one-row decode
#: and a long prefill alike); the figure only guides MKL's choice of blocking.
_PACK_ROWS = 32


@lru_cache(maxsize=1)
def _mkl() -> ctypes.CDLL | None:
    path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libmklml_intel.so")
    try:
        lib = ctypes.CDLL(path)
        for name in (
            "cblas_sgemm_alloc",
            "cblas_sgemm_pack",
            "cblas_sgemm_compute",
            "cblas_sgemm_free",
            "MKL_Set_Num_Threads_Local",
        ):
            getattr(lib, name)  # (an older or trimmed MKL lacks them: eager GEMMs then)
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cblas_sgemm_alloc.restype = p
    lib.cblas_sgemm_alloc.argtypes = [i, i, i, i]
    lib.cblas_sgemm_pack.restype = None
    lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    lib.cblas_sgemm_compute.restype = None
    lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    lib.cblas_sgemm_free.restype = None
    lib.cblas_sgemm_free.argtypes = [p]
    lib.MKL_Set_Num_Threads_Local.restype = i
    lib.MKL_Set_Num_Threads_Local.argtypes = [i]
    return lib


def available() -> bool:
    """Whether this Paddle build ships MKL with its packed-GEMM calls (its x86 CPU wheels do)."""
    return _mkl() is not None


def use_threads(threads: int) -> None:
    """MKL's threads for this thread's GEMMs from now on, eager and packed: Paddle leaves MKL
    at one thread, where a decode step's GEMMs, bound by streaming the weights from memory,
    go up to ~1.8x faster on two cores that stream more than one does."""
    lib = _mkl()
    if lib is not None:
        lib.MKL_Set_Num_Threads_Local(max(1, threads))


#: GEMM weights (bytes, all of a step's) below which a plan is timed on one MKL thread only.
#: Weights that fit in a core's caches give a second thread nothing to stream, its gain at
#: load is within the timing's noise (a tiny model's plan came out one or two threads from one
#: start to the next), and between GEMMs its OpenMP thread spins on the core the engine's
#: process needs: the tiny test model's worker took 1.2 cores instead of 0.7 in ``fd serve``
#: at 32 streams (bench/README.md, "the worker's threads on a small model").
THREADS_MIN_BYTES = 64 << 20

#: The row counts a plan is timed at, and the rows each one's choice serves up to: a decode
#: step of one or a few sequences streams the weights (memory-bound), one of 32 or more and a
#: prefill compute (bound by the FMAs), and 8 rows sit between.
TIMED_ROWS = ((1, 3), (8, 15), (32, None))


@dataclass(frozen=True)
class GemmChoice:
    route: str  # "packed" or "eager"
    threads: int  # MKL's threads


@dataclass(frozen=True)
class GemmPlan:
    """Which GEMMs, on how many MKL threads, for a step of so many token rows: ``steps`` is
    ``(up to rows, choice)`` ascending, the last (None) serving any more."""

    steps: tuple[tuple[int | None, GemmChoice], ...]

    @classmethod
    def always(cls, route: str, threads: int) -> GemmPlan:
        return cls(((None, GemmChoice(route, threads)),))

    def choice(self, rows: int) -> GemmChoice:
        for up_to, c in self.steps:
            if up_to is None or rows <= up_to:
                return c
        return self.steps[-1][1]

    @property
    def routes(self) -> frozenset[str]:
        return frozenset(c.route for _, c in self.steps)

    @property
    def max_threads(self) -> int:
        return max(c.threads for _, c in self.steps)

    def __str__(self) -> str:
        parts, lo = [], 1
        for up_to, c in self.steps:
            rows = f"{lo}+" if up_to is None else (f"{lo}-{up_to}" if up_to > lo else f"{lo}")
            parts.append(f"{c.route} on {c.threads} thread(s) at {rows} rows")
            lo = (up_to or lo) + 1
        return ", ".join(parts)


def fastest_gemms(
    pairs: list[tuple[paddle.Tensor, PackedLinear]],
    routes: tuple[str, ...],
    threads: tuple[int, ...],
    rows: tuple[tuple[int, int | None], ...] = TIMED_ROWS,
    rounds: int = 3,
) -> GemmPlan:
    """The fastest (route, MKL threads) for a step's GEMMs (``pairs``: weights and their packed
    copies, as the model streams them) at each of ``rows``' row counts, of ``routes``
    (``eager``, ``packed``) on each of ``threads``: the faster of ``rounds`` passes each, after
    one to warm up. Which wins is the machine's, the model's and the rows': on AMD EPYC packing
    halved them at 8 rows on one thread; on an Intel Xeon whose one core streams 5 GB/s, with
    the weights packed for two threads (:class:`PackedLinear` packs for the threads set then),
    eager GEMMs on two threads were fastest at one row (0.75x packed ones) and packed ones at 8
    and 32 (0.5x and 0.6x eager ones); a model whose weights fit in the caches loses by a
    second thread (bench/README.md, "two worker CPUs" and "a GEMM plan by rows"). So it is
    measured where the model runs, on its own weights, whose size against the caches decides
    it. More threads than the fewest are chosen only where they are at least 10% faster."""
    steps = []
    for n, up_to in rows:
        route, th = _fastest_at(pairs, routes, threads, n, rounds)
        steps.append((up_to, GemmChoice(route, th)))
    return GemmPlan(tuple(steps))


def _fastest_at(pairs, routes, threads, rows: int, rounds: int) -> tuple[str, int]:
    import time

    xs = {}
    for w, _ in pairs:
        k = int(w.shape[0])
        if k not in xs:
            xs[k] = paddle.to_tensor(np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32))

    def eager() -> None:
        for w, _ in pairs:
            paddle.matmul(xs[int(w.shape[0])], w)

    def packed() -> None:
        for w, p in pairs:
            p(xs[int(w.shape[0])])

    # Each configuration timed in turn, round after round (noise from elsewhere then falls on
    # all of them alike), for at least ``rounds`` rounds and ~50 ms each: a small model's pass
    # takes ~0.2 ms, where one pass says little.
    configs = [(name, n) for n in threads for name in routes]
    runs = {"eager": eager, "packed": packed}
    best = dict.fromkeys(configs, float("inf"))
    spent = dict.fromkeys(configs, 0.0)
    for name, n in configs:  # (warm-up)
        use_threads(n)
        runs[name]()
    done = 0
    while done < rounds or (min(spent.values()) < 0.05 and done < 500):
        for c in configs:
            use_threads(c[1])
            t = time.perf_counter()
            runs[c[0]]()
            dt = time.perf_counter() - t
            best[c] = min(best[c], dt)
            spent[c] += dt
        done += 1
    # More threads must earn their place by 10%: beside the engine's process they cost more
    # than the GEMMs show (fd/engine/runner/affinity.py)
    one = min((k for k in best if k[1] == min(threads)), key=best.__getitem__)
    more = min(best, key=best.__getitem__)
    log.debug(
        "GEMMs at %d rows: %s",
        rows,
        ", ".join(f"{r} on {n}: {t * 1e3:.1f} ms" for (r, n), t in best.items()),
    )
    return more if best[more] < 0.9 * best[one] else one


def gemm_operands(
    x: paddle.Tensor, k: int, n: int, what: str, out: paddle.Tensor | None = None
) -> tuple[paddle.Tensor, int, paddle.Tensor]:
    """For a GEMM by pointer over a prepared [k, n] weight (this module's, and
    fd/engine/model/qgemm.py's): ``x`` checked to be float32 [rows, k] and made contiguous, its
    rows, and a float32 [rows, n] output (``out`` if given: the caller's, of that shape; else
    a fresh one). (The kernel reads rows x k floats at the
    pointer: a wrong shape or dtype would be out of bounds. The place is not checked: only a
    CPU model prepares its weights, and this runs 121 times a SmolLM2 step. ``is``: a dtype's
    == costs ~1.4 us, identity ~0.1.)"""
    shape = x.shape
    if x.dtype is not paddle.float32 or len(shape) != 2 or shape[1] != k:
        raise ValueError(f"a {what} {k}x{n} GEMM takes float32 [rows, {k}], got {x.dtype} {shape}")
    if not x.is_contiguous():
        x = x.contiguous()
    m = int(shape[0])
    return x, m, paddle.empty([m, n], dtype=paddle.float32) if out is None else out


class PackedLinear:
    """``x @ w`` for float32 ``x`` [rows, in] on the CPU and a fixed ``w`` [in, out], packed
    once, computed with as many MKL threads as :func:`use_threads` set for the calling thread.
    MKL lays the packed copy out for the threads set when it packs: a copy packed on one
    thread gains nothing from a second one below 64 rows."""

    def __init__(self, w: np.ndarray):
        lib = _mkl()
        if lib is None:
            raise RuntimeError("this Paddle build has no MKL packed GEMM")
        w = np.ascontiguousarray(w, dtype=np.float32)
        k, n = int(w.shape[0]), int(w.shape[1])
        self.shape = (k, n)
        self._lib = lib
        self._buf = lib.cblas_sgemm_alloc(_B_MATRIX, _PACK_ROWS, n, k)
        if not self._buf:
            raise MemoryError(f"MKL could not allocate a packed {k}x{n} weight")
        lib.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _NO_TRANS, _PACK_ROWS, n, k, 1.0, w.ctypes.data, n, self._buf
        )

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        k, n = self.shape
        x, m, out = gemm_operands(x, k, n, "packed")
        if m:
            self._lib.cblas_sgemm_compute(
                _ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), k, self._buf, n, 0.0, out.data_ptr(), n
            )
        return out

    def __del__(self) -> None:
        buf, self._buf = getattr(self, "_buf", None), None
        if buf:
            self._lib.cblas_sgemm_free(buf)
