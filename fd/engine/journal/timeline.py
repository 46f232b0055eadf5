"""The timeline page of ``fd replay --html``: one self-contained HTML file (inline SVG + CSS,
no script, no network), so it can be attached to an incident and opened anywhere.

Each request is a bar: grey while waiting, green while it holds a running slot, with marks for
preemption, abort requested, drained and blocks released, and an end cap coloured by its
finish reason. Below, the KV block usage curve. The x axis is the engine step, or wall-clock ms
(entry timestamps) via a CSS-only toggle, so a stall shows up as a stretch of the ms view.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Callable
from typing import Any

from fd.control.events import Event

RUN = "#00a878"  # the running bar; distinctive so a screenshot test can count it
WAIT = "#c9ccd1"
USAGE = "#3466d6"
MARKS = {"preempted": "#8e44ad", "abort": "#e0301e", "drained": "#f39c12", "released": "#111111"}
FINISH = {"stop": RUN, "length": "#e6b422", "abort": "#e0301e", "error": "#111111"}
MAX_ROWS = 500

LEFT, WIDTH, ROW, BAR = 150, 1000, 14, 10


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _step_to_ms(usage: list[tuple[int, int, int]]) -> Callable[[float], float]:
    """Step -> ms since the first step, interpolated between recorded (step, ts) points."""
    pts: dict[int, int] = {}
    for step, _, ts in usage:
        pts.setdefault(step, ts)
    steps = sorted(pts)
    if not steps:
        return lambda s: 0.0
    t0 = pts[steps[0]]
    ms = [pts[s] - t0 for s in steps]

    def f(s: float) -> float:
        i = bisect.bisect_left(steps, s)
        if i <= 0:
            return float(ms[0])
        if i >= len(steps):
            return float(ms[-1]) + (s - steps[-1])  # past the end: keep bars visible
        s0, s1 = steps[i - 1], steps[i]
        return ms[i - 1] + (ms[i] - ms[i - 1]) * (s - s0) / (s1 - s0)

    return f


def _gantt(traces: list, last_step: int, pos: Callable[[float], float], unit: str, span: float) -> str:
    span = span or 1.0
    x0 = pos(0)

    def x(step: float) -> float:
        return LEFT + (pos(step) - x0) / span * WIDTH

    height = ROW * len(traces) + 30
    out = [
        f'<svg class="gantt" width="{LEFT + WIDTH + 50}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg" shape-rendering="crispEdges">'
    ]
    for i in range(6):  # axis ticks
        v = span * i / 5
        xx = LEFT + WIDTH * i / 5
        out.append(
            f'<line x1="{xx:.1f}" y1="0" x2="{xx:.1f}" y2="{height - 20}" class="grid"/>'
            f'<text x="{xx:.1f}" y="{height - 6}" class="tick">{v:.0f} {unit}</text>'
        )
    for row, t in enumerate(traces):
        y = row * ROW + 2
        end = t.final_step if t.final_step is not None else (t.released_step or last_step)
        start = t.added_step
        run_from = t.first_scheduled_step
        tip = (
            f"{t.request_id}: added step {t.added_step}, first scheduled {run_from}, "
            f"ended step {t.final_step} ({t.finish_reason or 'open'}), {t.num_tokens} tokens, "
            f"{len(t.preempted_steps)} preemption(s)"
        )
        if t.abort_step is not None:
            tip += f", abort ({t.abort_source}) step {t.abort_step} -> released step {t.released_step}"
        out.append(f"<g><title>{_esc(tip)}</title>")
        out.append(f'<text x="{LEFT - 6}" y="{y + BAR - 1}" class="rid">{_esc(t.request_id[:22])}</text>')
        wait_end = run_from if run_from is not None else end + 1
        if wait_end > start:
            out.append(
                f'<rect x="{x(start):.1f}" y="{y}" width="{max(1.0, x(wait_end) - x(start)):.1f}" '
                f'height="{BAR}" fill="{WAIT}"/>'
            )
        if run_from is not None:
            out.append(
                f'<rect x="{x(run_from):.1f}" y="{y}" '
                f'width="{max(2.0, x(end + 1) - x(run_from)):.1f}" height="{BAR}" fill="{RUN}"/>'
            )
        if t.finish_reason is not None:
            out.append(
                f'<rect x="{x(end + 1) - 3:.1f}" y="{y - 1}" width="3" height="{BAR + 2}" '
                f'fill="{FINISH.get(t.finish_reason, "#555")}"/>'
            )
        for s in t.preempted_steps:
            out.append(
                f'<rect x="{x(s):.1f}" y="{y - 1}" width="2" height="{BAR + 2}" fill="{MARKS["preempted"]}"/>'
            )
        if t.abort_step is not None:
            ax = x(t.abort_step)
            out.append(
                f'<polygon points="{ax - 4:.1f},{y - 1} {ax + 4:.1f},{y - 1} {ax:.1f},{y + 6}" '
                f'fill="{MARKS["abort"]}" shape-rendering="auto"/>'
            )
        if t.drained_step is not None and t.abort_step is not None:
            out.append(
                f'<rect x="{x(t.drained_step) + 1:.1f}" y="{y + 6}" width="2" height="5" '
                f'fill="{MARKS["drained"]}"/>'
            )
        if t.released_step is not None and t.abort_step is not None:
            out.append(
                f'<rect x="{x(t.released_step + 1) - 1:.1f}" y="{y + 6}" width="2" height="5" '
                f'fill="{MARKS["released"]}"/>'
            )
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _usage(
    usage: list[tuple[int, int, int]], total: int, pos: Callable[[float], float], unit: str, span: float
) -> str:
    span = span or 1.0
    h = 160
    x0 = pos(0)
    top = max(total, max((u for _, u, _ in usage), default=0), 1)

    def xy(step: float, used: int) -> str:
        return f"{LEFT + (pos(step) - x0) / span * WIDTH:.1f},{10 + (h - 20) * (1 - used / top):.1f}"

    pts = [xy(0, 0)]
    last = 0
    for step, used, _ in usage:
        pts.append(xy(step, last))
        pts.append(xy(step, used))
        last = used
    if usage:
        pts.append(xy(usage[-1][0] + 1, last))
        pts.append(xy(usage[-1][0] + 1, 0))
    ty = 10 + (h - 20) * (1 - total / top)
    return (
        f'<svg class="usage" width="{LEFT + WIDTH + 50}" height="{h + 10}" '
        f'xmlns="http://www.w3.org/2000/svg">'
        f'<text x="{LEFT - 6}" y="{ty + 4:.1f}" class="rid">total {total}</text>'
        f'<line x1="{LEFT}" y1="{ty:.1f}" x2="{LEFT + WIDTH}" y2="{ty:.1f}" class="total"/>'
        f'<polygon points="{" ".join(pts)}" fill="{USAGE}" fill-opacity="0.35" '
        f'stroke="{USAGE}" stroke-width="1.5"/>'
        f'<text x="{LEFT}" y="{h + 6}" class="tick">0 {unit}</text>'
        f'<text x="{LEFT + WIDTH - 60}" y="{h + 6}" class="tick">{span:.0f} {unit}</text>'
        "</svg>"
    )


CSS = """
body{font:13px system-ui,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 4px} .sum{margin:2px 0 10px;color:#444}
.bad{color:#b00020;font-weight:600} .ok{color:#00704a;font-weight:600}
.grid{stroke:#eee} .total{stroke:#999;stroke-dasharray:4 3}
.tick{font-size:10px;fill:#666} .rid{font:10px monospace;fill:#333;text-anchor:end}
.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:10px;margin-right:4px;vertical-align:-1px}
#by-ms:checked ~ .steps{display:none} #by-step:checked ~ .ms{display:none}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:260px}
"""


def render_html(entries: list[Event], report) -> str:
    """The timeline page for one engine's journal and its :class:`ReplayReport`."""
    a = report.analysis
    traces = list(a.requests.values())
    hidden = max(0, len(traces) - MAX_ROWS)
    traces = traces[:MAX_ROWS]
    last_step = max([a.steps] + [s for s, _, _ in a.usage] or [0])
    to_ms = _step_to_ms(a.usage)
    by_step = lambda s: float(s)  # noqa: E731
    step_span = float(last_step + 1)
    ms_span = to_ms(last_step + 1) - to_ms(0)
    s = report.summary()
    status = '<span class="ok">replay OK</span>' if report.ok else '<span class="bad">replay FAILED</span>'
    problems = ""
    if report.divergence is not None:
        problems += f"<h2>Divergence</h2><pre>{_esc(report.divergence.describe())}</pre>"
    if report.violations:
        problems += "<h2>Invariant violations</h2><pre>" + _esc("\n".join(report.violations)) + "</pre>"
    legend = "".join(
        f'<span><i style="background:{c}"></i>{_esc(n)}</span>'
        for n, c in [
            ("waiting", WAIT),
            ("running", RUN),
            ("preempted", MARKS["preempted"]),
            ("abort requested", MARKS["abort"]),
            ("drained", MARKS["drained"]),
            ("blocks released", MARKS["released"]),
            ("KV blocks in use", USAGE),
        ]
    )
    lat = s["abort_release_steps"]
    return "".join(
        [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>fd timeline {_esc(s['engine'])}</title><style>{CSS}</style></head><body>",
            f"<h1>fd timeline - engine {_esc(s['engine'] or '(unnamed)')}</h1>",
            f"<div class='sum'>{status} · {s['steps']} steps · {s['calls']} calls · "
            f"{s['requests']} requests {_esc(s['finish_reasons'])} · peak KV "
            f"{s['peak_blocks_in_use']}/{s['total_blocks']} blocks · aborts released "
            f"{s['aborts_released']} (p50 {lat['p50']} / max {lat['max']} steps) · recorded "
            f"{s['recorded_ms']} ms</div>",
            problems,
            f"<div class='legend'>{legend}</div>",
            "<div class='view'><input type='radio' name='x' id='by-step' checked> "
            "<label for='by-step'>x = step</label> "
            "<input type='radio' name='x' id='by-ms'> <label for='by-ms'>x = ms</label>",
            f"<div class='steps'>{_gantt(traces, last_step, by_step, 'step', step_span)}"
            f"{_usage(a.usage, a.total_blocks, by_step, 'step', step_span)}</div>",
            f"<div class='ms'>{_gantt(traces, last_step, to_ms, 'ms', ms_span)}"
            f"{_usage(a.usage, a.total_blocks, to_ms, 'ms', ms_span)}</div></div>",
            f"<p class='sum'>{hidden} more requests not drawn</p>" if hidden else "",
            "</body></html>",
        ]
    )
