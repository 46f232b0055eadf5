"""Prefix-aware placement against blind claims (DESIGN.md §4c), on a multi-turn chat workload.

Workload: ``--tenants`` tenants, each with a system prompt of ``--system-len`` tokens; ``4 x N``
sessions (N engines), spread over the tenants, each ``--turns`` turns long: a turn's prompt is
its tenant's system prompt, the session's earlier turns (user message and answer) and a new
user message of ``--user-len`` tokens; the answer is ``--output-len`` tokens. Every session runs
its turns one after another, all sessions at once (equal offered load for every mode). The
skewed variant sends 3/4 of the sessions to one tenant (a hot prefix). Prompts go as token ids
to ``/v1/completions``, streamed; an answer's tokens come back as ``token_ids``, and the next
turn repeats them as the chat would.

Modes, each on its own redis-server, engines and API node, one after another:
- ``blind``: ``fd api --placement blind`` (every request on ``P:requests``, the first engine
  with room claims it);
- ``prefix``: ``fd api --placement prefix`` (the default);
- ``ideal``: one engine with N x the KV cache, N x the batch and steps N x as fast: the
  hit-rate ceiling (its TTFT is not comparable, and not compared).

Engines: ``--sim``: ``fd engine --executor timed`` whose step time follows a cost model fitted
to the real model on this machine (``step + per token computed + per row sampled``; ``--fit``
measures it with SmolLM2-135M, or ``--cost A,B,C`` gives it), so N = 2..16 engines run on two
cores; ``--real``: N = 2 ``fd engine`` processes with SmolLM2-135M itself.

Figures: prefix-cache hit rate (prompt tokens found cached, from the engines' counters), TTFT
p50/p99 (client), output tok/s, queue time p99 (``request_accepted`` -> ``request_claimed`` on
``P:lifecycle``), per-engine load spread (max/mean requests claimed), and placement's own time
(``fd_placement_seconds``' mean from the API's /metrics, and ``Placement.choose`` timed on the
run's own cards and prompts).

Usage: python bench/placement.py [--fit | --cost A,B,C] [--engines 2,4,8,16] [--real]
                                 [--quick] [--output-json bench/results/placement.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench._common import (  # noqa: E402
    RESULTS,
    ROOT,
    environment,
    free_port,
    kill_pid,
    p50,
    p99,
    print_table,
    start_redis_server,
    write_json,
)

PREFIX = "fd"


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    tenants: int
    system_len: int
    sessions: int
    turns: int
    user_len: int
    output_len: int
    skewed: bool
    seed: int = 0
    systems: list[list[int]] = field(default_factory=list)
    tenant_of: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        rnd = random.Random(self.seed)
        self.systems = [
            [rnd.randrange(1000, 40000) for _ in range(self.system_len)] for _ in range(self.tenants)
        ]
        if self.skewed:  # 3/4 of the sessions on tenant 0, the rest round the others
            hot = (3 * self.sessions) // 4
            self.tenant_of = [0] * hot + [1 + i % (self.tenants - 1) for i in range(self.sessions - hot)]
        else:
            self.tenant_of = [i % self.tenants for i in range(self.sessions)]
        rnd.shuffle(self.tenant_of)

    def user(self, session: int, turn: int) -> list[int]:
        rnd = random.Random(self.seed * 7919 + session * 131 + turn)
        return [rnd.randrange(1000, 40000) for _ in range(self.user_len)]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    errors: int = 0


async def run_sessions(url: str, model: str, w: Workload) -> Result:
    import aiohttp
    import orjson

    res = Result()

    async def turn(s: aiohttp.ClientSession, prompt: list[int]) -> list[int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": w.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        t0 = time.perf_counter()
        got: list[int] = []
        first = None
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.errors += 1
                return []
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = orjson.loads(line[6:])
                for c in ev.get("choices", ()):
                    ids = c.get("token_ids") or []
                    if (ids or c.get("text")) and first is None:
                        first = time.perf_counter() - t0
                    got += ids
        if first is not None:
            res.ttft.append(first)
        res.tokens += len(got)
        return got

    async def session(s: aiohttp.ClientSession, i: int) -> None:
        history = list(w.systems[w.tenant_of[i]])
        for t in range(w.turns):
            prompt = history + w.user(i, t)
            answer = await turn(s, prompt)
            history = prompt + answer

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(s, i) for i in range(w.sessions)))
        res.seconds = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------- processes


@dataclass
class Cost:
    step_ms: float
    per_token_ms: float
    per_row_ms: float

    def scaled(self, k: float) -> Cost:
        return Cost(self.step_ms / k, self.per_token_ms / k, self.per_row_ms / k)


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    fh = open(log, "wb")  # noqa: SIM115  (the child's for its life)
    return subprocess.Popen(
        [sys.executable, "-m", "fd", *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ}
    )


def engine_args(
    url: str, model: str, eid: str, blocks: int, seqs: int, cost: Cost | None, steal_ms: int
) -> list[str]:
    a = ["engine", "--redis-url", url, "--prefix", PREFIX, "--model", model, "--engine-id", eid]
    a += ["--num-blocks", str(blocks), "--max-num-seqs", str(seqs), "--steal-after-ms", str(steal_ms)]
    a += ["--no-journal", "--disable-log-stats"]
    if cost is not None:
        a += ["--executor", "timed", "--step-ms", f"{cost.step_ms:.3f}"]
        a += [
            "--step-per-token-ms",
            f"{cost.per_token_ms:.5f}",
            "--step-per-row-ms",
            f"{cost.per_row_ms:.4f}",
        ]
    else:
        a += ["--worker-cpus", "none"]
    return a


async def wait_health(url: str, engines: int, timeout: float = 180.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200 and len((await r.json()).get("engines", ())) >= engines:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit(f"{url}: {engines} engine(s) never showed up")


async def lifecycle_figures(url: str) -> tuple[float, float]:
    """(queue time p99 in s, per-engine spread: max/mean requests claimed) from P:lifecycle."""
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.events import RequestAccepted, RequestClaimed
    from fd.control.keys import Keys

    client = connect(url)
    bus = Bus(client, Keys(PREFIX))
    cursor: bytes = b"0-0"
    accepted: dict[str, int] = {}
    claimed: dict[str, int] = {}
    per: dict[str, int] = {}
    while True:
        cursor, evs = await bus.read_lifecycle(cursor, None)
        if not evs:
            break
        for _, ev in evs:
            if isinstance(ev, RequestAccepted):
                accepted[ev.request_id] = ev.ts
            elif isinstance(ev, RequestClaimed) and ev.request_id not in claimed:
                claimed[ev.request_id] = ev.ts
                per[ev.engine] = per.get(ev.engine, 0) + 1
    await client.aclose()
    waits = [(claimed[r] - accepted[r]) / 1000 for r in claimed if r in accepted]
    spread = max(per.values()) / (sum(per.values()) / len(per)) if per else float("nan")
    return (p99(waits) if waits else float("nan")), spread


async def engine_counters(url: str) -> tuple[int, int]:
    from fd.control.connect import connect

    client = connect(url)
    q = h = 0
    async for key in client.scan_iter(match=f"{PREFIX}:engine:*"):
        f = await client.hgetall(key)
        q += int(f.get(b"cache_queries", 0))
        h += int(f.get(b"cache_hits", 0))
    await client.aclose()
    return q, h


async def served_name(api: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(api + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def placement_seconds(api: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(api + "/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("fd_placement_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("fd_placement_seconds_count"):
            count = float(line.split()[-1])
    return total / count if count else float("nan")


async def one_run(a, mode: str, n: int, w: Workload, cost: Cost | None, tmp: str) -> dict:
    """One mode on fresh processes: a redis-server, engines, an API node; the workload."""
    redis = start_redis_server()
    url = f"redis://127.0.0.1:{redis.port}"
    procs: list[subprocess.Popen] = []
    try:
        if mode == "ideal":
            specs = [("e0", a.blocks * n, a.max_num_seqs * n, cost.scaled(n) if cost else None)]
        else:
            specs = [(f"e{i}", a.blocks, a.max_num_seqs, cost) for i in range(n)]
        for eid, blocks, seqs, c in specs:
            log = Path(tmp) / f"{mode}-{n}-{eid}.log"
            procs.append(spawn(engine_args(url, a.model, eid, blocks, seqs, c, a.steal_after_ms), log))
        port = free_port()
        api_args = ["api", "--redis-url", url, "--prefix", PREFIX, "--model", a.model, "--port", str(port)]
        api_args += ["--placement", "blind" if mode == "blind" else "prefix", "--disable-uvicorn-access-log"]
        procs.append(spawn(api_args, Path(tmp) / f"{mode}-{n}-api.log"))
        api = f"http://127.0.0.1:{port}"
        await wait_health(api, len(specs))
        await asyncio.sleep(0.5)  # (the cards)
        res = await run_sessions(api, await served_name(api), w)
        queries, hits = await engine_counters(url)
        queue_p99, spread = await lifecycle_figures(url)
        place_s = await placement_seconds(api)
    finally:
        for p in reversed(procs):
            kill_pid(p, grace=5)
        redis.stop()
    return {
        "mode": mode,
        "engines": n,
        "hit_rate": hits / queries if queries else float("nan"),
        "ttft_p50_ms": p50(res.ttft) * 1000,
        "ttft_p99_ms": p99(res.ttft) * 1000,
        "tok_s": res.tokens / res.seconds if res.seconds else 0.0,
        "queue_p99_ms": queue_p99 * 1000,
        "spread": spread,
        "placement_mean_ms": place_s * 1000,
        "errors": res.errors,
        "requests": len(res.ttft),
    }


def choose_timing(n: int, w: Workload, blocks: int, reps: int = 2000) -> tuple[float, float]:
    """``Placement.choose`` (p50, p99 in ms) over ``n`` cards each holding ``blocks`` blocks
    (a few tenants' prompts and random others), for the workload's longest prompts."""
    from fd.api.placement import Placement
    from fd.control.events import Request
    from fd.control.lanes import Card
    from fd.control.prefix import chain, short
    from fd.control.request_data import RequestData
    from fd.control.sampling import SamplingParams

    rnd = random.Random(3)
    cards = []
    for i in range(n):
        held = {short(h) for t in range(i % w.tenants, w.tenants, max(n, 1)) for h in chain(w.systems[t], 16)}
        held |= {rnd.getrandbits(64) for _ in range(max(blocks - len(held), 0))}
        cards.append(Card(f"e{i}", 16, rnd.randrange(8), 0, 100, blocks, 8, 1, frozenset(held)))
    p = Placement(bus=None)  # type: ignore[arg-type]  (choices read no Redis)
    p.cards = {c.engine: c for c in cards}
    reqs = []
    for i in range(64):
        history = [*w.systems[i % w.tenants], *w.user(i, 0), *w.user(i, 1), *w.user(i, 2)]
        sp = SamplingParams()
        reqs.append(
            Request(request_id=f"r{i}", data=RequestData(prompt_token_ids=tuple(history), sampling=sp))
        )
    times = []
    for k in range(reps):
        p.read_at = time.monotonic()
        p.placed.clear()
        t0 = time.perf_counter()
        p.choose(reqs[k % len(reqs)])
        times.append((time.perf_counter() - t0) * 1000)
    return p50(times), p99(times)


# --------------------------------------------------------------------------- the cost model


def fit_cost(model: str) -> tuple[Cost, list[list]]:
    """Least squares (of the relative error) of ``step + per_token x tokens + per_row x rows``
    over timed runs of the real model (fd's LLM on this machine): prefills of 64..1024 tokens
    and decode steps of 1..32 rows. A prefill's attention grows with its square, which this
    line cannot follow: it is fitted where the workload's prefills are."""
    import numpy as np

    from fd.control.sampling import SamplingParams
    from fd.control.tokenizer import Tokenizer
    from fd.engine.runner.llm import LLM
    from fd.engine.runner.model_runner import ModelRunner

    runner = ModelRunner(model, device="cpu", num_blocks=1024, block_size=16)
    llm = LLM(runner, Tokenizer.from_dir(model), max_num_seqs=64, enable_prefix_caching=False)
    rnd = random.Random(1)
    rows: list[tuple[int, int, float]] = []  # (tokens computed, rows sampled, ms)

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return (time.perf_counter() - t0) * 1000

    timed([[rnd.randrange(1000, 40000) for _ in range(32)]], 2)  # warm-up
    for p in (64, 256, 512, 1024):
        ms = min(timed([[rnd.randrange(1000, 40000) for _ in range(p)]], 1) for _ in range(2))
        rows.append((p, 1, ms))
    for r in (1, 8, 32):
        prompts = [[rnd.randrange(1000, 40000) for _ in range(8)] for _ in range(r)]
        short = min(timed(prompts, 1) for _ in range(2))
        long = min(timed(prompts, 17) for _ in range(2))
        rows.append((r, r, (long - short) / 16))  # one decode step of r rows
    # least squares of the relative error: a 20 ms decode step counts as much as a 1 s prefill
    x = np.array([[1.0 / ms, t / ms, r / ms] for t, r, ms in rows])
    coef, *_ = np.linalg.lstsq(x, np.ones(len(rows)), rcond=None)
    step, per_tok, per_row = (max(float(c), 0.0) for c in coef)
    cost = Cost(step, per_tok, per_row)
    table = [[t, r, ms, step + per_tok * t + per_row * r] for t, r, ms in rows]
    return cost, table


# --------------------------------------------------------------------------- main


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: SmolLM2-135M, as fd serve resolves it)")
    p.add_argument("--fit", action="store_true", help="fit the cost model to the real model first")
    p.add_argument("--cost", default="24,0.45,2.5", help="step_ms,per_token_ms,per_row_ms (without --fit)")
    p.add_argument("--engines", default="2,4,8,16", help="N for the simulated runs")
    p.add_argument("--real", action="store_true", help="also N=2 with the real model")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1024, help="KV blocks of 16 tokens per engine")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--steal-after-ms", type=int, default=250)
    p.add_argument("--quick", action="store_true", help="N=2,4 only, 2 turns")
    p.add_argument("--output-json", default=str(RESULTS / "placement.json"))
    return p.parse_args(argv)


async def run(a) -> int:
    from fd.cli.models import resolve_model

    a.model = str(resolve_model(a.model))
    tmp = tempfile.mkdtemp(prefix="fd-bench-placement-")
    out: dict = {"environment": environment(), "args": {k: v for k, v in vars(a).items()}}
    if a.fit:
        cost, table = fit_cost(a.model)
        print_table(
            "cost model fitted to the real model (ms)",
            ["tokens computed", "rows sampled", "measured", "model"],
            table,
            nd=1,
        )
        out["fit"] = table
    else:
        cost = Cost(*(float(x) for x in a.cost.split(",")))
    out["cost"] = vars(cost)
    print(
        f"cost model: step {cost.step_ms:.2f} ms + {cost.per_token_ms:.4f} ms/token + {cost.per_row_ms:.3f} ms/row"
    )
    ns = [int(x) for x in a.engines.split(",")]
    if a.quick:
        ns, a.turns = [n for n in ns if n <= 4], 2
    rows = []
    for skewed in (False, True):
        for n in ns:
            w = Workload(a.tenants, a.system_len, 4 * n, a.turns, a.user_len, a.output_len, skewed)
            for mode in ("blind", "prefix", "ideal"):
                r = await one_run(a, mode, n, w, cost, tmp)
                r["variant"] = "skewed" if skewed else "multi-turn"
                r["model"] = "simulated"
                rows.append(r)
                print(
                    f"  {r['variant']:<10} N={n:<2} {mode:<6} hit {r['hit_rate']:.2f} ttft p50 {r['ttft_p50_ms']:.0f} ms tok/s {r['tok_s']:.0f}",
                    flush=True,
                )
    timing = []
    for n in (2, 4, 8, 16):
        w = Workload(a.tenants, a.system_len, 4 * n, a.turns, a.user_len, a.output_len, False)
        t50, t99 = choose_timing(n, w, a.blocks)
        timing.append([n, a.blocks, a.system_len + 3 * a.user_len, t50, t99])
    print_table(
        "Placement.choose, in the API's path (ms)",
        ["engines", "blocks per card", "prompt tokens", "p50", "p99"],
        timing,
        nd=3,
    )
    out["choose"] = timing
    if a.real:
        w = Workload(a.tenants, a.system_len // 2, 8, a.turns, a.user_len, a.output_len, False)
        for mode in ("blind", "prefix"):
            r = await one_run(a, mode, 2, w, None, tmp)
            r["variant"], r["model"] = "multi-turn", "SmolLM2-135M"
            rows.append(r)
            print(
                f"  real N=2 {mode:<6} hit {r['hit_rate']:.2f} ttft p50 {r['ttft_p50_ms']:.0f} ms", flush=True
            )
    headers = [
        "model",
        "variant",
        "N",
        "mode",
        "hit rate",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "tok/s",
        "queue p99 ms",
        "spread",
        "place ms",
        "errors",
    ]
    table = [
        [
            r["model"],
            r["variant"],
            r["engines"],
            r["mode"],
            r["hit_rate"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["tok_s"],
            r["queue_p99_ms"],
            r["spread"],
            r["placement_mean_ms"],
            r["errors"],
        ]
        for r in rows
    ]
    print_table(
        "placement: blind claims, prefix-aware placement, ideal (one engine, N x cache)", headers, table, nd=2
    )
    goals = []
    for r in rows:
        if r["mode"] != "prefix":
            continue
        same = {
            x["mode"]: x
            for x in rows
            if x["variant"] == r["variant"] and x["engines"] == r["engines"] and x["model"] == r["model"]
        }
        blind, ideal = same["blind"], same.get("ideal")
        g = {"model": r["model"], "variant": r["variant"], "N": r["engines"]}
        if ideal is not None:
            g["hit_vs_ideal"] = r["hit_rate"] / ideal["hit_rate"] if ideal["hit_rate"] else float("nan")
        g["ttft_p50_vs_blind"] = (
            r["ttft_p50_ms"] / blind["ttft_p50_ms"] if blind["ttft_p50_ms"] else float("nan")
        )
        g["tok_s_vs_blind"] = r["tok_s"] / blind["tok_s"] if blind["tok_s"] else float("nan")
        goals.append(g)
    print_table(
        "prefix vs blind (goals: hit >= 0.9 x ideal and TTFT p50 <= 0.5 x blind at N=4,8; skewed tok/s >= 0.95 x blind)",
        ["model", "variant", "N", "hit / ideal", "TTFT p50 / blind", "tok/s / blind"],
        [
            [
                g["model"],
                g["variant"],
                g["N"],
                g.get("hit_vs_ideal", float("nan")),
                g["ttft_p50_vs_blind"],
                g["tok_s_vs_blind"],
            ]
            for g in goals
        ],
        nd=2,
    )
    out["rows"], out["goals"] = rows, goals
    write_json(a.output_json, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse(list(sys.argv[1:] if argv is None else argv))))


if __name__ == "__main__":
    raise SystemExit(main())
