"""``fd run-batch``: OpenAI's batch file format, run against an fd server (vLLM's ``run-batch``).

Each input line is one request, ``{"custom_id", "method": "POST", "url", "body"}``, with
``url`` one of :data:`URLS`; each output line, in the input's order, is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` — the
answer's body on success, the OpenAI error object (also in ``error``) otherwise. A line that
is not such a request gets its error line and the batch goes on.

The requests go over HTTP to an fd API (``--base-url``, or the ``fd serve`` this command starts
in-process on a free port), so a batch is served as any other client is: same validation, same
event log, and a batch's requests can be watched, replayed or aborted like any others.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/responses",
)


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str | None
    url: str
    body: dict


def parse_line(raw: bytes | str, n: int) -> BatchLine | dict:
    """One input line, or the error object its output line carries."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return _error(f"line {n}: not JSON ({e})")
    if not isinstance(obj, dict):
        return _error(f"line {n}: not a JSON object")
    cid = obj.get("custom_id")
    if cid is not None and not isinstance(cid, str):
        return _error(f"line {n}: custom_id must be a string", cid)
    if obj.get("method", "POST") != "POST":
        return _error(f"line {n}: method must be POST", cid)
    url = obj.get("url")
    if url not in URLS:
        return _error(f"line {n}: url must be one of {', '.join(URLS)}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        return _error(f"line {n}: body must be a JSON object", cid)
    if body.get("stream"):
        return _error(f"line {n}: a batch request cannot stream", cid)
    return BatchLine(cid, url, body)


def _error(message: str, custom_id: Any = None) -> dict:
    return {
        "custom_id": custom_id if isinstance(custom_id, str) else None,
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None},
    }


def output_line(custom_id: str | None, status: int, request_id: str, body: Any) -> bytes:
    """An output line: the answer, or (status >= 400) its error object."""
    error = body.get("error") if status >= 400 and isinstance(body, dict) else None
    return (
        orjson.dumps(
            {
                "id": f"batch-{uuid.uuid4().hex}",
                "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body},
                "error": error,
            }
        )
        + b"\n"
    )


async def run_batch(
    base_url: str,
    lines: Iterable[bytes],
    out,
    *,
    concurrency: int = 64,
    api_key: str | None = None,
    progress: bool = True,
) -> tuple[int, int]:
    """Send every line's request to ``base_url`` (at most ``concurrency`` at once) and write
    the output lines to ``out`` (a binary file) in input order. Returns (succeeded, failed)."""
    import aiohttp

    from fd.control.logs import progress as told

    todo = [ln for ln in (raw.strip() for raw in lines) if ln]
    results: list[bytes | None] = [None] * len(todo)
    gate = asyncio.Semaphore(max(1, concurrency))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ok = 0

    async def one(session: aiohttp.ClientSession, k: int, raw: bytes) -> None:
        nonlocal ok
        parsed = parse_line(raw, k + 1)
        if isinstance(parsed, dict):
            results[k] = output_line(parsed["custom_id"], 400, "", {"error": parsed["error"]})
        else:
            rid = f"batch-{uuid.uuid4().hex}"
            async with gate:
                try:
                    async with session.post(
                        base_url.rstrip("/") + parsed.url,
                        json=parsed.body,
                        headers={**headers, "X-Request-Id": rid},
                    ) as resp:
                        status = resp.status
                        try:
                            body = await resp.json(content_type=None)
                        except ValueError:
                            body = {
                                "error": {
                                    "message": (await resp.text())[:500],
                                    "type": "server_error",
                                    "param": None,
                                    "code": None,
                                }
                            }
                except aiohttp.ClientError as e:
                    status, body = (
                        503,
                        {
                            "error": {
                                "message": f"the server could not be reached: {e}",
                                "type": "service_unavailable",
                                "param": None,
                                "code": None,
                            }
                        },
                    )
            results[k] = output_line(parsed.custom_id, status, rid, body)
            ok += status < 400

    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = asyncio.as_completed([one(session, k, raw) for k, raw in enumerate(todo)])
        # (a bar on a terminal, progress records in JSON logs: fd.control.logs.progress)
        for answer in told(answers, "batch", total=len(todo), unit="req") if progress else answers:
            await answer
    for line in results:
        out.write(line)
    return ok, len(todo) - ok
