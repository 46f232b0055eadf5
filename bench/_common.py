"""Helpers shared by bench/engine.py, bench/api.py and bench/abort.py.

A redis-server on a free port (killed by pid), ``fd serve`` as a subprocess (stopped by pid),
the tiny model in a temp dir, percentiles, a plain-text table, JSON results, a streaming
client for ``/v1/completions`` that records when each SSE chunk arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import platform
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fd.engine.runner.process import tune
from fd.tools.gauge_sampler import parse
from tests.kit.redis import RedisDidNotStart, RedisNotInstalled
from tests.kit.redis import start_redis_server as launch_redis_server

tune()  # the settings fd's own processes run the model with (before anything imports Paddle)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT_LEN = 33  # TARGETS.md workload


# ------------------------------------------------------------------ numbers


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def p50(xs: Sequence[float]) -> float:
    return pct(xs, 0.50)


def p99(xs: Sequence[float]) -> float:
    return pct(xs, 0.99)


def fmt(x: Any, nd: int = 1) -> str:
    if isinstance(x, float):
        if x != x:
            return "-"
        return f"{x:,.{nd}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], nd: int = 1) -> str:
    """A GitHub-markdown table (pastes into bench/README.md as is); returns the text."""
    cells = [[fmt(c, nd) for c in r] for r in rows]
    lines = [
        f"### {title}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    return text


def goal(name: str, at: str, value: float, op: str, limit: float) -> dict:
    """One of an issue's bench goals as this run measured it: ``value op limit`` holds or not.
    A goal is judged from the figures the run printed, never from a separate timing, so
    ``bench/repeat.py`` can count over runs how often it held."""
    held = {"<": value < limit, "<=": value <= limit, ">=": value >= limit, "==": value == limit}[op]
    return {"goal": name, "at": at, "value": value, "op": op, "limit": limit, "met": bool(held)}


def print_goals(title: str, goals: Sequence[dict]) -> str:
    return print_table(
        title,
        ["goal", "at", "measured", "needs", "met"],
        [
            [g["goal"], g["at"], g["value"], f"{g['op']} {fmt(g['limit'], 2)}", "yes" if g["met"] else "NO"]
            for g in goals
        ],
        nd=2,
    )


def environment() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "argv": sys.argv,
    }


def write_json(path: str | Path, obj: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"env": environment(), **obj}, indent=2, default=str) + "\n")
    print(f"wrote {p}")
    return p


def peak_rss_mb() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def children_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, sum of each process's VmHWM) in MiB of ``pid`` and every process below it (a
    server and its model workers), from /proc."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, grew = {pid}, True
    while grew:
        more = {c for c, p in parents.items() if p in tree} - tree
        grew = bool(more)
        tree |= more
    cur = peak = 0.0
    for p in tree:
        c, h = proc_rss_mb(p)
        cur += 0.0 if c != c else c
        peak += 0.0 if h != h else h
    return cur, peak


def proc_rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a live process in MiB, from /proc."""
    cur = peak = float("nan")
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return cur, peak


# ------------------------------------------------------------------ model / prompts


def model_dir(arg: str | None, tmp: str) -> str:
    """``--model DIR``, or the tiny random-weight model (TARGETS.md shape) made under ``tmp``."""
    if arg:
        return arg
    from fd.engine.model.tiny import make_tiny_model

    return make_tiny_model(os.path.join(tmp, "tiny-llama"))


def prompts(n: int, vocab: int = 512, length: int = PROMPT_LEN, seed: int = 0) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` token ids, avoiding the special tokens (0..3)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def kill_pid(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM by pid, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    tmp: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        kill_pid(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_redis_server() -> RedisServer:
    """A throwaway redis-server on a free port: the tests' launcher (tests/kit/redis.py)."""
    tmp = tempfile.mkdtemp(prefix="fd-bench-redis-")
    try:
        server = launch_redis_server(tmp)
    except (RedisNotInstalled, RedisDidNotStart) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(str(e)) from None
    return RedisServer(server.proc, server.port, tmp)


@dataclass
class Serve:
    """``python -m fd serve`` in a subprocess."""

    proc: subprocess.Popen
    port: int
    redis_url: str  # the embedded server's TCP door, or the --redis-url given
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        kill_pid(self.proc, grace=10)

    def rss_mb(self) -> tuple[float, float]:
        return proc_rss_mb(self.proc.pid)


def start_serve(
    model: str,
    *,
    redis_url: str | None = None,
    extra: Sequence[str] = (),
    log_dir: str | None = None,
    timeout: float = 120.0,
    tree: str | Path | None = None,
) -> Serve:
    """``tree``: the checkout whose fd serves (default this one): another's, for an A/B of two
    trees under the same client."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "fd",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]
    if redis_url:
        cmd += ["--redis-url", redis_url]
        url = redis_url
    else:
        eport = free_port()
        cmd += ["--embedded-port", str(eport)]
        url = f"redis://127.0.0.1:{eport}/0"
    log = Path(log_dir or tempfile.mkdtemp(prefix="fd-bench-serve-")) / f"serve-{port}.log"
    with open(log, "wb") as fh:  # (the child keeps its own copy)
        proc = subprocess.Popen(
            cmd,
            cwd=tree or ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"fd serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if b"fd serving" in log.read_bytes():
            srv = Serve(proc, port, url, log)
            _wait_health(srv, deadline)
            return srv
        time.sleep(0.1)
    kill_pid(proc)
    raise SystemExit(f"fd serve did not start in {timeout}s:\n{log.read_text()[-3000:]}")


def _wait_health(srv: Serve, deadline: float) -> None:
    import urllib.request

    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(srv.base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    srv.stop()
    raise SystemExit("fd serve: /health never answered 200")


# ------------------------------------------------------------------ streaming client


@dataclass
class StreamResult:
    request_id: str
    t_send: float = 0.0  # perf_counter just before the request was sent
    chunk_times: list[float] = field(default_factory=list)  # one per SSE data chunk with text
    last_event_id: str | None = None  # entry id of the last frame received (SSE ``id:``)
    t_close: float | None = None  # perf_counter when the client hung up (None: read to [DONE])
    wall_close_ms: float | None = None  # time.time() ms at the hang-up
    finish_reason: str | None = None
    error: str | None = None


def take_payload(res: StreamResult, payload: bytes, now: float, hang_up_after: int | None) -> str | None:
    """One SSE ``data:`` payload into ``res`` (``now``: when its bytes came). None: read on;
    ``"done"``: ``[DONE]`` or an error; ``"hang_up"``: the client hangs up now (timed here)."""
    if payload == b"[DONE]":
        return "done"
    obj = json.loads(payload)
    if "error" in obj:
        res.error = f"stream error: {obj['error']}"
        return "done"
    ch = (obj.get("choices") or [{}])[0]
    if ch.get("finish_reason"):
        res.finish_reason = ch["finish_reason"]
    if ch.get("text"):
        res.chunk_times.append(now)
        if hang_up_after is not None and len(res.chunk_times) >= hang_up_after:
            res.t_close = time.perf_counter()
            res.wall_close_ms = float(int(time.time() * 1000))  # whole ms, as events' ts
            return "hang_up"
    return None


async def stream_with(
    client: str,
    session,
    base: str,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    hang_up_after: int | None = None,
    pool=None,
) -> StreamResult:
    """:func:`stream_completion` on the benchmarks' ``--client``: ``lean``
    (bench/sse_client.py, a connection of its own; ``session`` unused) or ``aiohttp``."""
    if client == "lean":
        from bench.sse_client import stream_completion_lean

        return await stream_completion_lean(
            base, rid, prompt, max_tokens, hang_up_after=hang_up_after, pool=pool
        )
    return await stream_completion(session, base, rid, prompt, max_tokens, hang_up_after=hang_up_after)


async def stream_completion(
    session,
    base: str,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    hang_up_after: int | None = None,
    model: str | None = None,
) -> StreamResult:
    """POST a streaming /v1/completions (greedy, ignore_eos) and read its SSE chunks.

    ``hang_up_after=K``: close the connection right after the K-th chunk with text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if model:
        body["model"] = model
    res = StreamResult(rid)
    res.t_send = time.perf_counter()
    try:
        async with session.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while b"\n\n" in buf:
                    frame, buf = buf.split(b"\n\n", 1)
                    payload = None
                    for line in frame.split(b"\n"):
                        if line.startswith(b"id:"):
                            res.last_event_id = line[3:].strip().decode()
                        elif line.startswith(b"data:"):
                            payload = line[5:].strip()
                    if payload is None:
                        continue
                    end = take_payload(res, payload, now, hang_up_after)
                    if end == "hang_up":
                        resp.connection.transport.abort() if resp.connection else None
                        resp.close()
                    if end is not None:
                        return res
    except Exception as e:  # noqa: BLE001 - a bench reports, it does not crash mid-run
        res.error = f"{type(e).__name__}: {e}"
    return res


def http_session(limit: int = 0, keepalive: bool = False):
    """A client session; by default a new connection per request (each stream its own: the
    strictest case for the server); ``keepalive`` reuses them (a connection pool's way, as
    ``vllm bench serve``, the ``openai`` client and an admin tool calling again do)."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, force_close=not keepalive),
        timeout=aiohttp.ClientTimeout(total=600),
    )


def quiet_gc() -> None:
    """Keep the load generator's own full collections out of what it times: its heap (aiohttp,
    tqdm, the results so far) took ~9 ms to walk, and one such pause in the middle of a timed
    call was the slowest of fifty 1,000-id ``/v1/abort_requests`` calls. What start-up
    allocated is frozen and full collections wait until the run ends (young ones still run),
    as ``fd serve`` does for itself."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)


@contextlib.contextmanager
def on_the_workers_cpu():
    """Run the load generator on the CPU ``fd serve --worker-cpus auto`` gives the model worker
    (the last one), for a part of a benchmark where no request runs (the abort endpoint's
    unknown ids). Otherwise it shares the server's CPU: the server's answer wakes it there
    (a socket write is a synchronous wake-up), and it waits until the server is done with the
    work that answer started (1,000 tombstones, ~4 ms), which a client on another machine
    would never see: 1,000-id calls then took 5 ms, their answers written after 1.4."""
    try:
        before = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        yield
        return
    cpus = sorted(before)
    if len(cpus) < 2:
        yield
        return
    try:
        os.sched_setaffinity(0, {cpus[-1]})
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


FD_GAUGES = ("fd_num_requests_running", "fd_num_requests_waiting")
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


async def wait_idle(session, base: str, timeout: float = 60.0, names: Sequence[str] = FD_GAUGES) -> None:
    """Until the server's running + waiting gauges read 0."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await gauges(session, base, names) == 0:
            return
        await asyncio.sleep(0.05)


async def gauges(session, base: str, names: Sequence[str] = FD_GAUGES) -> float:
    """The sum of the gauges ``names`` (default fd_num_requests_running +
    fd_num_requests_waiting) from /metrics; a labelled sample (vLLM's ``{model_name=...}``)
    counts too."""
    async with session.get(base + "/metrics") as r:
        return parse(await r.read(), names)


def entry_le(a: bytes | str, b: bytes | str) -> bool:
    """Stream entry id ``a`` <= ``b`` (``ms-seq``)."""

    def key(x):
        x = x.decode() if isinstance(x, bytes) else x
        ms, _, seq = x.partition("-")
        return int(ms), int(seq or 0)

    return key(a) <= key(b)
