"""The model's large CPU GEMMs through oneDNN: one Paddle Inference predictor per weight.

Paddle's eager ``matmul`` on CPU is Intel MKL's sgemm, which on AMD CPUs runs its AVX2 path at
best (engine/__init__.py); Paddle Inference's oneDNN kernels (``brg_matmul:avx512_core``) run
the same shapes 1.5-2.5x faster once there are a few rows (bench/README.md, "the real model").
A predictor call costs ~40 µs more than an eager matmul, so it only pays for GEMMs with enough
work: :data:`MIN_MACS` and :data:`MIN_ROWS`, measured on SmolLM2-135M's shapes. Weights can
be held in bfloat16 (``avx512_core_bf16``, activations float32 in and out); the model does not
use that: it won only at 32+ rows, by less than its error costs (bench/README.md).

The predictor is a CPU build's tool: the model keeps its eager weights for the rest (GPUs,
small GEMMs, batch-invariant mode, whose row padding is tuned to MKL's tiles).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import paddle
from paddle.utils.dlpack import from_dlpack

#: GEMMs with fewer multiply-adds (rows x in x out) stay eager: below this the predictor's
#: per-call cost outweighs what oneDNN saves (at 8 rows SmolLM2's o_proj, 2.7M, lost; its
#: q|k|v, 4.4M, and down_proj, 7.1M, broke even; gate|up, 14M, took 0.25 against 0.58 ms).
MIN_MACS = 8 << 20
#: ... and so do GEMMs of fewer rows: one row is a matrix-vector product, bound by reading the
#: weight, where MKL is as fast (the 576x49152 head: 4.8 ms eager, 6.4 through oneDNN).
MIN_ROWS = 8


def available() -> bool:
    """Whether this Paddle build runs oneDNN kernels (its CPU wheels do)."""
    return paddle.is_compiled_with_mkldnn() if hasattr(paddle, "is_compiled_with_mkldnn") else \
        paddle.base.core.is_compiled_with_mkldnn()


class OneDnnLinear:
    """``x @ w`` for float32 ``x`` [rows, in] and a fixed ``w`` [in, out], by a predictor that
    holds ``w`` (in bfloat16 under a bf16 :class:`OneDnnGemms`)."""

    def __init__(self, predictor, shape: tuple[int, int]):
        self.shape = shape
        self._predictor = predictor
        self._in = predictor.get_input_handle(predictor.get_input_names()[0])
        self._out = predictor.get_output_handle(predictor.get_output_names()[0])

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        self._in.share_external_data(x)  # (the eager tensor itself: no copy in)
        self._predictor.run()
        # (the copied-out array itself, by DLPack: to_tensor would copy it again, 0.3 ms for
        # 32 rows of a 49152-word head)
        return from_dlpack(self._out.copy_to_cpu())

    def worth(self, rows: int) -> bool:
        """Whether ``rows`` rows are faster here than by an eager matmul."""
        return rows >= MIN_ROWS and rows * self.shape[0] * self.shape[1] >= MIN_MACS


class OneDnnGemms:
    """Makes :class:`OneDnnLinear` s. A static program is saved once per weight shape (~0.6 s
    each: the static executor's start); each weight then gets that program and a parameter file
    of its own, which is the program's file with the weight's bytes in place of the saved ones
    (a single-tensor ``.pdiparams`` is a fixed header, then the raw data)."""

    def __init__(self, *, bf16: bool = False, threads: int = 1):
        self.bf16 = bf16
        self.threads = threads
        self._dir = tempfile.TemporaryDirectory(prefix="fd-onednn-")
        self._programs: dict[tuple[int, int], tuple[str, bytes]] = {}  # shape -> (program, header)

    def linear(self, w: np.ndarray) -> OneDnnLinear:
        w = np.ascontiguousarray(w, dtype=np.float32)
        shape = (int(w.shape[0]), int(w.shape[1]))
        program, header = self._program(shape)
        params = os.path.join(self._dir.name, "weight.pdiparams")
        with open(params, "wb") as f:
            f.write(header)
            f.write(w.data)
        cfg = paddle.inference.Config(program, params)
        cfg.disable_gpu()
        cfg.set_cpu_math_library_num_threads(self.threads)
        cfg.enable_mkldnn()
        if self.bf16:
            cfg.enable_mkldnn_bfloat16()
        cfg.disable_glog_info()
        predictor = paddle.inference.create_predictor(cfg)  # (has read both files now)
        os.remove(params)
        return OneDnnLinear(predictor, shape)

    def close(self) -> None:
        self._dir.cleanup()

    def _program(self, shape: tuple[int, int]) -> tuple[str, bytes]:
        if shape not in self._programs:
            path = os.path.join(self._dir.name, f"linear_{shape[0]}x{shape[1]}")
            _save_program(shape, path)
            with open(path + ".pdiparams", "rb") as f:
                header = f.read()[:-shape[0] * shape[1] * 4]
            os.remove(path + ".pdiparams")
            program = next(os.path.join(self._dir.name, n) for n in os.listdir(self._dir.name)
                           if n.startswith(os.path.basename(path) + "."))
            self._programs[shape] = (program, header)
        return self._programs[shape]


def _save_program(shape: tuple[int, int], path: str) -> None:
    k, n = shape
    was_static = not paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        main, start = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, start):
            x = paddle.static.data("x", [-1, k], "float32")
            weight = paddle.create_parameter([k, n], "float32", name="w",
                                             default_initializer=paddle.nn.initializer.Constant(0.0))
            y = paddle.matmul(x, weight)
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(start)
        paddle.static.save_inference_model(path, [x], [y], exe, program=main)
    finally:
        if not was_static:
            paddle.disable_static()
