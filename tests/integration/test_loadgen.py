"""``fd bench`` (fd.tools.loadgen.main) against API + engine in this process: the report adds up, cancels
end in ``abort`` on the requests' own streams, everything else runs to ``length``."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.tools.loadgen import main as loadgen
from fd.tools.loadgen import report as loadgen_report
from fd.tools.loadgen import workload as loadgen_workload


def _ordered(d: dict) -> None:
    if d["n"]:
        assert d["p50"] <= d["p99"], d
        assert d["p50"] >= 0


def test_plan_is_deterministic_with_exact_cancel_shares():
    cfg = loadgen.BenchConfig(
        base_urls=["http://a", "http://b"],
        num_prompts=20,
        input_len=10,
        output_len=40,
        range_ratio=0.5,
        disconnect_ratio=0.3,
        abort_ratio=0.2,
        seed=7,
    )
    p1, p2 = loadgen_workload.plan_requests(cfg, "x"), loadgen_workload.plan_requests(cfg, "x")
    assert [(p.prompt, p.max_tokens, p.cancel) for p in p1] == [
        (p.prompt, p.max_tokens, p.cancel) for p in p2
    ]
    kinds = [p.cancel for p in p1]
    assert kinds.count("disconnect") == 6 and kinds.count("abort") == 4
    assert all(20 <= p.max_tokens <= 60 for p in p1) and len({p.max_tokens for p in p1}) > 1
    assert all(5 <= len(p.prompt.split()) <= 15 for p in p1)
    assert {p.base_url for p in p1} == {"http://a", "http://b"}
    other = loadgen_workload.plan_requests(loadgen.BenchConfig(**{**cfg.__dict__, "seed": 8}), "x")
    assert [p.prompt for p in other] != [p.prompt for p in p1]


def test_poisson_arrivals_and_percentiles():
    assert loadgen_workload.arrival_offsets(5, math.inf, 0) == [0.0] * 5
    t = loadgen_workload.arrival_offsets(2000, 100.0, 0)
    assert t == sorted(t) and 15 < t[-1] < 25  # ~2000 / 100 s
    assert loadgen_report.percentile([3, 1, 2], 50) == 2 and loadgen_report.percentile([], 50) is None
    d = loadgen_report.describe([0.001, 0.002, 0.010])
    assert d["n"] == 3 and d["p50"] == pytest.approx(2.0) and d["p50"] <= d["p99"] <= 10.0


async def test_bench_with_cancels_reads_release_from_events(served, embedded_redis, keys):
    api, eng = served
    cfg = loadgen.BenchConfig(
        base_urls=[api.url],
        num_prompts=10,
        max_concurrency=4,
        input_len=12,
        output_len=24,
        disconnect_ratio=0.3,
        abort_ratio=0.2,
        cancel_after_tokens=4,
        num_warmups=1,
        redis_url=embedded_redis.url,
        prefix=keys.prefix,
        progress=False,
        request_id_prefix="lgA",
    )
    r = await loadgen.run_bench(cfg)

    assert r["num_errors"] == 0, r["errors"]
    assert r["num_requests"] == 10 and r["finished"] == 10
    assert sum(r["counts"].values()) == 10
    assert r["counts"] == {"length": 5, "disconnected": 3, "abort": 2}
    c = r["cancel"]
    assert c["release_source"] == "events"
    assert (c["disconnect"]["planned"], c["disconnect"]["fired"]) == (3, 3)
    assert (c["abort"]["planned"], c["abort"]["fired"]) == (2, 2)
    assert c["disconnect"]["server_finish_reasons"] == {"abort": 3}
    assert c["abort"]["server_finish_reasons"] == {"abort": 2}
    assert c["disconnect"]["release_ms"]["n"] == 3 and c["abort"]["release_ms"]["n"] == 2
    for kind in ("disconnect", "abort"):
        _ordered(c[kind]["release_ms"])
        _ordered(c[kind]["noted_ms"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        _ordered(r[name])
    assert r["ttft_ms"]["n"] == 10 and r["e2el_ms"]["n"] == 5
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in r["requests"])
    assert r["output_throughput"] > 0 and r["request_throughput"] > 0

    # the streams themselves: cancelled -> abort (with the right source), the rest -> length
    client = connect(embedded_redis.url)
    bus = Bus(client, keys)
    try:
        for q in r["requests"]:
            evs = [e for _, e in await bus.read_req(q["request_id"])]
            final = evs[-1]
            assert final.TYPE == "final"
            if q["cancel"]:
                assert final.finish_reason == "abort", q
                src = next(e.source for e in evs if e.TYPE == "abort_requested")
                assert src == ("disconnect" if q["cancel"] == "disconnect" else "http")
                assert q["release_ms"] is not None and q["noted_ms"] <= q["release_ms"]
            else:
                assert final.finish_reason == "length" and q["output_tokens"] == q["max_tokens"]
    finally:
        await client.aclose()
    assert "fd bench" in loadgen.format_report(r)


async def test_cli_with_metrics_gauges_and_json(served, tmp_path):
    """``main`` end to end (in a thread: it runs its own event loop): chat endpoint, Poisson
    arrivals, cancel by time, release read from the /metrics gauges."""
    api, eng = served
    out = tmp_path / "bench.json"
    rc = await asyncio.to_thread(
        loadgen.main,
        [
            "--base-url",
            api.url,
            "--endpoint",
            "chat",
            "--num-prompts",
            "8",
            "--request-rate",
            "50",
            "--max-concurrency",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "200",
            "--disconnect-ratio",
            "0.25",
            "--abort-ratio",
            "0.25",
            "--cancel-after-ms",
            "60",
            "--output-json",
            str(out),
            "--disable-tqdm",
            "--redis-url",
            "",
        ],
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["cancel"]["release_source"] == "metrics"
    assert (
        r["counts"].get("length", 0) + r["counts"].get("disconnected", 0) + r["counts"].get("abort", 0) == 8
    )
    assert r["counts"]["length"] == 4
    assert r["cancel"]["disconnect"]["fired"] == 2 and r["cancel"]["abort"]["fired"] == 2
    assert r["cancel"]["disconnect"]["release_ms"]["n"] + r["cancel"]["abort"]["release_ms"]["n"] >= 1
    for q in r["requests"]:
        if q["cancel"]:
            assert q["cancel_after_ms"] >= 60
    for name in ("ttft_ms", "itl_ms", "e2el_ms"):
        _ordered(r[name])
    for _ in range(200):
        if eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks:
            break
        await asyncio.sleep(0.01)
    assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks


def test_bad_arguments_exit_2(capsys):
    assert loadgen.main(["--base-url", "http://x", "--disconnect-ratio", "0.8", "--abort-ratio", "0.5"]) == 2
    assert "must be <= 1" in capsys.readouterr().err
