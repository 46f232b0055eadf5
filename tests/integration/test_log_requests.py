"""vLLM's ``--enable-log-requests``: a line for each generating request with its prompt and its
sampling parameters, cut to ``--max-log-len``; off by default, and never a key."""

from __future__ import annotations

import logging

import aiohttp

from fd.api.config import ApiConfig
from fd.compose import join_in_process, start_api, start_engine
from fd.control.metrics import Metrics
from fd.engine.node.node_config import EngineConfig


async def _serve(embedded_redis, keys, tiny_model_dir, tiny_runner, **api_kw):
    metrics = Metrics()
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-log"),
        runner=tiny_runner,
        metrics=metrics,
    )
    api = await start_api(
        embedded_redis.client, keys, ApiConfig(model_dir=str(tiny_model_dir), **api_kw), metrics=metrics
    )
    join_in_process(api, eng)
    return api, eng


async def _complete(api, prompt: str) -> str:
    body = {"model": api.cfg.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0.5}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{api.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-x"}
        ) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Request-Id"]


async def test_requests_are_logged_only_when_asked_and_cut_to_max_log_len(
    embedded_redis, keys, tiny_model_dir, tiny_runner, caplog
):
    caplog.set_level(logging.INFO, logger="fd")
    prompt = "The quick brown fox jumps over the lazy dog"
    for kw, said in (
        ({}, None),
        ({"log_requests": True}, prompt),
        ({"log_requests": True, "max_log_len": 3}, ""),
    ):
        caplog.clear()
        api, eng = await _serve(embedded_redis, keys, tiny_model_dir, tiny_runner, api_key=["sk-x"], **kw)
        try:
            rid = await _complete(api, prompt)
        finally:
            await api.stop()
            await eng.stop()
        lines = [r for r in caplog.records if r.getMessage().startswith("received request")]
        assert "sk-x" not in caplog.text
        if said is None:
            assert lines == []
            continue
        (line,) = lines
        msg = line.getMessage()
        assert line.request_id == rid and rid in msg and "temperature=0.5" in msg
        ids = msg.rsplit("prompt_token_ids: ", 1)[1]
        if said:
            assert repr(said) in msg
        else:  # --max-log-len 3: three token ids, and at most three characters of their text
            assert len(ids.strip("[]").split(",")) == 3
            shown = msg.split("prompt: ", 1)[1].split(", params:", 1)[0]
            assert len(eval(shown)) <= 3  # noqa: S307 (the repr of a str, written by the test's own server)
