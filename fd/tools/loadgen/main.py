"""``fd bench``: a load generator for any OpenAI-compatible server, with cancellation built in.

It works like ``vllm bench serve`` (Poisson arrivals, a concurrency cap, random prompts of a
length distribution, warm-ups, TTFT/TPOT/ITL/E2EL percentiles) and adds what fd is about: a
share of the clients hang up mid-stream (``--disconnect-ratio``) or have their request aborted
through ``POST /v1/abort_requests`` (``--abort-ratio``), and the report says how long the
server took from that cancel to releasing the request.

That release time is read where it is exact when it can be: with ``--redis-url``, from the
``ts`` of ``abort_requested`` / ``blocks_released`` on each request's own stream (fd servers).
Otherwise, for any server, from the Prometheus gauges ``*num_requests_running + waiting``
polled every 5 ms by a process of its own (:mod:`fd.tools.gauge_sampler`), the way TARGETS.md
measured vLLM: the first drop of the gauge after the cancel. That is only exact when nothing
else starts or ends meanwhile.

Only the HTTP API and ``control`` (key names) are used: this module never imports ``engine``,
so it runs against a remote deployment from a machine without PaddlePaddle.

Importable: :class:`BenchConfig`, :func:`run_bench` (async, returns the report dict),
:func:`format_report`, :func:`main`.

This module runs a benchmark and is its command line; what it sends is
:mod:`fd.tools.loadgen.workload`, one request's client :mod:`fd.tools.loadgen.client`, the release timing
:mod:`fd.tools.loadgen.release` and the report :mod:`fd.tools.loadgen.report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from fd.tools.loadgen.client import Outcome, fetch_model, send_one
from fd.tools.loadgen.release import EventReader, GaugePoller
from fd.tools.loadgen.report import check_plot_available, format_report, plot_report, summarize
from fd.tools.loadgen.workload import BenchConfig, Planned, arrival_offsets, plan_requests


async def run_bench(cfg: BenchConfig, session: aiohttp.ClientSession | None = None) -> dict[str, Any]:
    """Run the benchmark and return its report (see :func:`summarize`)."""
    cfg.check()
    cfg.base_urls = [u.rstrip("/") for u in cfg.base_urls]
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)
        )
    reader = EventReader(cfg.redis_url, cfg.prefix) if cfg.redis_url else None
    try:
        model = cfg.model or await fetch_model(session, cfg.base_urls[0], cfg.api_key)
        run_id = cfg.request_id_prefix or f"bench-{secrets.token_hex(4)}"
        planned = plan_requests(cfg, run_id)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def limited(p: Planned, cancel: bool = True) -> Outcome:
            if sem is None:
                return await send_one(session, cfg, model, p, cancel)
            async with sem:
                return await send_one(session, cfg, model, p, cancel)

        if cfg.num_warmups:
            warm = [
                Planned(
                    i,
                    f"{run_id}-warmup-{i}",
                    planned[i % len(planned)].prompt,
                    min(16, cfg.output_len),
                    None,
                    cfg.base_urls[i % len(cfg.base_urls)],
                )
                for i in range(cfg.num_warmups)
            ]
            res = await asyncio.gather(*(limited(p, False) for p in warm))
            bad = [r.error for r in res if r.error]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")

        poller = None
        if reader is None and any(p.cancel for p in planned):
            poller = GaugePoller(cfg.base_urls[0], cfg.api_key, cfg.metrics_poll_ms)
            await poller.start()
            await asyncio.sleep(3 * poller.poll_s)  # a baseline sample before the first cancel

        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(planned), desc="fd bench", unit="req", file=sys.stderr)

        async def one(p: Planned, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            o = await limited(p)
            if bar is not None:
                bar.update(1)
            if reader is not None and o.cancel and o.t_cancel is not None:
                await reader.fill(o)
            return o

        offsets = arrival_offsets(len(planned), cfg.request_rate, cfg.seed)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(p, t0 + dt) for p, dt in zip(planned, offsets, strict=True)))
        if bar is not None:
            bar.close()
        if poller is not None:
            await asyncio.sleep(0.1)  # the last releases
            await poller.stop()
            for o in outcomes:
                poller.fill(o)
        t_end = max((o.t_end for o in outcomes), default=t0)
        source = "events" if reader else ("metrics" if poller else None)
        return summarize(cfg, model, outcomes, t_end - t0, source)
    finally:
        if reader is not None:
            await reader.close()
        if own:
            await session.close()


def build_parser(prog: str = "fd bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument(
        "--base-url",
        action="append",
        required=True,
        help="server URL, e.g. http://127.0.0.1:8000; repeat (or comma-separate) to "
        "spread requests round-robin over API replicas",
    )
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals; inf (default): all at once",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--disconnect-ratio",
        type=float,
        default=0.0,
        help="share of requests whose client closes the connection mid-stream",
    )
    p.add_argument(
        "--abort-ratio",
        type=float,
        default=0.0,
        help="share of requests aborted via POST /v1/abort_requests mid-stream",
    )
    p.add_argument("--cancel-after-tokens", type=int, default=10)
    p.add_argument(
        "--cancel-after-ms",
        type=float,
        default=None,
        help="cancel this long after sending instead of after K tokens",
    )
    p.add_argument("--api-key", default=os.environ.get("FD_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument(
        "--admin-key",
        default=os.environ.get("FD_ADMIN_KEY"),
        help="key for /v1/abort_requests (default: --api-key)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("FD_REDIS_URL"),
        help="read cancel->release from each request's events (fd servers); "
        "without it, from /metrics gauges polled every --metrics-poll-ms",
    )
    p.add_argument("--prefix", default=os.environ.get("FD_PREFIX", "fd"))
    p.add_argument("--metrics-poll-ms", type=float, default=5.0)
    p.add_argument("--request-id-prefix", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="needs matplotlib")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    urls = [u.strip() for arg in a.base_url for u in arg.split(",") if u.strip()]
    return BenchConfig(
        base_urls=urls,
        endpoint=a.endpoint,
        model=a.model,
        num_prompts=a.num_prompts,
        max_concurrency=a.max_concurrency,
        request_rate=a.request_rate,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        num_warmups=a.num_warmups,
        seed=a.seed,
        temperature=a.temperature,
        disconnect_ratio=a.disconnect_ratio,
        abort_ratio=a.abort_ratio,
        cancel_after_tokens=a.cancel_after_tokens,
        cancel_after_ms=a.cancel_after_ms,
        api_key=a.api_key,
        admin_key=a.admin_key,
        redis_url=a.redis_url,
        prefix=a.prefix,
        metrics_poll_ms=a.metrics_poll_ms,
        request_id_prefix=a.request_id_prefix,
        progress=not a.disable_tqdm,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``fd bench ...``; returns 1 when any request failed, 2 on bad arguments."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from_args(args)
    try:
        cfg.check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        check_plot_available()
    try:
        report = asyncio.run(run_bench(cfg))
    except (RuntimeError, aiohttp.ClientError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if report["num_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
