"""int8 weights on a GPU: Paddle's own weight-only GEMMs (``paddle.nn.quant.weight_quantize`` and
``weight_only_linear``, the kernels FastDeploy serves quantized models with).

A weight is quantized once at load (per output channel, int8, in the layout of the GPU's
architecture), the activations stay in float16 for the product, and the result comes back in
float32 as the rest of fd's model computes. Untested on a GPU where this was written (the
machines have none), so :func:`unavailable` runs one small product on the device at load and
compares it with float32's: anything that fails or disagrees there keeps the model in float32,
with the reason in one line, rather than serving wrong tokens.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import paddle


def _arch() -> int:
    major, minor = paddle.device.cuda.get_device_capability()
    return major * 10 + minor


class WeightOnlyLinear:
    """``x @ w`` for float32 ``x`` [rows, k] on the GPU, ``w`` [k, n] held in int8 with a scale per
    output channel."""

    fmt = "int8"

    def __init__(self, w: np.ndarray, place: paddle.CUDAPlace):
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.arch = _arch()
        # (quantized on the CPU, whose kernel takes float16, then moved; [k, n] is what it takes)
        half = paddle.to_tensor(np.ascontiguousarray(w, dtype=np.float16), place=paddle.CPUPlace())
        q, scale = paddle.nn.quant.weight_quantize(half, algo="weight_only_int8", arch=self.arch)
        self.weight, self.scale = q.to(place), scale.to(place)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.nn.quant.weight_only_linear(
            x.astype("float16"), self.weight, weight_scale=self.scale, weight_dtype="int8", arch=self.arch
        )
        return y.astype("float32")


@cache
def unavailable(device: str) -> str | None:
    """Why int8 weight-only GEMMs cannot run on ``device`` (None: they can, and one product of
    them agreed with float32's to within int8's error)."""
    if device == "cpu":
        return "a CPU (fd's own kernels serve int8 there: fd/engine/model/qgemm.py)"
    if not paddle.is_compiled_with_cuda():
        return "this Paddle build has no CUDA"
    try:
        place = paddle.CUDAPlace(int(device.split(":")[1]) if ":" in device else 0)
        rng = np.random.default_rng(0)
        w = (rng.standard_normal((256, 128)) * 0.05).astype(np.float32)
        x = rng.standard_normal((8, 256)).astype(np.float32)
        got = WeightOnlyLinear(w, place)(paddle.to_tensor(x, place=place)).numpy()
    except Exception as e:  # (any failure of an untested path: keep float32, say why)
        return f"Paddle's weight-only GEMM failed: {type(e).__name__}: {str(e)[:200]}"
    want = x @ w
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not err < 0.02:
        return f"Paddle's weight-only GEMM disagreed with float32 by {err:.3g} on a test product"
    return None
