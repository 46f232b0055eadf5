"""``fd bench``'s report: the statistics of a run's outcomes (:func:`summarize`), as text
(:func:`format_report`) and as a plot (:func:`plot_report`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from itertools import pairwise
from typing import Any

from fd.tools.loadgen.client import Outcome
from fd.tools.loadgen.workload import CANCEL_KINDS, BenchConfig


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(xs_s: Sequence[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """n, mean, p50, p99 (None when there is no data: JSON null, not NaN)."""
    xs = [x * scale for x in xs_s]
    return {
        "n": len(xs),
        "mean": (sum(xs) / len(xs)) if xs else None,
        "p50": percentile(xs, 50),
        "p99": percentile(xs, 99),
    }


def summarize(
    cfg: BenchConfig, model: str, outcomes: Sequence[Outcome], duration_s: float, release_source: str | None
) -> dict[str, Any]:
    """The report. Latencies in ms over: TTFT and ITL every request that got a token; TPOT and
    E2EL the requests that ran to completion (not cancelled, no error)."""
    ok = [o for o in outcomes if o.status in ("length", "stop")]
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    itl = [b - a for o in outcomes for a, b in pairwise(o.chunk_times)]
    e2el = [o.t_end - o.t_send for o in ok]
    tpot = [
        (o.t_end - o.t_send - o.ttft) / (o.output_tokens - 1)
        for o in ok
        if o.ttft is not None and o.output_tokens > 1
    ]
    out_tokens = sum(o.output_tokens for o in outcomes if o.status != "error")
    in_tokens = sum(o.prompt_tokens or 0 for o in outcomes)
    finished = sum(1 for o in outcomes if o.status != "error")
    counts = Counter(o.status for o in outcomes)
    cancel: dict[str, Any] = {"release_source": release_source}
    for kind in CANCEL_KINDS:
        mine = [o for o in outcomes if o.cancel == kind]
        fired = [o for o in mine if o.t_cancel is not None]
        cancel[kind] = {
            "planned": len(mine),
            "fired": len(fired),  # the rest finished before their cancel was due
            "server_finish_reasons": dict(
                Counter(o.server_finish_reason for o in fired if o.server_finish_reason)
            ),
            "noted_ms": describe([o.noted_ms / 1000 for o in fired if o.noted_ms is not None]),
            "release_ms": describe([o.release_ms / 1000 for o in fired if o.release_ms is not None]),
        }
    d = max(duration_s, 1e-9)
    errors = [{"request_id": o.request_id, "error": o.error} for o in outcomes if o.error]
    return {
        "config": {
            k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
            for k, v in asdict(cfg).items()
            if k not in ("api_key", "admin_key")
        },
        "model": model,
        "duration_s": duration_s,
        "num_requests": len(outcomes),
        "finished": finished,
        "counts": dict(counts),
        "errors": errors[:20],
        "num_errors": len(errors),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": finished / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "ttft_ms": describe(ttft),
        "tpot_ms": describe(tpot),
        "itl_ms": describe(itl),
        "e2el_ms": describe(e2el),
        "cancel": cancel,
        "requests": [
            {
                "request_id": o.request_id,
                "cancel": o.cancel,
                "status": o.status,
                "server_finish_reason": o.server_finish_reason,
                "output_tokens": o.output_tokens,
                "max_tokens": o.max_tokens,
                "send_s": o.t_send - (outcomes[0].t_send if outcomes else 0),
                "ttft_ms": o.ttft * 1000 if o.ttft is not None else None,
                "e2el_ms": (o.t_end - o.t_send) * 1000 if o.t_end else None,
                "cancel_after_ms": (o.t_cancel - o.t_send) * 1000 if o.t_cancel is not None else None,
                "noted_ms": o.noted_ms,
                "release_ms": o.release_ms,
                "error": o.error,
            }
            for o in outcomes
        ],
    }


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "-" if x != x else f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        "=" * 20 + " fd bench " + "=" * 20,
        f"{'Endpoint:':<34}{c['endpoint']} @ {', '.join(c['base_urls'])}",
        f"{'Model:':<34}{r['model']}",
        f"{'Requests (finished / sent):':<34}{r['finished']} / {r['num_requests']}",
        f"{'Finish reasons:':<34}" + ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())),
        f"{'Duration (s):':<34}{_f(r['duration_s'])}",
        f"{'Input / output tokens:':<34}{r['total_input_tokens']:,} / {r['total_output_tokens']:,}",
        f"{'Request throughput (req/s):':<34}{_f(r['request_throughput'])}",
        f"{'Output token throughput (tok/s):':<34}{_f(r['output_throughput'], 1)}",
        f"{'Total token throughput (tok/s):':<34}{_f(r['total_token_throughput'], 1)}",
        "",
        f"| {'ms':<40} | {'mean':>9} | {'p50':>9} | {'p99':>9} | {'n':>6} |",
        f"|{'-' * 42}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 8}|",
    ]

    def row(name: str, d: dict) -> None:
        lines.append(
            f"| {name:<40} | {_f(d['mean']):>9} | {_f(d['p50']):>9} | {_f(d['p99']):>9} | {d['n']:>6} |"
        )

    row("TTFT", r["ttft_ms"])
    row("TPOT", r["tpot_ms"])
    row("ITL", r["itl_ms"])
    row("E2EL", r["e2el_ms"])
    src = r["cancel"]["release_source"]
    for kind in CANCEL_KINDS:
        k = r["cancel"][kind]
        if not k["planned"]:
            continue
        if src == "events":
            row(f"{kind}: cancel -> abort noted", k["noted_ms"])
        row(f"{kind}: cancel -> released ({src})", k["release_ms"])
    for kind in CANCEL_KINDS:
        k = r["cancel"][kind]
        if k["planned"]:
            extra = f"; server finals {k['server_finish_reasons']}" if k["server_finish_reasons"] else ""
            lines.append(f"{kind}: {k['fired']} of {k['planned']} cancelled (the rest finished first){extra}")
    if r["num_errors"]:
        lines.append(f"errors: {r['num_errors']}; first: {r['errors'][0]['error']}")
    return "\n".join(lines)


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "error: --plot needs matplotlib, which is not installed: "
            "pip install matplotlib   (or pip install 'fd[plot]')"
        ) from None


def plot_report(r: dict[str, Any], path: str) -> None:
    """Four panels: TTFT and E2EL over send time, ITL and cancel->release distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = r["requests"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    for status, color in (
        ("length", "tab:blue"),
        ("stop", "tab:cyan"),
        ("abort", "tab:red"),
        ("disconnected", "tab:orange"),
        ("error", "black"),
    ):
        pts = [(q["send_s"], q["ttft_ms"]) for q in reqs if q["status"] == status and q["ttft_ms"]]
        if pts:
            ax[0][0].scatter(*zip(*pts, strict=True), s=8, color=color, label=status)
        pts = [(q["send_s"], q["e2el_ms"]) for q in reqs if q["status"] == status and q["e2el_ms"]]
        if pts:
            ax[0][1].scatter(*zip(*pts, strict=True), s=8, color=color, label=status)
    ax[0][0].set(title="TTFT", xlabel="sent at (s)", ylabel="ms")
    ax[0][1].set(title="end-to-end (cancelled: until their stream ended)", xlabel="sent at (s)", ylabel="ms")
    ax[0][0].legend(fontsize=7)
    rel = [q["release_ms"] for q in reqs if q["release_ms"] is not None]
    ax[1][0].hist(rel or [0], bins=30, color="tab:red")
    ax[1][0].set(title=f"cancel -> released ({r['cancel']['release_source']})", xlabel="ms")
    lat = sorted(q["ttft_ms"] for q in reqs if q["ttft_ms"])
    if lat:
        ax[1][1].plot(lat, [i / len(lat) for i in range(1, len(lat) + 1)])
    ax[1][1].set(title="TTFT CDF", xlabel="ms", ylabel="share")
    fig.suptitle(f"fd bench: {r['num_requests']} requests, {r['output_throughput']:.0f} tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
