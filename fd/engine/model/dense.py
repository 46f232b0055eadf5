"""How the model holds its dense layers' weights (the projections, the MLP's, the head): one copy
of each, in the format it is computed in. On a CPU, float32 tensors or fd's kernels' formats
(fd/engine/model/qgemm.py); on a GPU, float32 or int8 by Paddle's weight-only GEMMs
(fd/engine/model/weight_only.py); float32 ones packed for MKL where that is faster
(:func:`pack_weights`). A weight goes into ``layer[name]`` as a tensor, or with
``layer[name]`` None into ``layer[name + "_q"]`` (the kernels) or ``layer[name + "_wo"]``
(Paddle's weight-only), which the model's GEMMs look up in that order."""

from __future__ import annotations

import logging
import os

import numpy as np
import paddle

from fd.engine.model import packed_gemm, qgemm, weight_only
from fd.engine.model.formats import WEIGHT_FORMATS

log = logging.getLogger("fd.engine")


def _names(what: list[str]) -> str:
    """A list of weights, said in one line (layer by layer it would be 30 names)."""
    return ", ".join(what) if len(what) <= 4 else f"{', '.join(what[:3])} and {len(what) - 3} more"


class DenseWeights:
    """The dense weights' format on ``device`` for the ``asked`` one (:data:`WEIGHT_FORMATS`):
    :attr:`fmt` is what runs (float32 where the asked one cannot, said in one line)."""

    def __init__(self, asked: str, device: str, place, threads: int):
        if asked not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, not {asked!r}")
        # int8 on a GPU: Paddle's weight-only GEMMs, where a test product on the device agrees
        # (untested here: no GPU); else fd's CPU kernels
        self.gpu_weight_only = device != "cpu" and asked == "int8" and weight_only.unavailable(device) is None
        if device != "cpu" and asked == "int8" and not self.gpu_weight_only:
            log.warning("weights in float32, not int8: %s", weight_only.unavailable(device))
        self.fmt = "int8" if self.gpu_weight_only else qgemm.runnable(asked, device == "cpu")
        self.place, self.threads = place, threads
        self._kept: list[str] = []  # weights the kernels do not take, kept in float32
        self._eight: list[str] = []  # int4: weights not in 4-bit blocks, held in int8

    def put(self, layer: dict, name: str, a: np.ndarray, what: str) -> None:
        """``layer[name]``: the [in, out] weight ``a`` (``what`` names it in the log)."""
        if self.gpu_weight_only:
            layer[name], layer[name + "_wo"] = None, weight_only.WeightOnlyLinear(a, self.place)
            return
        fmt = self.fmt
        if fmt != "float32" and qgemm.fits(fmt, *a.shape):
            reuse = name != "lm_head"  # (a layer's output is consumed within its layer)
            try:
                q = qgemm.QuantLinear(a, fmt, self.threads, reuse=reuse)
            except qgemm.NotExact:  # (int4: a weight the checkpoint holds in more bits)
                q = qgemm.QuantLinear(a, "int8", self.threads, reuse=reuse)
                self._eight.append(what)
            layer[name], layer[name + "_q"] = None, q
            return
        if fmt != "float32":
            self._kept.append(f"{what} ({a.shape[0]}x{a.shape[1]})")
        layer[name] = paddle.to_tensor(np.ascontiguousarray(a, dtype=np.float32), place=self.place)

    def say(self) -> None:
        """One line each for the weights not held in the format asked."""
        if self._kept:
            log.warning("weights kept in float32 (%s): %s", self.fmt, ", ".join(self._kept))
        if self._eight:
            log.info("weights not in 4-bit blocks, held in int8: %s", _names(self._eight))


def thread_quantized(layers: list[dict], head: qgemm.QuantLinear | None, threads: int) -> int:
    """The threads of the quantized GEMMs and of what MKL still computes beside them
    (attention's products, LoRA, experts), returned for the model's GEMM plan: one per CPU the
    process may run on, or one where the weights fit in the caches (packed_gemm.THREADS_MIN_BYTES:
    a second thread would only spin). The plan says so, so that the worker is given the CPUs to
    match (fd/engine/runner/worker.py): Paddle leaves MKL at one thread, and a worker that looks
    single-threaded is pinned to one CPU, where two kernel threads take turns."""
    qs = [layer[n] for layer in layers for n in layer if n.endswith("_q")]
    qs += [head] if head is not None else []
    if sum(q.nbytes for q in qs) < packed_gemm.THREADS_MIN_BYTES:
        threads = 1
    for q in qs:
        q.threads = threads
    return threads


def pack_weights(
    layers: list[dict], head: paddle.Tensor, keep_if_slower: bool
) -> tuple[packed_gemm.GemmPlan, packed_gemm.PackedLinear | None]:
    """Packs the float32 dense layers' (``layers[i][name + "_packed"]``) and the head's weights,
    then times the routes (packed or, unless ``keep_if_slower``, eager) and MKL threads (one, or
    one per CPU this process may run on, the worker's --worker-cpus, where the weights are beyond
    the caches: packed_gemm.THREADS_MIN_BYTES) at a few row counts and keeps, for each, the one
    that runs a step's GEMMs fastest: the plan, and the head's packed weight (None when no row
    count takes the packed route, whose copies are then dropped). The timing streams every third
    layer's weights and the head's: as far beyond the caches as all of them (SmolLM2: ~250 MB),
    in under half the time."""
    cpus = len(os.sched_getaffinity(0))
    weights = sum(
        int(np.prod(layer[n].shape))
        for layer in layers
        if "moe" not in layer
        for n in ("qkv", "o", "gate_up", "down")
    )
    if (weights + int(np.prod(head.shape))) * 4 < packed_gemm.THREADS_MIN_BYTES:
        cpus = 1  # (the caches hold them: see THREADS_MIN_BYTES)
    # MKL lays a packed weight out for the threads set when it packs: packed on one thread,
    # a product on two ran no faster than on one below 64 rows (bench/README.md, "a GEMM
    # plan by rows")
    packed_gemm.use_threads(cpus)
    pairs = []
    for i, layer in enumerate(layers):
        if "moe" not in layer:
            for n in ("qkv", "o", "gate_up", "down"):
                layer[n + "_packed"] = packed_gemm.PackedLinear(layer[n].numpy())
                if i % 3 == 0:
                    pairs.append((layer[n], layer[n + "_packed"]))
    head_packed = packed_gemm.PackedLinear(head.numpy())
    pairs.append((head, head_packed))
    plan = packed_gemm.fastest_gemms(
        pairs, ("packed",) if keep_if_slower else ("packed", "eager"), tuple(sorted({1, cpus}))
    )
    if "packed" in plan.routes:
        return plan, head_packed
    for layer in layers:  # (their memory back: as large as the weights)
        for n in ("qkv", "o", "gate_up", "down"):
            layer.pop(n + "_packed", None)
    return plan, None
