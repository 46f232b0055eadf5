"""What one short request costs `fd serve`: CPU of the serve process (API, engine node and the
embedded store on one loop) and of the model worker, per request, and wall time per request.

Waves of ``--streams`` streamed completions of ``--max-tokens`` tokens each (33-token prompts,
greedy), after warm-up waves; CPU from /proc (utime + stime) of the serve process and of its
children. ``--serve-tree DIR`` serves from another checkout under this client: for an A/B of
two trees, run it for each, alternating.

Usage: python bench/serve_cpu.py [--model DIR] [--streams 32] [--max-tokens 4] [--waves 20]
                                [--serve-tree DIR] [--output-json bench/results/serve_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import (  # noqa: E402
    RESULTS,
    http_session,
    model_dir,
    print_table,
    prompts,
    quiet_gc,
    start_serve,
    stream_completion,
    write_json,
)

TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    """utime + stime of ``pid`` so far, ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def waves(base: str, streams: int, max_tokens: int, n: int, tag: str, bar=None) -> None:
    async with http_session() as s:
        for w in range(n):
            ps = prompts(streams, seed=w)
            await asyncio.gather(
                *(stream_completion(s, base, f"{tag}{w}-{i}", p, max_tokens) for i, p in enumerate(ps))
            )
            if bar is not None:
                bar.update(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the tiny random model)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--waves", type=int, default=20)
    ap.add_argument("--serve-tree", default=None, help="run fd serve from this checkout")
    ap.add_argument("--output-json", default=str(RESULTS / "serve_cpu.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-bench-cpu-")
    srv = start_serve(
        model_dir(args.model, tmp),
        log_dir=tmp,
        extra=["--max-num-seqs", str(max(64, args.streams)), "--num-blocks", "8192"],
        tree=args.serve_tree,
    )
    try:
        asyncio.run(waves(srv.base, args.streams, args.max_tokens, 3, "warm"))
        quiet_gc()
        pid = srv.proc.pid
        kids = children(pid)
        serve0, kids0, t0 = cpu_ms(pid), [cpu_ms(k) for k in kids], time.perf_counter()
        with tqdm(total=args.waves, desc="waves", unit="wave") as bar:
            asyncio.run(waves(srv.base, args.streams, args.max_tokens, args.waves, "m", bar))
        wall = time.perf_counter() - t0
        n = args.streams * args.waves
        serve = (cpu_ms(pid) - serve0) / n
        worker = sum(cpu_ms(k) - c for k, c in zip(kids, kids0, strict=True)) / n
    finally:
        srv.stop()
    row = [args.streams, args.max_tokens, n, serve, worker, wall * 1000 / n]
    print_table(
        f"fd serve's cost per request ({args.serve_tree or 'this tree'})",
        [
            "streams",
            "tokens",
            "requests",
            "serve CPU ms / request",
            "worker CPU ms / request",
            "wall ms / request",
        ],
        [row],
        nd=2,
    )
    write_json(
        args.output_json,
        {
            "serve_tree": args.serve_tree,
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "requests": n,
            "serve_cpu_ms_per_request": serve,
            "worker_cpu_ms_per_request": worker,
            "wall_ms_per_request": wall * 1000 / n,
        },
    )


if __name__ == "__main__":
    main()
