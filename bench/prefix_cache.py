"""Prefix caching: time to first token for requests sharing a long prefix, cache on and off.

A chat service's requests mostly begin with the same system prompt; vLLM's automatic prefix
caching (fd's too, fd/engine/core/block_manager.py) computes its KV blocks once. This starts ``fd
serve`` twice on the same model, with its default (cache on) and with
``--no-enable-prefix-caching``, sends one request to warm it, then ``--requests`` streaming
completions one after another, each the shared prefix plus ``--suffix`` tokens of its own,
and prints TTFT p50/p99 and the ratio. One at a time on purpose: the figure is the prefill a
request is spared, not batching.

Usage: python bench/prefix_cache.py [--model DIR] [--prefix 960] [--suffix 20] [--requests 30]
                                    [--output-json bench/results/prefix_cache.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
    p50,
    p99,
    print_table,
    start_serve,
    stream_with,
    wait_idle,
    write_json,
)


async def run(base: str, prefix: list[int], suffix: int, n: int, rng: random.Random, bar) -> list[float]:
    async with http_session() as session:
        await wait_idle(session, base)
        await stream_with("lean", session, base, f"warm-{time.time_ns()}", prefix + [7], 2)
        ttft = []
        for i in range(n):
            prompt = prefix + [rng.randrange(10, 500) for _ in range(suffix)]
            r = await stream_with("lean", session, base, f"pc{i}-{time.time_ns()}", prompt, 4)
            if r.error or not r.chunk_times:
                raise RuntimeError(f"request failed: {r.error}")
            ttft.append(r.chunk_times[0] - r.t_send)
            bar.update(1)
        return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix", type=int, default=960, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=20, help="tokens of each request's own")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--output-json", default=str(RESULTS / "prefix_cache.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fd-bench-pc-")
    mdir = model_dir(args.model, tmp)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 500) for _ in range(args.prefix)]
    out: dict = {"prefix": args.prefix, "suffix": args.suffix, "requests": args.requests, "runs": {}}
    modes = (("on (default)", []), ("off", ["--no-enable-prefix-caching"]))
    with tqdm(total=len(modes) * args.requests, desc="prefix cache", unit="req") as bar:
        for label, extra in modes:
            srv = start_serve(mdir, extra=["--num-blocks", "2048", *extra], log_dir=tmp)
            try:
                ttft = asyncio.run(run(srv.base, prefix, args.suffix, args.requests, random.Random(1), bar))
            finally:
                srv.stop()
            out["runs"][label] = {"ttft_p50_ms": 1000 * p50(ttft), "ttft_p99_ms": 1000 * p99(ttft)}
    on, off = out["runs"]["on (default)"], out["runs"]["off"]
    rows = [[label, r["ttft_p50_ms"], r["ttft_p99_ms"]] for label, r in out["runs"].items()]
    text = print_table(
        f"prefix cache: {args.requests} streaming completions one at a time, a shared "
        f"{args.prefix}-token prefix + {args.suffix} tokens each, 4 output tokens",
        ["prefix caching", "TTFT p50 ms", "TTFT p99 ms"],
        rows,
        nd=2,
    )
    out["ttft_p50_ratio_off_over_on"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
    print(f"TTFT p50, off / on: {out['ttft_p50_ratio_off_over_on']:.1f}x")
    out["table"] = {"markdown": text}
    write_json(args.output_json, out)


if __name__ == "__main__":
    main()
