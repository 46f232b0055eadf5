"""The cheap paths of the per-token API path render, deliver and wake exactly like the general
ones: pre-rendered chunk templates, batched subscription reads, the embedded server's direct
wake-up of blocked readers."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
import redis

from fd.api import bodies, rendering, sse
from fd.control import events as E
from fd.control.mux import MuxStopped, StreamMux

TEXTS = [
    "hi",
    " world",
    'quote " and \\ backslash',
    "new\nline\r\ttab",
    "\u00e9\u4e2d\U0001f600",
    "\x00fd-text\x00",
    "</script>",
    "\u2028\u2029",
    "{}",
    '"text":""',
]


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["tiny-llama", 'we"ird\n\x00fd-text\x00 model'])
def test_token_json_is_byte_identical_to_the_dict_path(endpoint, include_usage, model):
    slow = rendering.make_renderer("cmpl-1", endpoint, model, 1700000000, 7, include_usage)
    fast = rendering.make_renderer("cmpl-1", endpoint, model, 1700000000, 7, include_usage)
    for i, text in enumerate([*TEXTS, ""]):
        chunks = slow.token_chunks(text, i + 1)
        payload = fast.token_json(text, i + 1)
        if not text:
            assert chunks == [] and payload is None
            continue
        (chunk,) = chunks
        assert payload == orjson.dumps(chunk)
        eid = b"1700000000000-%d" % i
        assert sse.json_frame(payload, eid) == sse.frame(chunk, eid)
        assert sse.json_frame(payload, eid.decode()) == sse.frame(chunk, eid.decode())
    # the state the final chunks and usage come from advances the same way
    assert (fast.completion_tokens, fast.text) == (slow.completion_tokens, slow.text)
    final = E.Final(request_id="cmpl-1", finish_reason="length")
    assert fast.final_chunks(final) == slow.final_chunks(final)


def test_a_model_name_holding_the_marker_falls_back_to_the_dict_path():
    r = rendering.make_renderer("cmpl-1", "completion", "\x00fd-text\x00", 1, 1)
    assert r._template() is None
    assert r.token_json("x", 1) == orjson.dumps(bodies.completion_chunk("cmpl-1", 1, "\x00fd-text\x00", "x"))


# ------------------------------------------------------------------ subscriptions


class _Mux:
    def _unsubscribe(self, sub) -> None:
        pass


def _sub():
    from fd.control.mux import Subscription

    return Subscription(_Mux(), "r1", b"fd:req:{r1}", b"0-0")


def _tok(i: int) -> E.Tokens:
    return E.Tokens(request_id="r1", token_ids=(i,), text=f"t{i}")


async def test_take_ready_returns_everything_delivered_in_order_then_the_end():
    sub = _sub()
    assert sub.take_ready() == [] and not sub.done
    for i in range(1, 4):
        sub._offer(b"%d-0" % i, (i, 0), _tok(i))
    sub._offer(b"2-0", (2, 0), _tok(2))  # not after the last one: dropped
    assert await sub.ready(0.5) is True
    assert [(eid, ev.text) for eid, ev in sub.take_ready()] == [
        (b"1-0", "t1"),
        (b"2-0", "t2"),
        (b"3-0", "t3"),
    ]
    assert sub.take_ready() == [] and not sub.done
    final = E.Final(request_id="r1", finish_reason="length")
    sub._offer(b"4-0", (4, 0), _tok(4))
    sub._offer(b"5-0", (5, 0), final)
    sub._offer(b"6-0", (6, 0), _tok(6))  # nothing after the final
    assert [eid for eid, _ in sub.take_ready()] == [b"4-0", b"5-0"]
    assert not sub.done  # the end is seen by the next take
    assert sub.take_ready() == [] and sub.done
    assert await sub.ready(0.5) is True  # done: never waits
    await sub.close()


async def test_take_ready_raises_a_stop_only_after_what_came_before_it():
    sub = _sub()
    sub._offer(b"1-0", (1, 0), _tok(1))
    sub._end(MuxStopped("stopped"))
    assert [eid for eid, _ in sub.take_ready()] == [b"1-0"]
    with pytest.raises(MuxStopped):
        sub.take_ready()
    assert sub.done


async def test_ready_wakes_on_delivery_and_gives_up_when_quiet():
    sub = _sub()
    assert await sub.ready(0.01) is False  # quiet: the keep-alive case
    waiter = asyncio.ensure_future(sub.ready(30))
    await asyncio.sleep(0)
    assert not waiter.done()
    sub._offer(b"1-0", (1, 0), _tok(1))
    assert await waiter is True
    assert len(sub.take_ready()) == 1
    # one quiet timer serves successive waits; it is gone once the consumer has closed
    w2 = asyncio.ensure_future(sub.ready(30))
    await asyncio.sleep(0)
    sub._offer(b"2-0", (2, 0), _tok(2))
    assert await w2 is True
    await sub.close()
    assert sub._timer is None


async def test_async_iteration_still_yields_one_event_at_a_time():
    sub = _sub()
    for i in range(1, 3):
        sub._offer(b"%d-0" % i, (i, 0), _tok(i))
    sub._offer(b"3-0", (3, 0), E.Final(request_id="r1", finish_reason="stop"))
    got = [eid async for eid, _ in sub]
    assert got == [b"1-0", b"2-0", b"3-0"] and sub.done


async def test_mux_delivers_in_batches_with_ids_in_order(bus, keys):
    mux = StreamMux(bus.redis, keys, "perf-test", block_ms=200)
    await mux.start()
    try:
        sub = await mux.subscribe("b1")
        key = keys.req("b1")
        evs = [E.Accepted(request_id="b1", prompt_tokens=1)] + [
            E.Tokens(request_id="b1", token_ids=(i,), text=f"t{i}") for i in range(20)
        ]
        ids = await bus.publish_many([(key, ev) for ev in evs])
        await bus.publish(key, E.Final(request_id="b1", finish_reason="length"))
        seen = []
        while not sub.done:
            assert await sub.ready(10)
            seen += sub.take_ready()
        assert [eid for eid, _ in seen][: len(ids)] == ids
        assert isinstance(seen[-1][1], E.Final) and len(seen) == len(ids) + 1
    finally:
        await mux.stop()


# ------------------------------------------------------------------ embedded wake-ups


async def test_embedded_blocked_read_wakes_on_writes_from_the_loop_and_from_other_threads(embedded_redis):
    client = embedded_redis.client()
    writer = embedded_redis.client()
    try:
        await client.xadd("s", {"a": "0"})
        last = (await client.xrevrange("s", count=1))[0][0]
        # same thread (the engine and API of `fd serve`)
        read = asyncio.ensure_future(client.xread({"s": last}, block=10_000))
        await asyncio.sleep(0.01)
        assert not read.done()
        eid = await writer.xadd("s", {"a": "1"})
        assert (await read)[0][1][0][0] == eid
        # another thread: the TCP door, as redis-cli writes into a running fd serve
        read = asyncio.ensure_future(client.xread({"s": eid}, block=10_000))
        await asyncio.sleep(0.01)
        assert not read.done()
        got: list = []
        t = threading.Thread(
            target=lambda: got.append(redis.Redis.from_url(embedded_redis.url).xadd("s", {"a": "2"}))
        )
        t.start()
        res = await read
        t.join()
        assert res[0][1][0][0] == got[0]
    finally:
        await client.aclose()
        await writer.aclose()


async def test_sse_events_yield_a_keep_alive_when_quiet_then_the_batch(monkeypatch):
    from fd.api import streaming

    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.01)
    sub = _sub()
    it = streaming.events(sub)
    assert await it.__anext__() is None  # nothing came: a keep-alive comment
    sub._offer(b"1-0", (1, 0), _tok(1))
    sub._offer(b"2-0", (2, 0), _tok(2))
    assert [eid for eid, _ in await it.__anext__()] == [b"1-0", b"2-0"]
    sub._offer(b"3-0", (3, 0), E.Final(request_id="r1", finish_reason="stop"))
    assert [eid for eid, _ in await it.__anext__()] == [b"3-0"]
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()


def test_logprobs_ride_on_the_next_chunk_with_text_and_the_rest_on_the_last():
    """A token whose text is held back (half a character) has its log-probability shown with
    the next chunk that has text; what is left at the end goes on the finishing chunk, and
    the whole response carries them all, in OpenAI's shapes."""

    def ev(ids, text, lps):
        return dict(
            token_ids=ids, logprobs={"lp": lps, "top": [[[t, lp]] for t, lp in zip(ids, lps)]}, text=text
        )

    events = [
        ev((72,), "H", [-0.5]),
        ev((0xE2,), "", [-1.0]),
        ev((0x82, 0xAC), "\u20ac", [-2.0, -0.25]),
        ev((0xE2,), "", [-3.0]),
    ]
    final = E.Final(request_id="cmpl-1", finish_reason="length")
    for endpoint in ("completion", "chat"):
        stream = rendering.make_renderer("cmpl-1", endpoint, "m", 1, 3, token_bytes=lambda t: bytes([t]))
        whole = rendering.make_renderer("cmpl-1", endpoint, "m", 1, 3, token_bytes=lambda t: bytes([t]))
        shown = []
        for e in events:
            payload = stream.token_json(e["text"], len(e["token_ids"]), e["token_ids"], e["logprobs"])
            whole.add_tokens(e["text"], len(e["token_ids"]), e["token_ids"], e["logprobs"])
            shown.append(None if payload is None else orjson.loads(payload)["choices"][0]["logprobs"])
        last = stream.final_chunks(final)[0]["choices"][0]["logprobs"]
        body = whole.response(final)["choices"][0]["logprobs"]
        assert shown[1] is None and shown[3] is None  # no text: no chunk
        if endpoint == "completion":
            assert shown[0] == {
                "tokens": ["H"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{"H": -0.5}],
                "text_offset": [0],
            }
            assert shown[2]["token_logprobs"] == [-1.0, -2.0, -0.25] and shown[2]["text_offset"] == [1, 2, 3]
            assert last["token_logprobs"] == [-3.0] and last["text_offset"] == [4]
            assert body["token_logprobs"] == [-0.5, -1.0, -2.0, -0.25, -3.0]
            assert body["text_offset"] == [0, 1, 2, 3, 4]
        else:
            assert [c["logprob"] for c in shown[2]["content"]] == [-1.0, -2.0, -0.25]
            assert shown[2]["content"][0]["bytes"] == [0xE2]
            assert shown[0]["content"] == [
                {
                    "token": "H",
                    "logprob": -0.5,
                    "bytes": [72],
                    "top_logprobs": [{"token": "H", "logprob": -0.5, "bytes": [72]}],
                }
            ]
            assert [c["logprob"] for c in last["content"]] == [-3.0]
            assert [c["logprob"] for c in body["content"]] == [-0.5, -1.0, -2.0, -0.25, -3.0]
