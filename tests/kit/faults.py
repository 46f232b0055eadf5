"""Helpers for the fault tests: several in-process engines on one model, slow steps, kills,
and a redis-server of the test's own that it can stop and start again on the same port."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import aiohttp
import orjson
import pytest

from fd.compose import start_engine
from fd.control.connect import connect
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.core.sequence import PLACEHOLDER
from fd.engine.node.node_config import EngineConfig, SchedulerSettings
from fd.engine.runner.runners import InProcessRunner
from tests.kit.engine import GatedRunner
from tests.kit.redis import free_port, start_redis_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
_LOCKS: dict[int, threading.Lock] = {}

#: Fast failure detection for tests: peers scan often and look at entries idle for 0.2 s.
FAST_FAILOVER = dict(failover_interval_s=0.2, failover_idle_ms=200, heartbeat_ttl_s=2, heartbeat_s=0.5)


class RunnerSlice(InProcessRunner):
    """Blocks ``[offset, offset + num_blocks)`` of one shared runner's KV pool, so two
    in-process engines on one model never write each other's KV; steps take turns. ``delay``
    slows each step down, so a test can act while a request is half generated. Placeholders
    (async scheduling) are filled in here from this slice's own last step, as a runner of its
    own would: the shared runner's last step may be another engine's."""

    def __init__(self, inner, offset: int, num_blocks: int, delay: float = 0.0):
        self.inner = inner
        self.offset = offset
        self.num_blocks = num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        # (the engine refuses ids past the vocabulary at admission only if its runner says it)
        self.vocab_size = inner.vocab_size
        self.delay = delay
        self.lock = _LOCKS.setdefault(id(inner), threading.Lock())
        self.last: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.delay:
            time.sleep(self.delay)
        seqs = tuple(
            replace(
                s,
                block_table=tuple(b + self.offset for b in s.block_table),
                token_ids=((self.last[s.request_id],) if s.token_ids == (PLACEHOLDER,) else s.token_ids),
            )
            for s in out.seqs
        )
        with self.lock:
            # (the shared runner's own idea of the step before is the other engine's: what a
            # penalized or guided request's history lacks comes from this slice's)
            self.inner._last_sampled = dict(self.last)
            res = self.inner.execute(replace(out, seqs=seqs))
        self.last = dict(res.sampled)
        return res


class Engines:
    """Starts engines that share the session's tiny runner (each on its own slice of blocks)."""

    def __init__(self, url_or_factory, keys, model_dir, runner, tokenizer, slices: int = 4):
        self.factory = url_or_factory if callable(url_or_factory) else (lambda: connect(url_or_factory))
        self.keys = keys
        self.model_dir = model_dir
        self.runner = runner
        self.tokenizer = tokenizer
        self.per = runner.num_blocks // slices
        self.started = []
        self.gates: dict[str, GatedRunner] = {}

    async def start(self, engine_id: str, *, delay: float = 0.0, gated: bool = False, **kw):
        i = len(self.started)
        runner = RunnerSlice(self.runner, i * self.per, self.per, delay)
        if gated:
            runner = self.gates[engine_id] = GatedRunner(runner)
        cfg = EngineConfig(
            model_dir=str(self.model_dir),
            engine_id=engine_id,
            scheduler=SchedulerSettings(
                max_num_seqs=kw.pop("max_num_seqs", 8),
                max_num_batched_tokens=kw.pop("max_num_batched_tokens", 256),
            ),
            **{**FAST_FAILOVER, **kw},
        )
        eng = await start_engine(self.factory, self.keys, cfg, runner=runner, tokenizer=self.tokenizer)
        self.started.append(eng)
        return eng

    async def stop_all(self) -> None:
        for g in self.gates.values():
            g.open()
        for eng in self.started:
            await kill(eng)


async def kill(eng) -> None:
    """As close to SIGKILL as one process allows: the engine task is cancelled wherever it is
    (what it had not published is lost), its heartbeat goes, its connections close."""
    eng.task.cancel()
    await asyncio.gather(eng.task, return_exceptions=True)
    try:
        await eng.node.bus.redis.delete(eng.node.bus.keys.engine(eng.id))
    except Exception:
        pass
    for r in (eng.node.bus.redis, eng.node.control_bus.redis):
        try:
            await r.aclose()
        except Exception:
            pass


def dump_tasks_after(seconds: float, what: str, extra=None) -> asyncio.TimerHandle:
    """A timer that, unless cancelled within ``seconds``, prints every task's chain of awaits
    (and ``extra()``, if given), then cancels the task that set it: a test that hangs fails and
    says where. Cancel the handle when done."""
    test = asyncio.current_task()

    def dump() -> None:
        print(f"\n=== {what}: still running after {seconds:g} s; every task:", file=sys.stderr)
        for task in asyncio.all_tasks():
            print(f"--- {task!r}", file=sys.stderr)
            coro = task.get_coro()
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
                if frame is None:
                    break
                print(
                    f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=sys.stderr
                )
                coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        if extra is not None:
            print(extra(), file=sys.stderr)
        test.cancel()

    return asyncio.get_running_loop().call_later(seconds, dump)


async def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def all_blocks_free(node, timeout: float = 5.0) -> None:
    await wait_for(
        lambda: node.sched.num_free_blocks == node.sched.num_total_blocks and not node.sched.has_work(),
        timeout,
        f"all blocks free on {node.id}",
    )


class OwnRedis:
    """A redis-server this test may stop and restart on the same port, its data kept in an
    append-only file (fsync'ed on every write): what a Redis restart looks like in production."""

    def __init__(self, tmpdir: str):
        self.dir = tmpdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = start_redis_server(
            self.dir, "--appendonly", "yes", "--appendfsync", "always", port=self.port
        ).proc

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


def spawn_engine(url: str, keys, model_dir, engine_id: str, *extra: str) -> subprocess.Popen:
    """``python -m fd engine`` in its own process, as an operator runs it."""
    import sys

    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fd",
            "engine",
            "--redis-url",
            url,
            "--prefix",
            keys.prefix,
            "--model",
            str(model_dir),
            "--engine-id",
            engine_id,
            "--num-blocks",
            "128",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def reap(proc: subprocess.Popen, timeout: float = 10.0) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out.decode(errors="replace")


async def sse_objects(resp):
    """The JSON objects of an SSE response body in order, then ``None`` for ``[DONE]``."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        yield orjson.loads(data)


async def stream_completion(url: str, body: dict, headers: dict | None = None) -> dict:
    """A streaming client: the text it saw, its finish reason, and whether it ended in [DONE]."""
    out = {"text": "", "finish_reason": None, "done": False, "errors": [], "chunks": 0}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/v1/completions", json={**body, "stream": True}, headers=headers or {}
        ) as resp:
            out["status"] = resp.status
            async for obj in sse_objects(resp):
                if obj is None:
                    out["done"] = True
                    break
                if "error" in obj:
                    out["errors"].append(obj["error"])
                    continue
                for ch in obj.get("choices") or ():
                    out["text"] += ch.get("text") or ""
                    out["chunks"] += 1
                    if ch.get("finish_reason"):
                        out["finish_reason"] = ch["finish_reason"]
    return out


@pytest.fixture
async def engines(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """Engines started in this test (and stopped after it) on the session's real Redis."""
    e = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    yield e
    await e.stop_all()


class ReplyCutter:
    """A TCP proxy in front of a Redis that, once armed with a command name, lets the next
    command of that name through and cuts the connection before its reply reaches the client:
    Redis ran it, the client cannot know, and redis-py sends it again on a new connection
    (what a connection killed at the wrong moment does)."""

    def __init__(self, port: int):
        self.port = port
        self.url = ""
        self.armed: bytes | None = None
        self.cuts = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> ReplyCutter:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def arm(self, command: str) -> None:
        self.armed = command.upper().encode()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.port)
        cut = asyncio.Event()

        async def up() -> None:
            while data := await cr.read(65536):
                if self.armed is not None and self.armed in data.upper():
                    self.armed = None
                    cut.set()
                sw.write(data)
                await sw.drain()

        async def down() -> None:
            while data := await sr.read(65536):
                if cut.is_set():  # the reply to the armed command: lost with the connection
                    self.cuts += 1
                    return
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (cw, sw):
                w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
