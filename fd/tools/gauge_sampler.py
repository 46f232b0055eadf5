"""Samples a server's running + waiting gauges from ``/metrics`` every few ms, in a process of
its own: how ``fd bench`` (:mod:`fd.tools.loadgen.release`) and bench/abort.py's release wave see
a cancelled request released on a server whose own events they cannot read.

In the client's event loop the samples waited on the client's own work: while a wave of 32
streams hung up, 30-40 ms went by between two samples (the loop was reading the other streams'
chunks and closing sockets), and that gap, not the server, set the measured release. A process
of its own samples on time whatever the streams' client is doing; its clock
(``time.perf_counter``, CLOCK_MONOTONIC) is the same as the client's.

Run as a script it is the sampler: ``python fd/tools/gauge_sampler.py URL PERIOD_S [--suffix]
NAME...`` (an API key in ``FD_GAUGE_SAMPLER_KEY``) prints ``ready``, samples until SIGTERM,
then prints its samples as JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

#: The environment variable the sampler takes the API key from.
KEY_ENV = "FD_GAUGE_SAMPLER_KEY"


def parse(text: bytes, names: Sequence[str], suffix: bool = False) -> float:
    """The sum of the samples of ``names`` (a labelled sample, vLLM's ``{model_name=...}``,
    counts too); ``suffix``: of the metrics whose names end so (any server's prefix)."""
    total = 0.0
    for line in text.split(b"\n"):
        if not line or line.startswith(b"#"):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0].decode()
        if name.endswith(tuple(names)) if suffix else name in names:
            total += float(line.rsplit(None, 1)[1])
    return total


class GaugeSampler:
    """``start()`` (a wave's streams go after it returns), ``stop()`` -> ``[(perf_counter, sum)]``."""

    def __init__(
        self,
        base: str,
        names: Sequence[str],
        period_s: float = 0.005,
        suffix: bool = False,
        key: str | None = None,
    ):
        # (run as a file: it needs nothing but the standard library, wherever fd is)
        self.cmd = [sys.executable, __file__, base, str(period_s), *(["--suffix"] * suffix), *names]
        self.env = {**os.environ, KEY_ENV: key} if key else None  # (not in argv: ps shows that)
        self.proc: subprocess.Popen | None = None
        self.errors = 0  # requests that failed

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True, env=self.env)
        line = self.proc.stdout.readline()  # (the first sample taken)
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the gauge sampler did not start: {line!r}")

    def stop(self) -> list[tuple[float, float]]:
        proc = self.proc
        if proc is None:
            return []
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        got = json.loads(out or "{}")
        self.errors = got.get("errors", 0)
        return [tuple(s) for s in got.get("samples", [])]


def _sample(url: str, period_s: float, names: Sequence[str], suffix: bool, key: str | None) -> None:
    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    samples: list[tuple[float, float]] = []
    errors = 0
    ready = False
    while not stop:
        t = time.perf_counter()
        try:
            conn.request("GET", parts.path.rstrip("/") + "/metrics", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise ValueError(resp.status)
            value = parse(body, names, suffix)
            samples.append((time.perf_counter(), value))  # (when the value was known: after it)
        except (OSError, http.client.HTTPException, ValueError):
            errors += 1
            conn.close()  # (reconnects on the next request)
        if not ready:  # (after the first try, answered or not: the caller must not hang)
            print("ready", flush=True)
            ready = True
        time.sleep(max(0.0, period_s - (time.perf_counter() - t)))
    print(json.dumps({"samples": samples, "errors": errors}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="samples a server's gauges until SIGTERM")
    ap.add_argument("url")
    ap.add_argument("period_s", type=float)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--suffix", action="store_true", help="match the names as suffixes")
    a = ap.parse_args()
    _sample(a.url, a.period_s, a.names, a.suffix, os.environ.get(KEY_ENV))
