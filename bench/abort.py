"""Abort benchmark: how fast a client that goes away stops costing anything.

Runs ``python -m fd serve`` as a subprocess (embedded control plane, or ``--redis-url URL``
for a real Redis; ``--real-redis`` starts a throwaway redis-server on a free port) and
measures three things, with aiohttp clients in this process:

1. random disconnects: at 1/8/32/128 concurrent streams (closed loop, ``--requests`` per
   level at least), each client asks for 512 tokens and closes the connection after K chunks,
   K uniform in [3, 30]. Afterwards each request's story ``P:req:{id}`` is read with redis-py,
   and from the client's wall clock at the close to the ``ts`` (ms) of ``abort_requested``,
   ``drained`` and ``blocks_released`` (same machine, same clock) we get p50/p99 in ms; in
   engine steps, from the step of the last tokens the client received; and hang-up →
   ``blocks_released`` less the length of the step the release waited for (when the model
   worker ran each step is in the engine's journal): the goal's "one engine step plus 5 ms"
   with that step (a 128-stream wave's prefill steps are twice its decode steps, which the
   median step period hides). Tokens generated after
   the disconnect = ``completion_tokens`` of the final minus the tokens the client received
   (the SSE ``id:`` of its last chunk marks where it stopped); tokens events after
   ``abort_requested`` must be 0.
2. ``POST /v1/abort_requests``: time to the HTTP answer, p50/p99, for 1,000 requests naming
   one (unknown) id each, and for 50 requests naming 1,000 ids each. The client runs on the
   model worker's CPU meanwhile (idle then): on the server's, it waited for the work each
   answer starts (the engine's tombstones) before it could read the answer.
3. the TARGETS.md number: streams of 900 tokens, the client hanging up after 10 chunks, at
   concurrency 1/8/32 (all clients of a wave start together); a poller in a process of its own
   (fd/tools/gauge_sampler.py) reads ``fd_num_requests_running + fd_num_requests_waiting`` on
   /metrics every 5 ms, and the i-th drop of that sum is matched to the i-th hang-up of the wave.

Usage: python bench/abort.py [--model DIR] [--concurrency 1,8,32,128] [--requests 128]
                            [--release-concurrency 1,8,32] [--redis-url URL | --real-redis]
                            [--serve-tree DIR]
                            [--output-json bench/results/abort.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import sys
import tempfile
import time
from collections import deque
from itertools import pairwise
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import (  # noqa: E402
    FD_GAUGES,
    RESULTS,
    entry_le,
    gauges,
    goal,
    http_session,
    model_dir,
    on_the_workers_cpu,
    p50,
    p99,
    print_goals,
    print_table,
    prompts,
    quiet_gc,
    start_redis_server,
    start_serve,
    stream_completion,
    stream_with,
    wait_idle,
    write_json,
)
from fd.tools.gauge_sampler import GaugeSampler  # noqa: E402

MS = 1000.0


#: The streaming client (``--client``): bench/sse_client.py's lean one, or aiohttp's.
CLIENT = "lean"


# ------------------------------------------------------------------ 1. random disconnects


async def disconnects(
    base: str, n: int, total: int, max_tokens: int, rng: random.Random, tag: str, bar
) -> list:
    ps = prompts(total, seed=n)
    todo = list(range(total))
    out = []

    async def client(session) -> None:
        while todo:
            i = todo.pop()
            k = rng.randint(3, 30)
            res = await stream_with(CLIENT, session, base, f"{tag}-{i}", ps[i], max_tokens, hang_up_after=k)
            res.k = k
            out.append(res)
            bar.update(1)

    async with http_session() as session:
        await wait_idle(session, base)
        await asyncio.gather(*(client(session) for _ in range(n)))
        await wait_idle(session, base)
    return out


async def stories(redis_url: str, prefix: str, rids: list[str], timeout: float = 30.0) -> tuple:
    """Each request's events, once its final is there; and the engines' step times."""
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.events import Final
    from fd.control.keys import Keys
    from fd.engine.journal.journal_reader import journal_engines, load_journal_from_redis

    bus = Bus(connect(redis_url), Keys(prefix))
    got = {}
    deadline = time.monotonic() + timeout
    try:
        for rid in rids:
            while True:
                evs = await bus.read_req(rid)
                if any(isinstance(e, Final) for _, e in evs) or time.monotonic() > deadline:
                    got[rid] = evs
                    break
                await asyncio.sleep(0.05)
        runs = {
            eng: step_times(await load_journal_from_redis(bus, eng)) for eng in await journal_engines(bus)
        }
    finally:
        await bus.redis.aclose()
    return got, runs


def step_times(entries: list) -> list[tuple[int, int]]:
    """When the runner ran each step, ``(start ms, end ms)`` in step order, from the engine's
    journal (``fd serve`` keeps one; calls carry wall ms). The model worker says when it ran
    each step (``finished`` calls' ``ran``). Without that (an in-process runner, an older
    journal), a step ends when the engine heard its result is in (``finished``), else when it
    was folded in (``update``, later by however long the loop took to get to it), and starts
    when decided or when the one before it ended (the runner takes them in order)."""
    decided: dict[int, int] = {}
    ended: dict[int, int] = {}
    ran: dict[int, tuple[int, int]] = {}
    running: deque[int] = deque()  # decided, not known to have ended (in step order)
    for e in entries:
        for c in (e.data or {}).get("calls", []) if hasattr(e, "data") else []:
            t = c.get("t")
            if t is None:
                continue
            if c["op"] == "schedule" and c.get("out") and c["out"][2:3] != [[]]:
                decided[c["out"][0]] = t
                running.append(c["out"][0])
            elif c["op"] == "finished":
                if c.get("ran"):
                    ran[c["step"]] = (int(c["ran"][0]), int(c["ran"][1]))
                while running and running[0] <= c["step"]:
                    ended.setdefault(running.popleft(), t)
            elif c["op"] == "update":
                ended.setdefault(c["step"], t)
    out, prev_end = [], None
    for s in sorted(decided):
        if s in ran:
            out.append(ran[s])
            prev_end = ran[s][1]
            continue
        if s not in ended:
            continue
        start = decided[s] if prev_end is None else max(decided[s], prev_end)
        out.append((start, ended[s]))
        prev_end = ended[s]
    return out


def beyond_step(close_ms: float, release_ms: float, runs: list[tuple[int, int]]) -> float:
    """Hang-up → ``blocks_released`` less the length of the step the release waited for (the
    last one to end by the release, if it ended after the hang-up; none otherwise): the goal's
    "within one engine step plus 5 ms" with that step, whether it was running at the hang-up
    or started before the abort was heard. Whole ms, so ±1."""
    ends = [e for _, e in runs]
    i = bisect.bisect_right(ends, release_ms) - 1
    length = 0
    if i >= 0 and ends[i] >= close_ms:
        length = runs[i][1] - runs[i][0]
    return release_ms - close_ms - length


def analyse(results: list, story: dict, runs: dict | None = None) -> dict:
    from fd.control.events import AbortRequested, BlocksReleased, Drained, Final, Tokens

    runs = runs or {}
    beyond = []  # hang-up → blocks_released, ms beyond the step the release waited for
    ms = {"abort_requested": [], "drained": [], "blocks_released": []}
    steps = {"abort_requested": [], "drained": [], "blocks_released": []}
    after, discarded, tok_after_abort, problems, finished_early = [], [], 0, [], 0
    step_ms = []  # gaps between a request's successive tokens events: the step period
    for res in results:
        if res.error or res.wall_close_ms is None:
            problems.append(f"{res.request_id}: {res.error or 'stream ended before the hang-up'}")
            if res.wall_close_ms is None:
                finished_early += 1
            continue
        evs = story.get(res.request_id, [])
        delivered, last_step, seen_abort, prev_ts = 0, 0, False, None
        marks = {}
        final = None
        for eid, ev in evs:
            if isinstance(ev, Tokens):
                if seen_abort and ev.token_ids:
                    tok_after_abort += 1
                if ev.token_ids and not seen_abort:
                    if prev_ts is not None:
                        step_ms.append(ev.ts - prev_ts)
                    prev_ts = ev.ts
                if res.last_event_id is not None and entry_le(eid, res.last_event_id):
                    delivered += len(ev.token_ids)
                    last_step = ev.step
            elif isinstance(ev, AbortRequested):
                seen_abort = True
                marks["abort_requested"] = ev
            elif isinstance(ev, Drained):
                marks["drained"] = ev
                discarded.append(ev.discarded_tokens)
            elif isinstance(ev, BlocksReleased):
                marks["blocks_released"] = ev
            elif isinstance(ev, Final):
                final = ev
        if final is None or "blocks_released" not in marks:
            problems.append(f"{res.request_id}: story {[type(e).__name__ for _, e in evs]}")
            continue
        for name, ev in marks.items():
            ms[name].append(ev.ts - res.wall_close_ms)
            steps[name].append(ev.step - last_step)
        rel = marks["blocks_released"]
        if runs.get(rel.engine):
            beyond.append(beyond_step(res.wall_close_ms, rel.ts, runs[rel.engine]))
        after.append(int(final.usage.get("completion_tokens", 0)) - delivered)
    return {
        "ms": ms,
        "steps": steps,
        "step_ms": step_ms,
        "beyond_step_ms": beyond,
        "tokens_after_disconnect": after,
        "discarded": discarded,
        "tokens_events_after_abort_requested": tok_after_abort,
        "problems": problems[:10],
        "num_problems": len(problems),
        "finished_before_hangup": finished_early,
    }


# ------------------------------------------------------------------ 2. /v1/abort_requests


async def abort_endpoint(
    base: str, n_single: int, n_bulk: int, bulk_ids: int, gap_s: float, bar, keepalive: bool = True
) -> dict:
    """``keepalive``: the calls reuse one connection (an admin tool or SDK calling again);
    otherwise each call opens its own, and pays for TCP set-up and tear-down on top."""
    single, bulk = [], []
    async with http_session(limit=1, keepalive=keepalive) as session:

        async def call(ids: list[str], into: list[float]) -> None:
            t = time.perf_counter()
            async with session.post(base + "/v1/abort_requests", json={"request_ids": ids}) as r:
                await r.read()
                ok = r.status == 200
            into.append(time.perf_counter() - t)
            assert ok, r.status
            bar.update(1)

        for i in range(n_single):
            await call([f"ghost-{time.time_ns()}-{i}"], single)
        for j in range(n_bulk):
            await call([f"ghost-{time.time_ns()}-{j}-{i}" for i in range(bulk_ids)], bulk)
            await asyncio.sleep(gap_s)
        await wait_idle(session, base)
    return {"single": single, "bulk": bulk}


# ------------------------------------------------------------------ 3. TARGETS.md release


async def release_wave(
    base: str,
    c: int,
    max_tokens: int,
    hang_after: int,
    seed: int,
    tag: str,
    names=FD_GAUGES,
    vocab: int = 512,
) -> dict:
    """``c`` streams hanging up after ``hang_after`` chunks; ``names``: the server's running and
    waiting gauges (another server's, e.g. vLLM's)."""
    ps = prompts(c, vocab=vocab, seed=seed)
    sampler = GaugeSampler(base, names)
    async with http_session() as session:
        await wait_idle(session, base, names=names)
        sampler.start()
        try:
            results = await asyncio.gather(
                *(
                    stream_with(CLIENT, session, base, f"{tag}-{i}", p, max_tokens, hang_up_after=hang_after)
                    for i, p in enumerate(ps)
                )
            )
            deadline = time.perf_counter() + 10
            while time.perf_counter() < deadline and await gauges(session, base, names) > 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)  # (the sampler's last samples: after the last release)
        finally:
            samples = sampler.stop()
    closes = sorted(r.t_close for r in results if r.t_close is not None)
    # each drop of running+waiting after the first hang-up is one release (or several)
    releases = []
    prev = None
    for t, v in samples:
        if prev is not None and v < prev and closes and t >= closes[0]:
            releases += [t] * int(round(prev - v))
        prev = v
    lat = [r - h for h, r in zip(closes, releases, strict=False)]
    gaps = [b[0] - a[0] for a, b in pairwise(samples)]
    return {
        "latency": lat,
        "unmatched": len(closes) - len(lat),
        "poll_gap_p50": p50(gaps),
        "errors": [r.error for r in results if r.error][:3],
    }


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument(
        "--requests",
        type=int,
        default=128,
        help="disconnecting requests per level, at least (a p99 of 32 is the slowest one)",
    )
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--abort-calls", type=int, default=1000)
    ap.add_argument("--bulk-calls", type=int, default=50)
    ap.add_argument("--bulk-ids", type=int, default=1000)
    ap.add_argument("--bulk-gap-ms", type=float, default=20.0, help="pause between two bulk calls")
    ap.add_argument("--release-concurrency", default="1,8,32")
    ap.add_argument(
        "--release-samples",
        type=int,
        default=160,
        help="hang-ups per level, at least (at 32 streams one wave is 32 hang-ups that land in a few "
        "clusters, one sample of them: 160 is five waves)",
    )
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--real-redis", action="store_true", help="start a redis-server here and use it")
    ap.add_argument("--seed", type=int, default=0)
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
        help="the streaming client: lean (bench/sse_client.py) or aiohttp's",
    )
    ap.add_argument(
        "--serve-tree",
        default=None,
        help="run fd serve from this checkout (a worktree of another commit), under this client",
    )
    ap.add_argument("--output-json", default=str(RESULTS / "abort.json"))
    args = ap.parse_args()
    global CLIENT
    CLIENT = args.client
    conc = [int(x) for x in args.concurrency.split(",") if x]  # "" skips that part
    rconc = [int(x) for x in args.release_concurrency.split(",") if x] if args.release_concurrency else []
    rng = random.Random(args.seed)

    tmp = tempfile.mkdtemp(prefix="fd-bench-abort-")
    mdir = model_dir(args.model, tmp)
    redis_srv = start_redis_server() if args.real_redis else None
    url = redis_srv.url if redis_srv else args.redis_url
    prefix = f"fdb{time.time_ns() % 10**8}"
    srv = start_serve(
        mdir,
        redis_url=url,
        log_dir=tmp,
        extra=[
            "--prefix",
            prefix,
            "--max-num-seqs",
            str(max([64, *conc])),
            "--num-blocks",
            "8192",
            *args.serve_arg,
        ],
        tree=args.serve_tree,
    )
    out: dict = {
        "model": mdir,
        "server": "redis" if url else "embedded",
        "disconnects": {},
        "release": {},
        "serve_args": args.serve_arg,
    }
    try:

        async def warm():
            async with http_session() as s:
                await asyncio.gather(
                    *(
                        stream_completion(s, srv.base, f"warm-{i}", p, 8)
                        for i, p in enumerate(prompts(4, seed=5))
                    )
                )

        asyncio.run(warm())
        quiet_gc()
        total = sum(max(n, args.requests) for n in conc)
        with tqdm(total=total, desc="disconnects", unit="req") as bar:
            for n in conc:
                res = asyncio.run(
                    disconnects(srv.base, n, max(n, args.requests), args.max_tokens, rng, f"d{n}", bar)
                )
                story, runs = asyncio.run(stories(srv.redis_url, prefix, [r.request_id for r in res]))
                out["disconnects"][n] = analyse(res, story, runs)
        waves = {c: max(1, -(-args.release_samples // c)) for c in rconc}
        with tqdm(total=sum(waves.values()), desc="release (TARGETS)", unit="wave") as bar:
            for c in rconc:
                lat, unmatched, gaps = [], 0, []
                for w in range(waves[c]):
                    r = asyncio.run(release_wave(srv.base, c, 900, 10, 1000 + w, f"rel{c}w{w}"))
                    lat += r["latency"]
                    unmatched += r["unmatched"]
                    gaps.append(r["poll_gap_p50"])
                    bar.update(1)
                out["release"][c] = {"latency": lat, "unmatched": unmatched, "poll_gap_p50": p50(gaps)}
        with (
            tqdm(
                total=2 * (args.abort_calls + args.bulk_calls), desc="/v1/abort_requests", unit="call"
            ) as bar,
            on_the_workers_cpu(),
        ):
            for name, keepalive in (("abort_endpoint", True), ("abort_endpoint_new_conn", False)):
                out[name] = asyncio.run(
                    abort_endpoint(
                        srv.base,
                        args.abort_calls,
                        args.bulk_calls,
                        args.bulk_ids,
                        args.bulk_gap_ms / 1000,
                        bar,
                        keepalive=keepalive,
                    )
                )
    finally:
        srv.stop()
        if redis_srv is not None:
            redis_srv.stop()

    tables = []
    rows = []
    for n in conc:
        d = out["disconnects"][n]
        row = [n, len(d["tokens_after_disconnect"]), float(p50(d["step_ms"]))]
        for name in ("abort_requested", "drained", "blocks_released"):
            row += [p50(d["ms"][name]), p99(d["ms"][name])]
        row += [p50(d["beyond_step_ms"]), p99(d["beyond_step_ms"])]
        row += [
            p50(d["steps"]["abort_requested"]),
            p99(d["steps"]["abort_requested"]),
            p99(d["steps"]["blocks_released"]),
            p50(d["tokens_after_disconnect"]),
            p99(d["tokens_after_disconnect"]),
            max(d["discarded"] or [0]),
            d["tokens_events_after_abort_requested"],
            d["num_problems"],
        ]
        rows.append(row)
    tables.append(
        print_table(
            f"abort: random disconnects (K in [3, 30] chunks, {args.max_tokens}-token requests), "
            f"control plane {out['server']}; ms from the client's close, steps from its last chunk",
            [
                "streams",
                "n",
                "step ms p50",
                "→abort_requested p50 ms",
                "p99",
                "→drained p50 ms",
                "p99",
                "→blocks_released p50 ms",
                "p99",
                "→released beyond the step it waited for p50 ms",
                "p99",
                "steps →abort_req p50",
                "p99",
                "steps →released p99",
                "tokens after disconnect p50",
                "p99",
                "max discarded in flight",
                "tokens events after abort_requested",
                "problems",
            ],
            rows,
            nd=1,
        )
    )
    rows = []
    for c in rconc:
        r = out["release"][c]
        rows.append(
            [
                c,
                len(r["latency"]),
                MS * p50(r["latency"]),
                MS * p99(r["latency"]),
                r["unmatched"],
                MS * r["poll_gap_p50"],
            ]
        )
    tables.append(
        print_table(
            "abort: TARGETS.md release (900 tokens, hang up after 10 chunks; "
            "running+waiting gauges polled every 5 ms)",
            [
                "concurrency",
                "hang-ups",
                "hang-up → released p50 ms",
                "p99 ms",
                "unmatched",
                "poll period p50 ms",
            ],
            rows,
            nd=1,
        )
    )
    rows = []
    for name, how in (
        ("abort_endpoint", "one connection"),
        ("abort_endpoint_new_conn", "a new connection each"),
    ):
        a = out[name]
        for n, xs in ((1, a["single"]), (args.bulk_ids, a["bulk"])):
            rows.append([n, how, len(xs), MS * p50(xs), MS * p99(xs), MS * max(xs, default=float("nan"))])
    tables.append(
        print_table(
            "abort: POST /v1/abort_requests, time to the HTTP answer",
            ["ids per call", "calls on", "calls", "p50 ms", "p99 ms", "max ms"],
            rows,
            nd=2,
        )
    )
    goals = []
    for n in conc:
        d = out["disconnects"][n]
        step = float(p50(d["step_ms"]))
        goals += [
            goal(
                "hang-up → blocks_released p99, ms: one engine step (p50) + 5",
                f"{n} streams",
                p99(d["ms"]["blocks_released"]),
                "<=",
                step + 5,
            ),
            goal(
                "the same, less the step the release waited for",
                f"{n} streams",
                p99(d["beyond_step_ms"]),
                "<=",
                5.0,
            ),
            goal(
                "tokens events after abort_requested",
                f"{n} streams",
                d["tokens_events_after_abort_requested"],
                "==",
                0,
            ),
        ]
    for name, how in (
        ("abort_endpoint", "one connection"),
        ("abort_endpoint_new_conn", "a new connection each"),
    ):
        goals.append(
            goal(
                f"/v1/abort_requests with {args.bulk_ids:,} ids, p99 ms",
                how,
                MS * p99(out[name]["bulk"]),
                "<",
                5.0,
            )
        )
    tables.append(print_goals("abort: issue #5's goals, as this run measured them", goals))
    out["goals"] = goals
    out["tables"] = tables
    write_json(args.output_json, out)


if __name__ == "__main__":
    main()
