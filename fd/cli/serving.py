"""The commands that serve: ``fd serve`` (API, engine and embedded control plane in one
process, with ``--api-server-count`` more API processes), ``fd api``, ``fd engine`` and
``fd run-batch``; the configs they make of their flags for fd.compose, and how their processes run (signals,
garbage collection)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from fd.cli.args import api_keys, lora_modules, need_url
from fd.cli.local_serve import LocalServe
from fd.cli.models import resolve_model
from fd.control.keys import Keys
from fd.control.logs import say

log = logging.getLogger("fd.cli.main")


def _engine_config(args: argparse.Namespace, model_dir: Path):
    from fd.cli.flags import field_values
    from fd.engine.node.node_config import EngineConfig, SchedulerSettings

    flags = field_values(args, EngineConfig)
    if flags["executor"] == "timed":  # (its runner is _runner's; the config names a model's)
        flags["executor"] = "paddle"
    return EngineConfig(
        model_dir=str(model_dir),
        **flags,
        scheduler=SchedulerSettings(**field_values(args, SchedulerSettings)),
        lora_modules=lora_modules(args),
        request_ttl_s=_request_ttl(args),
        batch_invariant=args.batch_invariant,
    )


def _shown(url: str) -> str:
    """A Redis URL as a log may show it: its password masked."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a Redis URL>"
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(netloc=f"{user}***@{parts.netloc.rpartition('@')[2]}").geturl()


def _request_ttl(args: argparse.Namespace, embedded: bool = False) -> int:
    """``--request-ttl``, else the default of the store: a real Redis's, or the embedded one's
    (shorter: it holds the stories in this process's memory; see EmbeddedRedis.REQUEST_TTL_S)."""
    from fd.control.bus import REQUEST_TTL_S
    from fd.control.embedded import EmbeddedRedis

    if args.request_ttl is not None:
        return args.request_ttl
    return EmbeddedRedis.REQUEST_TTL_S if embedded else REQUEST_TTL_S


def _runner(args: argparse.Namespace, model_dir: Path):
    """The executor: None for the model itself (built by fd.compose), or the timed stand-in."""
    if args.executor != "timed":
        return None
    from fd.control.tokenizer import Tokenizer
    from fd.engine.runner.timed_runner import TimedRunner

    tok = Tokenizer.from_dir(str(model_dir))
    return TimedRunner.for_tokenizer(
        tok,
        step_ms=args.step_ms,
        num_blocks=args.num_blocks or 4096,
        per_token_ms=args.step_per_token_ms,
        per_row_ms=args.step_per_row_ms,
    )


def _api_config(args: argparse.Namespace, model_dir: Path):
    from fd.api.config import ApiConfig
    from fd.api.cors import Cors
    from fd.cli.flags import field_values

    return ApiConfig(
        model_dir=str(model_dir),
        **field_values(args, ApiConfig),
        api_key=api_keys(args),
        admin_key=args.admin_key,
        max_model_len=args.max_model_len,
        cors=Cors(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        priority_scheduling=args.scheduling_policy == "priority",
        lora_modules=lora_modules(args),
        runtime_lora=args.allow_runtime_lora_updating,
        request_ttl_s=_request_ttl(args),
    )


async def _start_serving(args: argparse.Namespace):
    """What ``fd serve`` runs: (the embedded server or None, the engine, the API)."""
    from fd.api.config import ApiConfig
    from fd.api.listen import hold_port
    from fd.cli.flags import field_values

    ApiConfig(model_dir="", **field_values(args, ApiConfig)).ssl_context()  # (before the model loads)
    count = args.api_server_count
    # The port first: one in use fails the start now, not after the model has loaded.
    held = hold_port(args.host, args.port, reuse_port=count > 1)
    try:
        return await _start_serving_on(args, held)
    finally:
        held.close()  # (handed to the API, or the start failed)


async def _start_serving_on(args: argparse.Namespace, held):
    from fd.compose import join_in_process, start_api, start_engine
    from fd.control.connect import connect
    from fd.control.metrics import Metrics

    embedded = None
    if args.redis_url:
        url = args.redis_url
        factory = lambda: connect(url, args.redis_timeout)  # noqa: E731
    else:
        from fd.control.embedded import EmbeddedRedis

        embedded = EmbeddedRedis(port=args.embedded_port or 0)
        embedded.start()
        factory = embedded.client
    keys = Keys(args.prefix)
    model_dir = resolve_model(args.model)
    metrics = Metrics()
    ttl = _request_ttl(args, embedded=embedded is not None)
    engine = await start_engine(
        factory,
        keys,
        dataclasses.replace(_engine_config(args, model_dir), request_ttl_s=ttl),
        metrics=metrics,
        runner=_runner(args, model_dir),
    )
    count = args.api_server_count
    api_cfg = dataclasses.replace(_api_config(args, model_dir), request_ttl_s=ttl)
    if api_cfg.max_model_len is None:  # (the engine's: the model's context, or what its KV cache holds)
        api_cfg = dataclasses.replace(api_cfg, max_model_len=engine.max_model_len)
    if count > 1:
        api_cfg = dataclasses.replace(api_cfg, reuse_port=True)
    api = await start_api(factory, keys, api_cfg, metrics=metrics, held=held)
    join_in_process(api, engine)
    if count > 1:  # vLLM's --api-server-count: more API processes on the same port
        url = args.redis_url or f"redis://127.0.0.1:{embedded.port}"
        ctx = multiprocessing.get_context("spawn")
        ready = []
        for _ in range(count - 1):
            up = ctx.Event()
            p = ctx.Process(
                target=_api_process,
                args=(
                    dataclasses.replace(api_cfg, port=api.port),
                    url,
                    args.prefix,
                    args.log_level,
                    args.log_format,
                    up,
                    args.redis_timeout,
                ),
                name="fd-api",
                daemon=True,
            )
            p.start()
            _API_PROCESSES.append(p)
            ready.append(up)
        for up in ready:  # (serving is said once every API process listens)
            if not await asyncio.to_thread(up.wait, API_PROCESS_START_S):
                _stop_api_processes()
                raise RuntimeError(f"an API process did not start in {API_PROCESS_START_S:.0f} s")
    return embedded, engine, api


#: fd serve --api-server-count's other API processes (stopped with it)
_API_PROCESSES: list = []
API_PROCESS_START_S = 60.0


def _api_process(
    api_cfg, url: str, prefix: str, log_level: str, log_format: str, ready, redis_timeout: float | None = None
) -> None:
    """One more API process of ``fd serve`` (``--api-server-count``): an API node on the same
    port (SO_REUSEPORT: the kernel spreads connections), against the same control plane — the
    embedded server's TCP door, or ``--redis-url``. It goes when its parent goes."""
    from fd.compose import start_api
    from fd.control.connect import connect
    from fd.control.logs import setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the parent's Ctrl-C; the parent stops it)
    setup_logging(log_level, log_format)
    parent = os.getppid()

    async def run() -> None:
        api = await start_api(lambda: connect(url, redis_timeout), Keys(prefix), api_cfg)
        ready.set()
        try:
            while os.getppid() == parent:
                await asyncio.sleep(0.5)
        finally:
            await api.stop()

    asyncio.run(run())


def _stop_api_processes() -> None:
    for p in _API_PROCESSES:
        p.terminate()
    for p in _API_PROCESSES:
        p.join(5)
    _API_PROCESSES.clear()


async def cmd_run_batch(args: argparse.Namespace) -> int:
    """vLLM's ``run-batch``: a file of OpenAI batch requests through an fd server (fd.tools.batch)."""
    from fd.tools.batch import run_batch

    src = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")  # noqa: SIM115 (closed by the with)
    with src:
        lines = src.readlines()
    started = None
    base = args.base_url
    if base is None:
        started = await _start_serving(args)
        base = started[2].url
    base = base.rstrip("/").removesuffix("/v1")
    try:
        dst = sys.stdout.buffer if args.output_file == "-" else open(args.output_file, "wb")  # noqa: SIM115 (closed by the with)
        with dst:
            ok, failed = await run_batch(
                base,
                lines,
                dst,
                concurrency=args.max_concurrency,
                api_key=next(iter(api_keys(args)), None),
                progress=args.output_file != "-",
            )
    finally:
        if started is not None:
            embedded, engine, api = started
            await api.stop()
            await engine.stop()
            if embedded is not None:
                embedded.stop()
    print(f"fd run-batch: {ok} succeeded, {failed} failed", file=sys.stderr)
    return 0


async def cmd_serve(args: argparse.Namespace) -> int:
    embedded, engine, api = await _start_serving(args)
    _tune_gc()
    say(
        f"fd serving {api.cfg.model_name} on {api.url}/v1",
        event="serving",
        model=api.cfg.model_name,
        url=f"{api.url}/v1",
        max_model_len=api.cfg.max_model_len,
    )
    local = None
    if embedded is not None:
        url = f"redis://127.0.0.1:{embedded.port}"
        say(
            f"embedded control plane: redis-cli -p {embedded.port}   (key prefix {args.prefix}:)",
            event="control_plane",
            redis_url=url,
            prefix=args.prefix,
        )
        say(f"FD_REDIS_URL={url}   (fd status, fd trace and fd abort on this machine find it)")
        local = LocalServe(args.prefix)
        local.write(url, api.url)
    else:
        shown = _shown(args.redis_url)
        say(f"control plane: {shown}", event="control_plane", redis_url=shown)
    try:
        await _wait_for_signal(engine.task)
    finally:
        if local is not None:
            local.remove()
    failed = engine.task.done() and not engine.task.cancelled() and engine.task.exception() is not None
    # With its one engine gone, nothing will finish the requests still streaming: close them
    # after a moment instead of aiohttp's minute of waiting, and say so in the exit code.
    _stop_api_processes()
    await api.stop(grace_s=ENGINE_FAILED_GRACE_S if failed else None)
    await engine.stop()
    if embedded is not None:
        embedded.stop()
    return 1 if failed else 0


#: After `fd serve`'s engine failed (its model worker died, say): how long requests still
#: streaming may go on before the API closes their connections.
ENGINE_FAILED_GRACE_S = 1.0

#: Full (gen-2) garbage collections run on this timer instead of whenever the heap has grown
#: by a quarter (Python's rule). A full collection walks every live container — with the
#: embedded server, every stored stream entry — and took ~20 ms under 32 streams; an abort or a
#: first token waiting behind one is a latency tail. In `bench/abort.py` without automatic full
#: collections, release p99 went 15.8 -> 10.4 ms at 8 streams and 55.7 -> 33.3 ms at 128.
FULL_GC_EVERY_S = 60.0

_gc_task: asyncio.Task | None = None


def _tune_gc() -> None:
    """After start-up: what it allocated (modules, tokenizer, servers, pools) lives as long as
    the process, so take it out of the collector's sight (``gc.freeze``); then leave young
    generations to Python and run full collections every ``FULL_GC_EVERY_S`` (cyclic garbage
    that reached the old generation waits that long at most)."""
    global _gc_task
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)  # the count that would trigger a full collection

    async def full_collections() -> None:
        period = FULL_GC_EVERY_S
        while True:
            await asyncio.sleep(period)
            t = time.perf_counter()
            gc.collect()
            # A heap that takes long to walk (the embedded server's stored streams: ~0.2 s per
            # million entries) is walked less often: at most 0.1% of the time goes to it.
            period = max(FULL_GC_EVERY_S, 1000 * (time.perf_counter() - t))

    _gc_task = asyncio.get_running_loop().create_task(full_collections(), name="full-gc")


async def _wait_for_signal(*tasks: asyncio.Task) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:
            pass
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.error("task failed", exc_info=t.exception())
    waiter.cancel()


async def cmd_api(args: argparse.Namespace) -> int:
    from fd.compose import start_api
    from fd.control.connect import connect

    url = need_url(args)
    model_dir = resolve_model(args.model)
    api = await start_api(
        lambda: connect(url, args.redis_timeout), Keys(args.prefix), _api_config(args, model_dir)
    )
    _tune_gc()
    say(f"fd api on {api.url}/v1 (control plane {_shown(url)})", event="serving", url=f"{api.url}/v1")
    await _wait_for_signal()
    await api.stop()
    return 0


async def cmd_engine(args: argparse.Namespace) -> int:
    from fd.compose import start_engine
    from fd.control.connect import connect

    url = need_url(args)
    model_dir = resolve_model(args.model)
    cfg = _engine_config(args, model_dir)
    engine = await start_engine(
        lambda: connect(url, args.redis_timeout), Keys(args.prefix), cfg, runner=_runner(args, model_dir)
    )
    _tune_gc()
    say(
        f"fd engine {engine.id} serving {model_dir} (control plane {_shown(url)})",
        event="serving",
        engine=engine.id,
        max_model_len=engine.max_model_len,
    )
    # SIGTERM/SIGINT: drain (finish or hand back what runs, then exit 0); a second one: stop
    # now (peers take over what was running).
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            say(f"fd engine {engine.id}: draining (signal again to stop now)", event="draining")
            engine.node.drain()
        else:
            engine.node.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except NotImplementedError:
            pass
    await asyncio.gather(engine.task, return_exceptions=True)
    failed = engine.task.exception() if not engine.task.cancelled() else None
    if failed is not None:
        log.error("engine failed", exc_info=failed)
    await engine.stop()
    return 1 if failed is not None else 0
