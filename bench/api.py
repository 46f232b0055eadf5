"""API-path benchmark: streaming clients against ``fd serve`` next to the engine in-process.

``fd serve`` runs as a subprocess (``python -m fd serve``, embedded control plane, or a real
Redis with ``--redis-url``) so the clients, here with aiohttp, do not share its event loop.
The workload is TARGETS.md's: streaming ``/v1/completions``, a 33-token prompt (token ids),
temperature 0, ``ignore_eos``, 256 output tokens. At concurrency N, N clients each send
``--rounds`` requests back to back (closed loop).

The baseline is :class:`fd.engine.runner.llm.LLM` in this process on the same model, prompts and
lengths: ``--rounds`` calls of ``generate`` on N prompts at once; TTFT and inter-token latency
come from ``Generation.token_times``. Each concurrency runs the baseline, then the API path.

- TTFT: request sent -> first SSE chunk with text (API) / ``generate`` called -> first token
  (in-process); ITL: gaps between successive chunks / tokens, pooled over all requests;
- output tok/s: completion tokens of all requests / wall time of the whole wave;
- ``api/llm``: API-path throughput over in-process throughput; ``+TTFT``: the added TTFT p50;
- also printed (and in the JSON): CPU time of ``fd serve``'s main thread (its event loop) per
  output token, which varies much less than tok/s when other work shares the machine.

The clients are bench/sse_client.py's (on a two-core machine the load generator's CPU is
taken from the server it measures, and aiohttp's client took ~0.2 ms a connection; ``--client
aiohttp`` to compare). ``--connections``: ``reuse`` (the default) keeps each client's connection
for its next request, opened by its first, as ``vllm bench serve`` (one aiohttp connector for
all requests) and the ``openai`` client (httpx's pool) do; ``new``, a new connection per
request (the default until 2026-11-30, stricter than either); ``warm``, reused and opened
before the clock (``--keepalive``, its old name).

Usage: python bench/api.py [--model DIR] [--concurrency 1,8,32] [--rounds 2] [--min-requests 8]
                          [--max-tokens 256] [--redis-url URL] [--client lean|aiohttp]
                          [--connections reuse|new|warm] [--output-json bench/results/api.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import (  # noqa: E402
    PROMPT_LEN,
    RESULTS,
    goal,
    http_session,
    model_dir,
    p50,
    p99,
    print_goals,
    print_table,
    prompts,
    start_serve,
    stream_completion,
    stream_with,
    wait_idle,
    write_json,
)

GOAL_STREAMS = 32  # issue #4's goals are stated at 32 concurrent streams
CONNECTIONS = {
    "reuse": "connections reused",
    "new": "a connection per request",
    "warm": "connections reused, opened before the clock",
}


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process's main thread, from /proc; NaN elsewhere. In
    ``fd serve`` that thread runs the one event loop every request and token goes through."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_inprocess(llm, n: int, rounds: int, max_tokens: int, seed: int) -> dict:
    from fd.control.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttft, itl, ntok = [], [], 0
    t0 = time.perf_counter()
    for r in range(rounds):
        ts = time.perf_counter()
        for g in llm.generate(prompts(n, seed=seed * 1000 + r), sp):
            ntok += len(g.token_ids)
            ttft.append(g.token_times[0] - ts)
            itl += [b - a for a, b in pairwise(g.token_times)]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": ntok, "tok_per_s": ntok / wall, "ttft": ttft, "itl": itl}


async def run_api(
    base: str,
    n: int,
    rounds: int,
    max_tokens: int,
    seed: int,
    tag: str,
    bar,
    client_kind: str = "lean",
    connections: str = "reuse",
) -> dict:
    """``n`` clients, ``rounds`` requests each. ``connections``: ``reuse``, a client's
    connection stays open for its next request (a connection pool's); ``warm``, the same, each
    opened before the clock (by a one-token request on another prompt, which no timed prompt
    shares a block with); ``new``, a new connection per request."""
    ps = prompts(n * rounds, seed=seed)
    keepalive = connections != "new"
    pool = None
    if keepalive:
        from bench.sse_client import Pool

        pool = Pool()
    ttft, itl, errors, results = [], [], [], []

    async def client(session, c: int) -> None:
        for r in range(rounds):
            res = await stream_with(
                client_kind, session, base, f"{tag}-c{c}-r{r}", ps[r * n + c], max_tokens, pool=pool
            )
            results.append(res)
            bar.update(1)

    async with http_session(keepalive=keepalive) as session:
        if connections == "warm":
            opening = prompts(n, seed=seed + 7_777_777)
            await asyncio.gather(
                *(
                    stream_with(client_kind, session, base, f"{tag}-open-c{c}", opening[c], 1, pool=pool)
                    for c in range(n)
                )
            )
        await wait_idle(session, base)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session, c) for c in range(n)))
        wall = time.perf_counter() - t0
    ntok = 0
    for res in results:
        if res.error or res.finish_reason != "length" or not res.chunk_times:
            errors.append(res.error or f"finish_reason={res.finish_reason}")
            continue
        ntok += max_tokens  # ignore_eos + finish_reason=length: exactly max_tokens generated
        ttft.append(res.chunk_times[0] - res.t_send)
        itl += [b - a for a, b in pairwise(res.chunk_times)]
    return {
        "wall_s": wall,
        "tokens": ntok,
        "tok_per_s": ntok / wall,
        "ttft": ttft,
        "itl": itl,
        "errors": errors[:5],
        "num_errors": len(errors),
        "chunks_per_request": sum(len(r.chunk_times) for r in results) / max(1, len(results)),
    }


async def warm(base: str, n: int, max_tokens: int) -> None:
    """The server's warm-up is the baseline's: ``n`` prompts at once, ``max_tokens`` each."""
    async with http_session() as session:
        await asyncio.gather(
            *(
                stream_completion(session, base, f"warm-{time.time_ns()}-{i}", p, max_tokens)
                for i, p in enumerate(prompts(n, seed=99))
            )
        )


def summarize(r: dict) -> dict:
    ms = 1000.0
    return {
        "tok_per_s": r["tok_per_s"],
        "ttft_p50_ms": ms * p50(r["ttft"]),
        "ttft_p99_ms": ms * p99(r["ttft"]),
        "itl_p50_ms": ms * p50(r["itl"]),
        "itl_p99_ms": ms * p99(r["itl"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, back to back")
    ap.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="at least this many requests per level (more rounds at low concurrency)",
    )
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--redis-url", default=None, help="run fd serve on this Redis instead of the embedded one"
    )
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra argument for fd serve (repeat), e.g. --serve-arg=--no-async-scheduling",
    )
    ap.add_argument(
        "--client",
        choices=("lean", "aiohttp"),
        default="lean",
        help="the streaming client: lean (bench/sse_client.py: the least CPU taken "
        "from the server it measures) or aiohttp's",
    )
    ap.add_argument(
        "--connections",
        choices=("reuse", "new", "warm"),
        default="reuse",
        help="reuse: a client's connection serves its next request (vllm bench serve's "
        "and the openai client's pools); new: a new one per request; warm: reused, "
        "opened before the clock",
    )
    ap.add_argument(
        "--keepalive",
        action="store_const",
        const="warm",
        dest="connections",
        help="(the old name of --connections warm)",
    )
    ap.add_argument("--output-json", default=str(RESULTS / "api.json"))
    args = ap.parse_args()
    conc = [int(x) for x in args.concurrency.split(",")]

    from fd.control.tokenizer import Tokenizer
    from fd.engine.runner.llm import LLM
    from fd.engine.runner.model_runner import ModelRunner

    tmp = tempfile.mkdtemp(prefix="fd-bench-api-")
    mdir = model_dir(args.model, tmp)
    runner = ModelRunner(mdir, device="cpu", num_blocks=2048, block_size=16)
    runner.warmup()
    llm = LLM(runner, Tokenizer.from_dir(mdir), max_num_seqs=max(64, max(conc)))
    from fd.control.sampling import SamplingParams

    llm.generate(prompts(max(conc), seed=99), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    srv = start_serve(
        mdir,
        redis_url=args.redis_url,
        extra=["--max-num-seqs", str(max(64, max(conc))), "--num-blocks", "2048", *args.serve_arg],
        log_dir=tmp,
    )
    out: dict = {
        "model": mdir,
        "server": "redis" if args.redis_url else "embedded",
        "serve_args": args.serve_arg,
        "client": args.client,
        "connections": args.connections,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "runs": {},
    }
    try:
        asyncio.run(warm(srv.base, max(conc), 8))
        rounds = {c: max(args.rounds, -(-args.min_requests // c)) for c in conc}
        total = sum(c * rounds[c] for c in conc)
        with tqdm(total=total, desc="api streams", unit="req") as bar:
            for i, n in enumerate(conc):
                base_r = run_inprocess(llm, n, rounds[n], args.max_tokens, seed=i)
                cpu0 = main_thread_cpu_s(srv.proc.pid)
                api_r = asyncio.run(
                    run_api(
                        srv.base,
                        n,
                        rounds[n],
                        args.max_tokens,
                        i,
                        f"a{i}n{n}",
                        bar,
                        args.client,
                        args.connections,
                    )
                )
                cpu_us = (main_thread_cpu_s(srv.proc.pid) - cpu0) / max(1, api_r["tokens"]) * 1e6
                out["runs"][n] = {
                    "requests": n * rounds[n],
                    "inprocess": {**summarize(base_r), "wall_s": base_r["wall_s"]},
                    "api": {
                        **summarize(api_r),
                        "wall_s": api_r["wall_s"],
                        "num_errors": api_r["num_errors"],
                        "errors": api_r["errors"],
                        "chunks_per_request": api_r["chunks_per_request"],
                        "main_thread_cpu_us_per_token": cpu_us,
                    },
                }
        out["server_rss_mb"], out["server_peak_rss_mb"] = srv.rss_mb()
    finally:
        srv.stop()

    rows = []
    for n in conc:
        a, b = out["runs"][n]["api"], out["runs"][n]["inprocess"]
        rows.append(
            [
                n,
                "api (fd serve)",
                a["tok_per_s"],
                a["ttft_p50_ms"],
                a["ttft_p99_ms"],
                a["itl_p50_ms"],
                a["itl_p99_ms"],
                a["tok_per_s"] / b["tok_per_s"],
                a["ttft_p50_ms"] - b["ttft_p50_ms"],
            ]
        )
        rows.append(
            [
                n,
                "in-process LLM",
                b["tok_per_s"],
                b["ttft_p50_ms"],
                b["ttft_p99_ms"],
                b["itl_p50_ms"],
                b["itl_p99_ms"],
                "",
                "",
            ]
        )
    headers = [
        "concurrency",
        "path",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "api/llm tok/s",
        "+TTFT p50 ms",
    ]
    errs = sum(out["runs"][n]["api"]["num_errors"] for n in conc)
    text = print_table(
        f"api: streaming /v1/completions, {PROMPT_LEN}-token prompt, {args.max_tokens} "
        f"output tokens, ignore_eos, greedy; closed loop, >= {args.min_requests} requests "
        f"and >= {args.rounds} per client ({args.client} client, "
        f"{CONNECTIONS[args.connections]}); "
        f"control plane {out['server']}",
        headers,
        rows,
        nd=2,
    )
    print(
        "fd serve main thread CPU per output token (less noisy than tok/s on a shared machine): "
        + ", ".join(
            f"{n} streams {out['runs'][n]['api']['main_thread_cpu_us_per_token']:.0f} us" for n in conc
        )
    )
    print(
        f"failed requests: {errs}; fd serve RSS {out['server_rss_mb']:.0f} MiB "
        f"(peak {out['server_peak_rss_mb']:.0f} MiB)"
    )
    out["table"] = {"headers": headers, "rows": rows, "markdown": text}
    if GOAL_STREAMS in conc:
        a, b = out["runs"][GOAL_STREAMS]["api"], out["runs"][GOAL_STREAMS]["inprocess"]
        at = f"{GOAL_STREAMS} streams"
        out["goals"] = [
            goal("output tok/s, api / in-process", at, a["tok_per_s"] / b["tok_per_s"], ">=", 0.9),
            goal("added TTFT p50, ms", at, a["ttft_p50_ms"] - b["ttft_p50_ms"], "<", 5.0),
        ]
        print_goals("api: issue #4's goals, as this run measured them", out["goals"])
    write_json(args.output_json, out)


if __name__ == "__main__":
    main()
