"""The API node in a test: a tokenizer of one token per byte, a scripted fake engine on the
bus, an app served by aiohttp's test server, and readers of what a client gets (SSE frames,
OpenAI's error shape, streamed deltas put together as OpenAI's clients do)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp.test_utils import TestClient, TestServer

from fd.api import ApiConfig, make_app
from fd.control.events import Abort, Claimed, Final, Tokens, decode
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from fd.control.token_payloads import embedding_field

MAX_LEN = 64


class FakeTokenizer:
    """One token per UTF-8 byte: prompt lengths are easy to reason about."""

    vocab_size = 256
    matryoshka = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def token_strs(self, ids) -> list[str]:
        return [self.decode([t]) for t in ids]

    def is_special(self, token_id: int) -> bool:
        return False

    def id_to_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        offered = "".join(f"tool:{t['function']['name']}\n" for t in tools or ())
        return (
            offered
            + "".join(f"{m['role'][0]}:{m['content']}\n" for m in messages)
            + ("a:" if add_generation_prompt else "")
        )


@contextlib.asynccontextmanager
async def api_client(bus, **cfg):
    mux = StreamMux(bus.redis, bus.keys, "api-test", block_ms=100)
    app = make_app(
        ApiConfig(model_dir="tiny", max_model_len=MAX_LEN, **cfg), bus, mux, FakeTokenizer(), Metrics()
    )
    async with TestClient(TestServer(app)) as client:
        yield client


def assert_openai_error(body: dict, status_code: int | None = None) -> dict:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


WORDS = ("Hello", ",", "", " world", "!")  # an empty delta: no chunk, ids still progress


class FakeEngine:
    """Claims requests and writes a scripted story; ``hold`` keeps them running until aborted."""

    def __init__(
        self,
        bus,
        *,
        hold: bool = False,
        words=WORDS,
        delay: float = 0.0,
        fail: str | None = None,
        vectors: bool = True,
    ):
        self.bus = bus
        self.vectors = vectors  # an embeddings request's first tokens carry a (made-up) vector
        self.fail = fail
        self.hold = hold
        self.words = words
        self.delay = delay
        self.stop = False
        self.claimed: list[str] = []
        self.aborted: dict[str, asyncio.Event] = {}
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        await self.bus.ensure_group()
        cursor = await self.bus.control_cursor()
        while not self.stop:
            for _eid, req in await self.bus.claim_requests("fake", 10, block_ms=20):
                self.claimed.append(req.request_id)
                self.aborted.setdefault(req.request_id, asyncio.Event())
                t = asyncio.create_task(self.serve(req))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
            cursor, events = await self.bus.read_control(cursor, block_ms=None)
            for _eid, ev in events:
                if isinstance(ev, Abort):
                    for rid in ev.request_ids:
                        self.aborted.setdefault(rid, asyncio.Event()).set()

    async def serve(self, req) -> None:
        rid, bus = req.request_id, self.bus
        key = bus.keys.req(rid)
        n_prompt = len(req.data.prompt_token_ids)
        await bus.publish(key, Claimed(request_id=rid, engine="fake"))
        words = self.words[: req.data.sampling.max_tokens]
        for i, w in enumerate(words):
            if self.aborted[rid].is_set():
                break
            vector = (
                embedding_field(bytes(4 * (1 + len(rid) % 5)))
                if i == 0 and self.vectors and req.data.sampling.embed
                else None
            )
            await bus.publish(
                key, Tokens(request_id=rid, token_ids=(100 + i,), text=w, step=i, embedding=vector)
            )
            if self.delay:
                await asyncio.sleep(self.delay)
        if self.hold:
            await self.aborted[rid].wait()
        if self.fail:
            await bus.publish(
                key, Final(request_id=rid, finish_reason="error", engine="fake", error=self.fail)
            )
            return
        if self.aborted[rid].is_set():
            fr, n = "abort", 1
        else:
            fr, n = ("length" if len(words) == req.data.sampling.max_tokens else "stop"), len(words)
        await bus.publish(
            key,
            Final(
                request_id=rid,
                finish_reason=fr,
                engine="fake",
                usage={"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n},
            ),
        )

    async def close(self) -> None:
        self.stop = True
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def setup(bus, engine: FakeEngine | None = None, metrics: Metrics | None = None, **cfg):
    mux = StreamMux(bus.redis, bus.keys, "api-test", block_ms=100)
    app = make_app(
        ApiConfig(model_dir="tiny", max_model_len=64, **cfg), bus, mux, FakeTokenizer(), metrics or Metrics()
    )
    task = asyncio.create_task(engine.run()) if engine else None
    try:
        async with TestClient(TestServer(app)) as client:
            yield client
    finally:
        if engine:
            await engine.close()
            await task


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(id, data) of each event; comments dropped."""
    out = []
    for block in raw.decode().split("\n\n"):
        eid, data = None, []
        for line in block.split("\n"):
            if line.startswith("id: "):
                eid = line[4:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((eid, "\n".join(data)))
    return out


async def control_events(bus) -> list:
    return [decode(f, eid) for eid, f in await bus.redis.xrange(bus.keys.control)]


async def wait_for(cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.02)
    return False


CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def accumulate(chunks: list[dict]) -> dict[int, dict]:
    """What OpenAI's clients do with streamed deltas, per choice."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            o = out.setdefault(ch["index"], {"content": "", "calls": {}, "finish_reason": None})
            d = ch["delta"]
            o["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                call = o["calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
            o["finish_reason"] = ch["finish_reason"] or o["finish_reason"]
    return out
