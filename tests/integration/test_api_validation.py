"""What a client sees when its request is wrong: the status, OpenAI's error shape, and that
nothing of a rejected request reaches Redis."""

from __future__ import annotations

from tests.kit.api import MAX_LEN, api_client, assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body (dict or raw bytes), status, param, code)
    (CHAT, b"{not json", 400, None, None),
    (CHAT, b"", 400, None, None),
    (CHAT, b"[1, 2]", 400, None, None),
    (CHAT, {"model": "gpt-4", "messages": MSG}, 404, "model", "model_not_found"),
    (COMP, {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    (CHAT, {"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    (CHAT, {"model": "tiny", "messages": "hi"}, 400, "messages", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": ["hi"]}, 400, "messages[0]", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages[0].role", "invalid_type"),
    (
        CHAT,
        {"model": "tiny", "messages": [{"role": "user"}]},
        400,
        "messages[0].content",
        "missing_required_parameter",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "invalid_type",
    ),
    (
        CHAT,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        400,
        "messages[0].content",
        "unsupported",
    ),
    (CHAT, {"model": "tiny", "messages": MSG, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "temperature": 3}, 400, "temperature", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "top_p": 0}, 400, "top_p", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "max_completion_tokens": -3},
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": 1000},
        400,
        "messages",  # (OpenAI's: the messages, even where the asked length does not fit)
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (COMP, {"model": "tiny", "prompt": "x" * MAX_LEN}, 400, "prompt", "context_length_exceeded"),
    (
        COMP,
        {"model": "tiny", "prompt": "x" * 60, "max_tokens": 5},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (CHAT, {"model": "tiny", "messages": MSG, "n": 17}, 400, "n", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "n": 3, "best_of": 4}, 400, "best_of", "unsupported"),
    (CHAT, {"model": "tiny", "messages": MSG, "stop": 7}, 400, "stop", "invalid_type"),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "presence_penalty": 2.5},
        400,
        "presence_penalty",
        "invalid_value",
    ),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "frequency_penalty": "lots"},
        400,
        "frequency_penalty",
        "invalid_type",
    ),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        "invalid_value",
    ),
    (COMP, {"model": "tiny", "prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "logit_bias": {"300": 1}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "logit_bias": {"7": 101}}, 400, "logit_bias", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "min_p": 1.5}, 400, "min_p", "invalid_value"),
    (CHAT, {"model": "tiny", "messages": MSG, "logprobs": 1}, 400, "logprobs", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (COMP, {"model": "tiny", "prompt": "x", "logprobs": True}, 400, "logprobs", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "echo": 1}, 400, "echo", "invalid_type"),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
        "invalid_value",
    ),  # without echo
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "response_format": {"type": "xml"}},
        400,
        "response_format",
        "invalid_value",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
        "invalid_value",
    ),
    (
        CHAT,
        {
            "model": "tiny",
            "messages": MSG,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        400,
        "response_format",
        "invalid_value",
    ),
    (COMP, {"model": "tiny", "prompt": "x", "guided_regex": "[a-"}, 400, "guided_regex", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "guided_choice": []}, 400, "guided_choice", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": "x", "guided_json": "{no"}, 400, "guided_json", "invalid_value"),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "guided_grammar": "start: foo"},
        400,
        "guided_grammar",
        "invalid_value",
    ),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]},
        400,
        "guided_choice",
        "invalid_value",
    ),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": 5}},
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        COMP,
        {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
        "invalid_value",
    ),
    (CHAT, {"model": "tiny", "messages": MSG, "stream": "yes"}, 400, "stream", "invalid_type"),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
    ),
    (
        CHAT,
        {
            "model": "tiny",
            "messages": MSG,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"},
        },
        400,
        "stream_options.continuous_usage_stats",
        "invalid_type",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MSG, "stop_token_ids": ["a"]},
        400,
        "stop_token_ids",
        "invalid_type",
    ),
    (CHAT, {"model": "tiny", "messages": MSG, "ignore_eos": "no"}, 400, "ignore_eos", "invalid_type"),
    (CHAT, {"model": "tiny", "messages": MSG, "background": 1}, 400, "background", "invalid_type"),
    (COMP, {"model": "tiny"}, 400, "prompt", "missing_required_parameter"),
    (COMP, {"model": "tiny", "prompt": 5}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": ["a", ""]}, 400, "prompt", "invalid_value"),  # in a batch
    (COMP, {"model": "tiny", "prompt": ["a", [1, 999]]}, 400, "prompt", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": ["a", [1, "b"]]}, 400, "prompt", "invalid_type"),
    (
        COMP,
        {"model": "tiny", "prompt": ["a", "x" * 60], "max_tokens": 5},
        400,
        "prompt",
        "context_length_exceeded",
    ),  # (the longest prompt decides)
    (COMP, {"model": "tiny", "prompt": ["a"] * 17, "n": 16}, 400, "prompt", "invalid_value"),  # 272 choices
    (COMP, {"model": "tiny", "prompt": [1, -2]}, 400, "prompt", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": [1, 999]}, 400, "prompt", "invalid_value"),
    (COMP, {"model": "tiny", "prompt": []}, 400, "prompt", "invalid_type"),
    (COMP, {"model": "tiny", "prompt": ""}, 400, "prompt", "invalid_value"),
]


async def test_every_validation_error_has_openai_shape_and_reaches_nothing(real_bus):
    async with api_client(real_bus) as client:
        for path, body, status, param, code in CASES:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            resp = await client.post(path, **kw)
            got = await resp.json()
            assert resp.status == status, (path, body, got)
            err = assert_openai_error(got)
            assert err["type"] == "invalid_request_error"
            assert err["param"] == param, (body, err)
            assert err["code"] == code, (body, err)
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0
        assert await real_bus.redis.keys(f"{real_bus.keys.prefix}:req:*") == []


async def test_body_over_the_limit_is_413(real_bus):
    async with api_client(real_bus, max_body_bytes=1000) as client:
        resp = await client.post(COMP, json={"model": "tiny", "prompt": "x" * 2000})
        assert resp.status == 413
        assert assert_openai_error(await resp.json())["code"] == "request_too_large"

        async def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b" " * 200

        resp = await client.post(COMP, data=chunks())
        assert resp.status == 413
        assert_openai_error(await resp.json())
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_invalid_request_id_header_is_400(real_bus):
    async with api_client(real_bus) as client:
        for bad in ("has space", "x" * 129, "{tag}", "a*b"):
            resp = await client.post(
                CHAT, json={"model": "tiny", "messages": MSG}, headers={"X-Request-Id": bad}
            )
            assert resp.status == 400
            err = assert_openai_error(await resp.json())
            assert err["param"] == "X-Request-Id"
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_api_key_is_required_on_v1(real_bus):
    async with api_client(real_bus, api_key="sekret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            resp = await client.post(CHAT, json={"model": "tiny", "messages": MSG}, headers=headers)
            assert resp.status == 401
            err = assert_openai_error(await resp.json())
            assert err["type"] == "authentication_error"
            resp = await client.get("/v1/models", headers=headers)
            assert resp.status == 401
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert resp.status == 200
        assert (await resp.json())["data"][0]["id"] == "tiny"
        # outside /v1: probes and scrapers need no key
        assert (await client.get("/metrics")).status == 200
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_admin_key_guards_abort_endpoints(real_bus):
    # abort_all reaches every tenant's requests: the admin key's alone
    async with api_client(real_bus, api_key="user", admin_key="admin") as client:
        for headers in ({}, {"Authorization": "Bearer user"}):
            resp = await client.post("/v1/abort_requests", json={"abort_all": True}, headers=headers)
            assert resp.status == 401
            assert_openai_error(await resp.json())
        assert await real_bus.redis.xlen(real_bus.keys.control) == 0
        resp = await client.post(
            "/v1/abort_requests", json={"abort_all": True}, headers={"Authorization": "Bearer admin"}
        )
        assert resp.status == 200, await resp.text()
        assert await real_bus.redis.xlen(real_bus.keys.control) == 1
    # with no API key, the abort routes are the admin key's: anyone may generate, not abort
    async with api_client(real_bus, admin_key="admin") as client:
        for path, body in (("/v1/abort_requests", {"req_ids": ["r1"]}), ("/v1/requests/r1/cancel", None)):
            for headers in ({}, {"Authorization": "Bearer user"}):
                resp = await client.post(path, json=body, headers=headers)
                assert resp.status == 401
                assert_openai_error(await resp.json())
            resp = await client.post(path, json=body, headers={"Authorization": "Bearer admin"})
            assert resp.status == 200, await resp.text()
        assert await real_bus.redis.xlen(real_bus.keys.control) == 3


async def test_malformed_abort_bodies(real_bus):
    async with api_client(real_bus) as client:
        for body in (
            b"nope",
            b"[]",
            {},
            {"req_ids": "has space"},
            {"req_ids": 5},
            {"req_ids": []},
            {"request_ids": ["bad id", 3]},
            {"abort_all": "yes"},
            {"abort_all": True, "engine": "a b"},
        ):
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            resp = await client.post("/v1/abort_requests", **kw)
            assert resp.status == 400, body
            assert_openai_error(await resp.json())
        resp = await client.post("/v1/abort_requests?wait=soon", json={"req_ids": ["a"]})
        assert resp.status == 400
        assert await real_bus.redis.xlen(real_bus.keys.control) == 0


async def test_unknown_route_has_openai_shape(real_bus):
    async with api_client(real_bus) as client:
        resp = await client.get("/v1/nothing")
        assert resp.status == 404
        assert_openai_error(await resp.json())
        resp = await client.get(CHAT)
        assert resp.status == 405
        assert_openai_error(await resp.json())
