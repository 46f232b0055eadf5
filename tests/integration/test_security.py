"""Security as a client, an operator and an attacker see it: keys on the HTTP API, passwords
and ACL users on Redis, size limits, and request ids that cannot reach into key names.

Auth policy (also in fd/api/openapi.py and the server's ``auth`` middleware):
- ``--api-key`` (one or several): every ``/v1/*`` route needs ``Authorization: Bearer <key>``;
  else 401 ``authentication_error``. Each key is a tenant: it reads and aborts only its own
  requests (tests/integration/test_isolation.py).
- ``--admin-key``: opens every ``/v1`` route, every request, ``abort_all`` and the LoRA
  routes. On a server with no API key, the abort routes need it. A key that is valid but not
  enough is also 401, not 403: a client learns nothing about which keys exist.
- ``/health``, ``/metrics`` and ``/openapi.json`` are open: probes and scrapers carry no
  keys, and none of them shows a request id or request content (metrics labels are only
  finish reasons and abort sources).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import AuthenticationError, ResponseError

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import Abort, Accepted, Final
from fd.control.keys import Keys
from tests.kit.api import MAX_LEN, FakeEngine, api_client, assert_openai_error, setup
from tests.kit.redis import start_redis_server

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


async def nothing_written(bus) -> None:
    assert await bus.redis.keys(f"{bus.keys.prefix}:*") == [], "a rejected request left keys in Redis"


# --------------------------------------------------------------------------- API keys


ROUTES = [  # (method, path, body) of every /v1 route
    ("POST", CHAT, {"messages": MSG, "max_tokens": 2}),
    ("POST", COMP, {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/abort_requests", {"req_ids": ["r1"]}),
    ("GET", "/v1/requests/r1/stream", None),
    ("POST", "/v1/requests/r1/cancel", None),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("GET", "/v1/responses/r1", None),
    ("POST", "/v1/responses/r1/cancel", None),
    ("GET", "/v1/models/tiny", None),
]
ABORT_ROUTES = {"/v1/abort_requests", "/v1/requests/r1/cancel", "/v1/responses/r1/cancel"}


async def lens(bus) -> tuple[int, int]:
    return await bus.redis.xlen(bus.keys.requests), await bus.redis.xlen(bus.keys.control)


async def _call(client, method, path, body, token):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    resp = await client.request(method, path, json=body, headers=headers)
    return resp.status, await resp.read(), resp


@pytest.mark.parametrize("api_key,admin_key", [("user", None), ("user", "admin"), (None, "admin")])
async def test_keys_guard_every_v1_route(real_bus, api_key, admin_key):
    engine = FakeEngine(real_bus)
    async with setup(real_bus, engine, api_key=api_key, admin_key=admin_key) as client:
        for method, path, body in ROUTES:
            # an API key aborts (its own requests); without one, aborting needs the admin key
            needs = admin_key if (path in ABORT_ROUTES and not api_key) else api_key
            bad_tokens = [None, "wrong", "", "user " * 3, "us", "usera"]
            if needs is not None:
                for token in bad_tokens:
                    before = await lens(real_bus)
                    status, raw, resp = await _call(client, method, path, body, token)
                    assert status == 401, (path, token, raw)
                    err = assert_openai_error(await resp.json())
                    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
                    assert await lens(real_bus) == before, "a refused request left a trace"
            good = [t for t in (needs, admin_key) if t is not None] or [None]
            for token in good:  # the admin key opens everything the API key opens
                status, raw, _ = await _call(client, method, path, body, token)
                assert status in (200, 404), (path, token, status, raw)  # 404: stream of unknown r1
        # a scheme other than Bearer, or the key without a scheme, is no key
        if api_key:
            for auth in (f"Basic {api_key}", api_key, f"Bearer{api_key}", f"Token {api_key}"):
                resp = await client.get("/v1/models", headers={"Authorization": auth})
                assert resp.status == 401, auth
            resp = await client.get("/v1/models", headers={"Authorization": f"bearer   {api_key}  "})
            assert resp.status == 200
        # open: probes, scrapers, the API document
        for path in ("/metrics", "/openapi.json"):
            assert (await client.get(path)).status == 200, path
        assert (await client.get("/health")).status in (200, 503)  # 503: no engine heartbeat here
        doc = await (await client.get("/openapi.json")).json()
        assert doc["paths"]["/v1/abort_requests"]["post"]["security"] == [{"apiKey": []}, {"adminKey": []}]
        assert doc["paths"]["/metrics"]["get"]["security"] == []


async def test_key_errors_do_not_echo_the_key(real_bus):
    async with api_client(real_bus, api_key="s3cret-key") as client:
        resp = await client.post(CHAT, json={"messages": MSG}, headers={"Authorization": "Bearer s3cret-kez"})
        assert resp.status == 401
        assert b"s3cret" not in await resp.read()


# --------------------------------------------------------------------------- Redis auth


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """A redis-server with a default-user password and an ACL user limited to fd's keys."""
    server = start_redis_server(
        str(tmp_path_factory.mktemp("acl")),
        "--requirepass",
        "defaultpw",
        "--user",
        "fduser",
        "on",
        ">fd pw:1",
        "~acl:*",
        "&*",
        "+@all",
        "-@dangerous",
        "+info",
        any_reply=True,  # -NOAUTH: up, and asking for a password
    )
    yield server.port
    server.stop()


async def _round_trip(url: str, prefix: str) -> None:
    client = connect(url)
    bus = Bus(client, Keys(prefix))
    try:
        eid = await bus.publish(bus.keys.req("r1"), Accepted(request_id="r1", api="t"))
        await bus.publish(bus.keys.req("r1"), Final(request_id="r1", finish_reason="stop"))
        story = await bus.read_req("r1")
        assert [e for e, _ in story][0] == eid and isinstance(story[-1][1], Final)
        await bus.ensure_group()
        await bus.publish(bus.keys.control, Abort(request_ids=("r1",)))
        _, evs = await bus.read_control(b"0", None)
        assert evs[0][1].request_ids == ("r1",)
    finally:
        await client.aclose()


async def test_redis_password_and_acl_user_from_the_url(acl_redis):
    port = acl_redis
    await _round_trip(f"redis://fduser:{'fd%20pw%3A1'}@127.0.0.1:{port}/0", "acl:u")  # URL-quoted password
    await _round_trip(f"redis://:defaultpw@127.0.0.1:{port}/0", "acl:d")
    # the ACL user is confined to its keys: the URL's user is really the one used
    client = connect(f"redis://fduser:fd%20pw%3A1@127.0.0.1:{port}/0")
    try:
        with pytest.raises(ResponseError, match="no permissions"):
            await client.set("other:key", "x")
    finally:
        await client.aclose()


@pytest.mark.parametrize("userinfo", ["fduser:wrong", ":wrong", "nobody:fd%20pw%3A1", ""])
async def test_wrong_redis_credentials_fail_clearly(acl_redis, userinfo, monkeypatch):
    # no retries here: whether an auth error is retried at all is the next test's question
    monkeypatch.setattr("fd.control.connect.RETRIES", 0)
    at = f"{userinfo}@" if userinfo else ""
    client = connect(f"redis://{at}127.0.0.1:{acl_redis}/0")
    try:
        with pytest.raises(AuthenticationError) as info:
            await client.ping()
        msg = str(info.value).lower()
        assert "password" in msg or "authentication required" in msg, msg
    finally:
        await client.aclose()


async def test_wrong_redis_password_fails_at_once(acl_redis):
    client = connect(f"redis://:wrong@127.0.0.1:{acl_redis}/0")
    try:
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError):
            await client.ping()
        assert time.monotonic() - t0 < 1.0  # a wrong password does not get better by waiting
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- sizes


async def test_body_and_prompt_limits(real_bus):
    async with api_client(real_bus, max_body_bytes=4096) as client:
        for path, body in (
            (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}),
            (COMP, {"prompt": "x" * 5000}),
            (COMP, {"prompt": list(range(2000))}),
            ("/v1/abort_requests", {"req_ids": ["a" * 100] * 100}),
        ):
            resp = await client.post(path, json=body)
            assert resp.status == 413, path
            assert assert_openai_error(await resp.json())["code"] == "request_too_large"
        # within the body limit but past the context: 400, named as such
        for path, body, param in (
            (CHAT, {"messages": [{"role": "user", "content": "x" * MAX_LEN}]}, "messages"),
            (COMP, {"prompt": "x" * (MAX_LEN + 1)}, "prompt"),
            (COMP, {"prompt": [1] * MAX_LEN}, "prompt"),
            (COMP, {"prompt": "x" * 10, "max_tokens": MAX_LEN}, "prompt"),  # (OpenAI's param)
        ):
            resp = await client.post(path, json=body)
            assert resp.status == 400, (path, param)
            err = assert_openai_error(await resp.json())
            assert err["code"] == "context_length_exceeded" and err["param"] == param
        await nothing_written(real_bus)


# --------------------------------------------------------------------------- request ids

BAD_IDS = [
    "{tag}",
    "a}",
    "a{",
    "a*b",
    "*",
    "has space",
    "x" * 129,
    "a?b",
    "a[1]",
    "é",
    "a/b",
    "a\\b",
    'a"b',
    "a'b",
    "a,b",
]


async def test_bad_request_ids_are_400_and_write_nothing(real_bus):
    async with api_client(real_bus) as client:
        for rid in BAD_IDS:
            for path in (CHAT, COMP):
                body = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
                resp = await client.post(path, json=body, headers={"X-Request-Id": rid})
                assert resp.status == 400, rid
                err = assert_openai_error(await resp.json())
                assert (err["param"], err["code"]) == ("X-Request-Id", "invalid_request_id")
                assert "X-Request-Id" not in resp.headers  # a bad id is not echoed back
        from urllib.parse import quote

        for rid in BAD_IDS + ["abc\n", "abc\r\n", "\n", "a\x00b", "abc\t"]:
            for method, what in (("POST", "cancel"), ("GET", "stream")):
                resp = await client.request(method, f"/v1/requests/{quote(rid, safe='')}/{what}")
                assert resp.status == 400, (rid, what)
                err = assert_openai_error(await resp.json())
                assert err["code"] == "invalid_request_id"
        # in abort bodies: rejected by name, never published
        resp = await client.post("/v1/abort_requests", json={"req_ids": BAD_IDS + ["abc\n"]})
        assert resp.status == 400
        assert_openai_error(await resp.json())
        await nothing_written(real_bus)
        resp = await client.post("/v1/abort_requests", json={"req_ids": ["ok-1", "abc\n", "{x}"]})
        assert resp.status == 200
        body = await resp.json()
        assert body["accepted"] == ["ok-1"] and len(body["rejected"]) == 2
        fields = [f for _, f in await real_bus.redis.xrange(real_bus.keys.control)]
        assert len(fields) == 1 and fields[0][b"request_id"] == b"ok-1"
        # the longest valid id and every allowed character work
        ok = "aZ09_.:@-" + "x" * 119
        assert len(ok) == 128
        assert (await client.post(f"/v1/requests/{ok}/cancel")).status == 200


async def test_header_injection_at_the_wire_is_refused(real_bus):
    """Newlines cannot be sent through an HTTP client; send them raw."""
    async with api_client(real_bus) as client:
        for header in (
            b"X-Request-Id: a\r\n b",
            b"X-Request-Id: a\rb",
            b"X-Request-Id: a\x00b",
            b"X-Request-Id: " + b"x" * 129,
        ):
            reader, writer = await asyncio.open_connection(client.host, client.port)
            body = b'{"prompt":"hi"}'
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + header
                + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
            reply = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert reply.startswith(b"HTTP/1.") and reply.split(b" ", 2)[1] == b"400", (header, reply[:200])
        await nothing_written(real_bus)


def test_many_ids_are_checked_as_strictly_as_one():
    """The one-pass check of a many-id abort agrees with the per-id check on every input."""
    from fd.control.keys import all_valid_request_ids, valid_request_id

    good = ["a", "req-1", "x" * 128, "cmpl-abc_def.ghi:jkl@mno"]
    cases = [
        good,
        good + ["a\nb"],
        good + [""],
        good + ["x" * 129],
        good + ["a b"],
        good + ["é"],
        good + [5],
        ["a\n"],
        ["\na"],
        [],
        ["ok", "ok"],
        ["a\r"],
        ["{a}"],
    ]
    for ids in cases:
        expect = bool(ids) and all(isinstance(r, str) and valid_request_id(r) for r in ids)
        assert all_valid_request_ids(ids) == expect, ids
