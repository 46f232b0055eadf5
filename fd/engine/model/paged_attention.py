"""Decode attention over the paged KV cache by MKL's batched GEMMs, without gathering it.

The general path (fd/engine/model/llama.py) gathers each sequence's context out of the cache
into one padded ``[kvh, S, L, hd]`` tensor per layer for K and one for V, then multiplies.
At 32 decode sequences of SmolLM2 that copy is ~4 MB twice a layer, 60 copies a step, as
long as the multiplies that read it. Here the multiplies read the cache where it lies:

- scores: one ``cblas_sgemm_batch`` call of ``S * kvh * blocks`` products, each a KV head's
  ``g`` queries of one sequence against one of its blocks (``g x hd`` by ``hd x block_size``),
  written into that block's columns of ``[kvh, S, g, L]``;
- the mask and softmax as in the general path;
- the output: one batched call per block column ``j``, ``S * kvh`` products of the
  probabilities' block ``j`` by that block's V, accumulated into ``[kvh, S, g, hd]``
  (beta 1 after the first: within a call every product writes its own output).

Many small products cost MKL ~1 µs apiece, so this wins only where the context is large
enough for the copy to matter: :func:`worth_it` (bench/README.md, "decode attention without
the gather", has the figures behind it). Every product involves one sequence alone, so a
sequence's scores do not depend on the batch; the choice of path does, which is why a
batch-invariant model keeps the general path.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import paddle
import paddle.nn.functional as F

from fd.engine.model import packed_gemm

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112

#: Below these, the gather and two large products beat many small ones (SmolLM2 at 1-2
#: sequences, the tiny test model at 8, on the CPUs this was measured on).
MIN_PRODUCTS = 12  # sequences x KV heads
MIN_CONTEXT_BYTES = 1 << 20  # K and V of the group's padded context, one layer


@lru_cache(maxsize=1)
def _batch() -> ctypes._CFuncPtr | None:
    lib = packed_gemm._mkl()
    fn = getattr(lib, "cblas_sgemm_batch", None) if lib is not None else None
    if fn is not None:
        p = ctypes.c_void_p
        fn.restype = None
        fn.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, p, p, p, p, p, p, ctypes.c_int, p]
    return fn


def available() -> bool:
    """Whether this Paddle build's MKL has ``cblas_sgemm_batch`` (its x86 CPU wheels do)."""
    return _batch() is not None


def worth_it(num_seqs: int, num_keys: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a decode group of this shape runs faster here than through the gather."""
    return (
        num_seqs * kv_heads >= MIN_PRODUCTS
        and num_seqs * num_keys * kv_heads * head_dim * 8 >= MIN_CONTEXT_BYTES
    )


def _ints(*v: int) -> ctypes.Array:
    return (ctypes.c_int * len(v))(*v)


class PagedDecode:
    """One step's decode attention for one group of single-token sequences: the pointer
    offsets into the cache, made once a step from the block tables and used in every layer
    (each layer's cache, queries and outputs add their own base address)."""

    def __init__(
        self, tables: np.ndarray, kv_heads: int, group: int, head_dim: int, block_size: int, blocks: int
    ):
        """``tables`` [S, nb]: each sequence's blocks (padding: any block, masked); ``blocks``:
        the cache's blocks a head (its second axis)."""
        s, nb = tables.shape
        self.fn = _batch()
        if self.fn is None:
            raise RuntimeError("this Paddle build's MKL has no cblas_sgemm_batch")
        self.shape = (kv_heads, s, group, nb * block_size, head_dim)
        kvh, g, L, hd, bs = kv_heads, group, nb * block_size, head_dim, block_size
        f = 4  # bytes a float32
        h, q, j = (a.ravel() for a in np.meshgrid(np.arange(kvh), np.arange(s), np.arange(nb), indexing="ij"))
        block = (h * blocks + tables[q, j]).astype(np.int64) * (bs * hd * f)  # [kvh, S, nb]
        # scores: (h, s, j) -> q[s, h*g : h*g+g], K block, scores[h, s, :, j*bs : j*bs+bs]
        self._q = ((q * kvh + h) * g * hd * f).astype(np.int64)
        self._k = block
        self._scores = (((h * s + q) * g * L + j * bs) * f).astype(np.int64)
        # output, by block column j: [nb, kvh*S] rows (h, s) of probabilities, V block, output
        by_j = lambda a: np.ascontiguousarray(a.reshape(kvh, s, nb).transpose(2, 0, 1).reshape(nb, kvh * s))  # noqa: E731
        self._p = by_j(self._scores)
        self._v = by_j(block)
        hs = np.arange(kvh * s)
        self._out = (hs * g * hd * f).astype(np.int64)
        self._n_scores = _ints(kvh * s * nb)
        self._n_out = _ints(kvh * s)
        self._args = dict(
            nt=_ints(_NO_TRANS), t=_ints(_TRANS), g=_ints(g), bs=_ints(bs), hd=_ints(hd), L=_ints(L)
        )
        self._one = (ctypes.c_float * 1)(1.0)
        self._zero = (ctypes.c_float * 1)(0.0)

    def __call__(
        self, q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, mask: paddle.Tensor
    ) -> paddle.Tensor:
        """q [S, nh, hd] (scaled), one layer's caches [kvh, blocks, block_size * hd], mask
        [kvh, S, 1, g, L] additive -> [S, nh * hd]."""
        kvh, s, g, L, hd = self.shape
        fn, a = self.fn, self._args
        if not q.is_contiguous():
            q = q.contiguous()
        scores = paddle.empty([kvh, s, g, L], dtype=paddle.float32)
        qa = self._q + q.data_ptr()
        ka = self._k + k_cache.data_ptr()
        sa = self._scores + scores.data_ptr()
        fn(
            _ROW_MAJOR,
            a["nt"],
            a["t"],
            a["g"],
            a["bs"],
            a["hd"],
            self._one,
            qa.ctypes.data,
            a["hd"],
            ka.ctypes.data,
            a["hd"],
            self._zero,
            sa.ctypes.data,
            a["L"],
            1,
            self._n_scores,
        )
        p = F.softmax(paddle.add(scores.reshape([kvh, s, 1, g, L]), mask), axis=-1)
        out = paddle.empty([kvh, s, g, hd], dtype=paddle.float32)
        pa = self._p + p.data_ptr()
        va = self._v + v_cache.data_ptr()
        oa = self._out + out.data_ptr()
        row = pa.shape[1] * 8  # bytes of one block column's pointers
        p0, v0, o0 = pa.ctypes.data, va.ctypes.data, oa.ctypes.data
        for j in range(pa.shape[0]):
            fn(
                _ROW_MAJOR,
                a["nt"],
                a["nt"],
                a["g"],
                a["hd"],
                a["bs"],
                self._one,
                p0 + j * row,
                a["L"],
                v0 + j * row,
                a["hd"],
                self._one if j else self._zero,
                o0,
                a["hd"],
                1,
                self._n_out,
            )
        return out.transpose([1, 0, 2, 3]).reshape([s, kvh * g * hd])
