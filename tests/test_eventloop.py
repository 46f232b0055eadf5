"""fd serve's event loop (fd.eventloop): who runs first, and that nothing else changes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import types

import pytest

from fd.eventloop import EngineFirstLoop


def run(coro_fn):
    with asyncio.Runner(loop_factory=EngineFirstLoop) as runner:
        return runner.run(coro_fn())


def _busy(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def _work_then_lane(loop, order: list[str], ingress, n: int) -> None:
    """Queued work (w0..w2, as a turn of token writes), then n ingress callbacks in the lane."""
    for i in range(3):
        loop.call_soon(order.append, f"w{i}")
    for i in range(n):
        loop._to_lane(ingress, (i,), None)


def test_a_prioritized_task_wakes_ahead_of_what_was_ready_while_its_predicate_holds():
    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        urgent = {"now": True}
        gate = loop.create_future()

        async def engine():
            await gate
            order.append("engine")

        task = loop.create_task(engine())
        loop.prioritize(task, lambda: urgent["now"])
        await asyncio.sleep(0)  # the engine now waits on the gate
        for i in range(3):
            loop.call_soon(order.append, f"api{i}")
        gate.set_result(None)  # wakes the engine: ahead of the three
        await task
        return order

    assert run(main) == ["engine", "api0", "api1", "api2"]


def test_without_its_predicate_a_prioritized_task_waits_its_turn_until_hurried():
    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        gates = [loop.create_future(), loop.create_future()]

        async def engine():
            for g in gates:
                await g
                order.append("engine")

        task = loop.create_task(engine())
        loop.prioritize(task, lambda: False)
        await asyncio.sleep(0)
        loop.call_soon(order.append, "api0")
        gates[0].set_result(None)  # queued behind api0 ...
        loop.call_soon(order.append, "api1")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # ... in arrival order. The second wake-up is queued behind api2, then hurried.
        loop.call_soon(order.append, "api2")
        gates[1].set_result(None)
        loop.hurry(task)
        loop.hurry(task)  # (nothing left to move: a no-op)
        await task
        return order

    assert run(main) == ["api0", "engine", "api1", "engine", "api2"]


def test_a_finished_task_is_forgotten():
    async def main():
        loop = asyncio.get_running_loop()

        async def engine():
            await asyncio.sleep(0)

        task = loop.create_task(engine())
        loop.prioritize(task, lambda: True)
        await task
        await asyncio.sleep(0)  # (done callbacks run a turn later)
        return dict(loop._first), dict(loop._queued)

    assert run(main) == ({}, {})


def test_callbacks_from_other_threads_go_first():
    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        queued = threading.Event()

        def other_thread():
            queued.wait()
            loop.call_soon_threadsafe(order.append, "thread")

        t = threading.Thread(target=other_thread)
        t.start()
        for i in range(3):
            loop.call_soon(order.append, f"api{i}")
        queued.set()
        t.join()  # (the thread's callback is in before this turn ends)
        await asyncio.sleep(0)
        return order

    assert run(main) == ["thread", "api0", "api1", "api2"]


def test_a_task_woken_by_a_cancellation_goes_first():
    """aiohttp cancels the handler whose client hung up: its abort must not queue."""
    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []

        async def handler():
            try:
                await loop.create_future()
            except asyncio.CancelledError:
                order.append("hung up")
                raise

        task = loop.create_task(handler())
        await asyncio.sleep(0)
        for i in range(3):
            loop.call_soon(order.append, f"api{i}")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return order

    assert run(main) == ["hung up", "api0", "api1", "api2"]


def test_a_lost_connection_is_heard_first():
    """A peer that closes: the server protocol's connection_lost runs ahead of callbacks that
    were already queued (and the name this relies on is still asyncio's)."""
    assert hasattr(asyncio.selector_events._SelectorTransport, "_call_connection_lost")

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        lost = loop.create_future()
        connected = loop.create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                connected.set_result(self)

            def eof_received(self):
                # Queue work, then close: asyncio schedules connection_lost behind it.
                for i in range(3):
                    loop.call_soon(order.append, f"api{i}")
                self.transport.close()

            def connection_lost(self, exc):
                order.append("lost")
                lost.set_result(None)

        server = await loop.create_server(Proto, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sock = socket.create_connection(("127.0.0.1", port))
        await connected
        sock.shutdown(socket.SHUT_WR)
        await lost
        await asyncio.sleep(0)
        sock.close()
        server.close()
        await server.wait_closed()
        return order

    assert run(main) == ["lost", "api0", "api1", "api2"]


def test_everything_else_keeps_arrival_order_and_a_closed_loop_refuses_like_asyncio():
    loop = EngineFirstLoop()
    order: list[int] = []
    for i in range(5):
        loop.call_soon(order.append, i)
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop.close()
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError):
        loop.call_soon_threadsafe(order.append, 5)
    with pytest.raises(RuntimeError):
        loop.call_soon(order.append, 5)


@pytest.mark.parametrize("chunk", [None, 3])
def test_fd_serve_on_it_streams_the_engines_tokens_and_hears_hang_ups(
        embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, monkeypatch, chunk):
    """API and engine composed as `fd serve` does, on this loop, the model in a worker process
    whose replies the loop reads itself: the engine's task is the prioritized one, 8 greedy
    streams give the engine's own text, and 8 clients that hang up after 3 chunks end in the
    abort story with every block back. ``chunk``: a step's publish split into chunks of 3
    events with a look at the sockets between them (as at 128 streams, where a publish is
    ~115 events): the same streams and stories."""
    import openai

    import engine.node
    if chunk is not None:
        monkeypatch.setattr(engine.node, "FLUSH_CHUNK", chunk)

    from control.metrics import Metrics
    from engine.llm import LLM
    from engine.sampler import SamplingParams
    from fd.compose import ApiOptions, EngineOptions, join_in_process, start_api, start_engine

    async def main():
        loop = asyncio.get_running_loop()
        looks_mid_publish = []  # for each look the step loop takes: was a publish under way?
        io_turn = loop.io_turn

        def counting_io_turn():
            looks_mid_publish.append(eng.node._flush_lock.locked())
            return io_turn()

        loop.io_turn = counting_io_turn
        answering, waited_for_a_first_token = loop.answering, []

        def counting_answering(task):
            waited_for_a_first_token.append(task)
            return answering(task)

        loop.answering = counting_answering
        metrics = Metrics()
        eng = await start_engine(embedded_redis.client, keys,
                                 EngineOptions(model_dir=str(tiny_model_dir), engine_id="first",
                                               num_blocks=512),
                                 tokenizer=tiny_tokenizer, metrics=metrics)  # (a worker process)
        api = await start_api(embedded_redis.client, keys, ApiOptions(model_dir=str(tiny_model_dir)),
                              metrics=metrics, tokenizer=tiny_tokenizer)
        join_in_process(api, eng)
        client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
        try:
            assert loop._first.get(eng.task) == eng.node._urgent
            assert eng.node._reader_fd == eng.node.runner.fileno()  # read by the loop

            async def one(i: int):
                s = await client.completions.create(
                    model=api.cfg.model_name, prompt=f"Request number {i}", max_tokens=24,
                    temperature=0, stream=True, extra_body={"ignore_eos": True})
                text, n = "", 0
                async for chunk in s:
                    n += 1
                    if chunk.choices:
                        text += chunk.choices[0].text
                    if i % 2 == 0 and n == 3:
                        await s.close()
                        return chunk.id, None
                return chunk.id, text

            results = await asyncio.gather(*(one(i) for i in range(16)))
            # each stream's handler waited for its first token in the lane, and none still does
            assert len(set(waited_for_a_first_token)) == 16
            assert not loop._answering
            refs = LLM(tiny_runner, tiny_tokenizer).generate(
                [tiny_tokenizer.encode(f"Request number {i}") for i in range(1, 16, 2)],
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            assert [results[i][1] for i in range(1, 16, 2)] == [r.text for r in refs]
            for i in range(0, 16, 2):
                for _ in range(500):
                    evs = [e for _, e in await api.bus.read_req(results[i][0])]
                    if evs and evs[-1].TYPE == "final":
                        break
                    await asyncio.sleep(0.01)
                assert [e.TYPE for e in evs if e.TYPE != "tokens"] == [
                    "accepted", "claimed", "abort_requested", "drained", "blocks_released", "final"]
            for _ in range(200):
                if eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks:
                    break
                await asyncio.sleep(0.01)
            assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks
            assert api.mux.newest_step >= 24  # what the engine's predicate reads
            # the step loop looked at the sockets in the middle of its publishes iff chunked
            assert any(looks_mid_publish) == (chunk is not None)
            for i in range(0, 16, 2):  # (and nothing after abort_requested, chunked or not)
                evs = [e.TYPE for _, e in await api.bus.read_req(results[i][0])]
                assert "tokens" not in evs[evs.index("abort_requested"):]
        finally:
            await client.close()
            await api.stop()
            await eng.stop()

    run(main)


def test_an_urgent_reader_runs_ahead_of_what_is_ready():
    """The model worker's pipe: when a step's result is readable, it is read before the work
    that was already queued, and a removed reader is forgotten."""
    assert hasattr(asyncio.BaseEventLoop, "_add_callback")

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        a, b = socket.socketpair()
        a.setblocking(False)
        got = loop.create_future()

        def readable():
            order.append(a.recv(16).decode())
            got.set_result(None)

        def kick():  # queues work for the next turn, whose select finds the pipe readable
            b.send(b"result")
            for i in range(3):
                loop.call_soon(order.append, f"api{i}")

        loop.add_urgent_reader(a.fileno(), readable)
        loop.call_soon(kick)
        await got
        await asyncio.sleep(0)
        loop.remove_reader(a.fileno())
        assert not loop._first_readers
        a.close()
        b.close()
        return order

    assert run(main) == ["result", "api0", "api1", "api2"]


def test_what_sockets_bring_goes_ahead_of_queued_work_in_the_order_it_came():
    """Input (a hang-up's EOF among it) is read before the turn's queued work, not after."""
    assert hasattr(asyncio.selector_events.BaseSelectorEventLoop, "_process_events")

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        pairs = [socket.socketpair() for _ in range(2)]
        done = loop.create_future()
        for i, (a, _) in enumerate(pairs):
            a.setblocking(False)

            def readable(a=a, i=i):
                order.append(f"read{i}:{a.recv(16).decode()}")
                if sum(x.startswith("read") for x in order) == 2:
                    done.set_result(None)
            loop.add_reader(a.fileno(), readable)

        def kick():  # queues work for the next turn, whose select finds both readable
            for _, b in pairs:
                b.send(b"x")
            for i in range(3):
                loop.call_soon(order.append, f"api{i}")

        loop.call_soon(kick)
        await done
        await asyncio.sleep(0)
        for a, b in pairs:
            loop.remove_reader(a.fileno())
            a.close()
            b.close()
        return order

    order = run(main)
    assert sorted(order[:2]) == ["read0:x", "read1:x"] and order[2:] == ["api0", "api1", "api2"]


def _long_turn_with_input_midway(loop_factory) -> list[str]:
    """A turn of 60 queued callbacks; the second one makes a socket readable. Returns the
    order in which things ran."""

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        a, b = socket.socketpair()
        a.setblocking(False)
        loop.add_reader(a.fileno(), lambda: order.append(f"read:{a.recv(16).decode()}"))

        def work(i: int) -> None:
            order.append(f"w{i}")
            if i == 1:
                b.send(b"eof")

        for i in range(60):
            loop.call_soon(work, i)
        while not any(x.startswith("read") for x in order):
            await asyncio.sleep(0)
        loop.remove_reader(a.fileno())
        a.close()
        b.close()
        return [x for x in order if x.startswith(("w", "read"))]

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


def test_a_long_turn_looks_at_the_sockets_again_every_few_callbacks():
    """A hang-up (any input) that arrives during a long turn of stream writes is read after
    at most POLL_EVERY more callbacks, not after the whole turn."""
    order = _long_turn_with_input_midway(EngineFirstLoop)
    at = order.index("read:eof")
    assert 2 <= at <= 2 + EngineFirstLoop.POLL_EVERY + 1, order
    assert [x for x in order if x != "read:eof"] == [f"w{i}" for i in range(60)]
    # the same on asyncio's own loop: read only after the whole turn
    plain = _long_turn_with_input_midway(asyncio.SelectorEventLoop)
    assert plain.index("read:eof") == 60


def test_a_long_busy_run_queues_one_look_at_a_time():
    """Each look queues the next, never more: a loop with a long ready queue for many turns
    does not fill up with looks (it used to, and spun)."""

    async def main():
        loop = asyncio.get_running_loop()
        stop = False

        def again(i: int) -> None:
            if not stop:
                loop.call_soon(again, i)

        for i in range(100):
            loop.call_soon(again, i)
        for _ in range(50):
            await asyncio.sleep(0)
            assert list(loop._ready).count(loop._poll) <= 1
            assert len(loop._ready) <= 102
        stop = True
        return loop.mid_turn_polls

    assert run(main) >= 50 * (100 // EngineFirstLoop.POLL_EVERY) // 2


def test_an_urgent_task_starts_ahead_of_what_is_ready_and_stays_there():
    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        gate = loop.create_future()

        async def abort_stage_one():
            order.append("urgent:start")
            await gate
            order.append("urgent:woken")

        for i in range(3):
            loop.call_soon(order.append, f"api{i}")
        task = loop.create_urgent_task(abort_stage_one())
        await asyncio.sleep(0)
        for i in range(3, 5):
            loop.call_soon(order.append, f"api{i}")
        gate.set_result(None)
        await task
        return order

    order = run(main)
    assert order[0] == "urgent:start" and order.index("urgent:woken") < order.index("api3")


def test_a_handler_cancelled_by_a_lost_connection_goes_first_even_with_its_step_queued():
    """A hang-up cancels its handler (aiohttp). If the handler was already woken (a token
    for it came), cancelling only marks it, and its step waited behind everything queued
    after it: at 128 streams up to 10 ms. Its step now follows the connection's end."""
    loop = EngineFirstLoop()
    order: list = []
    try:
        async def handler(woken: asyncio.Future) -> None:
            try:
                await woken
                order.append("handler ran")
            except asyncio.CancelledError:
                order.append("handler cancelled")
                raise

        async def main() -> None:
            woken = loop.create_future()
            task = loop.create_task(handler(woken))
            await asyncio.sleep(0)  # the handler waits on its future
            for i in range(20):
                loop.call_soon(order.append, i)
            woken.set_result(None)  # its wake-up queued, in arrival order: after those

            class Transport:  # the shape of asyncio's selector transports and aiohttp's
                def __init__(self, protocol) -> None:  # RequestHandler (checked below)
                    self._protocol = protocol

                def _call_connection_lost(self, exc) -> None:
                    order.append("lost")
                    self._protocol._task_handler.cancel()  # (handler_cancellation=True)

            protocol = types.SimpleNamespace(_task_handler=task)
            loop.call_soon(Transport(protocol)._call_connection_lost, None)
            with contextlib.suppress(asyncio.CancelledError):
                await task

        loop.run_until_complete(main())
    finally:
        loop.close()
    assert order[:2] == ["lost", "handler cancelled"]
    assert order[2:] == list(range(20))


def test_the_internals_the_hang_up_path_relies_on_are_there():
    import inspect
    from asyncio import selector_events

    from aiohttp import web_protocol

    assert "_task_handler" in web_protocol.RequestHandler.__slots__
    src = inspect.getsource(selector_events._SelectorTransport)
    assert "def _call_connection_lost" in src and "self._protocol = protocol" in src


def test_io_turn_runs_what_the_sockets_brought_then_the_task_ahead_of_the_rest():
    """The engine between two steps: one look at the sockets (a hang-up), then back at once,
    ahead of what was queued (the last step's token writes)."""
    loop = EngineFirstLoop()
    a, b = socket.socketpair()
    order: list = []
    try:
        async def main() -> None:
            loop.prioritize(asyncio.current_task(), lambda: True)  # as the engine's task is

            def readable() -> None:  # once: queued twice, the second finds nothing to read
                try:
                    order.append(("read", a.recv(100)))
                except BlockingIOError:
                    order.append("read twice")

            a.setblocking(False)
            loop.add_reader(a.fileno(), readable)
            await asyncio.sleep(0)
            for i in range(5):
                loop.call_soon(order.append, i)
            b.send(b"bye")
            await loop.io_turn()
            order.append("task")
            await asyncio.sleep(0.01)
            loop.remove_reader(a.fileno())

        loop.run_until_complete(main())
    finally:
        a.close()
        b.close()
        loop.close()
    assert order == [("read", b"bye"), "task", 0, 1, 2, 3, 4]


def test_io_turn_waits_for_the_last_looks_callbacks_instead_of_looking_twice():
    loop = EngineFirstLoop()
    order: list = []
    try:
        async def main() -> None:
            loop.prioritize(asyncio.current_task(), lambda: True)
            pending = asyncio.Handle(order.append, ("queued I/O",), loop, None)
            loop._ready.appendleft(pending)  # an I/O callback of the last look, not run yet
            loop._last_io = pending
            loop.call_soon(order.append, "other")
            await loop.io_turn()
            order.append("task")

        loop.run_until_complete(main())
    finally:
        loop.close()
    assert order[:3] == ["queued I/O", "task", "other"]


def _request_during_a_long_turn(loop_factory) -> tuple[int, int]:
    """An aiohttp server on the loop; 200 queued callbacks of ~0.2 ms each (a turn of token
    writes); a client in another thread connects and sends a request when the first of them
    runs. Returns (how many of the 200 had run when the handler started, total)."""
    from aiohttp import web

    busy = 200
    result: dict = {}
    go = threading.Event()

    def client(port: int) -> None:
        go.wait(10)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            while s.recv(4096):
                pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran = [0]

        async def handler(request):
            result["at"] = ran[0]
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/x", handler)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        thread = threading.Thread(target=client, args=(port,), daemon=True)
        thread.start()

        def write() -> None:
            go.set()
            time.sleep(0.0002)  # (a sleep: the client's thread gets the GIL meanwhile)
            ran[0] += 1

        for _ in range(busy):
            loop.call_soon(write)
        while "at" not in result or ran[0] < busy:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(thread.join, 10)
        await runner.cleanup()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return result["at"], busy


def test_a_new_connections_request_reaches_its_handler_ahead_of_queued_work():
    """Ingress (accepting a connection, setting it up, parsing, starting its handler) goes
    through ~5 callbacks; in arrival order each waits behind the work queued before it, which
    at 32 streams is a turn of token writes: a request sent as another ended reached its
    handler 10 ms later. fd's loop runs them in its ingress lane, ahead of that work."""
    at, busy = _request_during_a_long_turn(EngineFirstLoop)
    assert at < busy // 4, (at, busy)
    plain_at, _ = _request_during_a_long_turn(asyncio.SelectorEventLoop)
    assert plain_at == busy  # asyncio's own loop: after the whole turn


def test_the_ingress_lane_yields_to_an_urgent_task_and_to_the_sockets():
    """The lane runs in slices of LANE_S; what was put first while a slice ran (an urgent
    engine's wake-up) runs before the next slice, and the lane keeps its own order."""

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        gate = loop.create_future()

        async def engine():
            await gate
            order.append("engine")

        task = loop.create_task(engine())
        loop.prioritize(task, lambda: True)
        await asyncio.sleep(0)

        def ingress(i: int) -> None:
            if i == 1:
                gate.set_result(None)  # the engine is woken while the lane runs
            _busy(loop.LANE_S / 2)
            order.append(f"in{i}")

        _work_then_lane(loop, order, ingress, 6)
        await task
        while len(order) < 10:
            await asyncio.sleep(0)
        return order

    order = run(main)
    ins = [x for x in order if x.startswith("in")]
    assert ins == [f"in{i}" for i in range(6)]  # in the order they came
    assert order.index("engine") < order.index("in5")  # ahead of the lane's later slices
    assert order.index("in5") < order.index("w0")  # and the lane ahead of queued work


def test_a_first_answer_runs_ahead_of_the_lanes_ingress_and_later_answers_take_turns():
    """A streaming handler waiting for its first token (``answering``) is woken in the lane,
    ahead of the ingress queued there and of queued work: the token ends the request's TTFT.
    Once it has ``answered``, its wake-ups wait their turn again."""

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        tokens = [loop.create_future(), loop.create_future()]

        async def handler():
            for k, fut in enumerate(tokens):
                await fut
                order.append(f"token{k}")
                if k == 0:
                    loop.answered(asyncio.current_task())

        task = loop.create_task(handler())
        loop.answering(task)
        await asyncio.sleep(0)  # the handler now waits for its first token

        def ingress(i: int) -> None:
            if i == 1:
                tokens[0].set_result(None)  # the first token is delivered while the lane runs
            if i == 4:
                tokens[1].set_result(None)  # and the second
            _busy(loop.LANE_S / 3)
            order.append(f"in{i}")

        _work_then_lane(loop, order, ingress, 8)
        await task
        while len(order) < 13:
            await asyncio.sleep(0)
        return order

    order = run(main)
    assert [x for x in order if x.startswith("in")] == [f"in{i}" for i in range(8)]
    # the first answer: within the slice after the one that delivered it, ahead of the rest
    assert order.index("in1") < order.index("token0") < order.index("in4")
    assert order.index("token0") < order.index("w0")
    # the second: behind the lane and the work queued before it
    assert order.index("token1") > order.index("w2")


def test_a_finished_answering_task_is_forgotten():
    async def main():
        loop = asyncio.get_running_loop()
        task = loop.create_task(asyncio.sleep(0))
        loop.answering(task)
        loop.answering(task)  # (twice: one entry)
        await task
        await asyncio.sleep(0)
        return loop._answering

    assert run(main) == set()


def test_the_workers_pipe_is_read_between_lane_slices_while_a_bursts_reads_wait():
    """A burst's reads, all reported by one look, each start a request in the lane; no new
    look may come while they wait (a socket would be reported twice), but the model worker's
    pipe is looked at alone between two slices: a step's result is read after the slice that
    saw it come, not after the whole burst's ingress."""

    async def main():
        loop = asyncio.get_running_loop()
        order: list[str] = []
        pipe_a, pipe_b = socket.socketpair()
        pipe_a.setblocking(False)
        got = loop.create_future()

        def result_readable():
            data = pipe_a.recv(16)
            if data:  # (a second callback, from the full look, finds the pipe drained)
                order.append(data.decode())
                got.set_result(None)

        loop.add_urgent_reader(pipe_a.fileno(), result_readable)
        conns = [socket.socketpair() for _ in range(4)]
        finished = loop.create_future()

        def ingress(i: int) -> None:
            if i == 0:
                pipe_b.send(b"result")  # the step ends while the burst comes in
            _busy(loop.LANE_S * 0.8)
            order.append(f"in{i}")
            if i == len(conns) - 1:
                finished.set_result(None)

        for i, (a, b) in enumerate(conns):
            a.setblocking(False)

            def readable(a=a, i=i):
                a.recv(16)
                loop.remove_reader(a.fileno())
                order.append(f"read{i}")
                loop._to_lane(ingress, (i,), None)

            loop.add_reader(a.fileno(), readable)
            b.send(b"POST")
        await finished
        await got
        loop.remove_reader(pipe_a.fileno())
        for s in (pipe_a, pipe_b, *[s for pair in conns for s in pair]):
            s.close()
        return order

    order = run(main)
    assert order.index("in0") < order.index("result") < order.index("read1"), order
