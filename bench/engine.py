"""Engine benchmark: tokens/s of the model alone, and what the engine loop adds around it.

For batch sizes 1/8/32 (33-token prompts, 256 output tokens, greedy, ignore_eos):

- ``llm``: :class:`engine.llm.LLM`, the scheduler and the runner in a plain loop (no Redis);
- ``node``: a real :class:`engine.node.EngineNode` on the embedded control plane
  (``fd.compose.start_engine`` with the in-process fakeredis client, as in ``fd serve``),
  requests submitted to ``P:requests`` in one round trip, the run ending when the last
  ``final`` is published;
- ``node/redis``: the same node on a real redis-server started here on a free port (skip with
  ``--no-real-redis``): the same loop with a C server and hiredis instead of fakeredis.

Both share one :class:`ModelRunner`, whose ``execute`` is wrapped with a timer, so the "forward"
column is time inside ``runner.execute`` (in the step thread for the node). Columns:

- ``overhead`` = (wall - forward) / wall: the share of the run spent outside the model forward
  (scheduler, detokenizer, publishing, claiming, thread hand-off), the engine loop's own cost;
- ``step_s`` = ``node.step_seconds`` (submit of the step to the thread -> result back in the
  loop), so ``wall - step_s`` is the loop's serial time between steps;
- ``node/llm`` = node tok/s over in-process tok/s, measured back to back in each repetition.

Each configuration runs ``--reps`` times interleaved (llm, node, llm, node...); the table shows
medians. Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss`` after each part.

Usage: python bench/engine.py [--model DIR] [--batches 1,8,32] [--reps 3] [--max-tokens 256]
                             [--output-json bench/results/engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# bench/engine.py must not shadow the ``engine`` package: drop bench/ from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from tqdm import tqdm  # noqa: E402

from bench._common import (PROMPT_LEN, RESULTS, model_dir, peak_rss_mb, print_table,  # noqa: E402
                           prompts, start_redis_server, write_json)
from control.events import Accepted, Final, Request, RequestData, SamplingParams  # noqa: E402


class TimedRunner:
    """Delegates to a runner and sums the time spent inside ``execute`` (thread-safe enough:
    one step runs at a time)."""

    def __init__(self, inner):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        self.seconds = 0.0
        self.calls = 0

    def execute(self, out):
        t = time.perf_counter()
        res = self.inner.execute(out)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return res

    def reset(self) -> tuple[float, int]:
        s, c = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return s, c


def run_llm(llm, runner: TimedRunner, batch: int, max_tokens: int, seed: int) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ps = prompts(batch, seed=seed)
    runner.reset()
    t = time.perf_counter()
    gens = llm.generate(ps, sp)
    wall = time.perf_counter() - t
    fwd, steps = runner.reset()
    ntok = sum(len(g.token_ids) for g in gens)
    assert ntok == batch * max_tokens, (ntok, batch * max_tokens)
    return {"wall_s": wall, "forward_s": fwd, "steps": steps, "tokens": ntok,
            "tok_per_s": ntok / wall, "overhead": (wall - fwd) / wall}


class FinalCounter:
    """Wraps the node's ``publish_many``: notes when the last expected ``final`` went out, and
    how long the loop spent awaiting publishes."""

    def __init__(self, bus):
        self.bus = bus
        self.inner = bus.publish_many
        self.expect = 0
        self.finals = 0
        self.done = asyncio.Event()
        self.t_done = 0.0
        self.publish_s = 0.0
        self.publishes = 0
        self.events = 0
        bus.publish_many = self  # instance attribute: the node calls self.bus.publish_many

    async def __call__(self, items, expire=(), ack=()):
        t = time.perf_counter()
        out = await self.inner(items, expire=expire, ack=ack)
        now = time.perf_counter()
        self.publish_s += now - t
        self.publishes += 1
        self.events += len(items)
        self.finals += sum(1 for _, ev in items if isinstance(ev, Final))
        if self.expect and self.finals >= self.expect and not self.done.is_set():
            self.t_done = now
            self.done.set()
        return out

    def arm(self, n: int) -> None:
        self.expect, self.finals, self.done = n, 0, asyncio.Event()
        self.publish_s, self.publishes, self.events = 0.0, 0, 0


async def run_node(eng, counter: FinalCounter, runner: TimedRunner, batch: int, max_tokens: int,
                   seed: int, tag: str) -> dict:
    node = eng.node
    bus = node.bus
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    items = []
    rids = []
    for i, ids in enumerate(prompts(batch, seed=seed)):
        rid = f"{tag}-{i}"
        rids.append(rid)
        items += [(bus.keys.req(rid), Accepted(request_id=rid, prompt_tokens=len(ids), endpoint="completion")),
                  (bus.keys.requests, Request(request_id=rid, data=RequestData(
                      prompt_token_ids=tuple(ids), sampling=sp)))]
    counter.arm(batch)
    runner.reset()
    steps0, step_s0 = node.steps, node.step_seconds
    t0 = time.perf_counter()
    await counter.inner(items)  # one round trip: one claim can see them all
    await asyncio.wait_for(counter.done.wait(), 300)
    wall = counter.t_done - t0
    fwd, calls = runner.reset()
    step_s = node.step_seconds - step_s0
    steps = node.steps - steps0
    ntok = 0
    for rid in rids:  # check, outside the timed part
        for _, ev in await bus.read_req(rid):
            if isinstance(ev, Final):
                ntok += int(ev.usage["completion_tokens"])
    assert ntok == batch * max_tokens, (ntok, batch * max_tokens)
    return {"wall_s": wall, "forward_s": fwd, "step_s": step_s, "steps": steps, "tokens": ntok,
            "tok_per_s": ntok / wall, "overhead": (wall - fwd) / wall,
            "between_steps": (wall - step_s) / wall, "publish_s": counter.publish_s,
            "publishes": counter.publishes, "events": counter.events}


async def node_part(runner: TimedRunner, tok, llm, batches, reps, max_tokens, results, bar,
                    real_redis: bool):
    from control.embedded import EmbeddedRedis
    from control.connect import connect
    from control.keys import Keys
    from fd.compose import EngineOptions, start_engine

    emb = EmbeddedRedis()
    emb.start()
    srv = start_redis_server() if real_redis else None
    eng2 = counter2 = None
    try:
        if srv is not None:
            eng2 = await start_engine(lambda: connect(srv.url), Keys("bench"),
                                      EngineOptions(model_dir="unused", num_blocks=runner.num_blocks,
                                                    max_num_seqs=max(64, max(batches))),
                                      runner=runner, tokenizer=tok)
            counter2 = FinalCounter(eng2.node.bus)
        eng = await start_engine(emb.client, Keys("bench"),
                                 EngineOptions(model_dir="unused", num_blocks=runner.num_blocks,
                                               max_num_seqs=max(64, max(batches))),
                                 runner=runner, tokenizer=tok)
        counter = FinalCounter(eng.node.bus)
        try:
            for rep in range(reps):
                for b in batches:
                    # in-process LLM in a thread, so the node's loop keeps its heartbeat going
                    r = await asyncio.to_thread(run_llm, llm, runner, b, max_tokens, rep)
                    results["llm"][b].append(r)
                    bar.update(1)
                    r = await run_node(eng, counter, runner, b, max_tokens, rep, f"r{rep}b{b}")
                    results["node"][b].append(r)
                    bar.update(1)
                    if eng2 is not None:
                        r = await run_node(eng2, counter2, runner, b, max_tokens, rep, f"r{rep}b{b}")
                        results["node_redis"][b].append(r)
                        bar.update(1)
            results["rss_after_node_mb"] = peak_rss_mb()
        finally:
            await eng.stop()
    finally:
        if eng2 is not None:
            await eng2.stop()
        emb.stop()
        if srv is not None:
            srv.stop()


def med(rs: list[dict], k: str) -> float:
    return statistics.median(r[k] for r in rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the tiny model, made in a temp dir)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--no-real-redis", action="store_true", help="skip the node on a real redis-server")
    ap.add_argument("--output-json", default=str(RESULTS / "engine.json"))
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]

    from control.tokenizer import Tokenizer
    from engine.llm import LLM
    from engine.model_runner import ModelRunner

    tmp = tempfile.mkdtemp(prefix="fd-bench-engine-")
    mdir = model_dir(args.model, tmp)
    rss0 = peak_rss_mb()
    inner = ModelRunner(mdir, device="cpu", num_blocks=args.num_blocks, block_size=16)
    inner.warmup()
    runner = TimedRunner(inner)
    tok = Tokenizer.from_dir(mdir)
    llm = LLM(runner, tok, max_num_seqs=max(64, max(batches)))
    run_llm(llm, runner, max(batches), 16, 99)  # warm the shapes
    rss_model = peak_rss_mb()

    real = not args.no_real_redis
    results: dict = {k: {b: [] for b in batches} for k in ("llm", "node", "node_redis")}
    with tqdm(total=(3 if real else 2) * len(batches) * args.reps, desc="engine", unit="run") as bar:
        asyncio.run(node_part(runner, tok, llm, batches, args.reps, args.max_tokens, results, bar, real))

    rows = []
    for b in batches:
        L = results["llm"][b]
        rows.append([b, "llm (in-process)", med(L, "tok_per_s"), 1.0,
                     1000 * med(L, "forward_s") / med(L, "steps"),
                     1000 * (med(L, "wall_s") - med(L, "forward_s")) / med(L, "steps"),
                     100 * med(L, "overhead"), "-", "-"])
        for kind, label in (("node", "node, embedded"), ("node_redis", "node, redis-server")):
            N = results[kind][b]
            if not N:
                continue
            rows.append([b, label, med(N, "tok_per_s"), med(N, "tok_per_s") / med(L, "tok_per_s"),
                         1000 * med(N, "forward_s") / med(N, "steps"),
                         1000 * (med(N, "wall_s") - med(N, "forward_s")) / med(N, "steps"),
                         100 * med(N, "overhead"), 100 * med(N, "between_steps"),
                         1000 * med(N, "publish_s") / med(N, "publishes")])
    headers = ["batch", "path", "tok/s", "vs llm", "forward ms/step", "outside forward ms/step",
               "overhead %", "wall - step_seconds %", "publish ms/flush"]
    print_table(f"engine: {PROMPT_LEN}-token prompts, {args.max_tokens} output tokens, greedy, "
                f"ignore_eos; medians of {args.reps}", headers, rows, nd=2)
    print(f"peak RSS: {rss0:.0f} MiB at start, {rss_model:.0f} MiB with the model loaded, "
          f"{results['rss_after_node_mb']:.0f} MiB after all runs")
    write_json(args.output_json, {"model": mdir, "max_tokens": args.max_tokens, "reps": args.reps,
                                  "rss_start_mb": rss0, "rss_model_mb": rss_model,
                                  "table": {"headers": headers, "rows": rows}, "runs": results})


if __name__ == "__main__":
    main()
