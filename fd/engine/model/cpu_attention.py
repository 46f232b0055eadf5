"""A layer's attention around the paged KV cache in two C++ calls on a CPU
(fd/engine/model/kernels/attention.cc), instead of the ~15 Paddle ops of the general path.

- :func:`rope_store`: RoPE on every row's q and k, its k and v into the cache at its slot, the
  rotated q into a buffer the step reuses in every layer.
- :func:`attend`: each query's attention over its own sequence's keys, read in place from its
  blocks: a decode's one query, or each token of a prefill chunk up to :data:`MAX_CHUNK` tokens
  (a longer chunk's stays with the general path, gathers and two GEMMs, reading the rotated q
  and the cache this wrote).

Every query is computed alone, in an order fixed by its own context, so its output does not
depend on the batch around it.

Built with AVX2 and FMA flags (fd/engine/model/native.py); elsewhere (or with a head size
not a multiple of 8) the model keeps the general path, which computes the same
(tests/unit/test_cpu_attention.py).
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

log = logging.getLogger("fd.engine")

#: prefill chunks up to this many tokens a sequence run as that many single queries, each over
#: its own prefix (a longer chunk's GEMMs read each key once for all its queries: the model's
#: general path)
MAX_CHUNK = 128

NEEDS = ("avx2", "fma")
FLAGS = ("-mavx2", "-mfma")


@cache
def _library() -> ctypes.CDLL | str:
    lib = native.library("attention", "attention.cc", NEEDS, FLAGS)
    if isinstance(lib, str):
        return lib
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.attn_rope_store.restype = None
    lib.attn_rope_store.argtypes = [p, i64, i64, i, i, i, p, p, p, p, p, i64, p, i]
    lib.attn_decode.restype = None
    lib.attn_decode.argtypes = [p, p, i64, i, i, i, p, p, i64, i, p, i64, p, i64, p, i]
    return lib


def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can). Builds them the first time."""
    got = _library()
    return got if isinstance(got, str) else None


def runs(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels run here for this shape (else one line saying why)."""
    why = (
        f"{heads} heads over {kv_heads} KV heads of {head_dim}"
        if heads % kv_heads or head_dim % 8
        else unavailable()
    )
    if why is not None:
        log.warning("attention by Paddle ops, not fd's kernels: %s", why)
    return why is None


def _ptr(t: paddle.Tensor, dtype) -> int:
    """The address of a contiguous CPU tensor of ``dtype`` (the kernels read it whole)."""
    if t.dtype is not dtype or not t.is_contiguous():
        raise ValueError(f"the attention kernels take contiguous {dtype}, got {t.dtype}")
    return t.data_ptr()


class LayerShape:
    """The model's attention shapes and the cache's geometry, as the kernels take them."""

    def __init__(
        self, heads: int, kv_heads: int, head_dim: int, block_size: int, num_slots: int, threads: int
    ):
        if heads % kv_heads or head_dim % 8:
            raise ValueError(f"{heads} heads over {kv_heads} KV heads of {head_dim}: not the kernels' shape")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.block_size, self.num_slots, self.threads = block_size, num_slots, threads
        lib = _library()
        if isinstance(lib, str):
            raise RuntimeError(f"attention kernels unavailable: {lib}")
        self._lib = lib

    # The kernels' calls by address, argument order as attention.cc takes them (the functions
    # below, and fd/engine/model/kernel_layers.py's calls laid out once per step size).

    def rope_store_call(
        self,
        qkv: int,
        rows: int,
        rope: int,
        positions: int,
        slots: int,
        k_cache: int,
        v_cache: int,
        q_out: int,
    ) -> tuple[Callable[..., None], tuple[Any, ...]]:
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        return self._lib.attn_rope_store, (
            (qkv, rows, width, self.heads, self.kv_heads, self.head_dim, rope, positions, slots)
            + (k_cache, v_cache, self.num_slots, q_out, self.threads)
        )

    def attend_call(
        self,
        q: int,
        q_rows: int,
        n: int,
        k_cache: int,
        v_cache: int,
        tables: int,
        table_width: int,
        lens: int,
        window: int,
        out: int,
    ) -> tuple[Callable[..., None], tuple[Any, ...]]:
        return self._lib.attn_decode, (
            (q, q_rows, n, self.heads, self.kv_heads, self.head_dim, k_cache, v_cache, self.num_slots)
            + (self.block_size, tables, table_width, lens, window, out, self.threads)
        )


def rope_store(
    shape: LayerShape,
    qkv: paddle.Tensor,
    positions: paddle.Tensor,
    slots: paddle.Tensor,
    rope: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    q_out: paddle.Tensor,
) -> None:
    """``qkv`` [rows, (heads + 2 kv_heads) * head_dim]: its k and v rotated/stored into the caches
    at ``slots`` [rows], its q rotated into ``q_out`` [rows, heads * head_dim]; ``rope`` [P, 2,
    head_dim] the model's table (cos, signed sin) by position."""
    s = shape
    rows = int(qkv.shape[0])
    width = (s.heads + 2 * s.kv_heads) * s.head_dim
    if list(qkv.shape) != [rows, width] or list(q_out.shape) != [rows, s.heads * s.head_dim]:
        raise ValueError(f"q|k|v {qkv.shape}, q out {q_out.shape}: not this model's")
    if int(positions.shape[0]) != rows or int(slots.shape[0]) != rows:
        raise ValueError("one position and one slot a row")
    fn, args = s.rope_store_call(
        _ptr(qkv, paddle.float32),
        rows,
        _ptr(rope, paddle.float32),
        _ptr(positions, paddle.int64),
        _ptr(slots, paddle.int64),
        _ptr(k_cache, paddle.float32),
        _ptr(v_cache, paddle.float32),
        _ptr(q_out, paddle.float32),
    )
    fn(*args)


def attend(
    shape: LayerShape,
    q: paddle.Tensor,
    rows: np.ndarray,
    tables: np.ndarray,
    lens: np.ndarray,
    window: int | None,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    out: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """[Q, heads * head_dim] (into ``out`` if given, of that shape): query ``i`` (row ``rows[i]`` of ``q``) against the first ``lens[i]``
    keys of its sequence (the last ``window`` of them, with a sliding window), whose blocks are
    ``tables[i]``: a decode's one query, or each of a prefill chunk's over its own prefix. The
    host arrays are int64; the caller's bounds (the rows of q, the blocks of the cache) are the
    model's own (fd/engine/runner/batch.py)."""
    s = shape
    n = len(rows)
    if tables.dtype != np.int64 or rows.dtype != np.int64 or lens.dtype != np.int64 or tables.shape[0] != n:
        raise ValueError("rows, tables and lens: int64, one a sequence")
    tables = np.ascontiguousarray(tables)
    if out is None:
        out = paddle.empty([n, s.heads * s.head_dim], dtype=paddle.float32)
    elif list(out.shape) != [n, s.heads * s.head_dim]:
        raise ValueError(f"attention out {out.shape}: not [{n}, {s.heads * s.head_dim}]")
    fn, args = s.attend_call(
        _ptr(q, paddle.float32),
        rows.ctypes.data,
        n,
        _ptr(k_cache, paddle.float32),
        _ptr(v_cache, paddle.float32),
        tables.ctypes.data,
        int(tables.shape[1]),
        lens.ctypes.data,
        window or 0,
        _ptr(out, paddle.float32),
    )
    fn(*args)
    return out


class StepAttention:
    """One step's attention by the kernels, layer after layer: the rotated q and each in-place
    group's output are allocated once a step and written again by every layer (each is consumed
    within its layer). ``groups``: per attention group of the step, its queries' host rows,
    tables and lengths where the kernels attend for it, None where the model's general path
    does (a chunk past :data:`MAX_CHUNK`)."""

    def __init__(
        self,
        shape: LayerShape,
        positions: paddle.Tensor,
        slots: paddle.Tensor,
        rope: paddle.Tensor,
        groups: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None],
        window: int | None,
    ):
        self.shape, self.positions, self.slots, self.rope, self.window = shape, positions, slots, rope, window
        self.groups = groups
        width = shape.heads * shape.head_dim
        self.q_rot = paddle.empty([int(positions.shape[0]), width], dtype=paddle.float32)
        self._outs = [
            None if g is None else paddle.empty([len(g[0]), width], dtype=paddle.float32) for g in groups
        ]

    def layer(
        self, qkv: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor
    ) -> list[paddle.Tensor | None]:
        """RoPE and this layer's KV writes for every row, then each in-place group's output
        (None for the others, which read :attr:`q_rot` and the cache this wrote)."""
        rope_store(self.shape, qkv, self.positions, self.slots, self.rope, k_cache, v_cache, self.q_rot)
        return [
            None if g is None else attend(self.shape, self.q_rot, *g, self.window, k_cache, v_cache, out)
            for g, out in zip(self.groups, self._outs, strict=True)
        ]
