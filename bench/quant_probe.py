"""Issue 47's first probe: can a step's GEMMs read fewer bytes and go faster on this CPU?

One decode or prefill step's weight GEMMs of SmolLM2-135M (30 layers of q|k|v, o, gate|up and
down, and the LM head: 134.5 M weights) at 1, 8, 32 and 256 rows, by route:

- ``eager``: Paddle's ``matmul`` in float32 (MKL sgemm), what a model without packing runs;
- ``packed``: MKL's packed sgemm (fd/engine/model/packed_gemm.py), what fd runs today;
- ``bf16``: weights in bfloat16, AVX512-BF16 (fd/engine/model/qgemm.py);
- ``q8``: Q8_0-style blocks (32 int8 + an fp16 scale), activations quantized per block at each
  call, AVX512-VNNI (the same module's ``int8``).

Each route's time is the median of ``--rounds`` whole steps (every GEMM once, in order), on
``--threads`` threads; ratios are against the faster float32 route. The kernels' results are
checked against numpy first (relative error printed). Prints a table, writes JSON.

    python bench/quant_probe.py --output-json bench/results/quant_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd.engine.runner.process import tune  # noqa: E402

tune()  # (MKL's AVX2 path on AMD CPUs: before Paddle loads MKL, as fd's commands do)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from fd.engine.model import packed_gemm, qgemm  # noqa: E402

# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64, 30 layers, vocab 49152
LAYER = [(576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576)]
LAYERS = 30
HEAD = (576, 49152)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")
    flags = next((x.split() for x in lines if x.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({os.cpu_count()} vCPUs; {', '.join(isa)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--routes", default="eager,packed,bf16,q8")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    paddle.set_device("cpu")
    packed_gemm.use_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = LAYER * LAYERS + [HEAD]
    weights = [(rng.standard_normal(s) * 0.02).astype(np.float32) for s in shapes]
    routes: dict[str, list] = {"eager": [paddle.to_tensor(w) for w in weights]}
    if packed_gemm.available():
        routes["packed"] = [packed_gemm.PackedLinear(w) for w in weights]
    routes["bf16"] = [qgemm.QuantLinear(w, "bfloat16", args.threads) for w in weights]
    routes["q8"] = [qgemm.QuantLinear(w, "int8", args.threads) for w in weights]
    nbytes = {
        "eager": sum(w.nbytes for w in weights),
        "packed": sum(w.nbytes for w in weights),
        "bf16": sum(q.nbytes for q in routes["bf16"]),
        "q8": sum(q.nbytes for q in routes["q8"]),
    }

    # correctness: each kernel against numpy on the first layer's and the head's shapes
    errors = {}
    for fmt in ("bf16", "q8"):
        worst = 0.0
        for idx in (0, 3, len(shapes) - 1):
            x = rng.standard_normal((5, shapes[idx][0])).astype(np.float32)
            ref = x.astype(np.float64) @ weights[idx].astype(np.float64)
            got = routes[fmt][idx](paddle.to_tensor(x)).numpy()
            worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        errors[fmt] = worst

    def step(route: str, xs: dict[int, paddle.Tensor]) -> None:
        ws = routes[route]
        if route == "eager":
            for w in ws:
                paddle.matmul(xs[int(w.shape[0])], w)
        else:
            for w in ws:
                w(xs[w.shape[0]])

    for route in [r for r in routes if r not in args.routes.split(",")]:
        del routes[route]
    results = []
    for rows in rows_list:
        xs = {k: paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32)) for k in (576, 1536)}
        times = {}
        for route in routes:
            step(route, xs)  # warm
            ts = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                step(route, xs)
                ts.append(time.perf_counter() - t0)
            times[route] = statistics.median(ts)
        best32 = min(times[r] for r in ("eager", "packed") if r in times)
        for route, t in times.items():
            results.append(
                {
                    "rows": rows,
                    "route": route,
                    "ms": t * 1e3,
                    "vs_fp32": best32 / t,
                    "mb": nbytes[route] / 1e6,
                    "gb_s": nbytes[route] / t / 1e9,
                }
            )
    cpu = cpu_name()
    print(f"CPU: {cpu}; {args.threads} threads; median of {args.rounds} steps")
    print(f"relative error vs numpy float64: bf16 {errors['bf16']:.2e}, q8 {errors['q8']:.2e}")
    print(f"{'rows':>5} {'route':>7} {'ms/step':>9} {'x fp32':>7} {'MB':>6} {'GB/s':>6}")
    for r in results:
        print(
            f"{r['rows']:>5} {r['route']:>7} {r['ms']:>9.2f} {r['vs_fp32']:>7.2f} {r['mb']:>6.0f} {r['gb_s']:>6.1f}"
        )
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(
            json.dumps({"cpu": cpu, "threads": args.threads, "errors": errors, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
