"""What the fence (fd/control/fence.py) costs an engine's publish of one step.

An engine's flush, as it is made after a step: one ``tokens`` event per request and one
journal entry, published with ``Bus.publish_many`` (unfenced, as before the fence) and with
``Bus.publish_owned`` (each request's events through the fence: one script per request,
pipelined, on a real Redis; the direct equivalent under the server lock on the embedded
server's in-process client), at 1, 8 and 32 requests a step. Each figure is the median wall
time of one flush, the two ways taken in turns so that both see the same load; a last row
adds a final to every request's batch (the script's ack with it).

Usage: python bench/fence.py [--flushes N] [--output-json bench/results/fence.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import environment, print_table, start_redis_server, write_json  # noqa: E402
from fd.control import events as E  # noqa: E402
from fd.control.bus import Bus  # noqa: E402
from fd.control.connect import connect  # noqa: E402
from fd.control.embedded import EmbeddedRedis  # noqa: E402
from fd.control.keys import Keys, owner_token  # noqa: E402


def flush(bus: Bus, rids: list[str], step: int) -> list:
    items = [
        (
            bus.keys.req(rid),
            E.Tokens(request_id=rid, token_ids=(1000 + step % 7,), text="tok", step=step, ts=1),
        )
        for rid in rids
    ]
    items.append(
        (bus.keys.journal("e"), E.JournalStep(engine="e", step=step, seq=step, data={"calls": []}, ts=1))
    )
    return items


async def measure(bus: Bus, n: int, flushes: int) -> dict:
    rids = [f"b{n}-{i}" for i in range(n)]
    owners = {rid: owner_token("e", 1) for rid in rids}
    for rid in rids:
        await bus.redis.set(bus.keys.owner(rid), owners[rid])
    plain, fenced = [], []
    for step in range(flushes):
        items = flush(bus, rids, step)
        t0 = time.perf_counter()
        await bus.publish_many(items)
        t1 = time.perf_counter()
        refused = await bus.publish_owned(items, owners)
        t2 = time.perf_counter()
        assert not refused
        plain.append(t1 - t0)
        fenced.append(t2 - t1)
    p, f = statistics.median(plain) * 1e6, statistics.median(fenced) * 1e6
    return {
        "requests": n,
        "unfenced_us": p,
        "fenced_us": f,
        "extra_us": f - p,
        "extra_per_request_us": (f - p) / n,
    }


async def with_finals(bus: Bus, n: int, flushes: int) -> dict:
    """A flush that ends every request: unfenced (XADD the final, EXPIRE, XACK+XDEL in one
    pipeline) against fenced (the script appends, renews and acks)."""
    await bus.ensure_group()
    plain, fenced = [], []
    for round_ in range(flushes // 4):
        for way, out in (("plain", plain), ("fenced", fenced)):
            rids = [f"f{round_}-{way}-{i}" for i in range(n)]
            entries = [await bus.redis.xadd(bus.keys.requests, {"x": "1"}) for _ in rids]
            await bus.redis.xreadgroup("engines", "e", {bus.keys.requests: ">"}, count=n)
            owners = {rid: owner_token("e", 1) for rid in rids}
            for rid in rids:
                await bus.redis.set(bus.keys.owner(rid), owners[rid])
            items = [
                (bus.keys.req(rid), ev)
                for rid in rids
                for ev in (
                    E.Tokens(request_id=rid, token_ids=(7,), text="t", step=1, ts=1),
                    E.Final(request_id=rid, finish_reason="length", engine="e", ts=1),
                )
            ]
            t0 = time.perf_counter()
            if way == "plain":
                await bus.publish_many(
                    items, expire=[k for r in rids for k in (bus.keys.req(r), bus.keys.owner(r))], ack=entries
                )
            else:
                await bus.publish_owned(items, owners, ack=list(zip(rids, entries, strict=True)))
            out.append(time.perf_counter() - t0)
    p, f = statistics.median(plain) * 1e6, statistics.median(fenced) * 1e6
    return {
        "requests": n,
        "unfenced_us": p,
        "fenced_us": f,
        "extra_us": f - p,
        "extra_per_request_us": (f - p) / n,
    }


async def run(flushes: int) -> dict:
    out: dict = {"env": environment(), "flushes": flushes, "servers": {}}
    server = start_redis_server()
    embedded = EmbeddedRedis()
    embedded.start()
    try:
        for name, make in (
            ("redis-server", lambda: connect(f"redis://127.0.0.1:{server.port}")),
            ("embedded (in-process)", embedded.client),
        ):
            client = make()
            bus = Bus(client, Keys("fbench"))
            rows = [await measure(bus, n, flushes) for n in (1, 8, 32)]
            rows.append({**await with_finals(bus, 32, flushes), "requests": "32 + final"})
            out["servers"][name] = rows
            await client.flushall()
            await client.aclose()
    finally:
        embedded.stop()
        server.stop()
    for name, rows in out["servers"].items():
        print_table(
            f"one step's publish, {name} (median µs per flush)",
            ["requests/step", "unfenced", "fenced", "extra", "extra/request"],
            [
                [r["requests"], r["unfenced_us"], r["fenced_us"], r["extra_us"], r["extra_per_request_us"]]
                for r in rows
            ],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flushes", type=int, default=2000)
    ap.add_argument("--output-json", default="bench/results/fence.json")
    args = ap.parse_args()
    write_json(args.output_json, asyncio.run(run(args.flushes)))


if __name__ == "__main__":
    main()
