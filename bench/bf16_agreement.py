"""bfloat16 against float32 on a real model: how often the likeliest token agrees, and by how
much the log-probabilities move.

No Paddle route runs a bf16 GEMM faster than fd's float32 ones on the CPUs this was measured
on (bench/README.md), so fd has no ``--dtype bfloat16``; this is what such a mode would cost in
accuracy, the figure a user weighs against vLLM's bf16 speed. bf16 is simulated where it
matters most: every GEMM's weight and its input rounded to bf16 (round to nearest even), the
products and sums in float32 (as oneDNN's and AMX's bf16 GEMMs accumulate), attention, norms
and softmax in float32.

For each prompt the float32 model's greedy continuation is generated (``--tokens``), then both
models score the whole sequence in one forward (teacher forcing: the same context at every
position) and each continuation position is compared: top-1 agreement, and the log-probability
the bf16 model gives float32's top token less float32's own (its mean |delta|, p99, max), and
the largest |delta| over float32's top 5.

Usage: python bench/bf16_agreement.py [--model DIR|FILE.gguf] [--tokens 48]
           [--output-json bench/results/bf16_agreement.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench._common import RESULTS, print_table, write_json  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The main difference between a virus and a bacterium is",
    "import numpy as np\n\ndef normalize(x):",
    "Water boils at 100 degrees Celsius because",
]


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def _bf16_model(cfg, weights):
    from fd.engine.model.llama import Llama

    def rounded(x: paddle.Tensor) -> paddle.Tensor:
        return paddle.cast(paddle.cast(x, "bfloat16"), "float32")

    class Bf16Gemms(Llama):
        """GEMM inputs rounded to bf16 (the weights are, at load)."""

        def _mm(self, x, layer, name):
            return super()._mm(rounded(x), layer, name)

        def _layers(self, ids, positions, attention):  # the head's input
            return rounded(super()._layers(ids, positions, attention))

    # projections, MLP, embeddings and the (tied) head rounded; norms (1-D) stay float32
    return Bf16Gemms(cfg, {k: round_bf16(v) if v.ndim == 2 else v for k, v in weights.items()})


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF dir or .gguf (default: fd's default model)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens generated per prompt")
    ap.add_argument("--output-json", default=str(RESULTS / "bf16_agreement.json"))
    args = ap.parse_args()

    from fd.cli.models import resolve_model
    from fd.control.tokenizer import Tokenizer
    from fd.engine.model.config import ModelConfig
    from fd.engine.model.llama import Llama
    from fd.engine.model.loader import load_weights

    model = str(resolve_model(args.model))
    cfg = ModelConfig.from_dir(model)
    weights = load_weights(model, cfg)
    f32 = Llama(cfg, weights)
    bf16 = _bf16_model(cfg, weights)
    tok = Tokenizer.from_dir(model)

    agree, top_delta, top5_delta, rows = [], [], [], []
    for text in tqdm(PROMPTS, desc="prompts", unit="prompt"):
        ids = tok.encode(text)
        n0 = len(ids)
        for _ in range(args.tokens):  # float32's greedy continuation
            ids.append(int(np.argmax(f32.reference_logits(ids)[-1])))
        # position i's logits predict token i + 1: the continuation's are rows n0-1 .. end-1
        a = log_softmax(f32.reference_logits(ids)[n0 - 1 : -1])
        b = log_softmax(bf16.reference_logits(ids)[n0 - 1 : -1])
        top = a.argmax(axis=-1)
        same = b.argmax(axis=-1) == top
        at = np.arange(len(top))
        d = np.abs(b[at, top] - a[at, top])
        top5 = np.argsort(-a, axis=-1)[:, :5]
        d5 = np.abs(np.take_along_axis(b, top5, -1) - np.take_along_axis(a, top5, -1)).max(axis=-1)
        agree.append(same)
        top_delta.append(d)
        top5_delta.append(d5)
        rows.append(
            {
                "prompt": text,
                "top1_agreement": float(same.mean()),
                "first_disagreement": int(np.argmin(same)) if not same.all() else None,
                "mean_abs_delta_top": float(d.mean()),
                "max_abs_delta_top5": float(d5.max()),
            }
        )
    agree_all, d_all, d5_all = np.concatenate(agree), np.concatenate(top_delta), np.concatenate(top5_delta)
    summary = {
        "positions": int(agree_all.size),
        "top1_agreement": float(agree_all.mean()),
        "prompts_whose_greedy_tokens_all_agree": int(sum(bool(a.all()) for a in agree)),
        "abs_delta_top_mean": float(d_all.mean()),
        "abs_delta_top_p99": float(np.quantile(d_all, 0.99)),
        "abs_delta_top_max": float(d_all.max()),
        "abs_delta_top5_max": float(d5_all.max()),
    }
    print_table(
        "bf16 (GEMM weights and inputs) against float32, teacher-forced on float32's greedy tokens",
        ["prompt", "top-1 agreement", "first disagreement", "mean abs Δ logprob, top", "max abs Δ, top 5"],
        [
            [
                r["prompt"][:40].replace("\n", " "),
                f"{r['top1_agreement']:.1%}",
                "—" if r["first_disagreement"] is None else r["first_disagreement"],
                f"{r['mean_abs_delta_top']:.4f}",
                f"{r['max_abs_delta_top5']:.4f}",
            ]
            for r in rows
        ],
    )
    print_table(
        "all positions",
        ["positions", "top-1 agreement", "abs Δ top: mean", "p99", "max", "max abs Δ, top 5"],
        [
            [
                summary["positions"],
                f"{summary['top1_agreement']:.2%}",
                f"{summary['abs_delta_top_mean']:.4f}",
                f"{summary['abs_delta_top_p99']:.4f}",
                f"{summary['abs_delta_top_max']:.4f}",
                f"{summary['abs_delta_top5_max']:.4f}",
            ]
        ],
    )
    write_json(args.output_json, {"model": model, "args": vars(args), "summary": summary, "prompts": rows})


if __name__ == "__main__":
    main()
