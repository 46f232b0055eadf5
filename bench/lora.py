"""LoRA benchmark: what serving adapters costs the model.

For batch sizes 1/8/32 (33-token prompts, 128 output tokens, greedy, ignore_eos), through
:class:`fd.engine.runner.llm.LLM` (the scheduler and the runner, no Redis, the model in this process),
every request of a run on:

- ``base``: the base model, on a runner with no adapter loaded;
- ``base, adapters loaded``: the base model, on the runner that holds the adapters (what an
  adapter-less request pays for them being there: nothing, by construction);
- ``one adapter``: every request on one adapter (rank ``--rank``, every projection);
- ``two adapters + base``: requests spread over two adapters and the base model, round-robin.

Columns: output tok/s (median of ``--reps`` interleaved runs) and its ratio to ``base``.
Random adapters made here (``fd.engine.model.lora.save_adapter``), the tiny model of
``fd make-tiny-model`` unless ``--model``.

Usage: python bench/lora.py [--model DIR] [--batches 1,8,32] [--reps 3] [--rank 16]
                            [--max-tokens 128] [--output-json bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # (bench/engine.py: not the package)
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import RESULTS, model_dir, print_table, prompts, write_json  # noqa: E402
from fd.control.sampling import SamplingParams  # noqa: E402

MODES = ("base", "base, adapters loaded", "one adapter", "two adapters + base")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output-json", default=str(RESULTS / "lora.json"))
    args = ap.parse_args()

    from fd.control.tokenizer import Tokenizer
    from fd.engine.model.config import ModelConfig
    from fd.engine.model.lora import save_adapter
    from fd.engine.runner.llm import LLM
    from fd.engine.runner.model_runner import ModelRunner

    tmp = tempfile.mkdtemp(prefix="fd-bench-lora-")
    mdir = model_dir(args.model, tmp)
    cfg = ModelConfig.from_dir(mdir)
    mods = {}
    for k in range(2):
        mods[f"a{k}"] = os.path.join(tmp, f"a{k}")
        save_adapter(mods[f"a{k}"], cfg, rank=args.rank, alpha=2 * args.rank, seed=k)
    tok = Tokenizer.from_dir(mdir)
    plain = LLM(ModelRunner(mdir, num_blocks=1024), tok)
    loaded = LLM(ModelRunner(mdir, num_blocks=1024, lora_modules=mods), tok)
    batches = [int(b) for b in args.batches.split(",")]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def sampling(mode: str, n: int) -> list[SamplingParams]:
        names = {
            "base": [""],
            "base, adapters loaded": [""],
            "one adapter": ["a0"],
            "two adapters + base": ["a0", "a1", ""],
        }[mode]
        return [SamplingParams(**{**sp.to_dict(), "lora": names[i % len(names)]}) for i in range(n)]

    tps: dict[tuple[int, str], list[float]] = {}
    bar = tqdm(total=len(batches) * len(MODES) * args.reps, desc="lora runs", unit="run")
    for rep in range(args.reps):
        for n in batches:
            ps = prompts(n, vocab=cfg.vocab_size, seed=rep)
            for mode in MODES:
                llm = plain if mode == "base" else loaded
                t = time.perf_counter()
                gens = llm.generate(ps, sampling(mode, n))
                wall = time.perf_counter() - t
                tps.setdefault((n, mode), []).append(sum(len(g.token_ids) for g in gens) / wall)
                bar.update(1)
    bar.close()
    rows, runs = [], {}
    for n in batches:
        base = statistics.median(tps[(n, "base")])
        for mode in MODES:
            v = statistics.median(tps[(n, mode)])
            rows.append([n, mode, v, v / base])
            runs[f"{n}/{mode}"] = {"tok_per_s": v, "vs_base": v / base, "all": tps[(n, mode)]}
    md = print_table(
        f"lora: output tok/s through fd.engine.runner.llm.LLM, rank {args.rank} adapters on every "
        f"projection, {args.max_tokens} output tokens, median of {args.reps}",
        ["batch", "requests on", "output tok/s", "vs base"],
        rows,
        nd=2,
    )
    write_json(
        args.output_json,
        {
            "model": mdir,
            "rank": args.rank,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "runs": runs,
            "table": {"markdown": md},
        },
    )


if __name__ == "__main__":
    main()
