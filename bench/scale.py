"""The scale table: what one more engine, one more API node, or a real Redis buys, and what
the control plane costs in Redis round trips, bytes and memory per generated token.

Each comparison runs both sides in one run of this script (ratios, not absolute numbers, are
what carries across machines; see TARGETS.md on noise). Engines run the timed executor
(:class:`fd.engine.runner.timed_runner.TimedRunner`): every step sleeps ``--step-ms`` instead of running
a forward, standing in for a GPU, so that on a 2-core box the comparison measures the serving
system rather than CPU contention between model steps, Redis, the API and the clients. Every
engine and API node is its own process (``python bench/scale.py _node ...``: fd.compose with a
TimedRunner, what ``fd engine --executor timed --step-ms N`` runs) against a real
``redis-server``, except the embedded-server row. The load comes from ``fd bench``
(:mod:`fd.tools.loadgen.main`) in this process: streaming ``/v1/completions``, ``ignore_eos``.

1. engines: 1 vs 2 engine processes behind one API node, load that saturates one engine
   (concurrency 2 x --max-num-seqs); goal: 2 engines >= 1.8x the output tok/s.
2. API nodes: 1 vs 2 API processes (requests round-robin) over 2 fast engines.
3. control plane: API + engine in one process (what ``fd serve`` runs) on the embedded
   fakeredis server vs on the real redis-server.
4. Redis cost per generated token, from INFO deltas on the real server during runs 1 and 2:
   round trips (``total_reads_processed``: one per batch a client sends, a pipeline counts
   once), commands (INFO commandstats), bytes in + out; the idle background (blocking reads
   with a timeout, heartbeats) measured just before each run is subtracted.
5. Redis memory: MEMORY USAGE of finished requests' streams by output length, used_memory
   before / after N requests and after their EXPIRE (``--req-ttl`` seconds, short here so the
   script can wait for it; the default is an hour).

Usage: python bench/scale.py [--model DIR] [--step-ms 20] [--max-num-seqs 8] [--output-len 64]
                             [--output-json bench/results/scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench._common import (  # noqa: E402
    RESULTS,
    ROOT,
    free_port,
    kill_pid,
    model_dir,
    print_table,
    start_redis_server,
    write_json,
)

CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the node process


async def node_main(a: argparse.Namespace) -> int:
    """Engines on the timed executor and/or an API node, in this process, until SIGTERM."""
    from fd.api.config import ApiConfig
    from fd.compose import start_api, start_engine
    from fd.control.connect import connect
    from fd.control.keys import Keys
    from fd.control.metrics import Metrics
    from fd.control.tokenizer import Tokenizer
    from fd.engine.node.node_config import EngineConfig, SchedulerSettings
    from fd.engine.runner.timed_runner import TimedRunner

    embedded = None
    if a.embedded:
        from fd.control.embedded import EmbeddedRedis

        embedded = EmbeddedRedis(port=0)
        embedded.start()
        factory, url = embedded.client, embedded.url
    else:
        factory, url = (lambda: connect(a.redis_url)), a.redis_url
    keys = Keys(a.prefix)
    tok = Tokenizer.from_dir(a.model)
    metrics = Metrics()
    engines, api = [], None
    for i in range(a.engines):
        runner = TimedRunner.for_tokenizer(tok, step_ms=a.step_ms)
        eng = await start_engine(
            factory,
            keys,
            EngineConfig(
                model_dir=a.model,
                engine_id=f"{a.name}-e{i}",
                scheduler=SchedulerSettings(max_num_seqs=a.max_num_seqs),
            ),
            runner=runner,
            tokenizer=tok,
            metrics=metrics if a.api else None,
        )
        eng.node.bus.req_ttl_s = a.req_ttl
        engines.append(eng)
    if a.api:
        api = await start_api(
            factory, keys, ApiConfig(model_dir=a.model, port=a.port), metrics=metrics, tokenizer=tok
        )
        api.bus.req_ttl_s = a.req_ttl
    print(f"READY port={api.port if api else 0} redis={url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if api is not None:
        await api.stop()
    for eng in engines:
        await eng.stop()
    if embedded is not None:
        embedded.stop()
    return 0


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / CLK_TCK
    except OSError:
        return float("nan")


class Node:
    """One ``_node`` subprocess (stopped by pid)."""

    def __init__(
        self,
        model: str,
        name: str,
        *,
        redis_url: str | None = None,
        engines: int = 0,
        api: bool = False,
        step_ms: float = 20.0,
        max_num_seqs: int = 8,
        req_ttl: int = 3600,
        log_dir: str,
    ):
        self.name = name
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_node",
            "--model",
            model,
            "--name",
            name,
            "--engines",
            str(engines),
            "--step-ms",
            str(step_ms),
            "--max-num-seqs",
            str(max_num_seqs),
            "--req-ttl",
            str(req_ttl),
        ]
        cmd += ["--redis-url", redis_url] if redis_url else ["--embedded"]
        if api:
            cmd += ["--api", "--port", str(free_port())]
        self.log = Path(log_dir) / f"{name}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.port = 0
        self.redis_url = redis_url

    def wait_ready(self, timeout: float = 60.0) -> Node:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("READY "):
                    kv = dict(x.split("=", 1) for x in line.split()[1:])
                    self.port, self.redis_url = int(kv["port"]), kv["redis"]
                    return self
            if self.proc.poll() is not None:
                raise SystemExit(f"node {self.name} exited ({self.proc.returncode}):\n{text[-3000:]}")
            time.sleep(0.05)
        self.stop()
        raise SystemExit(f"node {self.name} not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    def stop(self) -> None:
        kill_pid(self.proc, grace=10)


def start_nodes(*nodes: Node) -> list[Node]:
    return [n.wait_ready() for n in nodes]


async def wait_engines(api_url: str, n: int, timeout: float = 30.0) -> None:
    """Until the API's /health sees ``n`` live engines (heartbeats)."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(api_url + "/health") as r:
                    if r.status == 200 and len((await r.json())["engines"]) >= n:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{api_url}: {n} engine(s) never showed up in /health")


# --------------------------------------------------------------------------- Redis counters


class RedisStats:
    """INFO deltas on the real redis-server over a window, with the idle background rate."""

    def __init__(self, url: str, pid: int):
        import redis

        from fd.control.connect import redis_timeout

        t = redis_timeout()  # (a stalled server fails the run instead of hanging it)
        self.r = redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t)
        self.pid = pid

    def snap(self) -> dict:
        stats, cmds = self.r.info("stats"), self.r.info("commandstats")
        return {
            "t": time.perf_counter(),
            "round_trips": stats["total_reads_processed"],
            "commands": stats["total_commands_processed"],
            "bytes": stats["total_net_input_bytes"] + stats["total_net_output_bytes"],
            "by_cmd": {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmds.items()},
        }

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {
            "s": b["t"] - a["t"],
            "round_trips": b["round_trips"] - a["round_trips"],
            "commands": b["commands"] - a["commands"],
            "bytes": b["bytes"] - a["bytes"],
            "by_cmd": {
                k: v - a["by_cmd"].get(k, 0) for k, v in b["by_cmd"].items() if v - a["by_cmd"].get(k, 0)
            },
        }

    async def idle(self, seconds: float = 1.5) -> dict:
        a = self.snap()
        await asyncio.sleep(seconds)
        return self.delta(a, self.snap())

    @staticmethod
    def per_token(run: dict, idle: dict, tokens: int) -> dict:
        """Per generated token, net of the idle background over the run's duration."""
        k = run["s"] / idle["s"] if idle["s"] else 0.0
        net = lambda key: max(0.0, run[key] - k * idle[key])  # noqa: E731
        cmds = {c: max(0.0, n - k * idle["by_cmd"].get(c, 0)) / tokens for c, n in run["by_cmd"].items()}
        return {
            "round_trips": net("round_trips") / tokens,
            "commands": net("commands") / tokens,
            "bytes": net("bytes") / tokens,
            "gross_round_trips": run["round_trips"] / tokens,
            "gross_bytes": run["bytes"] / tokens,
            "by_cmd": {c: v for c, v in sorted(cmds.items(), key=lambda x: -x[1]) if v >= 0.005},
        }

    def used_memory(self) -> int:
        return int(self.r.info("memory")["used_memory"])

    def by_family(self, prefix: str) -> dict[str, dict[str, int]]:
        """MEMORY USAGE summed per key family (``P:<family>:...``)."""
        out: dict[str, dict[str, int]] = {}
        for k in self.r.scan_iter(match=f"{prefix}:*", count=1000):
            fam = k.decode().split(":")[1]
            d = out.setdefault(fam, {"keys": 0, "bytes": 0})
            d["keys"] += 1
            d["bytes"] += self.usage(k)
        return out

    def count(self, pattern: str) -> int:
        return sum(1 for _ in self.r.scan_iter(match=pattern, count=1000))

    def usage(self, key: str) -> int:
        return int(self.r.memory_usage(key, samples=0) or 0)


# --------------------------------------------------------------------------- load


async def load(
    urls: list[str],
    a: argparse.Namespace,
    *,
    n: int,
    conc: int,
    tag: str,
    output_len: int | None = None,
    warmups: int = 2,
    seed: int = 0,
) -> dict:
    from fd.tools.loadgen import main as loadgen

    cfg = loadgen.BenchConfig(
        base_urls=urls,
        num_prompts=n,
        max_concurrency=conc,
        input_len=a.input_len,
        output_len=output_len or a.output_len,
        num_warmups=warmups,
        seed=seed,
        progress=not a.no_progress,
        request_id_prefix=f"{tag}-{os.getpid()}-{int(time.time() * 1000) % 10**7}",
    )
    r = await loadgen.run_bench(cfg)
    if r["num_errors"]:
        print(f"  {tag}: {r['num_errors']} errors, first: {r['errors'][0]}", file=sys.stderr)
    r.pop("requests", None)
    return r


def best(runs: list[dict]) -> dict:
    """The run with the highest output throughput: on a shared machine the others lost time
    to neighbours, not to the system under test."""
    return max(runs, key=lambda r: r["output_throughput"])


def _row_lat(r: dict) -> list:
    return [
        r["output_throughput"],
        r["ttft_ms"]["p50"],
        r["ttft_ms"]["p99"],
        r["itl_ms"]["p50"],
        r["itl_ms"]["p99"],
    ]


class CpuMeter:
    """CPU share (one core = 100%) of each node, the redis-server and this process (the
    load generator) over one run: on 2 shared cores this says what the bottleneck was."""

    def __init__(self, nodes: list[Node], redis_pid: int | None):
        self.pids = {n.name: n.proc.pid for n in nodes}
        if redis_pid:
            self.pids["redis"] = redis_pid
        self.t0 = time.perf_counter()
        self.c0 = {k: proc_cpu_s(p) for k, p in self.pids.items()}
        self.self0 = time.process_time()

    def done(self) -> dict[str, float]:
        dt = time.perf_counter() - self.t0
        out = {k: 100 * (proc_cpu_s(p) - self.c0[k]) / dt for k, p in self.pids.items()}
        out["client"] = 100 * (time.process_time() - self.self0) / dt
        return out

    @staticmethod
    def text(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.0f}%" for k, v in d.items())


# --------------------------------------------------------------------------- the comparisons


async def scale_engines(a, model, rs: RedisStats, url: str, tmp: str, out: dict) -> None:
    conc = 2 * a.max_num_seqs
    n = a.num_prompts or 6 * a.max_num_seqs
    api = Node(model, "api0", redis_url=url, api=True, log_dir=tmp)
    e0 = Node(
        model, "eng0", redis_url=url, engines=1, step_ms=a.step_ms, max_num_seqs=a.max_num_seqs, log_dir=tmp
    )
    nodes = start_nodes(api, e0)
    e1 = None
    try:
        runs = {}
        for k in (1, 2):
            if k == 2:
                e1 = Node(
                    model,
                    "eng1",
                    redis_url=url,
                    engines=1,
                    step_ms=a.step_ms,
                    max_num_seqs=a.max_num_seqs,
                    log_dir=tmp,
                ).wait_ready()
                nodes.append(e1)
            await wait_engines(api.url, k)
            idle = await rs.idle()
            cpu = CpuMeter(nodes, rs.pid)
            s0 = rs.snap()
            r = await load([api.url], a, n=n, conc=conc, tag=f"eng{k}")
            d = rs.delta(s0, rs.snap())
            r["cpu"] = cpu.done()
            r["redis"] = {
                "run": d,
                "idle": idle,
                "per_token": rs.per_token(d, idle, max(1, r["total_output_tokens"])),
            }
            runs[k] = r
        out["engines"] = {
            "concurrency": conc,
            "num_prompts": n,
            "step_ms": a.step_ms,
            "max_num_seqs": a.max_num_seqs,
            "runs": runs,
            "ratio": runs[2]["output_throughput"] / runs[1]["output_throughput"],
        }
    finally:
        for x in nodes:
            x.stop()


async def scale_apis(a, model, rs: RedisStats, url: str, tmp: str, out: dict) -> None:
    step, seqs = a.fast_step_ms, 4 * a.max_num_seqs
    conc, n = 2 * seqs, a.num_prompts or 8 * seqs
    engs = [
        Node(model, f"feng{i}", redis_url=url, engines=1, step_ms=step, max_num_seqs=seqs, log_dir=tmp)
        for i in range(2)
    ]
    apis = [Node(model, f"api{i}", redis_url=url, api=True, log_dir=tmp) for i in range(2)]
    nodes = start_nodes(*engs, *apis)
    try:
        await wait_engines(apis[0].url, 2)
        await wait_engines(apis[1].url, 2)
        every: dict[int, list] = {1: [], 2: []}
        for rep in range(a.reps):  # interleaved: drift in the machine's load hits both sides
            for k in (1, 2):
                idle = await rs.idle(0.5)
                cpu = CpuMeter(nodes, rs.pid)
                s0 = rs.snap()
                r = await load([x.url for x in apis[:k]], a, n=n, conc=conc, tag=f"api{k}r{rep}")
                d = rs.delta(s0, rs.snap())
                r["cpu"] = cpu.done()
                r["redis"] = {
                    "run": d,
                    "idle": idle,
                    "per_token": rs.per_token(d, idle, max(1, r["total_output_tokens"])),
                }
                every[k].append(r)
        runs = {k: best(v) for k, v in every.items()}
        out["apis"] = {
            "concurrency": conc,
            "num_prompts": n,
            "step_ms": step,
            "max_num_seqs": seqs,
            "engines": 2,
            "runs": runs,
            "all_runs": every,
            "reps": a.reps,
            "ratio": runs[2]["output_throughput"] / runs[1]["output_throughput"],
        }
    finally:
        for x in nodes:
            x.stop()


async def control_planes(a, model, rs: RedisStats, url: str, tmp: str, out: dict) -> None:
    step, seqs = a.fast_step_ms, 4 * a.max_num_seqs
    conc, n = seqs, a.num_prompts or 4 * seqs
    kinds = ("embedded", "redis-server")
    nodes = start_nodes(
        *(
            Node(
                model,
                f"serve-{k}",
                redis_url=url if k == "redis-server" else None,
                engines=1,
                api=True,
                step_ms=step,
                max_num_seqs=seqs,
                log_dir=tmp,
            )
            for k in kinds
        )
    )
    every: dict[str, list] = {k: [] for k in kinds}
    try:
        for rep in range(a.reps):
            for kind, node in zip(kinds, nodes, strict=True):
                cpu = CpuMeter([node], rs.pid if kind == "redis-server" else None)
                r = await load([node.url], a, n=n, conc=conc, tag=f"cp-{kind}-r{rep}")
                r["cpu"] = cpu.done()
                every[kind].append(r)
    finally:
        for x in nodes:
            x.stop()
    runs = {k: best(v) for k, v in every.items()}
    out["control_plane"] = {
        "concurrency": conc,
        "num_prompts": n,
        "step_ms": step,
        "max_num_seqs": seqs,
        "runs": runs,
        "all_runs": every,
        "reps": a.reps,
        "ratio": runs["redis-server"]["output_throughput"] / runs["embedded"]["output_throughput"],
    }


async def memory(a, model, rs: RedisStats, url: str, tmp: str, out: dict) -> None:
    prefix = "fd"
    seqs = 4 * a.max_num_seqs
    rs.r.flushdb()  # the earlier comparisons' streams (1 h TTL): a clean baseline
    nodes = start_nodes(
        Node(model, "mem-api", redis_url=url, api=True, req_ttl=a.req_ttl, log_dir=tmp),
        Node(
            model,
            "mem-eng",
            redis_url=url,
            engines=1,
            step_ms=a.fast_step_ms,
            max_num_seqs=seqs,
            req_ttl=a.req_ttl,
            log_dir=tmp,
        ),
    )
    api = nodes[0]
    try:
        await wait_engines(api.url, 1)
        base = {"used_memory": rs.used_memory(), "req_keys": rs.count(f"{prefix}:req:*")}
        by_len = []
        for L in (16, 64, 256):
            from fd.tools.loadgen import main as loadgen

            cfg = loadgen.BenchConfig(
                base_urls=[api.url],
                num_prompts=3,
                input_len=a.input_len,
                output_len=L,
                progress=False,
                request_id_prefix=f"mem{L}",
            )
            r = await loadgen.run_bench(cfg)
            sizes = sorted(rs.usage(f"{prefix}:req:{{mem{L}-{i}}}") for i in range(3))
            owner = rs.usage(f"{prefix}:owner:{{mem{L}-0}}")
            entries = rs.r.xlen(f"{prefix}:req:{{mem{L}-0}}")
            by_len.append(
                {
                    "output_tokens": L,
                    "stream_bytes": sizes[1],
                    "entries": entries,
                    "owner_bytes": owner,
                    "errors": r["num_errors"],
                }
            )
        n = a.mem_requests
        journal = f"{prefix}:journal:mem-eng-e0"
        before, jbefore = rs.used_memory(), rs.usage(journal)
        r = await load([api.url], a, n=n, conc=2 * seqs, tag="mem", warmups=0)
        after, jafter = rs.used_memory(), rs.usage(journal)
        families = rs.by_family(prefix)
        info_after = {
            k: v
            for k, v in rs.r.info("memory").items()
            if k
            in (
                "used_memory_dataset",
                "mem_clients_normal",
                "used_memory_overhead",
                "mem_fragmentation_ratio",
                "allocator_allocated",
            )
        }
        live = {
            "req_keys": rs.count(f"{prefix}:req:*"),
            "owner_keys": rs.count(f"{prefix}:owner:*"),
            "requests_xlen": rs.r.xlen(f"{prefix}:requests"),
            "journal_entries": rs.r.xlen(journal),
            "journal_bytes": jafter,
            "journal_cap_bytes": jafter / max(1, rs.r.xlen(journal)) * 10_000,
            "control_entries": rs.r.xlen(f"{prefix}:control"),
        }
        t_wait = time.perf_counter()
        for _ in range(int(a.req_ttl * 10) + 50):
            if rs.count(f"{prefix}:req:*") == 0 and rs.count(f"{prefix}:owner:*") == 0:
                break
            await asyncio.sleep(0.1)
        expired = {
            "after_s": time.perf_counter() - t_wait,
            "used_memory": rs.used_memory(),
            "req_keys": rs.count(f"{prefix}:req:*"),
            "owner_keys": rs.count(f"{prefix}:owner:*"),
        }
        out["memory"] = {
            "req_ttl_s": a.req_ttl,
            "baseline": base,
            "by_output_len": by_len,
            "n": n,
            "output_len": a.output_len,
            "tokens": r["total_output_tokens"],
            "used_before": before,
            "used_after": after,
            "live": live,
            "expired": expired,
            "used_memory_delta_per_request": (after - before - (jafter - jbefore)) / n,
            "per_request_bytes": sum(families.get(f, {}).get("bytes", 0) for f in ("req", "owner"))
            / max(1, families.get("req", {}).get("keys", 1)),
            "journal_growth_bytes": jafter - jbefore,
            "families": families,
            "info_after": info_after,
        }
    finally:
        for x in nodes:
            x.stop()


# --------------------------------------------------------------------------- report


def report(out: dict, a: argparse.Namespace) -> str:
    text = []
    gpu = f"timed executor, {a.step_ms:g} ms/step (stands in for a GPU)"
    fast = f"timed executor, {a.fast_step_ms:g} ms/step (stands in for a fast GPU)"
    lat = ["output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    e = out["engines"]
    rows = [
        [f"{k} engine{'s' * (k > 1)}", gpu, *_row_lat(r), CpuMeter.text(r["cpu"])]
        for k, r in e["runs"].items()
    ]
    rows.append(["2 / 1", "", e["ratio"], "", "", "", "", "goal >= 1.8x"])
    text.append(
        print_table(
            f"Engines: 1 vs 2 processes, one API node, real Redis (concurrency {e['concurrency']}, "
            f"{e['num_prompts']} requests, {a.output_len} tokens, max-num-seqs {e['max_num_seqs']} each)",
            ["setup", "executor", *lat, "CPU (one core = 100%)"],
            rows,
        )
    )
    p = out["apis"]
    rows = [
        [f"{k} API node{'s' * (k > 1)}", fast, *_row_lat(r), CpuMeter.text(r["cpu"])]
        for k, r in p["runs"].items()
    ]
    one = p["runs"][1]["cpu"].get("api0", float("nan"))
    rows.append(
        [
            "2 / 1",
            "",
            p["ratio"],
            "",
            "",
            "",
            "",
            f"alone, api0 used {one:.0f}% of a core: not saturated (2 cores shared by all)"
            if one < 90
            else "api0 saturated alone",
        ]
    )
    text.append(
        print_table(
            f"API nodes: 1 vs 2 processes over 2 engines, real Redis (concurrency {p['concurrency']}, "
            f"{p['num_prompts']} requests, max-num-seqs {p['max_num_seqs']} per engine; best of "
            f"{p['reps']} interleaved)",
            ["setup", "executor", *lat, "CPU (one core = 100%)"],
            rows,
        )
    )
    c = out["control_plane"]
    rows = [[k, fast, *_row_lat(r), CpuMeter.text(r["cpu"])] for k, r in c["runs"].items()]
    rows.append(["redis-server / embedded", "", c["ratio"], "", "", "", "", ""])
    text.append(
        print_table(
            f"Control plane: API + engine in one process (fd serve) on the embedded server vs a real "
            f"redis-server (concurrency {c['concurrency']}, {c['num_prompts']} requests; best of "
            f"{c['reps']} interleaved)",
            ["control plane", "executor", *lat, "CPU"],
            rows,
        )
    )
    rows = []
    for name, sect in (
        ("1 engine", e["runs"][1]),
        ("2 engines", e["runs"][2]),
        ("1 API, 2 fast engines", p["runs"][1]),
        ("2 APIs, 2 fast engines", p["runs"][2]),
    ):
        pt = sect["redis"]["per_token"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(pt["by_cmd"].items())[:6])
        rows.append(
            [
                name,
                sect["total_output_tokens"],
                pt["round_trips"],
                pt["commands"],
                pt["bytes"],
                pt["gross_round_trips"],
                pt["gross_bytes"],
                top,
            ]
        )
    text.append(
        print_table(
            "Redis cost per generated token (real redis-server, INFO deltas; net = minus the idle "
            "background of blocking reads and heartbeats)",
            [
                "run",
                "tokens",
                "round trips/tok",
                "commands/tok",
                "bytes/tok (in+out)",
                "gross round trips/tok",
                "gross bytes/tok",
                "commands/tok by type (net)",
            ],
            rows,
            nd=2,
        )
    )
    m = out["memory"]
    rows = [
        [
            f"one finished request, {b['output_tokens']} tokens",
            b["entries"],
            b["stream_bytes"],
            b["stream_bytes"] / b["output_tokens"],
            b["owner_bytes"],
        ]
        for b in m["by_output_len"]
    ]
    text.append(
        print_table(
            "Redis memory of one request (MEMORY USAGE of P:req:{id}, the median of 3; P:owner:{id})",
            ["request", "stream entries", "stream bytes", "bytes/token", "owner key bytes"],
            rows,
        )
    )
    lv, ex = m["live"], m["expired"]
    rows = [
        ["baseline (empty db, nodes up)", m["baseline"]["used_memory"], m["baseline"]["req_keys"], ""],
        [f"before {m['n']} requests x {m['output_len']} tokens", m["used_before"], "", ""],
        [
            f"after them (finished, EXPIRE {m['req_ttl_s']} s pending)",
            m["used_after"],
            lv["req_keys"],
            f"{m['per_request_bytes']:,.0f} B/request in its keys (P:req + P:owner); used_memory "
            f"grew {m['used_memory_delta_per_request']:,.0f} B/request besides the journal, "
            f"client buffers included; P:requests {lv['requests_xlen']} entries (acked = deleted)",
        ],
        [
            "  of which the engine journal (one entry per step)",
            lv["journal_bytes"],
            "",
            f"{lv['journal_entries']} entries, +{m['journal_growth_bytes']:,} B in this run; "
            f"capped by MAXLEN ~10000 entries = ~{lv['journal_cap_bytes'] / 2**20:,.0f} MiB",
        ],
        [
            f"{ex['after_s']:.1f} s later (after EXPIRE)",
            ex["used_memory"],
            ex["req_keys"],
            f"owner keys {ex['owner_keys']}",
        ],
    ]
    text.append(
        print_table(
            "Redis memory over N requests and how it is bounded (used_memory; P:req:* keys)",
            ["moment", "used_memory B", "P:req:* keys", "notes"],
            rows,
        )
    )
    fam = m["families"]
    rows = [[f, d["keys"], d["bytes"], d["bytes"] / d["keys"]] for f, d in sorted(fam.items())]
    rows.append(
        ["(all keys)", sum(d["keys"] for d in fam.values()), sum(d["bytes"] for d in fam.values()), ""]
    )
    mi = m["info_after"]
    rows.append(
        [
            "used_memory (dataset / client buffers / other overhead)",
            "",
            f"{m['used_after']:,} ({mi['used_memory_dataset']:,} / {mi['mem_clients_normal']:,} / "
            f"{mi['used_memory_overhead'] - mi['mem_clients_normal']:,})",
            "",
        ]
    )
    text.append(
        print_table(
            f"Redis memory by key family right after {m['n']} requests x {m['output_len']} tokens "
            "(MEMORY USAGE, SAMPLES 0)",
            ["family", "keys", "bytes", "bytes/key"],
            rows,
            nd=0,
        )
    )
    return "\n".join(text)


async def run(a: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="fd-bench-scale-")
    model = model_dir(a.model, tmp)
    server = start_redis_server()
    out: dict = {
        "model": model,
        "step_ms": a.step_ms,
        "fast_step_ms": a.fast_step_ms,
        "output_len": a.output_len,
        "input_len_words": a.input_len,
        "logs": tmp,
    }
    t0 = time.perf_counter()
    try:
        rs = RedisStats(server.url, server.proc.pid)
        print("1/4 engines: 1 vs 2", file=sys.stderr)
        await scale_engines(a, model, rs, server.url, tmp, out)
        print("2/4 API nodes: 1 vs 2", file=sys.stderr)
        await scale_apis(a, model, rs, server.url, tmp, out)
        print("3/4 control plane: embedded vs redis-server", file=sys.stderr)
        await control_planes(a, model, rs, server.url, tmp, out)
        print("4/4 Redis memory", file=sys.stderr)
        await memory(a, model, rs, server.url, tmp, out)
    finally:
        server.stop()
    out["wall_s"] = time.perf_counter() - t0
    out["tables"] = report(out, a)
    write_json(a.output_json, out)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["_node"]:
        p = argparse.ArgumentParser(prog="scale.py _node")
        p.add_argument("--model", required=True)
        p.add_argument("--name", required=True)
        p.add_argument("--redis-url")
        p.add_argument("--embedded", action="store_true")
        p.add_argument("--prefix", default="fd")
        p.add_argument("--engines", type=int, default=0)
        p.add_argument("--api", action="store_true")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--step-ms", type=float, default=20.0)
        p.add_argument("--max-num-seqs", type=int, default=8)
        p.add_argument("--req-ttl", type=int, default=3600)
        a = p.parse_args(argv[1:])
        a.node = True
        return a
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (tokenizer only); default: the tiny model")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step time, engines table")
    p.add_argument(
        "--fast-step-ms",
        type=float,
        default=2.0,
        help="engine step time where the engines must not be the bottleneck",
    )
    p.add_argument("--max-num-seqs", type=int, default=8, help="per engine, engines table")
    p.add_argument("--num-prompts", type=int, default=None, help="default: sized per comparison")
    p.add_argument("--input-len", type=int, default=16, help="prompt words")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--mem-requests", type=int, default=100)
    p.add_argument("--req-ttl", type=int, default=3, help="request stream TTL (s) in this run")
    p.add_argument(
        "--reps",
        type=int,
        default=2,
        help="interleaved repetitions of the API and control-plane comparisons (best kept)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--output-json", default=str(RESULTS / "scale.json"))
    a = p.parse_args(argv)
    a.node = False
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(list(sys.argv[1:] if argv is None else argv))
    return asyncio.run(node_main(a) if a.node else run(a))


if __name__ == "__main__":
    raise SystemExit(main())
