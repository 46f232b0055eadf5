"""A step's decoder layers as the kernels' calls alone, for a model whose every layer the kernels
compute: per layer the q|k|v GEMM with its RMSNorm and residual add, RoPE and the KV writes,
attention, the o GEMM, the gate|up GEMM with its norm and add, the down GEMM with SwiGLU
(fd/engine/model/qgemm.py, fd/engine/model/cpu_attention.py). Six foreign calls a layer and no
Python between them: each call's arguments are laid out once for a step's size, over buffers
that size owns, and a step copies in only its own inputs (positions, slots, each query's blocks
and length). At one row a layer's Python around its calls (shape checks, outputs, pointers)
cost as much as half its bytes take to stream; bench/README.md has the step before and after.

The same kernels in the same order as the general path's (fd/engine/model/llama.py's
``_layers``), so the same bits. A step it does not take (LoRA rows, a chunk past
:data:`~fd.engine.model.cpu_attention.MAX_CHUNK`, more than one attention group, more than
:data:`MAX_ROWS` rows) goes that way instead.

An abort that lands while the step runs (fd/engine/runner/step_cut.py) is asked before each
layer's KV writes, as there: its new slot mapping is copied over the step's, whose address the
calls hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import paddle

from fd.engine.model import cpu_attention
from fd.engine.model.qgemm import REUSE_ROWS, QuantLinear

#: the most rows a step laid out here has (a decode step's sizes: a layer's buffers a row are
#: ~30 KB for the default model)
MAX_ROWS = REUSE_ROWS
#: step sizes whose layouts are kept (a batch's size holds for many steps and changes by few)
KEPT_SIZES = 8

_Call = tuple[Callable[..., None], tuple[Any, ...]]


def takes(layers: list[dict]) -> bool:
    """Every layer is the kernels' alone: its four projections quantized, no biases, a dense MLP
    whose down projection takes SwiGLU in (a multiple of 16 inputs)."""
    names = ("qkv_q", "o_q", "gate_up_q", "down_q")
    return bool(layers) and all(
        all(isinstance(layer.get(n), QuantLinear) for n in names)
        and layer.get("qkv_b") is None
        and layer.get("o_b") is None
        and "moe" not in layer
        and layer["down_q"].shape[0] % 16 == 0
        for layer in layers
    )


class _Layout:
    """One step size's buffers, host inputs and calls."""

    def __init__(self, owner: KernelLayers, rows: int, table_width: int):
        self.rows, self.table_width = rows, table_width
        s, first = owner.shape, owner.layers[0]
        hidden, width = first["qkv_q"].shape
        heads = s.heads * s.head_dim
        inter = first["gate_up_q"].shape[1]  # gate | up: the down projection takes half

        def buf(n: int) -> paddle.Tensor:
            return paddle.empty([rows, n], dtype=paddle.float32)

        self.qkv, self.q_rot, self.attn, self.o = buf(width), buf(heads), buf(heads), buf(hidden)
        self.gate_up, self.down = buf(inter), buf(hidden)
        # the residual sums, alternating: a normed GEMM reads one and writes the other
        self.sums = (buf(hidden), buf(hidden))
        self.positions = np.zeros(rows, dtype=np.int64)
        self.slots = np.zeros(rows, dtype=np.int64)
        self.q_rows = np.zeros(rows, dtype=np.int64)
        self.lens = np.ones(rows, dtype=np.int64)
        self.tables = np.zeros((rows, table_width), dtype=np.int64)
        eps = owner.eps
        p = lambda t: t.data_ptr()  # noqa: E731
        a, b = (p(t) for t in self.sums)
        positions, slots, q_rows = self.positions.ctypes.data, self.slots.ctypes.data, self.q_rows.ctypes.data
        tables, lens = self.tables.ctypes.data, self.lens.ctypes.data
        self.layers: list[list[_Call]] = []
        for i, layer in enumerate(owner.layers):
            qkv, o, gate_up, down = (layer[n] for n in ("qkv_q", "o_q", "gate_up_q", "down_q"))
            k_cache, v_cache = p(owner.k_blocks[i]), p(owner.v_blocks[i])
            calls: list[_Call] = [
                # (layer 0's input and residual are the step's embeddings: :meth:`run` fills them)
                qkv.normed_call(p(self.down), b, p(layer["in_norm"]), eps, rows, p(self.qkv), a),
                s.rope_store_call(
                    p(self.qkv), rows, p(owner.rope), positions, slots, k_cache, v_cache, p(self.q_rot)
                ),
                s.attend_call(
                    p(self.q_rot),
                    q_rows,
                    rows,
                    k_cache,
                    v_cache,
                    tables,
                    table_width,
                    lens,
                    owner.window,
                    p(self.attn),
                ),
                o.gemm_call(p(self.attn), rows, p(self.o)),
                gate_up.normed_call(p(self.o), a, p(layer["post_norm"]), eps, rows, p(self.gate_up), b),
                down.swiglu_call(p(self.gate_up), rows, p(self.down)),
            ]
            self.layers.append(calls)

    def first_call(self, embedded: paddle.Tensor) -> _Call:
        """Layer 0's q|k|v GEMM over the step's embeddings, no residual before them."""
        fn, args = self.layers[0][0]
        return fn, (embedded.data_ptr(), None, *args[2:])


class KernelLayers:
    """The model's decoder layers as the kernels' calls (see the module doc), laid out by step
    size as steps come (:data:`KEPT_SIZES` sizes kept)."""

    def __init__(
        self,
        layers: list[dict],
        shape: cpu_attention.LayerShape,
        rope: paddle.Tensor,
        k_blocks: list[paddle.Tensor],
        v_blocks: list[paddle.Tensor],
        eps: float,
        window: int | None,
    ):
        if not takes(layers):
            raise ValueError("a layer the kernels do not compute alone")
        self.layers, self.shape, self.rope = layers, shape, rope
        self.k_blocks, self.v_blocks = k_blocks, v_blocks
        self.eps, self.window = eps, window or 0
        self._layouts: OrderedDict[int, _Layout] = OrderedDict()

    def _layout(self, rows: int, table_width: int) -> _Layout:
        got = self._layouts.get(rows)
        if got is None or got.table_width < table_width:
            # (a wider table than before: room to grow, so a long decode lays out a few times)
            width = max(table_width, 2 * got.table_width if got is not None else table_width)
            got = self._layouts[rows] = _Layout(self, rows, width)
            while len(self._layouts) > KEPT_SIZES:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(rows)
        return got

    def run(
        self,
        embedded: paddle.Tensor,
        positions: paddle.Tensor,
        slots: paddle.Tensor,
        q_rows: np.ndarray,
        tables: np.ndarray,
        lens: np.ndarray,
        new_slots: Callable[[], paddle.Tensor | None] | None,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The last layer's output and residual sum [rows, hidden] (good until the next step
        of as many rows) of a step's ``embedded`` rows, one query a row (``q_rows``: each
        query's row, ``tables`` its sequence's blocks, ``lens`` its context)."""
        rows = int(embedded.shape[0])
        lay = self._layout(rows, int(tables.shape[1]))
        lay.positions[:] = positions.numpy()
        lay.slots[:] = slots.numpy()
        lay.q_rows[:] = q_rows
        lay.lens[:] = lens
        lay.tables[:, : tables.shape[1]] = tables
        for i, calls in enumerate(lay.layers):
            if new_slots is not None and (cut := new_slots()) is not None:
                lay.slots[:] = cut.numpy()
            if i == 0:
                calls = [lay.first_call(embedded), *calls[1:]]
            for fn, args in calls:
                fn(*args)
        return lay.down, lay.sums[1]
