"""The ``fd replay --html`` page draws in a real browser: headless Chromium screenshots it and
the running bars are counted in the PNG, one band per request that ran."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib

import pytest

from fd.engine.journal.replay import replay
from fd.engine.journal.timeline import LEFT, RUN, render_html
from tests.kit.journal import record_run


def read_png(path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB/RGBA PNG: enough for a screenshot."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rows.append(
            bytes(line) if bpp == 3 else bytes(x for j in range(0, stride, 4) for x in line[j : j + 3])
        )
    return w, h, rows


def test_timeline_renders_in_headless_chromium(tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail(
            "chromium is not on PATH: install it (`apt-get install chromium`) -- the "
            "timeline page is checked in a real headless browser",
            pytrace=False,
        )
    run = record_run()
    report = replay(run.entries)
    page = render_html(run.entries, report)
    # self-contained: nothing to fetch
    assert not re.search(r"""(src|href)\s*=|@import|url\(|<script""", page)
    html = tmp_path / "timeline.html"
    html.write_text(page, encoding="utf-8")
    png = tmp_path / "shot.png"
    profile = tmp_path / "profile"
    profile.mkdir()
    proc = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            "--window-size=1200,800",
            "--hide-scrollbars",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert png.exists(), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    w, h, rows = read_png(png)
    assert (w, h) == (1200, 800)
    run_rgb = bytes(int(RUN[i : i + 2], 16) for i in (1, 3, 5))
    plot = 3 * (16 + LEFT)  # bytes left of the plot area: body margin + labels (and legend)
    hit_rows = [
        y
        for y, row in enumerate(rows)
        if sum(row[i : i + 3] == run_rgb for i in range(plot, len(row), 3)) >= 8
    ]
    bands = 0
    for i, y in enumerate(hit_rows):
        if i == 0 or y != hit_rows[i - 1] + 1:
            bands += 1
    ran = [t for t in report.analysis.requests.values() if t.first_scheduled_step is not None]
    assert len(ran) >= 6
    # one green band per request that ran (only the step view is shown; the ms view is hidden)
    assert bands == len(ran), (bands, [t.request_id for t in ran])
    pixels = sum(row[i : i + 3] == run_rgb for row in rows for i in range(plot, len(row), 3))
    assert pixels > len(ran) * 10 * 20  # bars, not specks
