"""Bus micro-benchmark: what the control plane costs, next to what Redis itself can do.

For each server (a real redis-server started here on a free port, the embedded fakeredis
through its in-process client, and the embedded server through its TCP door) it measures:

- publish: ``Bus.publish`` one event at a time, and ``Bus.publish_many`` in batches of 64,
  next to the redis-py ceiling (raw pipelined XADD of pre-encoded fields, no event encoding)
  and redis-benchmark's XADD (one client unpipelined, and 50 clients pipelined 64 deep);
- delivery latency: from just before XADD to the moment a reader parked in a blocking XREAD
  has the decoded event (writer and reader in one process and loop, as in ``fd serve``);
- fan-in: a :class:`StreamMux` watching 10/100/1,000 request streams; "wake" is the latency of
  one event on one random stream (the cost of one XREAD over that many keys), "burst" the
  time per event when every stream gets one event at once.

Usage: python bench/bus.py [--quick] [--output-json bench/results/bus.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fd.control import events as E  # noqa: E402
from fd.control.bus import Bus  # noqa: E402
from fd.control.connect import connect  # noqa: E402
from fd.control.embedded import EmbeddedRedis  # noqa: E402
from fd.control.keys import Keys  # noqa: E402
from fd.control.mux import StreamMux  # noqa: E402

BATCH = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_event(i: int, rid: str = "r1") -> E.Tokens:
    """The hot path: an engine step's tokens for one request."""
    return E.Tokens(request_id=rid, token_ids=(1000 + i % 7,), text="tok", step=i)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------ measurements


async def publish_rates(bus: Bus, n_single: int, n_batched: int) -> dict:
    key = bus.keys.req("r1")
    t = time.perf_counter()
    for i in range(n_single):
        await bus.publish(key, _token_event(i))
    single = n_single / (time.perf_counter() - t)
    await bus.redis.delete(key)

    evs = [(key, _token_event(i)) for i in range(BATCH)]
    rounds = max(1, n_batched // BATCH)
    t = time.perf_counter()
    for _ in range(rounds):
        await bus.publish_many(evs)
    batched = rounds * BATCH / (time.perf_counter() - t)
    await bus.redis.delete(key)

    raw = {k.encode(): v.encode() for k, v in _token_event(0).encode().items()}
    t = time.perf_counter()
    for _ in range(rounds):
        pipe = bus.redis.pipeline(transaction=False)
        for _ in range(BATCH):
            pipe.xadd(key, raw)
        await pipe.execute()
    ceiling = rounds * BATCH / (time.perf_counter() - t)
    await bus.redis.delete(key)
    return {
        "xadd_single_per_s": single,
        "xadd_pipelined_per_s": batched,
        "redis_py_ceiling_per_s": ceiling,
        "pipelined_vs_ceiling": batched / ceiling,
    }


async def delivery_latency(bus: Bus, n: int) -> dict:
    """A reader parked in XREAD BLOCK; the writer times from just before its XADD."""
    rid, got = "lat", asyncio.Queue()
    key = bus.keys.req(rid)

    async def reader():
        after = b"0"
        while True:
            evs = await bus.read_req(rid, after=after, block_ms=1000)
            for entry_id, ev in evs:
                after = entry_id
                got.put_nowait(time.perf_counter())
                if isinstance(ev, E.Final):
                    return

    task = asyncio.create_task(reader())
    lat = []
    await asyncio.sleep(0.01)
    for i in range(n):
        await asyncio.sleep(0.0005)  # let the reader park in its blocking read again
        t0 = time.perf_counter()
        await bus.publish(key, _token_event(i, rid))
        lat.append((await got.get()) - t0)
    await bus.publish(key, E.Final(request_id=rid, finish_reason="stop"))
    await got.get()
    await task
    await bus.redis.delete(key)
    return {"delivery_p50_ms": _pct(lat, 0.5) * 1e3, "delivery_p99_ms": _pct(lat, 0.99) * 1e3}


async def fan_in(bus: Bus, n_streams: int, n_wakes: int, n_bursts: int) -> dict:
    keys = bus.keys
    mux = StreamMux(bus.redis, keys, f"bench{n_streams}", block_ms=1000)
    await mux.start()
    rids = [f"f{n_streams}-{i}" for i in range(n_streams)]
    subs = {r: await mux.subscribe(r) for r in rids}
    await asyncio.sleep(0.05)  # every shard parked
    rng = random.Random(0)
    wake = []
    for i in range(n_wakes):
        r = rng.choice(rids)
        await asyncio.sleep(0.0005)
        t0 = time.perf_counter()
        await bus.publish(keys.req(r), _token_event(i, r))
        await subs[r].__anext__()
        wake.append(time.perf_counter() - t0)
    w0 = mux.wakeups
    t0 = time.perf_counter()
    for b in range(n_bursts):
        items = [(keys.req(r), _token_event(b, r)) for r in rids]
        for i in range(0, len(items), 256):
            await bus.publish_many(items[i : i + 256])
        for r in rids:
            await subs[r].__anext__()
    burst_s = time.perf_counter() - t0
    n_events = n_bursts * n_streams
    wakeups = mux.wakeups - w0
    for s in subs.values():
        await s.close()
    await mux.stop()
    await bus.redis.delete(*[keys.req(r) for r in rids])
    return {
        "streams": n_streams,
        "shards": -(-n_streams // mux.shard_size),
        "wake_p50_ms": _pct(wake, 0.5) * 1e3,
        "wake_p99_ms": _pct(wake, 0.99) * 1e3,
        "burst_us_per_event": burst_s / n_events * 1e6,
        "burst_events_per_wakeup": n_events / max(1, wakeups),
    }


def redis_benchmark(port: int, n: int, clients: int, pipeline: int) -> float | None:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    fields = [x for kv in _token_event(0).encode().items() for x in kv]
    out = subprocess.run(
        [
            exe,
            "-p",
            str(port),
            "-n",
            str(n),
            "-c",
            str(clients),
            "-P",
            str(pipeline),
            "-q",
            "XADD",
            "bench:rb",
            "*",
            *fields,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.findall(r"([\d.]+) requests per second", out.stdout.replace("\r", "\n"))
    return float(m[-1]) if m else None


async def bench_server(name: str, client, port: int, sizes: dict, pbar: tqdm) -> dict:
    bus = Bus(client, Keys(prefix=f"bench{os.getpid()}"))
    dead_before = bus.dead_letters
    res: dict = {"server": name}
    if name == "embedded-tcp":  # fakeredis' TCP handler manages ~1.5k pipelined XADD/s: keep it short
        sizes = {**sizes, "single": sizes["single"] // 2, "batched": sizes["batched"] // 8}
    pbar.set_description(f"{name}: publish")
    res.update(await publish_rates(bus, sizes["single"], sizes["batched"]))
    pbar.update()
    pbar.set_description(f"{name}: latency")
    res.update(await delivery_latency(bus, sizes["latency"]))
    pbar.update()
    res["fan_in"] = []
    for n in (10, 100, 1000):
        pbar.set_description(f"{name}: fan-in {n}")
        res["fan_in"].append(await fan_in(bus, n, sizes["wakes"], sizes["bursts"]))
        pbar.update()
    pbar.set_description(f"{name}: redis-benchmark")
    rb_n = sizes["rb"] if name == "real" else sizes["rb"] // 50
    res["redis_benchmark_single_per_s"] = redis_benchmark(port, max(200, rb_n // 10), 1, 1)
    res["redis_benchmark_ceiling_per_s"] = redis_benchmark(port, rb_n, 50 if name == "real" else 4, BATCH)
    pbar.update()
    await client.delete(*[k async for k in client.scan_iter(match=f"{bus.keys.prefix}:*")] or ["-"])
    await client.delete("bench:rb")
    assert bus.dead_letters == dead_before, "the bench wrote dead letters: a bug in the bench"
    return res


# ------------------------------------------------------------------ servers and report


def start_redis(tmpdir: str) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: apt-get install redis-server")
    port = _free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tmpdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start")


def _fmt(x, unit=""):
    if x is None:
        return "-"
    if isinstance(x, float) and x >= 1000:
        return f"{x:,.0f}{unit}"
    return f"{x:.3g}{unit}" if isinstance(x, float) else f"{x}{unit}"


def print_table(results: list[dict]) -> None:
    names = [r["server"] for r in results]
    rows = [
        ("XADD single (Bus.publish) ev/s", "xadd_single_per_s"),
        (f"XADD pipelined {BATCH} (publish_many) ev/s", "xadd_pipelined_per_s"),
        (f"redis-py ceiling (raw pipelined {BATCH}) ev/s", "redis_py_ceiling_per_s"),
        ("publish_many / redis-py ceiling", "pipelined_vs_ceiling"),
        ("redis-benchmark XADD -c1 -P1 /s", "redis_benchmark_single_per_s"),
        (f"redis-benchmark XADD -P{BATCH} (ceiling) /s", "redis_benchmark_ceiling_per_s"),
        ("delivery p50 ms", "delivery_p50_ms"),
        ("delivery p99 ms", "delivery_p99_ms"),
    ]
    for i, n in enumerate((10, 100, 1000)):
        rows += [
            (f"fan-in {n} streams: wake p50 ms", ("fan_in", i, "wake_p50_ms")),
            (f"fan-in {n} streams: wake p99 ms", ("fan_in", i, "wake_p99_ms")),
            (f"fan-in {n} streams: burst us/event", ("fan_in", i, "burst_us_per_event")),
        ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  " + "  ".join(f"{n:>14}" for n in names))
    for label, key in rows:
        vals = []
        for r in results:
            v = r
            for k in key if isinstance(key, tuple) else (key,):
                v = v[k]
            vals.append(_fmt(v))
        print(f"{label:{w}}  " + "  ".join(f"{v:>14}" for v in vals))


async def main_async(args) -> list[dict]:
    sizes = (
        {"single": 500, "batched": 2048, "latency": 100, "wakes": 30, "bursts": 2, "rb": 20000}
        if args.quick
        else {"single": 3000, "batched": 32768, "latency": 1000, "wakes": 200, "bursts": 5, "rb": 200000}
    )
    servers = [s for s in args.servers.split(",") if s]
    results = []
    with tqdm(total=6 * len(servers), file=sys.stderr, leave=False) as pbar:
        for name in servers:
            if name == "real":
                with tempfile.TemporaryDirectory() as tmp:
                    proc, port = start_redis(tmp)
                    client = connect(f"redis://127.0.0.1:{port}")
                    try:
                        results.append(await bench_server(name, client, port, sizes, pbar))
                    finally:
                        await client.aclose()
                        os.kill(proc.pid, signal.SIGTERM)
                        proc.wait(timeout=10)
            else:
                emb = EmbeddedRedis()
                emb.start()
                client = emb.client() if name == "embedded" else connect(emb.url)
                try:
                    results.append(await bench_server(name, client, emb.port, sizes, pbar))
                finally:
                    await client.aclose()
                    emb.stop()
    return results


def main(argv=None) -> None:
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the redis-server started here dies too.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default=str(Path(__file__).parent / "results" / "bus.json"))
    ap.add_argument(
        "--servers",
        default="real,embedded,embedded-tcp",
        help="comma-separated: real, embedded (in-process client), embedded-tcp",
    )
    ap.add_argument("--quick", action="store_true", help="small sample sizes (a smoke run)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = asyncio.run(main_async(args))
    print_table(results)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "cpu_count": os.cpu_count(),
                "batch": BATCH,
                "results": results,
                "wall_s": time.perf_counter() - t0,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
