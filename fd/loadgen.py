"""``fd bench``: a load generator for any OpenAI-compatible server, with cancellation built in.

It works like ``vllm bench serve`` (Poisson arrivals, a concurrency cap, random prompts of a
length distribution, warm-ups, TTFT/TPOT/ITL/E2EL percentiles) and adds what fd is about: a
share of the clients hang up mid-stream (``--disconnect-ratio``) or have their request aborted
through ``POST /v1/abort_requests`` (``--abort-ratio``), and the report says how long the
server took from that cancel to releasing the request.

That release time is read where it is exact when it can be: with ``--redis-url``, from the
``ts`` of ``abort_requested`` / ``blocks_released`` on each request's own stream (fd servers).
Otherwise, for any server, from the Prometheus gauges ``*_num_requests_running + waiting``
polled every 5 ms, the way TARGETS.md measured vLLM: the first drop of the gauge after the
cancel. That is only exact when nothing else starts or ends meanwhile.

Only the HTTP API and ``control`` (key names) are used: this module never imports ``engine``,
so it runs against a remote deployment from a machine without PaddlePaddle.

Importable: :class:`BenchConfig`, :func:`run_bench` (async, returns the report dict),
:func:`format_report`, :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import aiohttp

CANCEL_KINDS = ("disconnect", "abort")

# Common short English words: most byte-level BPE vocabularies hold " word" as one token, so a
# prompt of N words is close to N tokens (the report gives the server's own count from usage).
WORDS = tuple(
    """
the of and to in is was for on that with as by at from it his an be are this which or had
not but were her they one all there their has been have more its who when would also will
two other some time into out first only new can after about most over then these many such
than may them any even like much where back well what some through long down good year day
make way each work city world life house part both three people under state over few water
light small place great old land high name music game river song night group book story
system power line between still round home road while never point early field open study
team order number side sound right left hand head king war film sea south north east west
""".split()
)


# --------------------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    base_urls: list[str]
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # default: the first id of GET /v1/models
    num_prompts: int = 100
    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    input_len: int = 32  # words
    output_len: int = 128  # max_tokens, with ignore_eos
    range_ratio: float = 0.0  # lengths uniform in [L*(1-r), L*(1+r)]
    num_warmups: int = 0
    seed: int = 0
    temperature: float = 0.0
    disconnect_ratio: float = 0.0
    abort_ratio: float = 0.0
    cancel_after_tokens: int = 10
    cancel_after_ms: float | None = None  # when set, cancels fire on time, not token count
    api_key: str | None = None
    admin_key: str | None = None  # for /v1/abort_requests; default: api_key
    redis_url: str | None = None
    prefix: str = "fd"
    metrics_poll_ms: float = 5.0
    request_id_prefix: str | None = None
    progress: bool = True
    timeout_s: float = 600.0

    def check(self) -> None:
        if not self.base_urls:
            raise ValueError("at least one --base-url is required")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("--endpoint must be completions or chat")
        for name in ("disconnect_ratio", "abort_ratio", "range_ratio"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
        if self.disconnect_ratio + self.abort_ratio > 1.0 + 1e-9:
            raise ValueError("--disconnect-ratio + --abort-ratio must be <= 1")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")


@dataclass
class Planned:
    index: int
    request_id: str
    prompt: str
    max_tokens: int
    cancel: str | None  # None | "disconnect" | "abort"
    base_url: str


@dataclass
class Outcome:
    """What one request did, as the client saw it (plus the server's story when read)."""

    index: int
    request_id: str
    cancel: str | None
    base_url: str
    max_tokens: int
    t_send: float = 0.0  # perf_counter
    chunk_times: list[float] = field(default_factory=list)  # chunks carrying text
    t_end: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    status: str = "error"  # length | stop | abort | disconnected | error
    error: str | None = None
    t_cancel: float | None = None  # perf_counter when the cancel fired
    cancel_wall_ms: float | None = None  # the same instant, epoch ms (to compare with event ts)
    server_finish_reason: str | None = None
    abort_source: str | None = None
    noted_ms: float | None = None  # cancel -> abort_requested
    release_ms: float | None = None  # cancel -> blocks released

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t_send if self.chunk_times else None


# --------------------------------------------------------------------------- planning


def _length(rng: random.Random, n: int, ratio: float) -> int:
    lo, hi = max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio)))
    return rng.randint(lo, hi)


def plan_requests(cfg: BenchConfig, run_id: str) -> list[Planned]:
    """The prompts, lengths and cancel assignments: a pure function of the config and seed, so
    two runs (or two servers) get the same workload. Exactly round(ratio * n) requests of each
    cancel kind, spread at random over the run."""
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts
    kinds: list[str | None] = ["disconnect"] * round(cfg.disconnect_ratio * n) + ["abort"] * round(
        cfg.abort_ratio * n
    )
    kinds = (kinds + [None] * n)[:n]
    rng.shuffle(kinds)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(_length(rng, cfg.input_len, cfg.range_ratio))]
        out.append(
            Planned(
                i,
                f"{run_id}-{i}",
                " ".join(words).capitalize(),
                _length(rng, cfg.output_len, cfg.range_ratio),
                kinds[i],
                cfg.base_urls[i % len(cfg.base_urls)],
            )
        )
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process of ``rate`` requests/s."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --------------------------------------------------------------------------- statistics


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


# --------------------------------------------------------------------------- HTTP


def _headers(key: str | None, rid: str | None = None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    if rid:
        h["X-Request-Id"] = rid
    return h


async def fetch_model(session: aiohttp.ClientSession, base: str, api_key: str | None) -> str:
    async with session.get(base + "/v1/models", headers=_headers(api_key)) as r:
        if r.status != 200:
            raise RuntimeError(f"GET {base}/v1/models: HTTP {r.status}: {(await r.text())[:200]}")
        data = (await r.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _body(cfg: BenchConfig, model: str, p: Planned) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": p.max_tokens,
        "temperature": cfg.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    return body


def _text_of(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")


class _Cancel(Exception):
    """Raised inside the read loop when the request's cancel is due."""


async def _post_abort(session: aiohttp.ClientSession, base: str, key: str | None, rid: str) -> str | None:
    try:
        async with session.post(
            base + "/v1/abort_requests", json={"request_ids": [rid]}, headers=_headers(key)
        ) as r:
            if r.status != 200:
                return f"abort: HTTP {r.status}: {(await r.text())[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"abort: {type(e).__name__}: {e}"
    return None


async def send_one(
    session: aiohttp.ClientSession, cfg: BenchConfig, model: str, p: Planned, cancel: bool = True
) -> Outcome:
    """One streaming request; fires its cancel (if planned and ``cancel``) after
    ``cancel_after_tokens`` text chunks or ``cancel_after_ms``."""
    o = Outcome(p.index, p.request_id, p.cancel if cancel else None, p.base_url, p.max_tokens)
    chat = cfg.endpoint == "chat"
    url = p.base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    abort_task: asyncio.Task | None = None
    resp = None
    o.t_send = time.perf_counter()
    deadline = (
        o.t_send + cfg.cancel_after_ms / 1000.0 if o.cancel and cfg.cancel_after_ms is not None else None
    )

    def fire() -> None:
        nonlocal abort_task, deadline
        o.t_cancel = time.perf_counter()
        # whole ms, as the events' ts are: an abort noted within the same millisecond must not
        # read as noted before it was sent
        o.cancel_wall_ms = float(int(time.time() * 1000))
        deadline = None
        if o.cancel == "disconnect":
            raise _Cancel
        abort_task = asyncio.create_task(
            _post_abort(session, p.base_url, cfg.admin_key or cfg.api_key, p.request_id)
        )

    try:
        resp = await session.post(url, json=_body(cfg, model, p), headers=_headers(cfg.api_key, p.request_id))
        if resp.status != 200:
            o.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return o
        buf = b""
        done = False
        while not done:
            if deadline is not None:
                left = deadline - time.perf_counter()
                try:  # (asyncio.timeout: 3.11's wait_for can lose a cancellation, gh-86296)
                    async with asyncio.timeout(max(left, 0.0)):
                        data = await resp.content.readany()
                except TimeoutError:
                    fire()
                    continue
            else:
                data = await resp.content.readany()
            if not data:
                break
            now = time.perf_counter()
            buf += data.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                payload = b"".join(
                    line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")
                )
                if not payload:
                    continue  # a comment (keep-alive) or an id-only frame
                if payload == b"[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    o.error = str(obj["error"].get("message", obj["error"]))[:300]
                    done = True
                    break
                if _text_of(obj, chat):
                    o.chunk_times.append(now)
                    o.output_tokens += 1
                ch = obj.get("choices") or []
                if ch and ch[0].get("finish_reason"):
                    o.status = ch[0]["finish_reason"]
                u = obj.get("usage")
                if u:
                    o.prompt_tokens = u.get("prompt_tokens")
                    o.output_tokens = u.get("completion_tokens", o.output_tokens)
                if (
                    o.cancel
                    and o.t_cancel is None
                    and cfg.cancel_after_ms is None
                    and len(o.chunk_times) >= cfg.cancel_after_tokens
                ):
                    fire()
        o.t_end = time.perf_counter()
        if not done and o.error is None:
            o.error = "the stream ended without [DONE]"
        if o.error is not None:
            o.status = "error"
    except _Cancel:
        o.status = "disconnected"
        o.t_end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        o.error = f"{type(e).__name__}: {e}"[:300]
        o.status = "error"
        o.t_end = time.perf_counter()
    finally:
        if resp is not None:
            resp.close()  # for a disconnect: closes the TCP connection, which the server sees
        if abort_task is not None:
            err = await abort_task
            if err and o.error is None:
                o.error = err
    return o


# --------------------------------------------------------------------------- release timing


class EventReader:
    """Reads a cancelled request's own stream (``P:req:{id}``) until its ``final``."""

    def __init__(self, redis_url: str, prefix: str):
        from control.connect import connect
        from control.keys import Keys

        self.redis = connect(redis_url)
        self.keys = Keys(prefix)

    async def fill(self, o: Outcome, timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
        key = self.keys.req(o.request_id)
        ts: dict[str, int] = {}
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                entries = await self.redis.xrange(key)
            except Exception as e:  # noqa: BLE001 - a bench reports, it does not crash mid-run
                o.error = o.error or f"redis: {type(e).__name__}: {e}"
                return
            for _eid, f in entries:
                typ = f.get(b"type", b"").decode()
                if typ not in ts and b"ts" in f:
                    ts[typ] = int(f[b"ts"])
                if typ == "abort_requested" and o.abort_source is None:
                    o.abort_source = f.get(b"source", b"").decode() or None
                if typ == "final":
                    o.server_finish_reason = f.get(b"finish_reason", b"").decode() or None
            if "final" in ts:
                break
            await asyncio.sleep(poll_s)
        if o.cancel_wall_ms is not None and "abort_requested" in ts:
            o.noted_ms = ts["abort_requested"] - o.cancel_wall_ms
            if "blocks_released" in ts:
                o.release_ms = ts["blocks_released"] - o.cancel_wall_ms

    async def close(self) -> None:
        await self.redis.aclose()


class GaugePoller:
    """Samples running + waiting requests from ``/metrics`` every ``poll_ms``."""

    NAMES = (b"_num_requests_running", b"_num_requests_waiting")

    def __init__(self, session: aiohttp.ClientSession, base: str, key: str | None, poll_ms: float):
        self.session, self.url, self.key, self.poll_s = session, base + "/metrics", key, poll_ms / 1000
        self.samples: list[tuple[float, float]] = []
        self._stop = False
        self._task: asyncio.Task | None = None
        self.errors = 0

    async def _sample(self) -> float | None:
        async with self.session.get(self.url, headers=_headers(self.key)) as r:
            if r.status != 200:
                return None
            text = await r.read()
        total, seen = 0.0, False
        for line in text.split(b"\n"):
            if line.startswith(b"#") or b"{" in line.split(b" ", 1)[0]:
                continue
            name, _, val = line.partition(b" ")
            if name.endswith(self.NAMES):
                total += float(val)
                seen = True
        return total if seen else None

    async def _run(self) -> None:
        while not self._stop:
            t = time.perf_counter()
            try:
                v = await self._sample()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                v = None
            if v is None:
                self.errors += 1
            else:
                self.samples.append((time.perf_counter(), v))
            await asyncio.sleep(max(0.0, self.poll_s - (time.perf_counter() - t)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop = True
        if self._task is not None:
            await self._task

    def fill(self, o: Outcome) -> None:
        """Release = the first sample after the cancel whose value is below the last sample
        taken before it."""
        if o.t_cancel is None or not self.samples:
            return
        before = [v for t, v in self.samples if t <= o.t_cancel]
        if not before:
            return
        v0 = before[-1]
        for t, v in self.samples:
            if t > o.t_cancel and v < v0:
                o.release_ms = (t - o.t_cancel) * 1000.0
                return


# --------------------------------------------------------------------------- the run


async def run_bench(cfg: BenchConfig, session: aiohttp.ClientSession | None = None) -> dict[str, Any]:
    """Run the benchmark and return its report (see :func:`summarize`)."""
    cfg.check()
    cfg.base_urls = [u.rstrip("/") for u in cfg.base_urls]
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)
        )
    reader = EventReader(cfg.redis_url, cfg.prefix) if cfg.redis_url else None
    try:
        model = cfg.model or await fetch_model(session, cfg.base_urls[0], cfg.api_key)
        run_id = cfg.request_id_prefix or f"bench-{secrets.token_hex(4)}"
        planned = plan_requests(cfg, run_id)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def limited(p: Planned, cancel: bool = True) -> Outcome:
            if sem is None:
                return await send_one(session, cfg, model, p, cancel)
            async with sem:
                return await send_one(session, cfg, model, p, cancel)

        if cfg.num_warmups:
            warm = [
                Planned(
                    i,
                    f"{run_id}-warmup-{i}",
                    planned[i % len(planned)].prompt,
                    min(16, cfg.output_len),
                    None,
                    cfg.base_urls[i % len(cfg.base_urls)],
                )
                for i in range(cfg.num_warmups)
            ]
            res = await asyncio.gather(*(limited(p, False) for p in warm))
            bad = [r.error for r in res if r.error]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")

        poller = None
        if reader is None and any(p.cancel for p in planned):
            poller = GaugePoller(session, cfg.base_urls[0], cfg.api_key, cfg.metrics_poll_ms)
            poller.start()
            await asyncio.sleep(3 * poller.poll_s)  # a baseline sample before the first cancel

        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(planned), desc="fd bench", unit="req", file=sys.stderr)

        async def one(p: Planned, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            o = await limited(p)
            if bar is not None:
                bar.update(1)
            if reader is not None and o.cancel and o.t_cancel is not None:
                await reader.fill(o)
            return o

        offsets = arrival_offsets(len(planned), cfg.request_rate, cfg.seed)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(p, t0 + dt) for p, dt in zip(planned, offsets)))
        if bar is not None:
            bar.close()
        if poller is not None:
            await asyncio.sleep(0.1)  # the last releases
            await poller.stop()
            for o in outcomes:
                poller.fill(o)
        t_end = max((o.t_end for o in outcomes), default=t0)
        source = "events" if reader else ("metrics" if poller else None)
        return summarize(cfg, model, outcomes, t_end - t0, source)
    finally:
        if reader is not None:
            await reader.close()
        if own:
            await session.close()


def summarize(
    cfg: BenchConfig, model: str, outcomes: Sequence[Outcome], duration_s: float, release_source: str | None
) -> dict[str, Any]:
    """The report. Latencies in ms over: TTFT and ITL every request that got a token; TPOT and
    E2EL the requests that ran to completion (not cancelled, no error)."""
    ok = [o for o in outcomes if o.status in ("length", "stop")]
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    itl = [b - a for o in outcomes for a, b in zip(o.chunk_times, o.chunk_times[1:])]
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


# --------------------------------------------------------------------------- output


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
            ax[0][0].scatter(*zip(*pts), s=8, color=color, label=status)
        pts = [(q["send_s"], q["e2el_ms"]) for q in reqs if q["status"] == status and q["e2el_ms"]]
        if pts:
            ax[0][1].scatter(*zip(*pts), s=8, color=color, label=status)
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


# --------------------------------------------------------------------------- CLI


def build_parser(prog: str = "fd bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument(
        "--base-url",
        action="append",
        required=True,
        help="server URL, e.g. http://127.0.0.1:8000; repeat (or comma-separate) to "
        "spread requests round-robin over API replicas",
    )
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s with Poisson arrivals; inf (default): all at once",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--disconnect-ratio",
        type=float,
        default=0.0,
        help="share of requests whose client closes the connection mid-stream",
    )
    p.add_argument(
        "--abort-ratio",
        type=float,
        default=0.0,
        help="share of requests aborted via POST /v1/abort_requests mid-stream",
    )
    p.add_argument("--cancel-after-tokens", type=int, default=10)
    p.add_argument(
        "--cancel-after-ms",
        type=float,
        default=None,
        help="cancel this long after sending instead of after K tokens",
    )
    p.add_argument("--api-key", default=os.environ.get("FD_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument(
        "--admin-key",
        default=os.environ.get("FD_ADMIN_KEY"),
        help="key for /v1/abort_requests (default: --api-key)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("FD_REDIS_URL"),
        help="read cancel->release from each request's events (fd servers); "
        "without it, from /metrics gauges polled every --metrics-poll-ms",
    )
    p.add_argument("--prefix", default=os.environ.get("FD_PREFIX", "fd"))
    p.add_argument("--metrics-poll-ms", type=float, default=5.0)
    p.add_argument("--request-id-prefix", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="needs matplotlib")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    urls = [u.strip() for arg in a.base_url for u in arg.split(",") if u.strip()]
    return BenchConfig(
        base_urls=urls,
        endpoint=a.endpoint,
        model=a.model,
        num_prompts=a.num_prompts,
        max_concurrency=a.max_concurrency,
        request_rate=a.request_rate,
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        num_warmups=a.num_warmups,
        seed=a.seed,
        temperature=a.temperature,
        disconnect_ratio=a.disconnect_ratio,
        abort_ratio=a.abort_ratio,
        cancel_after_tokens=a.cancel_after_tokens,
        cancel_after_ms=a.cancel_after_ms,
        api_key=a.api_key,
        admin_key=a.admin_key,
        redis_url=a.redis_url,
        prefix=a.prefix,
        metrics_poll_ms=a.metrics_poll_ms,
        request_id_prefix=a.request_id_prefix,
        progress=not a.disable_tqdm,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``fd bench ...``; returns 1 when any request failed, 2 on bad arguments."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from_args(args)
    try:
        cfg.check()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        check_plot_available()
    try:
        report = asyncio.run(run_bench(cfg))
    except (RuntimeError, aiohttp.ClientError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if report["num_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
