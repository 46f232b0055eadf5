"""CORS as vLLM's flags set it (``--allowed-origins`` and friends; by default any origin): a
browser page's preflight is answered before the key check, and every answer to an allowed
origin says so, a streamed one too; a disallowed origin's preflight is refused and its
answers carry no CORS header."""

from __future__ import annotations

import pytest

from fd.api.cors import Cors
from fd.cli.main import build_parser
from tests.kit.api import FakeEngine, parse_sse, setup

CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _preflight(origin: str, method: str = "POST", headers: str = "authorization, content-type") -> dict:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers,
    }


async def test_any_origin_by_default(real_bus):
    async with setup(real_bus, FakeEngine(real_bus), api_key="k") as client:
        r = await client.options(CHAT, headers=_preflight("https://app.example"))
        assert r.status == 200  # (no key: a browser sends none on a preflight)
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert r.headers["Access-Control-Allow-Methods"] == "POST"
        assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        r = await client.post(
            CHAT,
            json={**BODY, "stream": True},
            headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
        )
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        assert r.headers["Access-Control-Expose-Headers"] == "X-Request-Id"
        assert parse_sse(await r.read())[-1] == (None, "[DONE]")
        r = await client.post(CHAT, json=BODY, headers={"Origin": "https://app.example"})  # no key
        assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == "*"  # (readable by the page)
        r = await client.post(CHAT, json=BODY, headers={"Authorization": "Bearer k"})  # not a browser
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


async def test_only_the_allowed_origins(real_bus):
    cors = Cors(
        origins=("https://a.example",), methods=("GET", "POST"), headers=("content-type",), credentials=True
    )
    async with setup(real_bus, FakeEngine(real_bus), cors=cors) as client:
        r = await client.options(CHAT, headers=_preflight("https://a.example", headers="content-type"))
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://a.example"
        assert r.headers["Access-Control-Allow-Credentials"] == "true" and r.headers["Vary"] == "Origin"
        assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
        for refused in (
            _preflight("https://b.example", headers="content-type"),
            _preflight("https://a.example", method="DELETE", headers="content-type"),
            _preflight("https://a.example", headers="x-secret"),
        ):
            r = await client.options(CHAT, headers=refused)
            assert r.status == 400 and "Access-Control-Allow-Origin" not in r.headers, refused
        r = await client.post(CHAT, json=BODY, headers={"Origin": "https://b.example"})
        assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        r = await client.get("/v1/models", headers={"Origin": "https://a.example"})
        assert r.headers["Access-Control-Allow-Origin"] == "https://a.example"
    async with setup(real_bus, FakeEngine(real_bus), cors=None) as client:  # none at all
        r = await client.options(CHAT, headers=_preflight("https://a.example"))
        assert r.status == 405


def test_the_flags_take_vllms_json_lists():
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials"]
    )
    assert args.allowed_origins == ["https://a.example"] and args.allow_credentials
    assert build_parser().parse_args(["api"]).allowed_origins == ["*"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "https://a.example"])
