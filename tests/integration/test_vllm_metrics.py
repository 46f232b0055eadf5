"""vLLM's metrics beside fd's (fd/control/vllm_metrics.py): every ``vllm:`` series that vLLM's Grafana
dashboard and production-stack's autoscaling rules query is in ``/metrics`` with vLLM's labels and
buckets, and the numbers are those of the requests actually served."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from fd.control.metrics import Metrics
from fd.control.vllm_metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    request_tokens_buckets,
)

DASHBOARDS = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "vllm_dashboard_metrics.json").read_text()
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The exposition's samples as (name, labels, value)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(parsed, name: str, **labels: str) -> float:
    found = [v for n, lab, v in parsed if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def buckets(parsed, name: str, model: str) -> list[float]:
    return [
        float(lab["le"])
        for n, lab, _v in parsed
        if n == f"{name}_bucket" and lab.get("model_name") == model and lab["le"] != "+Inf"
    ]


async def _scrape(api) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/metrics") as r:
            assert r.status == 200
            return await r.text()


async def _sse(resp: aiohttp.ClientResponse):
    """The JSON chunks of an SSE answer, as they come."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield orjson.loads(line[6:])


async def test_dashboard_and_hpa_series_carry_the_served_numbers(served, tiny_tokenizer):
    api, _eng = served
    model = api.cfg.model_name
    url = f"{api.url}/v1"
    usages: list[dict] = []
    reasons: list[str] = []
    async with aiohttp.ClientSession() as s:
        # not streamed, cut by length
        body = {
            "model": model,
            "prompt": "Hello there, how",
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with s.post(f"{url}/completions", json=body) as r:
            out = await r.json()
        usages.append(out["usage"])
        reasons.append(out["choices"][0]["finish_reason"])

        # streamed chat, cut by length
        chat = {
            "model": model,
            "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post(f"{url}/chat/completions", json=chat) as r:
            async for chunk in _sse(r):
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
                for c in chunk.get("choices", ()):
                    if c.get("finish_reason"):
                        reasons.append(c["finish_reason"])

        # ended by a stop token: the third token greedy decoding gives
        first = body | {"max_tokens": 3}
        async with s.post(f"{url}/completions", json=first | {"return_token_ids": True}) as r:
            out = await r.json()
        third = out["choices"][0]["token_ids"][2]
        usages.append(out["usage"])
        reasons.append(out["choices"][0]["finish_reason"])
        async with s.post(f"{url}/completions", json=body | {"stop_token_ids": [third]}) as r:
            out = await r.json()
        usages.append(out["usage"])
        reasons.append(out["choices"][0]["finish_reason"])

        # streamed, aborted by id after its first tokens
        long = body | {"max_tokens": 400, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(f"{url}/completions", json=long) as r:
            rid = r.headers["X-Request-Id"]
            aborted = False
            async for chunk in _sse(r):
                if not aborted:
                    async with s.post(f"{url}/abort_requests", json={"request_ids": [rid]}) as a:
                        assert a.status == 200, await a.text()
                    aborted = True
                if chunk.get("usage"):
                    usages.append(chunk["usage"])
                for c in chunk.get("choices", ()):
                    if c.get("finish_reason"):
                        reasons.append(c["finish_reason"])
    assert sorted(reasons) == ["abort", "length", "length", "length", "stop"]
    assert len(usages) == 5 and usages[3]["completion_tokens"] == 3  # (the stop token counts)
    assert usages[-1]["completion_tokens"] < 400

    parsed = samples(await _scrape(api))
    names = {n for n, _lab, _v in parsed}
    for source in DASHBOARDS["sources"]:
        for series in source["series"]:
            assert series in names, (source["path"], series)
            if series != "vllm:num_incoming_requests_total":  # (the router's: by `model`)
                assert any(n == series and lab.get("model_name") == model for n, lab, _ in parsed), series
                assert all(lab.get("engine") == "0" for n, lab, _ in parsed if n == series), series

    # the tokens counted are those the answers' usage reports
    assert value(parsed, "vllm:prompt_tokens_total", model_name=model) == sum(
        u["prompt_tokens"] for u in usages
    )
    assert value(parsed, "vllm:generation_tokens_total", model_name=model) == sum(
        u["completion_tokens"] for u in usages
    )
    assert value(parsed, "vllm:request_generation_tokens_count", model_name=model) == 5
    success = {r: value(parsed, "vllm:request_success_total", model_name=model, finished_reason=r) for r in
               ("stop", "length", "abort", "error", "repetition")}  # fmt: skip
    assert success == {"stop": 1, "length": 3, "abort": 1, "error": 0, "repetition": 0}
    assert value(parsed, "vllm:num_incoming_requests_total", model=model) == 5
    # every request's latencies, once each
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_time_per_output_token_seconds"):  # fmt: skip
        assert value(parsed, f"vllm:{h}_count", model_name=model) == 5, h
    assert value(parsed, "vllm:time_to_first_token_seconds_count", model_name=model) == 5
    assert value(parsed, "vllm:e2e_request_latency_seconds_sum", model_name=model) > 0

    # vLLM 0.32's bucket bounds
    assert buckets(parsed, "vllm:e2e_request_latency_seconds", model) == list(REQUEST_LATENCY_BUCKETS)
    assert buckets(parsed, "vllm:time_to_first_token_seconds", model) == list(TIME_TO_FIRST_TOKEN_BUCKETS)
    assert buckets(parsed, "vllm:inter_token_latency_seconds", model) == list(INTER_TOKEN_LATENCY_BUCKETS)
    assert buckets(parsed, "vllm:request_prompt_tokens", model) == list(
        request_tokens_buckets(api.cfg.max_model_len)
    )
    assert buckets(parsed, "vllm:request_queue_time_seconds", model)[:4] == [0.3, 0.5, 0.8, 1.0]

    # the engine gauges: idle now, and the KV cache empty but for what the prefix cache keeps
    assert value(parsed, "vllm:num_requests_running", model_name=model) == 0
    assert value(parsed, "vllm:num_requests_waiting", model_name=model) == 0
    usage = value(parsed, "vllm:kv_cache_usage_perc", model_name=model)
    assert 0 <= usage < 1 and value(parsed, "vllm:gpu_cache_usage_perc", model_name=model) == usage
    assert value(parsed, "vllm:prefix_cache_queries_total", model_name=model) > 0


async def test_requests_whose_handler_ends_first_leave_the_waiting_count(served):
    """A background response is answered before any engine claims it, and a hung-up stream's
    handler ends without its final: neither counts as waiting once it is gone (an autoscaler
    reading vllm:num_requests_waiting would otherwise scale for it)."""
    api, _eng = served
    model = api.cfg.model_name
    body = {"model": model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        background = {"model": model, "input": "Hello", "background": True, "max_output_tokens": 4}
        async with s.post(f"{api.url}/v1/responses", json=background) as r:
            assert r.status == 200 and (await r.json())["status"] == "queued"
        async with s.post(f"{api.url}/v1/completions", json=body) as r:
            async for _chunk in _sse(r):
                break  # one chunk, then the client goes away
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        parsed = samples(await _scrape(api))
        idle = value(parsed, "vllm:num_requests_running", model_name=model) == 0
        if idle and value(parsed, "vllm:num_requests_waiting", model_name=model) == 0:
            break
        assert asyncio.get_running_loop().time() < deadline, "the hung-up request still counts"
        await asyncio.sleep(0.05)


def test_engine_gauges_sum_over_the_engines_heartbeats():
    """A split deployment: the API sums the engines' heartbeat hashes into engine "0"."""
    m = Metrics()
    m.vllm.configure("m", 2048)
    m.set_engine_gauges_from(
        {
            "e1": {"blocks_total": "100", "blocks_free": "70", "running": "3", "waiting": "5",
                   "cache_queries": "400", "cache_hits": "100"},
            "e2": {"blocks_total": "300", "blocks_free": "130", "running": "2", "waiting": "1",
                   "cache_queries": "600", "cache_hits": "oops"},
        }
    )  # fmt: skip
    text = m.render().decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}  # (it parses)
    assert types["vllm:num_requests_waiting"] == types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:prompt_tokens"] == types["vllm:request_success"] == "counter"
    assert types["vllm:prefix_cache_hits"] == types["vllm:num_preemptions"] == "counter"
    assert (
        types["vllm:time_to_first_token_seconds"] == types["vllm:request_queue_time_seconds"] == "histogram"
    )
    parsed = samples(text)
    assert value(parsed, "vllm:num_requests_running", model_name="m", engine="0") == 5
    assert value(parsed, "vllm:num_requests_waiting", model_name="m", engine="0") == 6
    assert value(parsed, "vllm:kv_cache_usage_perc", model_name="m") == (400 - 200) / 400
    assert value(parsed, "vllm:prefix_cache_queries_total", model_name="m") == 1000
    assert value(parsed, "vllm:prefix_cache_hits_total", model_name="m") == 100
    assert value(parsed, "fd_num_requests_waiting") == 6  # (fd's own sums, unchanged)

    # one engine gone: its share goes with it
    m.set_engine_gauges_from({"e2": {"blocks_total": "300", "blocks_free": "300", "waiting": "1"}})
    parsed = samples(m.render().decode())
    assert value(parsed, "vllm:num_requests_waiting", model_name="m") == 1
    assert value(parsed, "vllm:kv_cache_usage_perc", model_name="m") == 0


def test_requests_not_yet_claimed_wait_too():
    """Engines claim only what they can start now: the rest of the backlog waits in P:requests,
    and vllm:num_requests_waiting (what autoscalers read) counts it from the API's side."""
    m = Metrics()
    m.vllm.configure("m", 2048)
    m.set_engine_gauges(blocks_total=10, blocks_free=10, running=1, waiting=2)

    def waiting() -> float:
        return value(samples(m.render().decode()), "vllm:num_requests_waiting", model_name="m")

    a, b, c = (m.vllm.request(0.0, 4, 8, 1) for _ in range(3))
    assert waiting() == 2 + 3
    a.claimed(0.1)
    assert waiting() == 2 + 2
    b.final(0.2, "abort", {})  # (ended before any engine took it)
    assert waiting() == 2 + 1
    c.close()  # its handler ended without a final (the client hung up)
    assert waiting() == 2
    assert value(samples(m.render().decode()), "fd_num_requests_waiting") == 2  # (fd's: claimed only)


def test_a_request_phases_and_preemptions():
    """Queue, prefill, decode and TPOT from the events the API relays, on a known clock."""
    m = Metrics()
    m.vllm.configure("m", 100)
    r = m.vllm.request(10.0, prompt_tokens=12, max_tokens=30, n=1)
    r.claimed(10.5)
    r.preempted()
    r.tokens(11.0, 1)  # first token: prefill 0.5 s after the claim
    r.tokens(11.25, 2)  # a coalesced event: two gaps of 0.125 s
    r.tokens(11.75, 1)
    r.final(11.75, "length", {"prompt_tokens": 12, "completion_tokens": 4})
    parsed = samples(m.render().decode())

    def hist(name: str) -> tuple[float, float]:
        count = value(parsed, f"vllm:{name}_count", model_name="m")
        return count, value(parsed, f"vllm:{name}_sum", model_name="m")

    assert hist("request_queue_time_seconds") == (1, 0.5)
    assert hist("request_prefill_time_seconds") == (1, 0.5)
    assert hist("time_to_first_token_seconds") == (1, 1.0)
    assert hist("request_decode_time_seconds")[1] == 0.75
    assert hist("request_inference_time_seconds")[1] == 1.25
    assert hist("request_time_per_output_token_seconds")[1] == 0.25
    assert hist("inter_token_latency_seconds")[0] == 3
    assert hist("request_num_preemptions") == (1, 1)
    assert value(parsed, "vllm:num_preemptions_total", model_name="m") == 1
    assert value(parsed, "vllm:prompt_tokens_total", model_name="m") == 12
    assert value(parsed, "vllm:generation_tokens_total", model_name="m") == 4
    assert value(parsed, "vllm:request_params_max_tokens_sum", model_name="m") == 30
    # a 0.5 s gap sits in the le="0.5" bucket (le is inclusive), not above it
    itl = {lab["le"]: v for n, lab, v in parsed if n == "vllm:inter_token_latency_seconds_bucket"}
    assert (itl["0.1"], itl["0.15"], itl["0.4"], itl["0.5"]) == (0, 2, 2, 3)
    assert buckets(parsed, "vllm:request_generation_tokens", "m") == [1, 2, 5, 10, 20, 50, 100]
