"""One ``fd bench`` request as its client sees it: the streaming POST, its cancel (a hang-up,
or ``POST /v1/abort_requests``) fired mid-stream, and what came back (:class:`Outcome`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fd.tools.loadgen.workload import BenchConfig, Planned


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


def request_headers(key: str | None, rid: str | None = None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    if rid:
        h["X-Request-Id"] = rid
    return h


async def fetch_model(session: aiohttp.ClientSession, base: str, api_key: str | None) -> str:
    async with session.get(base + "/v1/models", headers=request_headers(api_key)) as r:
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
            base + "/v1/abort_requests", json={"request_ids": [rid]}, headers=request_headers(key)
        ) as r:
            if r.status != 200:
                return f"abort: HTTP {r.status}: {(await r.text())[:200]}"
    except (TimeoutError, aiohttp.ClientError) as e:
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
        resp = await session.post(
            url, json=_body(cfg, model, p), headers=request_headers(cfg.api_key, p.request_id)
        )
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
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
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
