"""Read isolation between API keys (fd/api/tenancy.py), as clients and an operator see it.
(Tests taking ``bus`` also run on the embedded server that ``fd serve`` uses.)

Keys A and B are tenants of one server of two API replicas, beside an admin key. A's
requests, by the id the server made or the one A gave, are served to A and to the admin; to B
every per-request route answers exactly as it does for an id that never existed (status,
body and headers, the id aside), and B's aborts of them abort nothing. Ids A gives live in
A's own space: B may use the same id, and a 409 only ever speaks of one's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets

import openai
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fd.api import ApiConfig, make_app
from fd.api.tenancy import key_tag
from fd.control.events import Abort, Accepted, Final, decode
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from tests.kit.api import FakeEngine, FakeTokenizer, parse_sse

A, B, ADMIN = "key-a-7f3c9d", "key-b-21e8aa", "key-admin-5b0c"
TAG_A = key_tag(A)


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.asynccontextmanager
async def replicas(bus, engine: FakeEngine, n: int = 2, **cfg):
    """``n`` API replicas of one control plane (any may serve any request), and the engine."""
    cfg = {"api_key": [A, B], "admin_key": ADMIN, **cfg}
    task = asyncio.create_task(engine.run())
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            mux = StreamMux(bus.redis, bus.keys, f"api-{i}", block_ms=100)
            app = make_app(
                ApiConfig(model_dir="tiny", max_model_len=64, **cfg), bus, mux, FakeTokenizer(), Metrics()
            )
            clients.append(await stack.enter_async_context(TestClient(TestServer(app))))
        try:
            yield clients
        finally:
            await engine.close()
            await task


async def answer(client, method: str, path: str, rid: str, key: str | None, body=None) -> tuple:
    """What a client sees of one call naming ``rid``: status, the X-Request-Id header and the
    body, with ``rid`` written as ``<ID>`` (so answers about two ids compare) and an abort's
    own random ``abort_id`` left out."""
    body = orjson.loads(orjson.dumps(body).replace(b"{ID}", rid.encode())) if body is not None else None
    resp = await client.request(method, path.replace("{ID}", rid), json=body, headers=auth(key))
    raw = (await resp.read()).replace(rid.encode(), b"<ID>")
    if resp.content_type == "application/json":
        raw = orjson.loads(raw)
        if isinstance(raw, dict):
            raw.pop("abort_id", None)
    header = resp.headers.get("X-Request-Id")
    return resp.status, header and header.replace(rid, "<ID>"), raw


ROUTES = [  # every per-request route: (method, path, body)
    ("GET", "/v1/requests/{ID}/stream", None),
    ("GET", "/v1/responses/{ID}", None),
    ("GET", "/v1/responses/{ID}?stream=true", None),
    ("GET", "/v1/responses/{ID}/input_items", None),
    ("POST", "/v1/responses/{ID}/cancel", None),
    ("POST", "/v1/requests/{ID}/cancel", None),
    ("POST", "/v1/abort_requests", {"req_ids": ["{ID}"]}),
    ("POST", "/v1/abort_requests?wait=1", {"request_ids": ["{ID}"]}),
    ("POST", "/v1/responses", {"input": "more", "max_output_tokens": 2, "previous_response_id": "{ID}"}),
]
READS = ROUTES[:4]


async def aborts_published(bus) -> set[str]:
    ids: set[str] = set()
    for eid, fields in await bus.redis.xrange(bus.keys.control):
        ev = decode(fields, eid)
        if isinstance(ev, Abort):
            ids.update(ev.request_ids)
    return ids


async def make_response(client, key: str, rid: str | None = None, **extra) -> str:
    headers = {**auth(key), **({"X-Request-Id": rid} if rid else {})}
    resp = await client.post(
        "/v1/responses", json={"input": "hi", "max_output_tokens": 3, **extra}, headers=headers
    )
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert resp.headers["X-Request-Id"] == body["id"] == (rid or body["id"])
    return body["id"]


async def test_another_tenants_request_answers_as_an_unknown_id(bus):
    engine = FakeEngine(bus)
    async with replicas(bus, engine) as (one, two):
        made = await make_response(one, A)  # the server's id
        given = await make_response(one, A, "a-own-1")  # A's own id
        for rid in (made, given):
            unknown = rid[:-6] + secrets.token_hex(3)  # as long, and never made
            # any replica serves A's request to A (the tag is in the story every replica reads)
            for method, path, body in READS:
                status, header, got = await answer(two, method, path, rid, A, body)
                assert status == 200 and header == "<ID>", (path, got)
            for method, path, body in ROUTES:
                theirs = await answer(two, method, path, rid, B, body)
                assert theirs == await answer(two, method, path, unknown, B, body), path
                assert theirs[0] in (200, 404), (path, theirs)
            assert "<ID>" in str(theirs[2])  # (the messages name the id as the client gave it)
        # B's aborts and cancels reached none of A's requests
        assert not {made, f"{TAG_A}:a-own-1"} & await aborts_published(bus)
        # the admin reads every request under its id in the event log
        for rid in (made, f"{TAG_A}:a-own-1"):
            for method, path, body in READS:
                status, _, got = await answer(one, method, path, rid, ADMIN, body)
                assert status == 200, (path, got)
        # A goes on from its own response; B cannot, from either replica
        prev = {"input": "more", "max_output_tokens": 2, "previous_response_id": made}
        resp = await two.post("/v1/responses", json=prev, headers=auth(A))
        assert resp.status == 200, await resp.text()
        for client in (one, two):
            resp = await client.post("/v1/responses", json=prev, headers=auth(B))
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "previous_response_not_found"


async def test_only_the_owner_or_the_admin_aborts_a_request(bus):
    engine = FakeEngine(bus, hold=True)  # every request runs until it is aborted
    async with replicas(bus, engine) as (one, two):
        # background: answered at once, running on
        ids = [
            await make_response(one, A, background=True),
            await make_response(one, A, "a-job", background=True),
            await make_response(one, A, background=True),
            await make_response(one, A, background=True),
        ]
        logged = [ids[0], f"{TAG_A}:a-job", ids[2], ids[3]]
        for rid in ids:
            for method, path, body in ROUTES[4:8]:
                status, _, _ = await answer(two, method, path, rid, B, body)
                assert status in (200, 404)
        assert not set(logged) & await aborts_published(bus)
        for rid in ids:
            resp = await two.get(f"/v1/responses/{rid}", headers=auth(A))
            assert (await resp.json())["status"] == "in_progress"  # B's aborts did nothing
        # A's own: by cancel, by id, by abort_requests; the admin's: by the log's id
        resp = await two.post(f"/v1/responses/{ids[0]}/cancel", headers=auth(A))
        assert resp.status == 200
        assert (await resp.json())["status"] == "cancelled"
        resp = await two.post("/v1/requests/a-job/cancel", headers=auth(A))
        assert (await resp.json())["accepted"] == ["a-job"]
        resp = await one.post("/v1/abort_requests?wait=5", json={"req_ids": [ids[2]]}, headers=auth(A))
        body = await resp.json()
        assert [a["request_id"] for a in body["aborted"]] == [ids[2]] and body["not_found"] == []
        resp = await one.post(f"/v1/responses/{ids[3]}/cancel", headers=auth(ADMIN))
        assert (await resp.json())["status"] == "cancelled"
        assert set(logged) <= await aborts_published(bus)
        for rid in logged:
            story = await bus.read_req(rid)
            assert isinstance(story[-1][1], Final) and story[-1][1].finish_reason == "abort"
        # abort_all touches every tenant's requests: the admin key's alone
        resp = await one.post("/v1/abort_requests", json={"abort_all": True}, headers=auth(A))
        assert resp.status == 401


async def test_a_reused_request_id_tells_nothing_of_another_tenant(bus):
    engine = FakeEngine(bus)
    async with replicas(bus, engine) as (one, two):
        for key, n in ((A, 2), (B, 4)):
            resp = await one.post(
                "/v1/chat/completions",
                headers={**auth(key), "X-Request-Id": "job-1"},
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": n},
            )
            assert resp.status == 200, await resp.text()  # B's job-1 is not A's: no 409
            body = await resp.json()
            assert body["id"] == resp.headers["X-Request-Id"] == "job-1"
            assert body["usage"]["completion_tokens"] == n
        # each tenant's job-1 is its own: a reuse is a 409 for the one who made it
        for key in (A, B):
            resp = await two.post(
                "/v1/chat/completions",
                headers={**auth(key), "X-Request-Id": "job-1"},
                json={"messages": [{"role": "user", "content": "hi"}]},
            )
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "duplicate_request_id"
        texts = {}
        for key in (A, B):
            resp = await two.get("/v1/requests/job-1/stream", headers=auth(key))
            chunks = [orjson.loads(d) for _, d in parse_sse(await resp.read()) if d != "[DONE]"]
            texts[key] = "".join(
                c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
            )
        assert texts == {A: "Hello,", B: "Hello, world"}
        # in the event log: one story each, tagged with a hash of its key, never the key
        assert not await bus.request_exists("job-1")
        for key in (A, B):
            story = await bus.redis.xrange(bus.keys.req(f"{key_tag(key)}:job-1"))
            first = decode(story[0][1], story[0][0])
            assert isinstance(first, Accepted) and first.tenant == key_tag(key)
            assert re.fullmatch(r"[0-9a-f]{16}", first.tenant)
            assert all(key.encode() not in v for _, fields in story for v in fields.values())
        # an id too long for A's space is refused as any bad id is, with nothing written
        resp = await one.post(
            "/v1/chat/completions",
            headers={**auth(A), "X-Request-Id": "x" * 120},
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "X-Request-Id"


async def test_server_made_ids_are_long_and_random(real_bus):
    engine = FakeEngine(real_bus)
    async with replicas(real_bus, engine, n=1) as (one,):
        ids = []
        for path, body, prefix in (
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                "chatcmpl",
            ),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                "chatcmpl",
            ),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "cmpl"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 1}, "resp"),
        ):
            resp = await one.post(path, json=body, headers=auth(A))
            rid = (await resp.json())["id"]
            assert rid == resp.headers["X-Request-Id"]
            # 32 hex digits: 128 bits, none of them a clock or a counter's
            assert re.fullmatch(rf"{prefix}-[0-9a-f]{{32}}", rid), rid
            ids.append(rid.split("-", 1)[1])
        assert len(set(ids)) == len(ids)
        # (and the server's id is the log's too: an operator's `fd trace` takes it as it is)
        assert all([await real_bus.request_exists(f"chatcmpl-{h}") for h in ids[:2]])


async def test_the_openai_client_sees_only_its_own_responses(real_bus):
    engine = FakeEngine(real_bus)
    async with replicas(real_bus, engine) as (one, two):
        url = str(one.make_url("/v1"))
        oa_a, oa_b, oa_admin = (
            openai.AsyncOpenAI(base_url=url, api_key=k, max_retries=0) for k in (A, B, ADMIN)
        )
        try:
            r = await oa_a.responses.create(model="tiny", input="hi", max_output_tokens=3)
            assert (await oa_a.responses.retrieve(r.id)).output_text == r.output_text
            assert (await oa_admin.responses.retrieve(r.id)).id == r.id
            assert [it.type for it in (await oa_a.responses.input_items.list(r.id)).data] == ["message"]
            for call in (oa_b.responses.retrieve, oa_b.responses.input_items.list, oa_b.responses.cancel):
                with pytest.raises(openai.NotFoundError):
                    await call(r.id)
            with pytest.raises(openai.NotFoundError):
                await oa_b.responses.create(model="tiny", input="more", previous_response_id=r.id)
            chat = await oa_b.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                extra_headers={"X-Request-Id": r.id},
            )
            assert chat.id == r.id  # B may name its own request as A's is named
        finally:
            for oa in (oa_a, oa_b, oa_admin):
                await oa.close()


async def test_one_key_servers_work_as_before(real_bus):
    """One API key and no admin key: one tenant, whose key is everything, its ids the log's."""
    engine = FakeEngine(real_bus, hold=True)
    async with replicas(real_bus, engine, api_key="solo", admin_key=None) as (one, two):
        rid = await make_response(one, "solo", "mine", background=True)
        assert rid == "mine" and await real_bus.request_exists("mine")
        story = await real_bus.read_req("mine")
        assert isinstance(story[0][1], Accepted) and story[0][1].tenant is None
        assert (await two.get("/v1/responses/mine", headers=auth("solo"))).status == 200
        assert (await two.get("/v1/responses/mine", headers=auth(A))).status == 401
        resp = await two.post("/v1/abort_requests", json={"abort_all": True}, headers=auth("solo"))
        assert resp.status == 200
        resp = await one.post("/v1/abort_requests?wait=5", json={"req_ids": ["mine"]}, headers=auth("solo"))
        assert [a["request_id"] for a in (await resp.json())["aborted"]] == ["mine"]


def test_api_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    from fd.cli.args import api_keys
    from fd.cli.main import build_parser

    monkeypatch.delenv("FD_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nk3\n\n  k4  \n")
    parse = build_parser().parse_args
    assert api_keys(parse(["api", "--api-key", "k1"])) == ["k1"]  # the old single key
    args = parse(
        [
            "serve",
            "m",
            "--api-key",
            "k1",
            "k2",
            "--api-key",
            "k5",
            "--api-key-file",
            str(keys),
            "--admin-api-key",
            "adm",
        ]
    )
    assert api_keys(args) == ["k1", "k2", "k5", "k3", "k4"] and args.admin_key == "adm"
    assert parse(["api", "--admin-key", "adm"]).admin_key == "adm"
    assert api_keys(parse(["api"])) == []
    monkeypatch.setenv("VLLM_API_KEY", "v1")
    assert api_keys(parse(["api"])) == ["v1"]
    monkeypatch.setenv("FD_API_KEY", "e1, e2")
    assert api_keys(parse(["api"])) == ["e1", "e2"]
    assert api_keys(parse(["api", "--api-key", "k1"])) == ["k1"]  # a flag wins over the environment
