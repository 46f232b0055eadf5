"""Bad input at the HTTP API, generated: whatever a client sends, it gets a 2xx or a 4xx with
OpenAI's error shape -- never a 5xx, never a hang -- and nothing it sent that was rejected
reaches ``P:requests`` or ``P:control``.

Every test drives one app (real Redis, a fake engine that finishes requests at once) from its
own event loop, so hypothesis can call it example after example without restarting servers.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import urllib.parse
import zlib
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd.api import ApiConfig, make_app
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from tests.kit.api import MAX_LEN, FakeEngine, FakeTokenizer, assert_openai_error, parse_sse

CHAT, COMP, ABORT = "/v1/chat/completions", "/v1/completions", "/v1/abort_requests"
RESP = "/v1/responses"
EMB = "/v1/embeddings"
MAX_BODY = 16 << 10
TIMEOUT_S = 10.0  # per call: a call that takes longer is a hang
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


class Harness:
    """An app on a fresh loop; ``call`` runs one client coroutine with the hang timeout."""

    def __init__(self, url: str, keys, **cfg):
        self.loop = asyncio.new_event_loop()
        self.keys = keys
        self.url = url
        self.cfg = cfg
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.redis = connect(self.url)
        self.bus = Bus(self.redis, self.keys)
        self.engine = FakeEngine(Bus(connect(self.url), self.keys))
        self.engine_task = asyncio.create_task(self.engine.run())
        mux = StreamMux(connect(self.url), self.keys, "api-fuzz", block_ms=50)
        self.mux = mux
        app = make_app(
            ApiConfig(model_dir="tiny", max_model_len=MAX_LEN, max_body_bytes=MAX_BODY, **self.cfg),
            self.bus,
            mux,
            FakeTokenizer(),
            Metrics(),
        )
        self.client = TestClient(TestServer(app))
        await self.client.start_server()

    def call(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S))

    async def lens(self) -> tuple[int, int]:
        return (await self.redis.xlen(self.keys.requests), await self.redis.xlen(self.keys.control))

    def close(self) -> None:
        async def stop():
            await self.client.close()
            await self.engine.close()
            await self.engine_task
            await self.engine.bus.redis.aclose()
            await self.mux.redis.aclose()
            await self.redis.aclose()

        self.loop.run_until_complete(stop())
        self.loop.close()


@pytest.fixture
def harness(redis_server, keys):
    # tools' "auto" too; every chat through the reasoning parser (qwen3: the fake engine's text
    # does not open with <think>, so it all stays content)
    h = Harness(redis_server.url, keys, tool_parser="hermes", reasoning_parser="qwen3")
    yield h
    h.close()


async def check(resp, *, wire_error_ok: bool = False) -> tuple[int, Any]:
    """The invariants of any answer; returns (status, parsed body).

    ``wire_error_ok``: a body aiohttp's HTTP parser itself cannot decode (a Content-Encoding
    that is not what it says, when the body came in with the headers) is answered by aiohttp
    before any handler or middleware runs: a plain-text 400, the one non-JSON error."""
    raw = await resp.read()
    assert resp.status < 500, (resp.status, raw[:500])
    ctype = resp.headers.get("Content-Type", "")
    if wire_error_ok and resp.status == 400 and ctype.startswith("text/plain"):
        return resp.status, None
    if resp.status >= 400:
        assert ctype.startswith("application/json"), (resp.status, ctype, raw[:200])
        return resp.status, assert_openai_error(orjson.loads(raw))
    if ctype.startswith("text/event-stream"):
        events = parse_sse(raw)
        if events and events[0][1].startswith('{"type":"response.'):  # the Responses API's
            chunks = [orjson.loads(d) for _, d in events]
            assert chunks[-1]["type"] in ("response.completed", "response.incomplete"), chunks[-1]
            assert [c["sequence_number"] for c in chunks] == list(range(len(chunks)))
            return resp.status, events
        assert events and events[-1][1] == "[DONE]", raw[-300:]
        for _eid, data in events[:-1]:
            chunk = orjson.loads(data)
            assert "error" not in chunk, chunk
        return resp.status, events
    return resp.status, orjson.loads(raw)


# --------------------------------------------------------------------------- strategies

JUNK_TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "\x00", "{x}", "a" * 300, "tiny", "\u202e"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | JUNK_TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(JUNK_TEXT, inner, max_size=4),
    max_leaves=10,
)

ROLES = ["system", "developer", "user", "assistant", "tool", "", "USER"]
CONTENT = (
    st.text(max_size=10)
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", 3]), "text": st.text(max_size=6) | JSON}
        ),
        max_size=3,
    )
    | JSON
)
FUNCTION = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["f", ""]) | JSON,
        "arguments": st.sampled_from(['{"a": 1}', "{x", ""]) | JSON,
        "parameters": JSON,
    },
)
TOOL = st.fixed_dictionaries(
    {}, optional={"type": st.sampled_from(["function"]) | JSON, "function": FUNCTION | JSON}
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(ROLES) | JSON,
        "content": CONTENT,
        "name": JSON,
        "tool_call_id": JSON,
        "tool_calls": st.lists(TOOL | JSON, max_size=2) | JSON,
    },
)
SAMPLING_FIELDS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "best_of",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "background",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "echo",
    "suffix",
    "user",
    "x_unknown",
    "repetition_penalty",
    "logit_bias",
    "min_p",
    "min_tokens",
    "parallel_tool_calls",
]
INTERESTING = {
    "model": st.sampled_from(["tiny", "gpt-4", "", None]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans() | JSON, "continuous_usage_stats": st.booleans() | JSON}
    )
    | JSON,
    "max_tokens": st.integers(-2, MAX_LEN + 2),
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.2, 1.2),
    "stop": st.lists(st.text(max_size=3), max_size=3) | st.text(max_size=3),
    "stop_token_ids": st.lists(st.integers(-1, 300), max_size=3),
    "logit_bias": st.dictionaries(
        st.integers(-2, 300).map(str) | JUNK_TEXT, st.floats(-120, 120), max_size=3
    ),
    "min_tokens": st.integers(-1, MAX_LEN + 2),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, 3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.lists(TOOL, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
}


@st.composite
def mutated(draw, base: dict, junk: bool) -> dict:
    """A valid body with a few fields removed and a few set to edge values (or to junk)."""
    body = dict(base)
    if junk:
        for name in draw(st.sets(st.sampled_from(sorted(base)), max_size=2)):
            body.pop(name)
    names = SAMPLING_FIELDS if junk else sorted(INTERESTING)
    for name in draw(st.lists(st.sampled_from(names), max_size=4)):
        body[name] = draw(
            INTERESTING[name] | JSON if junk and name in INTERESTING else INTERESTING.get(name, JSON)
        )
    return body


CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMP_BASE = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
CHAT_BODIES = st.one_of(
    mutated(CHAT_BASE, junk=False),
    mutated(CHAT_BASE, junk=True),
    st.builds(
        lambda ms, extra: {"messages": ms, **extra},
        st.lists(MESSAGE, max_size=3) | JSON,
        st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JSON, max_size=2),
    ),
    JSON,
)
COMP_BODIES = st.one_of(
    mutated(COMP_BASE, junk=False),
    mutated(COMP_BASE, junk=True),
    st.builds(
        lambda p, extra: {"prompt": p, **extra},
        st.lists(st.integers(-2, 300), max_size=5)
        | st.lists(st.text(max_size=4), max_size=2)
        | st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=2)
        | JSON,
        st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JSON, max_size=2),
    ),
    JSON,
)
RESP_FIELDS = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "previous_response_id",
    "background",
    "seed",
    "store",
    "x_unknown",
]
RESP_ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]) | JSON,
        "role": st.sampled_from(ROLES) | JSON,
        "call_id": st.sampled_from(["c1"]) | JSON,
        "name": st.sampled_from(["f"]) | JSON,
        "arguments": st.sampled_from(["{}", "{x"]) | JSON,
        "output": st.text(max_size=4) | JSON,
        "content": st.text(max_size=8)
        | st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["input_text", "output_text", "input_image"]) | JSON,
                    "text": st.text(max_size=6) | JSON,
                }
            ),
            max_size=2,
        )
        | JSON,
    },
)
RESP_BASE = {"model": "tiny", "input": "hi", "max_output_tokens": 3}
RESP_BODIES = st.one_of(
    st.builds(
        lambda extra: {**RESP_BASE, **extra},
        st.fixed_dictionaries(
            {},
            optional={
                "stream": st.booleans(),
                "instructions": st.text(max_size=5) | JSON,
                "max_output_tokens": st.integers(-1, MAX_LEN + 2),
                "text": st.sampled_from(
                    [
                        {"format": {"type": "text"}},
                        {"format": {"type": "json_object"}},
                        {"format": {"type": "xml"}},
                    ]
                )
                | JSON,
                "input": st.lists(RESP_ITEM, max_size=3) | JSON,
                "tools": st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["function", "web_search"]),
                            "name": st.sampled_from(["f", ""]) | JSON,
                        }
                    ),
                    max_size=2,
                ),
                "tool_choice": st.sampled_from(
                    ["none", "auto", "required", {"type": "function", "name": "f"}]
                )
                | JSON,
            },
        ),
    ),
    st.builds(
        lambda extra: {**RESP_BASE, **extra}, st.dictionaries(st.sampled_from(RESP_FIELDS), JSON, max_size=3)
    ),
    JSON,
)
EMB_FIELDS = [
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "normalize",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "priority",
    "user",
    "x_unknown",
]
EMB_BODIES = st.one_of(
    st.builds(
        lambda extra: {"model": "tiny", "input": "hi", **extra},
        st.fixed_dictionaries(
            {},
            optional={
                "input": st.text(max_size=6)
                | st.lists(st.text(max_size=4), max_size=3)
                | st.lists(st.integers(-2, 300), max_size=5)
                | st.lists(st.lists(st.integers(-1, 300), max_size=3), max_size=2)
                | st.sampled_from(["y" * (MAX_LEN - 1), "y" * MAX_LEN])
                | JSON,
                "encoding_format": st.sampled_from(["float", "base64", "hex"]) | JSON,
                "dimensions": st.integers(-1, 9) | JSON,
                "normalize": st.booleans() | JSON,
                "truncate_prompt_tokens": st.integers(-2, MAX_LEN + 2) | JSON,
            },
        ),
    ),
    st.builds(
        lambda extra: {"input": "hi", **extra}, st.dictionaries(st.sampled_from(EMB_FIELDS), JSON, max_size=3)
    ),
    JSON,
)
TEXTS = st.sampled_from(["a", "b", "", "y" * MAX_LEN]) | st.lists(
    st.sampled_from(["a", "b", "c", ""]), max_size=3
)
SCORE_BODIES = st.one_of(
    st.fixed_dictionaries(
        {"text_1": TEXTS | JSON, "text_2": TEXTS | JSON},
        optional={
            "model": st.sampled_from(["tiny", "other"]),
            "truncate_prompt_tokens": st.integers(-2, 3) | JSON,
        },
    ),
    st.fixed_dictionaries(
        {"query": TEXTS | JSON, "documents": TEXTS | JSON},
        optional={"top_n": st.integers(-1, 4) | JSON, "add_special_tokens": st.booleans() | JSON},
    ),
    JSON,
)
ABORT_BODIES = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "req_ids": st.lists(st.text(max_size=6) | JSON, max_size=4) | JSON,
            "request_ids": st.lists(st.from_regex(r"[A-Za-z0-9_.:@-]{1,8}", fullmatch=True), max_size=3)
            | JSON,
            "abort_all": st.booleans() | JSON,
            "engine": st.sampled_from(["e0", "bad id", "", "x" * 65]) | JSON,
        },
    ),
    JSON,
)
HEADER_TEXT = st.text(st.characters(blacklist_categories=("Cc",)), max_size=140) | st.sampled_from(
    ["ok-id", "{tag}", "a*b", "has space", "x" * 129, "x" * 128, "é", "日本語", "a\tb", "id:1@host.a-b_c"]
)
VALID_ID = st.from_regex(r"[A-Za-z0-9_.:@-]{1,128}", fullmatch=True)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "text/plain",
        "",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=zz",
        "application/json; charset=latin-1",
        "\u00e9/\u00e9",
    ]
)


def dumps(body: Any) -> bytes:
    # The stdlib writes NaN/Infinity and lone surrogates, which a client might send too.
    return json.dumps(body, allow_nan=True).encode()


def _choices_of(data: bytes, headers: dict) -> int:
    """How many requests an accepted body puts on P:requests: one a choice (n, times the
    prompts of a completions batch)."""
    if headers.get("Content-Encoding") not in (None, "identity"):
        data = gzip.decompress(data) if headers["Content-Encoding"] == "gzip" else zlib.decompress(data)
    body = json.loads(data)
    if "text_1" in body or "query" in body:  # (score, rerank: one a distinct text)
        texts = [
            t
            for name in ("text_1", "text_2", "query", "documents")
            for t in ([body[name]] if isinstance(body.get(name), str) else body.get(name) or [])
        ]
        return len(set(texts))
    if "input" in body and "prompt" not in body and "messages" not in body:  # (embeddings: one an input)
        x = body["input"]
        return len(x) if isinstance(x, list) and all(isinstance(i, (str, list)) for i in x) else 1
    p = body.get("prompt")
    batch = len(p) if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else 1
    return (body.get("n") or 1) * batch


async def post(h: Harness, path: str, data: bytes, headers: dict) -> tuple[int, Any]:
    before = await h.lens()
    try:
        resp = await h.client.post(path, data=data, headers=headers)
    except ValueError:  # the client itself refused the header (control characters)
        return 0, None
    async with resp:
        status, body = await check(resp, wire_error_ok="Content-Encoding" in headers)
    after = await h.lens()
    if status >= 400:
        assert after == before, (path, status, body, "a rejected request left a trace")
    elif path in (CHAT, COMP, EMB, "/score", "/v1/rerank"):
        assert after[0] == before[0] + _choices_of(data, headers)
        rid = resp.headers["X-Request-Id"]
        if "X-Request-Id" in headers:  # (HTTP drops a value's surrounding spaces and tabs)
            assert rid == headers["X-Request-Id"].strip(" \t")
    return status, body


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "path,bodies",
    [
        (CHAT, CHAT_BODIES),
        (COMP, COMP_BODIES),
        (RESP, RESP_BODIES),
        (EMB, EMB_BODIES),
        ("/score", SCORE_BODIES),
        ("/v1/rerank", SCORE_BODIES),
    ],
    ids=["chat", "completions", "responses", "embeddings", "score", "rerank"],
)
def test_generating_bodies_and_headers(harness, path, bodies):
    seen: set[int] = set()

    @FUZZ
    @given(body=bodies, rid=st.none() | VALID_ID | HEADER_TEXT, ctype=st.none() | CONTENT_TYPES)
    def one(body, rid, ctype):
        headers = {}
        if rid is not None:
            headers["X-Request-Id"] = rid
        if ctype is not None:
            headers["Content-Type"] = ctype
        status, out = harness.call(post(harness, path, dumps(body), headers))
        seen.add(status)
        if status == 200 and isinstance(out, dict):
            if "results" in out:  # rerank: best first
                assert [r["relevance_score"] for r in out["results"]] == sorted(
                    (r["relevance_score"] for r in out["results"]), reverse=True
                )
            elif out["object"] == "list":  # embeddings: one a vector each input, in order
                assert [d["index"] for d in out["data"]] == list(range(len(out["data"]))) and out["data"]
            elif out["object"] == "response":
                assert out["status"] in ("completed", "incomplete") and out["output"][0]["type"] == "message"
            else:
                assert out["object"] in ("chat.completion", "text_completion")
                assert out["choices"][0]["finish_reason"] in ("stop", "length")

    one()
    assert 200 in seen and 400 in seen, seen  # the generator reaches both sides of validation


def test_abort_bodies(harness):
    @FUZZ
    @given(
        body=ABORT_BODIES, wait=st.none() | st.sampled_from(["0", "0.05", "-1", "nan", "inf", "x", "1e400"])
    )
    def one(body, wait):
        path = ABORT if wait is None else f"{ABORT}?wait={urllib.parse.quote(wait)}"
        harness.call(post(harness, path, dumps(body), {}))

    one()


def test_ids_in_paths(harness):
    async def run(rid: str, what: str, last: str | None):
        before = await harness.lens()
        try:  # (an id no client can send, a lone surrogate, ends here: UnicodeEncodeError)
            url = f"/v1/requests/{urllib.parse.quote(rid, safe='')}/{what}"
            headers = {"Last-Event-ID": last} if last is not None else {}
            resp = await (
                harness.client.post(url) if what == "cancel" else harness.client.get(url, headers=headers)
            )
        except ValueError:
            return
        async with resp:
            status, _ = await check(resp)
        if status >= 400:
            assert await harness.lens() == before
        if (
            not rid
            or any(
                c not in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:@-" for c in rid
            )
            or len(rid) > 128
        ):
            assert status in (400, 404, 405), (rid, status)  # 404/405: did not even route

    @FUZZ
    @given(
        rid=HEADER_TEXT | st.sampled_from(["abc\n", "abc%0A", "a/b", "..", "."]),
        what=st.sampled_from(["cancel", "stream"]),
        last=st.none() | HEADER_TEXT,
    )
    def one(rid, what, last):
        harness.call(run(rid, what, last))

    one()


def test_raw_bytes_bodies(harness):
    @FUZZ
    @given(
        data=st.binary(max_size=200)
        | st.sampled_from(
            [
                b"{",
                b"\xff\xfe{}",
                b"null",
                b"[]",
                b"{}" * 9,
                b'{"messages":[{"role":"user","content":"\xff"}]}',
            ]
        ),
        path=st.sampled_from([CHAT, COMP, ABORT]),
        gz=st.sampled_from([None, "gzip", "deflate", "identity"]),
        real_gzip=st.booleans(),
    )
    def one(data, path, gz, real_gzip):
        headers = {"Content-Type": "application/json"}
        if gz:
            headers["Content-Encoding"] = gz
            if gz == "gzip" and real_gzip:
                data = gzip.compress(data)
        status, _ = harness.call(post(harness, path, data, headers))
        assert status != 200 or path == ABORT or data.startswith(b"\x1f\x8b")

    one()


def test_huge_and_deep_bodies(harness):
    async def run():
        # over the limit, with a Content-Length
        s, err = await post(harness, COMP, dumps({"prompt": "x" * (2 * MAX_BODY)}), {})
        assert s == 413 and err["code"] == "request_too_large"
        # over the limit, chunked (no Content-Length): the limit holds while reading

        async def chunks():
            for _ in range(64):
                yield b" " * 1024

        before = await harness.lens()
        resp = await harness.client.post(CHAT, data=chunks())
        async with resp:
            assert (await check(resp))[0] == 413
        assert await harness.lens() == before
        # a gzip bomb: small on the wire, over the limit once inflated
        bomb = gzip.compress(b"[" + b" " * (8 * MAX_BODY) + b"]")
        s, err = await post(harness, CHAT, bomb, {"Content-Encoding": "gzip"})
        assert s == 413
        # nesting past any parser's depth, and just under ours
        for depth in (MAX_BODY // 2 - 10, 1000, 200):
            s, err = await post(harness, CHAT, b'{"messages":' + b"[" * depth + b"]" * depth + b"}", {})
            assert s == 400
        s, err = await post(harness, COMP, b'{"prompt":' + b'{"a":' * 600 + b"1" + b"}" * 600 + b"}", {})
        assert s == 400
        # a prompt past the context is 400, not 413
        s, err = await post(harness, COMP, dumps({"prompt": "x" * (MAX_LEN + 1)}), {})
        assert s == 400 and err["code"] == "context_length_exceeded"
        # many stop strings and ids (every id of the vocabulary), all within the body limit
        s, _ = await post(
            harness,
            CHAT,
            dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "stop": ["a"] * 2000,
                    "stop_token_ids": list(range(FakeTokenizer.vocab_size)),
                }
            ),
            {},
        )
        assert s == 200

    harness.call(run())


# --------------------------------------------------------------------------- the OpenAPI document


def from_schema(schema: dict, doc: dict, depth: int = 0):
    """A strategy for values that satisfy ``schema`` (the subset fd's document uses)."""
    if "$ref" in schema:
        return from_schema(doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], doc, depth)
    if "oneOf" in schema:
        s = st.one_of(*(from_schema(x, doc, depth + 1) for x in schema["oneOf"]))
    elif "enum" in schema:
        s = st.sampled_from(schema["enum"])
    else:
        t = schema.get("type")
        if t == "object":
            props = {k: from_schema(v, doc, depth + 1) for k, v in schema.get("properties", {}).items()}
            req = set(schema.get("required", ()))
            s = st.fixed_dictionaries(
                {k: v for k, v in props.items() if k in req},
                optional={k: v for k, v in props.items() if k not in req},
            )
        elif t == "array":
            s = st.lists(
                from_schema(schema["items"], doc, depth + 1),
                min_size=schema.get("minItems", 0),
                max_size=min(schema.get("maxItems", 3), 3),
            )
        elif t == "integer":
            lo, hi = schema.get("minimum"), schema.get("maximum")
            if schema.get("format") == "int64":
                lo, hi = (
                    max(lo, -(2**63)) if lo is not None else -(2**63),
                    min(hi, 2**63 - 1) if hi is not None else 2**63 - 1,
                )
            s = st.integers(lo, hi)
        elif t == "number":
            lo, hi = schema.get("minimum"), schema.get("maximum")
            s = st.floats(lo, hi, exclude_min=bool(schema.get("exclusiveMinimum")), allow_nan=False)
        elif t == "boolean":
            s = st.booleans()
        elif t == "string":
            s = st.text(min_size=schema.get("minLength", 0), max_size=8)
        else:
            s = st.none()
    return st.none() | s if schema.get("nullable") else s


def test_openapi_document_is_served_and_schema_bodies_are_accepted(harness):
    async def get_doc():
        resp = await harness.client.get("/openapi.json")
        assert resp.status == 200
        return await resp.json()

    doc = harness.call(get_doc())
    assert doc["openapi"].startswith("3.")
    for path in (
        CHAT,
        COMP,
        "/v1/models",
        "/health",
        "/metrics",
        ABORT,
        "/v1/requests/{id}/stream",
        "/v1/requests/{id}/cancel",
    ):
        assert path in doc["paths"], path
    schemas = doc["components"]["schemas"]
    body_schema = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schemas[body_schema["$ref"].rsplit("/", 1)[1]]["required"] == ["messages"]

    @settings(FUZZ, max_examples=50)  # most of these run to a final: slower per example
    @given(path=st.sampled_from([CHAT, COMP]), data=st.data())
    def one(path, data):
        name = "ChatCompletionRequest" if path == CHAT else "CompletionRequest"
        body = data.draw(from_schema(schemas[name], doc))
        status, out = harness.call(post(harness, path, dumps(body), {}))
        if status != 200:
            # the rules no schema can say (openapi.build): prompt + max_tokens within the
            # context, stream_options only with stream=true, top_logprobs only with logprobs,
            # min_tokens <= max_tokens, logit_bias keyed by token ids of the vocabulary (and
            # allowed_token_ids' ids in it), an
            # earlier tool call's arguments that are JSON text, tool_choice only with tools, a
            # structured output whose regex or schema compiles (and only one of them), a
            # final message to continue that is the assistant's (and no generation prompt),
            # prompt_logprobs neither on a stream nor with echo
            assert status == 400 and (
                out["code"] == "context_length_exceeded"
                or out["param"]
                in (
                    "stream_options",
                    "top_logprobs",
                    "min_tokens",
                    "logit_bias",
                    "best_of",
                    "tool_choice",
                    "response_format",
                    "guided_regex",
                    "guided_choice",
                    "continue_final_message",
                    "prompt_logprobs",
                    "allowed_token_ids",
                    "priority",
                )
                or str(out["param"]).endswith(".tool_calls")
            ), (body, out)

    one()


def test_replay_of_a_story_without_accepted(harness):
    """An abort that overtook its request writes the whole story itself, with no `accepted`
    (DESIGN §4): replaying it is a normal abort answer, not a 5xx."""
    from fd.control.events import AbortRequested, BlocksReleased, Drained, Final

    async def run():
        bus = harness.bus
        for ev in (
            AbortRequested(request_id="tomb"),
            Drained(request_id="tomb"),
            BlocksReleased(request_id="tomb", count=0),
            Final(request_id="tomb", finish_reason="abort"),
        ):
            await bus.publish(bus.keys.req("tomb"), ev)
        resp = await harness.client.get("/v1/requests/tomb/stream")
        async with resp:
            status, events = await check(resp)
        assert status == 200
        chunks = [orjson.loads(d) for _, d in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["abort"]

    harness.call(run())
