"""Weights in fewer bytes on a CPU: the GEMM kernels of fd/engine/model/kernels/qgemm.cc.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over the
memory bandwidth (bench/README.md, "Issue 47's first probe"). Three formats read fewer bytes
than float32 and compute from them directly:

- ``int8``: blocks of 32 weights along the input dimension, each with an fp16 scale (GGUF's
  Q8_0), the activations quantized the same way at each call (as llama.cpp does) and the
  products summed in int32 by AVX512-VNNI. 1.125 bytes a weight.
- ``int4``: a GGUF's own 4-bit blocks (Q4_0, Q4_1): ``d * q + m``
  per block of 32, q in 0..15, d and m fp16, packed only where the weight is exactly that
  (:class:`NotExact` otherwise: the model then holds it in int8); activations as for int8.
  0.625 bytes a weight, the file's own.
- ``bfloat16``: the weights in bfloat16, the products in float32 by AVX512-BF16. 2 bytes.

The kernels are compiled with the system's C++ compiler on first use (fd/engine/model/native.py),
one library per format and ISA with that ISA's flags (the integer formats on AVX512-VNNI, else
on AVX2: :func:`isa`), and cached (``$FD_KERNEL_CACHE``, else ``~/.cache/fd/kernels``); they link
Paddle's own OpenMP runtime, so the process keeps one pool of threads. They are reached by ctypes
on tensors' own memory, like MKL's packed GEMMs (fd/engine/model/packed_gemm.py). A CPU
without the format's instructions, a machine without a compiler, or a failed build gets
:func:`unavailable`'s reason and keeps float32 (the model logs it in one line).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import paddle

from fd.engine.model import native
from fd.engine.model.packed_gemm import gemm_operands

log = logging.getLogger("fd.engine")

_VNNI = (
    ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma"),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"),
)
#: the integer formats' second build, for x86 CPUs without AVX512-VNNI (the same packed layouts)
_AVX2 = (("avx2", "fma", "f16c"), ("-DFD_AVX2", "-mavx2", "-mfma", "-mf16c"))
_BF16 = (
    ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "f16c", "fma"),
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mf16c", "-mfma"),
)
#: per format: the kernels' prefix in the library, and its builds by ISA, the first a CPU has
#: the flags of (as /proc/cpuinfo names them) taken: (CPU flags it needs, compiler flags)
FORMATS: dict[str, tuple[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]]] = {
    "int8": ("q8", {"avx512_vnni": _VNNI, "avx2": _AVX2}),
    "int4": ("q4", {"avx512_vnni": _VNNI, "avx2": _AVX2}),
    "bfloat16": ("bf16", {"avx512_bf16": _BF16}),
}
#: the kernels' shape constraints: the input dimension in whole blocks, the output in whole tiles
K_MULTIPLE = {"int8": 32, "int4": 32, "bfloat16": 2}
#: int4 packs a weight only where its blocks are 4-bit already: no value further than this share
#: of its block's step from the grid (float rounding of a dequantized GGUF is ~1e-6)
INT4_EXACT = 1e-3


class NotExact(ValueError):
    """A weight that is not 4-bit blocks (its values are not on a 16-step grid per block of 32)."""


N_MULTIPLE = 16


def isa(fmt: str) -> str | None:
    """The build of ``fmt``'s kernels this CPU runs (None: none of them)."""
    have = native.cpu_flags()
    return next((name for name, (needs, _) in FORMATS[fmt][1].items() if set(needs) <= have), None)


@cache
def _library(fmt: str, build: str | None = None) -> ctypes.CDLL | str:
    """The loaded library of ``fmt`` (in ``build``, else the first this CPU runs), or why there
    is none."""
    prefix, builds = FORMATS[fmt]
    build = build or isa(fmt) or next(iter(builds))
    needs, flags = builds[build]
    lib = native.library(f"qgemm-{fmt}-{build}", "qgemm.cc", needs, flags)
    if isinstance(lib, str):
        return lib
    i, p, i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    getattr(lib, f"{prefix}_packed_bytes").restype = i64
    getattr(lib, f"{prefix}_packed_bytes").argtypes = [i, i]
    getattr(lib, f"{prefix}_pack").restype = ctypes.c_float if fmt == "int4" else None
    getattr(lib, f"{prefix}_pack").argtypes = [p, i, i, p, i]
    for fn in ("gemm", "gemm_swiglu"):
        getattr(lib, f"{prefix}_{fn}").restype = None
        getattr(lib, f"{prefix}_{fn}").argtypes = [p, i, i, p, i, p, i]
    getattr(lib, f"{prefix}_gemm_norm").restype = None
    getattr(lib, f"{prefix}_gemm_norm").argtypes = [p, p, p, ctypes.c_float, i, i, p, i, p, p, i]
    return lib


def unavailable(fmt: str) -> str | None:
    """Why ``fmt``'s kernels cannot run here (None: they can). Builds them the first time."""
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}"
    got = _library(fmt)
    return got if isinstance(got, str) else None


def runnable(fmt: str, on_cpu: bool) -> str:
    """``fmt`` if its kernels run here, else float32 (and one line saying why)."""
    if fmt == "float32":
        return fmt
    why = "not on a CPU" if not on_cpu else unavailable(fmt)
    if why is None:
        return fmt
    log.warning("weights in float32, not %s: its kernels cannot run here (%s)", fmt, why)
    return "float32"


def fits(fmt: str, k: int, n: int) -> bool:
    """Whether a [k, n] weight has the shape the kernels take."""
    return k % K_MULTIPLE[fmt] == 0 and n % N_MULTIPLE == 0


#: rows up to which a layer writes its output into the tensor of its last call, where that had
#: as many rows (a decode step's sizes; allocating a tensor costs ~8 µs, and a step calls 150)
REUSE_ROWS = 64


class QuantLinear:
    """``x @ w`` for float32 ``x`` [rows, k] on the CPU, ``w`` [k, n] held in ``fmt`` (packed
    once; the float32 array is not kept), computed on ``threads`` threads.

    With ``reuse`` an output of up to :data:`REUSE_ROWS` rows is good until the layer's next
    call: the model consumes each within its layer of a step (the head, whose logits outlive
    it, does not reuse)."""

    def __init__(
        self, w: np.ndarray, fmt: str, threads: int = 1, build: str | None = None, reuse: bool = False
    ):
        lib = _library(fmt, build)
        if isinstance(lib, str):
            raise RuntimeError(f"{fmt} kernels unavailable: {lib}")
        k, n = int(w.shape[0]), int(w.shape[1])
        if not fits(fmt, k, n):
            raise ValueError(f"a {k}x{n} weight does not fit the {fmt} kernels")
        prefix = FORMATS[fmt][0]
        self.fmt = fmt
        self.shape = (k, n)
        self.threads = max(1, threads)
        self.nbytes = int(getattr(lib, f"{prefix}_packed_bytes")(k, n))
        self._buf = np.empty(self.nbytes, dtype=np.uint8)
        w = np.ascontiguousarray(w, dtype=np.float32)
        err = getattr(lib, f"{prefix}_pack")(w.ctypes.data, k, n, self._buf.ctypes.data, self.threads)
        if fmt == "int4" and not err <= INT4_EXACT:
            raise NotExact(f"a {k}x{n} weight is not 4-bit blocks (off the grid by {err:.3g} of a step)")
        self._ptr = self._buf.ctypes.data
        self._gemm = getattr(lib, f"{prefix}_gemm")
        self._gemm_swiglu = getattr(lib, f"{prefix}_gemm_swiglu")
        self._gemm_norm = getattr(lib, f"{prefix}_gemm_norm")
        self.reuse = reuse
        # with reuse: the last output, and normed's last residual sum (one each: a step's batch
        # size holds for many steps, and one per size would keep 64 of each a layer)
        self._last: paddle.Tensor | None = None
        self._last_sum: paddle.Tensor | None = None

    @staticmethod
    def _same(t: paddle.Tensor | None, rows: int) -> paddle.Tensor | None:
        return t if t is not None and int(t.shape[0]) == rows else None

    def _out(self, x: paddle.Tensor, k: int) -> tuple[paddle.Tensor, int, paddle.Tensor]:
        rows = int(x.shape[0]) if len(x.shape) == 2 else 0
        x, m, out = gemm_operands(
            x, k, self.shape[1], self.fmt, self._same(self._last, rows) if self.reuse else None
        )
        if self.reuse and m <= REUSE_ROWS:
            self._last = out
        return x, m, out

    # The kernels' calls by address, argument order as qgemm.cc takes them (the methods below,
    # and fd/engine/model/kernel_layers.py's calls laid out once per step size).

    def gemm_call(self, x: int, m: int, out: int) -> tuple[Callable[..., None], tuple[Any, ...]]:
        k, n = self.shape
        return self._gemm, (x, m, k, self._ptr, n, out, self.threads)

    def swiglu_call(self, x: int, m: int, out: int) -> tuple[Callable[..., None], tuple[Any, ...]]:
        k, n = self.shape
        return self._gemm_swiglu, (x, m, k, self._ptr, n, out, self.threads)

    def normed_call(
        self, x: int, residual: int | None, w: int, eps: float, m: int, out: int, sums: int
    ) -> tuple[Callable[..., None], tuple[Any, ...]]:
        k, n = self.shape
        return self._gemm_norm, (x, residual, w, eps, m, k, self._ptr, n, out, sums, self.threads)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        x, m, out = self._out(x, self.shape[0])
        if m:
            fn, args = self.gemm_call(x.data_ptr(), m, out.data_ptr())
            fn(*args)
        return out

    def swiglu(self, x: paddle.Tensor) -> paddle.Tensor:
        """``(silu(gate) * up) @ w`` of ``x`` = [gate | up], [rows, 2k]: an MLP's down projection
        taking the gate|up projection's output as it lies (no activation op between them)."""
        k, n = self.shape
        if k % 16:
            raise ValueError(f"SwiGLU by the kernels takes an input of a multiple of 16, not {k}")
        x, m, out = self._out(x, 2 * k)
        if m:
            fn, args = self.swiglu_call(x.data_ptr(), m, out.data_ptr())
            fn(*args)
        return out

    def normed(
        self, x: paddle.Tensor, residual: paddle.Tensor | None, w: paddle.Tensor, eps: float
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``(rms_norm(x + residual) * w @ self, x + residual)``: a layer's or an MLP's first GEMM
        taking its RMSNorm (and the residual add before it) on the way in, as
        fd/engine/model/llama.py's ``fused_rms_norm`` and this GEMM compute them apart."""
        k, n = self.shape
        x, m, out = self._out(x, k)
        if residual is not None and (list(residual.shape) != [m, k] or residual.dtype is not paddle.float32):
            raise ValueError(f"a residual [{m}, {k}] float32, not {residual.dtype} {residual.shape}")
        if list(w.shape) != [k] or w.dtype is not paddle.float32:
            raise ValueError(f"norm weights [{k}] float32, not {w.dtype} {w.shape}")
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        sums = self._same(self._last_sum, m) if self.reuse else None
        if sums is None:
            sums = paddle.empty([m, k], dtype=paddle.float32)
            if self.reuse and m <= REUSE_ROWS:
                self._last_sum = sums
        if m:
            fn, args = self.normed_call(
                x.data_ptr(),
                None if residual is None else residual.data_ptr(),
                w.data_ptr(),
                eps,
                m,
                out.data_ptr(),
                sums.data_ptr(),
            )
            fn(*args)
        return out, sums
