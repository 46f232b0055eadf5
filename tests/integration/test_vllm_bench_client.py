"""vLLM's benchmark client (``vllm bench serve --backend openai`` and ``--backend openai-chat``)
against what ``fd serve`` runs (the ``served`` fixture: an engine and an API node on the
embedded store, the tiny model).

vLLM's client is not a dependency of the tests; :class:`BenchClient` reads a stream as its
request functions do (vllm/benchmarks/lib/endpoint_request_func.py, read on 2026-12-07): the
body's chunks as they arrive, each stripped, decoded incrementally, split into messages on a
blank line (a trailing ``data:`` message that parses already counts); a message that starts
with ``:`` (a comment) is skipped; the rest has a leading ``data: `` removed and, unless it
is ``[DONE]``, is parsed as JSON, or the request fails. A chunk with choices is a token chunk
(its text, or its delta's content), one with ``usage`` gives the output token count, and a
request with no token chunk has failed. Its payloads are vLLM's too."""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field

import aiohttp
import pytest

from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM

PROMPT = "The benchmark asks for a long answer about"
OUTPUT_LEN = 24


@dataclass
class Result:
    success: bool = False
    error: str = ""
    text: str = ""
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


def _messages(buffer: str) -> tuple[list[str], str]:
    """Complete SSE messages in ``buffer``, and what is left of it."""
    out = []
    while "\n\n" in buffer:
        message, buffer = buffer.split("\n\n", 1)
        if message.strip():
            out.append(message.strip())
    if buffer.startswith("data: "):
        rest = buffer.removeprefix("data: ").strip()
        if rest == "[DONE]":
            out.append(buffer.strip())
            buffer = ""
        elif rest:
            try:
                json.loads(rest)
            except json.JSONDecodeError:
                return out, buffer  # (a message cut by the chunking: wait for the rest)
            out.append(buffer.strip())
            buffer = ""
    return out, buffer


async def bench_request(url: str, payload: dict, chat: bool) -> Result:
    res = Result()
    start = last = time.perf_counter()
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=payload) as resp:
                if resp.status != 200:
                    res.error = resp.reason or ""
                    return res
                async for chunk in resp.content.iter_any():
                    chunk = chunk.strip()
                    if not chunk:
                        continue
                    messages, buffer = _messages(buffer + decoder.decode(chunk))
                    for message in messages:
                        if message.startswith(":"):
                            continue
                        data = message.removeprefix("data: ")
                        if data == "[DONE]":
                            continue
                        obj = json.loads(data)
                        if choices := obj.get("choices"):
                            now = time.perf_counter()
                            if res.success:
                                res.itl.append(now - last)
                            else:
                                res.success, res.ttft = True, now - start
                            last = now
                            piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                            res.text += piece or ""
                        elif usage := obj.get("usage"):
                            res.output_tokens = usage.get("completion_tokens")
    except Exception as e:  # (what the client records: the request failed, and why)
        res.success, res.error = False, repr(e)
    if not res.success and not res.error:
        res.error = "Never received a valid chunk to calculate TTFT."
    return res


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
async def test_vllm_bench_serve_reads_fd_serves_streams(served, tiny_runner, tiny_tokenizer, backend):
    api, _ = served
    if backend == "openai":
        url = f"{api.url}/v1/completions"
        payload = {
            "model": api.cfg.model_name,
            "prompt": PROMPT,
            "repetition_penalty": 1.0,
            "max_tokens": OUTPUT_LEN,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        ids = tiny_tokenizer.encode(PROMPT)
    else:
        url = f"{api.url}/v1/chat/completions"
        payload = {
            "model": api.cfg.model_name,
            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "max_completion_tokens": OUTPUT_LEN,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        ids = None
    results = [
        await bench_request(url, {**payload, "temperature": 0}, backend == "openai-chat") for _ in range(4)
    ]
    for res in results:
        assert res.success, res.error
        assert res.output_tokens == OUTPUT_LEN
        assert len(res.itl) >= 1
    if ids is not None:  # the completion's text is the greedy one
        (ref,) = LLM(tiny_runner, tiny_tokenizer).generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        )
        assert all(res.text == ref.text for res in results)
    assert len({res.text for res in results}) == 1


async def test_the_bench_parser_fails_on_id_lines_as_vllms_does(served):
    """The check is real: the same client fails on every request whose stream carries ``id:``
    lines (fd's frames before, or now when a client asks for them)."""
    api, _ = served
    payload = {
        "model": api.cfg.model_name,
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    }

    async def with_ids() -> Result:
        res = Result()
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{api.url}/v1/completions", json=payload, headers={"X-Event-Ids": "1"}) as r:
                raw = await r.read()
        messages, _ = _messages(raw.decode())
        try:
            for m in messages:
                if not m.startswith(":") and m.removeprefix("data: ") != "[DONE]":
                    json.loads(m.removeprefix("data: "))
            res.success = True
        except json.JSONDecodeError as e:
            res.error = repr(e)
        return res

    res = await with_ids()
    assert not res.success and "char 0" in res.error
