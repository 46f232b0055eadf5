"""A burst of requests in ``fd serve``: what the engine claims, and when its turn comes.

The engine there claims when its API says it submitted (``on_local_arrival``) and otherwise
only every CLAIM_POLL_S. A claim is capped (``max_num_waiting``); what it left behind must be
claimed at the next chance, not after the poll (a wave of 32 was prefilled as 16, then the
other 15 a poll later)."""

from __future__ import annotations

from control.bus import Bus
from engine.node import EngineConfig, EngineNode
from tests.enginekit import submit_together


async def _node(embedded_redis, keys, tiny_runner, tiny_tokenizer) -> EngineNode:
    node = EngineNode(Bus(embedded_redis.client(), keys), Bus(embedded_redis.client(), keys),
                      tiny_runner, tiny_tokenizer,
                      EngineConfig(engine_id="burst", max_num_seqs=64, max_num_waiting=16))
    await node.prepare()
    return node


async def test_a_capped_claim_leaves_the_rest_for_the_next_chance_not_the_poll(
        embedded_redis, keys, tiny_runner, tiny_tokenizer):
    node = await _node(embedded_redis, keys, tiny_runner, tiny_tokenizer)
    try:
        await submit_together(node.bus, [(f"b{i}", [3, 4, 5], {"max_tokens": 2}) for i in range(20)])
        node.on_local_arrival()  # what fd serve's API says after submitting
        assert await node._claim(block=False) == 16  # the cap
        assert len(node.sched.schedule().seqs) == 16  # the step that starts them
        # at once (well inside CLAIM_POLL_S): the four it could not take
        assert await node._claim(block=False) == 4
        assert node.sched.num_waiting == 4 and node.sched.num_running == 16
        # and nothing more announced or queued: the next chance does not read again
        assert await node._claim(block=False) == 0 and not node._arrived
    finally:
        await node.bus.redis.aclose()
        await node.control_bus.redis.aclose()


async def test_an_idle_engine_is_urgent_once_a_request_is_announced(
        embedded_redis, keys, tiny_runner, tiny_tokenizer):
    """fd serve's loop runs the engine's turn first while it is urgent: idle with a request
    announced, it is (the model must not wait while the rest of a burst comes in)."""
    node = await _node(embedded_redis, keys, tiny_runner, tiny_tokenizer)
    try:
        assert node._urgent()  # idle, nothing announced: whatever wakes it goes first
        node.on_local_arrival()
        assert node._urgent()
        assert await node._claim(block=False) == 0  # (nothing was really there)
        assert node._urgent()
    finally:
        await node.bus.redis.aclose()
        await node.control_bus.redis.aclose()


def test_fd_serve_starts_a_bursts_first_prefill_before_the_burst_is_all_in(
        embedded_redis, keys, tiny_model_dir, tiny_tokenizer):
    """16 requests sent at once, each on a connection of its own, to API and engine composed as
    ``fd serve`` does on its loop: the model computes the first prompts while the API takes
    in the rest (it used to sit idle until the whole burst was submitted, ~7 ms for 32), and
    every request still gets its tokens."""
    import asyncio
    import socket
    import threading
    import time

    import orjson

    from control.metrics import Metrics
    from fd.compose import ApiOptions, EngineOptions, join_in_process, start_api, start_engine
    from fd.eventloop import EngineFirstLoop

    n = 16

    def send_all(port: int, go: threading.Event, replies: list) -> None:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]
        go.wait(30)
        for i, s in enumerate(socks):
            body = orjson.dumps({"prompt": [5 + i, 6, 7, 8] * 8, "max_tokens": 4, "stream": True,
                                 "stream_options": {"include_usage": True}, "temperature": 0,
                                 "ignore_eos": True})
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                      b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        for s in socks:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            replies.append(data)
            s.close()

    async def main():
        eng = await start_engine(embedded_redis.client, keys,
                                 EngineOptions(model_dir=str(tiny_model_dir), engine_id="burst",
                                               num_blocks=512),
                                 tokenizer=tiny_tokenizer, metrics=Metrics())
        api = await start_api(embedded_redis.client, keys, ApiOptions(model_dir=str(tiny_model_dir)),
                              metrics=Metrics(), tokenizer=tiny_tokenizer)
        join_in_process(api, eng)
        submits: list[float] = []
        steps: list[float] = []
        submit, step = api.bus.submit, eng.node._submit

        async def timed_submit(*a, **k):
            out = await submit(*a, **k)
            submits.append(time.perf_counter())
            return out

        def timed_step(loop, out):
            steps.append(time.perf_counter())
            return step(loop, out)

        api.bus.submit, eng.node._submit = timed_submit, timed_step
        try:
            go, replies = threading.Event(), []
            thread = threading.Thread(target=send_all, args=(int(api.url.rsplit(":", 1)[1]), go, replies))
            thread.start()
            await asyncio.sleep(0.2)  # (connected, idle)
            go.set()
            await asyncio.to_thread(thread.join, 60)
            assert len(replies) == n and all(
                r.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in r
                and b'"completion_tokens":4' in r and r.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
                for r in replies), replies[0].decode()
            assert len(submits) == n
            first_step = steps[0]
            assert first_step < max(submits), (first_step - min(submits), max(submits) - min(submits))
        finally:
            await api.stop()
            await eng.stop()

    with asyncio.Runner(loop_factory=EngineFirstLoop) as runner:
        runner.run(main())
