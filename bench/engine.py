"""Engine benchmark: tokens/s of the model alone, and what the engine loop adds around it.

For batch sizes 1/8/32 (33-token prompts, 256 output tokens, greedy, ignore_eos):

- ``llm``: :class:`fd.engine.runner.llm.LLM`, the scheduler and the runner in a plain loop (no Redis),
  the model in this process;
- ``node, sync``: a real :class:`fd.engine.node.node.EngineNode` on the embedded control plane
  (``fd.compose.start_engine`` with the in-process fakeredis client, as in ``fd serve``), the
  model in a worker process (``--executor paddle``, the default), each step decided after the
  last one's results are in (``--no-async-scheduling``);
- ``node, async``: the same with async scheduling (the default): step N+1 decided while N runs;
- ``node, async, redis-server``: the same on a real redis-server started here on a free port
  (skip with ``--no-real-redis``).

Requests are submitted to ``P:requests`` in one round trip; a run ends when the last ``final``
is published. The "forward" column is time inside ``execute`` of the model runner: in this
process for ``llm``, inside the worker for the nodes (``ProcessRunner.busy_seconds``, the pipe
excluded). Columns:

- ``overhead`` = (wall - forward) / wall: the share of the run when the model was not
  computing (scheduler, detokenizer, publishing, claiming, the pipe to the worker), the engine
  loop's own cost as the model sees it — issue #3's goal is < 10 % at batch 32;
- ``vs llm`` = node tok/s over in-process tok/s, measured back to back in each repetition.

Each configuration runs ``--reps`` times interleaved; the table shows medians. Peak RSS is
``getrusage(RUSAGE_SELF).ru_maxrss`` (this process) and of the worker (children).

Usage: python bench/engine.py [--model DIR] [--batches 1,8,32] [--reps 3] [--max-tokens 256]
                             [--no-real-redis] [--output-json bench/results/engine.json]
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

from bench._common import (  # noqa: E402
    PROMPT_LEN,
    RESULTS,
    children_peak_rss_mb,
    model_dir,
    peak_rss_mb,
    print_table,
    prompts,
    start_redis_server,
    write_json,
)
from fd.control.events import Accepted, Final, Request  # noqa: E402
from fd.control.request_data import RequestData  # noqa: E402
from fd.control.sampling import SamplingParams  # noqa: E402
from fd.engine.runner.runners import InProcessRunner  # noqa: E402


class TimedRunner(InProcessRunner):
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


class WorkerTimer:
    """The same ``reset()`` for a :class:`fd.engine.runner.worker.ProcessRunner`: the time its worker
    spent inside ``execute``, and how many steps."""

    def __init__(self, runner):
        self.runner = runner
        self.calls = 0
        self._busy = runner.busy_seconds
        self._submit = runner.submit
        runner.submit = self._counted  # instance attribute: the node calls runner.submit

    def _counted(self, out):
        self.calls += 1
        return self._submit(out)

    def reset(self) -> tuple[float, int]:
        busy, calls = self.runner.busy_seconds - self._busy, self.calls
        self._busy, self.calls = self.runner.busy_seconds, 0
        return busy, calls


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
    return {
        "wall_s": wall,
        "forward_s": fwd,
        "steps": steps,
        "tokens": ntok,
        "tok_per_s": ntok / wall,
        "overhead": (wall - fwd) / wall,
    }


class FinalCounter:
    """Wraps the node's ``publish_owned`` (its flush, through the fence): notes when the last
    expected ``final`` went out, and how long the loop spent awaiting publishes."""

    def __init__(self, bus):
        self.bus = bus
        self.inner = bus.publish_owned
        self.expect = 0
        self.finals = 0
        self.done = asyncio.Event()
        self.t_done = 0.0
        self.publish_s = 0.0
        self.publishes = 0
        self.events = 0
        bus.publish_owned = self  # instance attribute: the node's publisher calls self.bus.publish_owned

    async def __call__(self, items, owners, expire=(), ack=()):
        t = time.perf_counter()
        refused = await self.inner(items, owners, expire=expire, ack=ack)
        now = time.perf_counter()
        self.publish_s += now - t
        self.publishes += 1
        self.events += len(items)
        self.finals += sum(1 for _, ev in items if isinstance(ev, Final) and ev.request_id not in refused)
        if self.expect and self.finals >= self.expect and not self.done.is_set():
            self.t_done = now
            self.done.set()
        return refused

    def arm(self, n: int) -> None:
        self.expect, self.finals, self.done = n, 0, asyncio.Event()
        self.publish_s, self.publishes, self.events = 0.0, 0, 0


async def run_node(
    eng, counter: FinalCounter, runner: TimedRunner, batch: int, max_tokens: int, seed: int, tag: str
) -> dict:
    node = eng.node
    bus = node.bus
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    items = []
    rids = []
    for i, ids in enumerate(prompts(batch, seed=seed)):
        rid = f"{tag}-{i}"
        rids.append(rid)
        items += [
            (bus.keys.req(rid), Accepted(request_id=rid, prompt_tokens=len(ids), endpoint="completion")),
            (
                bus.keys.requests,
                Request(request_id=rid, data=RequestData(prompt_token_ids=tuple(ids), sampling=sp)),
            ),
        ]
    counter.arm(batch)
    runner.reset()
    steps0, step_s0 = node.steps, node.step_seconds
    t0 = time.perf_counter()
    await bus.publish_many(items)  # one round trip: one claim can see them all
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
    return {
        "wall_s": wall,
        "forward_s": fwd,
        "step_s": step_s,
        "steps": steps,
        "tokens": ntok,
        "tok_per_s": ntok / wall,
        "overhead": (wall - fwd) / wall,
        "between_steps": (wall - step_s) / wall,
        "publish_s": counter.publish_s,
        "publishes": counter.publishes,
        "events": counter.events,
    }


NODE_KINDS = (("sync", "node, sync"), ("async", "node, async"), ("async_redis", "node, async, redis-server"))


async def node_part(
    worker,
    timer: WorkerTimer,
    runner: TimedRunner,
    tok,
    llm,
    batches,
    reps,
    max_tokens,
    results,
    bar,
    real_redis: bool,
):
    from fd.compose import start_engine
    from fd.control.connect import connect
    from fd.control.embedded import EmbeddedRedis
    from fd.control.keys import Keys
    from fd.engine.node.node_config import EngineConfig, SchedulerSettings

    emb = EmbeddedRedis()
    emb.start()
    srv = start_redis_server() if real_redis else None
    kinds = [kind for kind, _ in NODE_KINDS if kind != "async_redis" or srv is not None]
    try:
        for rep in range(reps):
            for b in batches:
                r = run_llm(llm, runner, b, max_tokens, rep)
                results["llm"][b].append(r)
                bar.update(1)
                # All three share the one worker (one model copy), so they take turns: each
                # engine runs for its run only (the worker's replies are read by the loop of
                # the one node that runs; two nodes on one pipe would read each other's).
                for kind in kinds:
                    factory = (lambda: connect(srv.url)) if kind == "async_redis" else emb.client
                    eng = await start_engine(
                        factory,
                        Keys(f"bench-{kind}"),
                        EngineConfig(
                            model_dir="unused",
                            num_blocks=worker.num_blocks,
                            scheduler=SchedulerSettings(
                                max_num_seqs=max(64, max(batches)), async_scheduling=kind != "sync"
                            ),
                            engine_id=f"bench-{kind}",
                        ),
                        runner=worker,
                        tokenizer=tok,
                    )
                    try:
                        r = await run_node(
                            eng, FinalCounter(eng.node.bus), timer, b, max_tokens, rep, f"r{rep}b{b}"
                        )
                    finally:
                        await eng.stop()
                    results[kind][b].append(r)
                    bar.update(1)
        results["rss_after_node_mb"] = peak_rss_mb()
    finally:
        emb.stop()
        if srv is not None:
            srv.stop()


def med(rs: list[dict], k: str) -> float:
    return statistics.median(r[k] for r in rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="HF model dir (default: the tiny model, made in a temp dir)"
    )
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--no-real-redis", action="store_true", help="skip the node on a real redis-server")
    ap.add_argument("--output-json", default=str(RESULTS / "engine.json"))
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    sys.setswitchinterval(0.0005)  # as `fd serve` and `fd engine` run (fd/cli/main.py)

    from fd.control.tokenizer import Tokenizer
    from fd.engine.runner.llm import LLM
    from fd.engine.runner.model_runner import ModelRunner
    from fd.engine.runner.worker import ProcessRunner

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
    worker = ProcessRunner(mdir, device="cpu", num_blocks=args.num_blocks, block_size=16)
    worker.warmup()
    timer = WorkerTimer(worker)

    real = not args.no_real_redis
    kinds = [k for k, _ in NODE_KINDS if real or k != "async_redis"]
    results: dict = {k: {b: [] for b in batches} for k in ["llm", *kinds]}
    try:
        with tqdm(total=(1 + len(kinds)) * len(batches) * args.reps, desc="engine", unit="run") as bar:
            asyncio.run(
                node_part(
                    worker, timer, runner, tok, llm, batches, args.reps, args.max_tokens, results, bar, real
                )
            )
    finally:
        worker.close()

    rows = []
    for b in batches:
        L = results["llm"][b]
        rows.append(
            [
                b,
                "llm (in-process)",
                med(L, "tok_per_s"),
                1.0,
                1000 * med(L, "forward_s") / med(L, "steps"),
                1000 * (med(L, "wall_s") - med(L, "forward_s")) / med(L, "steps"),
                100 * med(L, "overhead"),
                "-",
            ]
        )
        for kind, label in NODE_KINDS:
            N = results.get(kind, {}).get(b)
            if not N:
                continue
            rows.append(
                [
                    b,
                    label,
                    med(N, "tok_per_s"),
                    med(N, "tok_per_s") / med(L, "tok_per_s"),
                    1000 * med(N, "forward_s") / med(N, "steps"),
                    1000 * (med(N, "wall_s") - med(N, "forward_s")) / med(N, "steps"),
                    100 * med(N, "overhead"),
                    1000 * med(N, "publish_s") / med(N, "publishes"),
                ]
            )
    headers = [
        "batch",
        "path",
        "tok/s",
        "vs llm",
        "forward ms/step",
        "outside forward ms/step",
        "overhead %",
        "publish ms/flush",
    ]
    print_table(
        f"engine: {PROMPT_LEN}-token prompts, {args.max_tokens} output tokens, greedy, "
        f"ignore_eos; medians of {args.reps}",
        headers,
        rows,
        nd=2,
    )
    print(
        f"peak RSS: {rss0:.0f} MiB at start, {rss_model:.0f} MiB with the model loaded, "
        f"{results['rss_after_node_mb']:.0f} MiB after all runs; the model worker "
        f"{children_peak_rss_mb():.0f} MiB"
    )
    write_json(
        args.output_json,
        {
            "model": mdir,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "rss_start_mb": rss0,
            "rss_model_mb": rss_model,
            "table": {"headers": headers, "rows": rows},
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()
