"""Wiring of API nodes and engine nodes in one process, for ``fd serve`` and the tests.

This is the composition root: the only module besides the CLI that imports both ``fd.api``
and ``engine``. Each part gets its own Redis connections, exactly as separate processes would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fd.api.config import ApiConfig
from fd.api.listen import HeldPort
from fd.api.placement import Placement
from fd.api.reasoning import PARSERS as REASONING_PARSERS
from fd.control.bus import Bus
from fd.control.keys import Keys
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from fd.engine.node.node_config import EngineConfig, engine_context

log = logging.getLogger("fd.api")


@dataclass
class RunningEngine:
    node: Any
    task: asyncio.Task
    metrics: Metrics | None
    owns_runner: bool = False  # made here (not handed in by the caller), so closed here

    @property
    def id(self) -> str:
        return self.node.id

    @property
    def max_model_len(self) -> int:
        """The context it serves (:func:`fd.engine.node.node_config.engine_context`): what an API in its process holds
        requests to."""
        return self.node.sched.config.max_model_len

    async def stop(self) -> None:
        self.node.stop()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.node.bus.redis.aclose()
        await self.node.control_bus.redis.aclose()
        if self.owns_runner:
            self.node.runner.close()  # (a model worker process, for one that runs in its own)


@dataclass
class RunningApi:
    runner: Any  # aiohttp AppRunner
    mux: StreamMux
    bus: Bus
    host: str
    port: int
    cfg: ApiConfig  # as start_api filled it in
    tls: bool = False
    placement: Placement | None = None  # its reads of the engines' cards run while it serves

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving; requests still streaming get ``grace_s`` seconds (default aiohttp's
        60) to finish before their connections are closed."""
        runner = self.runner
        if grace_s is not None and runner.server is not None:
            # cleanup() waits its runner's shutdown_timeout; this waits grace_s first, after
            # which no connection is left for cleanup() to wait on.
            for site in list(runner.sites):
                await site.stop()
            await runner.server.shutdown(grace_s)
        await runner.cleanup()
        if self.placement is not None:
            await self.placement.close()
        await self.mux.stop()
        await self.bus.redis.aclose()
        await self.mux.redis.aclose()


def _no_retries(client):
    """The engine retries Redis calls itself, and must: a client that silently re-sends a
    pipeline after a lost reply would repeat tokens on a stream (see fd.engine.node.outbox)."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    try:
        client.set_retry(Retry(NoBackoff(), 0))
    except AttributeError:  # a client without redis-py's retry machinery: nothing to turn off
        pass
    return client


def weight_format(cfg: EngineConfig) -> str:
    """The weight format ``cfg``'s --quantization and --dtype come to for its model (its note,
    if any, logged)."""
    from fd.engine.model.config import ModelConfig
    from fd.engine.model.formats import choose_format

    fmt, note = choose_format(cfg.quantization, cfg.dtype, ModelConfig.from_dir(cfg.model_dir).gguf_types)
    if note:
        logging.getLogger("fd.engine").info("weights: %s", note)
    return fmt


def make_runner(cfg: EngineConfig, progress: bool = True):
    kw = dict(
        weight_format=weight_format(cfg),
        device=cfg.device,
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        kv_cache_bytes=cfg.kv_cache_mb << 20,
        progress=progress,
        seed=cfg.seed,
        lora_modules=dict(cfg.lora_modules) or None,
        max_lora_rank=cfg.max_lora_rank,
        batch_invariant=cfg.batch_invariant,
    )
    if cfg.executor == "paddle":
        from fd.engine.runner import affinity
        from fd.engine.runner.worker import ProcessRunner

        cpus = affinity.plan(cfg.worker_cpus)
        runner = ProcessRunner(
            cfg.model_dir,
            cpus=cpus.worker if cpus else None,
            nice=cpus.worker_nice if cpus else 0,
            alone=cpus.alone if cpus else None,
            **kw,
        )
        if cpus is not None:
            affinity.apply_rest(cpus.settled(runner.cpus))
    elif cfg.executor == "paddle-thread":
        from fd.engine.runner.model_runner import ModelRunner

        runner = ModelRunner(cfg.model_dir, **kw)
    else:
        raise ValueError(f"unknown executor {cfg.executor!r}")
    runner.warmup()  # before any request is admitted: warm-up writes scratch KV
    return runner


async def start_engine(
    redis_factory: Callable[[], Any],
    keys: Keys,
    cfg: EngineConfig,
    *,
    metrics: Metrics | None = None,
    runner: Any = None,
    tokenizer: Any = None,
) -> RunningEngine:
    """An engine node of ``cfg``, running. ``runner``: the model's runner, if the caller has
    one (else :func:`make_runner`'s, closed with the node)."""
    from fd.control.tokenizer import Tokenizer, served_context
    from fd.engine.node.node import EngineNode

    owns_runner = runner is None
    asked = cfg.scheduler.max_model_len
    if owns_runner and asked is not None:  # (a bad value: said before the model loads)
        served_context(asked, Tokenizer.from_dir(cfg.model_dir).max_model_len)
    runner = runner if runner is not None else make_runner(cfg)
    tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(cfg.model_dir)
    if metrics is not None:
        metrics.engine_in_process = True  # the engine sets its gauges itself, every step
    try:
        if asked is not None:  # (out of the model's range: said as ever)
            served_context(asked, runner.max_model_len)
        context = engine_context(
            asked,
            runner.max_model_len,
            runner.num_blocks * cfg.block_size,
            "--num-blocks" if cfg.num_blocks is not None else "--kv-cache-mb",
        )
    except BaseException:
        if owns_runner:
            runner.close()  # a model worker must not outlive a failed start
        raise
    cfg = dataclasses.replace(
        cfg,
        engine_id=cfg.engine_id or f"{socket.gethostname()[:24]}-{secrets.token_hex(3)}",
        scheduler=dataclasses.replace(cfg.scheduler, max_model_len=context),
    )
    node = EngineNode(
        Bus(
            _no_retries(redis_factory()),
            keys,
            journal_maxlen=cfg.journal_maxlen,
            req_ttl_s=cfg.request_ttl_s,
        ),
        Bus(_no_retries(redis_factory()), keys, req_ttl_s=cfg.request_ttl_s),
        runner,
        tokenizer,
        cfg,
        metrics=metrics,
        # (an interval of 0 or less: off, as --disable-log-stats)
        stats_interval_s=0.0 if cfg.disable_log_stats else max(0.0, cfg.log_stats_interval_s or 0.0),
    )
    if metrics is not None:
        node.bus.on_dead_letter = node.control_bus.on_dead_letter = metrics.dead_letters_total.inc
    try:
        await node.prepare()
    except BaseException:
        if owns_runner:
            runner.close()  # a model worker must not outlive a failed start
        raise
    task = asyncio.create_task(node.run(), name=f"engine-{cfg.engine_id}")
    return RunningEngine(node, task, metrics, owns_runner=owns_runner)


def join_in_process(api: RunningApi, engine: RunningEngine) -> None:
    """API and engine in one process (``fd serve``): the one in-process shortcut, wired here
    alone. The engine is told when the API has put requests on ``P:requests``, so it claims
    when there is something to claim instead of asking ``P:requests`` every step: a wake-up,
    not a delivery (the requests still come through its claim, and aborts only through its
    read of ``P:control``). And on the embedded server the API takes the events the engine
    appends to request streams as the store tells them, instead of reading them back
    (StreamMux.hear_in_process). Each event reaches each reader once."""
    api.mux.hear_in_process()
    api.bus.local_requests.append(engine.node.on_local_arrival)
    engine.node.hears_local_arrivals()


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or, as vLLM takes it, the template itself when it is
    not a file and looks like one (it has braces or a line break); else the file is missing."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise FileNotFoundError(
        f"--chat-template {value!r}: no such file (and not a template: it has no {{{{ }}}} or {{% %}})"
    )


def read_generation_config(value: str, model_dir: str) -> dict[str, Any]:
    """``--generation-config``: the JSON of ``generation_config.json`` in the model dir
    ("auto", vLLM's default), in another dir, or nothing ("vllm")."""
    if value == "vllm":
        return {}
    folder = Path(model_dir if value == "auto" else value).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if value == "auto":
            return {}  # (a model without one: fd's own defaults)
        raise FileNotFoundError(f"--generation-config {value!r}: no generation_config.json there")
    with open(path, encoding="utf-8") as f:
        try:
            gen = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: not a JSON object")
    return gen


async def start_api(
    redis_factory: Callable[[], Any],
    keys: Keys,
    cfg: ApiConfig,
    *,
    metrics: Metrics | None = None,
    tokenizer: Any = None,
    held: HeldPort | None = None,
) -> RunningApi:
    """An API node of ``cfg``, serving; its config there (``RunningApi.cfg``) has what ``cfg``
    left to the model dir filled in: its id, the context, the sampling defaults and output cap
    of ``--generation-config`` (the ones ``cfg`` gives win). ``held``: the port, bound already
    (:func:`fd.api.listen.hold_port`); else ``cfg.host``:``cfg.port`` is bound here."""
    from aiohttp import web

    from fd.api import parse_errors
    from fd.api.config import new_api_id
    from fd.api.sampling import generation_defaults
    from fd.api.server import ApiSite, make_app
    from fd.control.tokenizer import Tokenizer, served_context

    if cfg.reasoning_parser is not None and cfg.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {cfg.reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}"
        )
    tls = cfg.ssl_context()
    tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(cfg.model_dir)
    if cfg.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(read_chat_template(cfg.chat_template))
    defaults, cap, ignored = generation_defaults(read_generation_config(cfg.generation_config, cfg.model_dir))
    for why in ignored:
        log.warning("generation_config.json: %s: left out", why)
    if defaults or cap is not None:
        # (as vLLM says it: a request without these gets the model maker's, not fd's)
        log.warning(
            "default sampling parameters from the model's generation_config.json: %s%s "
            "(--generation-config vllm to use fd's own)",
            defaults,
            f", output capped at {cap} tokens" if cap is not None else "",
        )
    cfg = dataclasses.replace(
        cfg,
        api_id=cfg.api_id or new_api_id(),
        max_model_len=served_context(cfg.max_model_len, tokenizer.max_model_len),
        sampling_defaults={**defaults, **cfg.sampling_defaults},
        max_output_tokens=cap if cfg.max_output_tokens is None else cfg.max_output_tokens,
        lora_modules=dict(cfg.lora_modules),
    )
    metrics = metrics if metrics is not None else Metrics()
    mux = StreamMux(redis_factory(), keys, cfg.api_id)
    await mux.start()
    bus = Bus(redis_factory(), keys, req_ttl_s=cfg.request_ttl_s)
    bus.on_dead_letter = mux.on_dead_letter = metrics.dead_letters_total.inc
    placement: Placement | None = None
    if cfg.placement == "prefix":
        placement = Placement(bus, on_choice=metrics.note_placement)
        bus.placer = placement
        placement.task = asyncio.get_running_loop().create_task(placement.run(), name="placement")
    app = make_app(
        cfg,
        bus,
        mux,
        tokenizer,
        metrics,
        access=not cfg.disable_uvicorn_access_log,
        access_skip=cfg.disable_access_log_for_endpoints or (),
    )
    parse_errors.install()  # (a client's malformed request: one log line, not a traceback)
    # handler_cancellation: a client that goes away cancels its handler, which is how
    # fd.api.cancellation notices a disconnect before anything is written.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    # (the site makes each connection's protocol, so the protocol's settings go to it)
    site = ApiSite(
        runner,
        cfg.host,
        cfg.port,
        reuse_port=cfg.reuse_port,
        sock=held.take() if held is not None else None,
        ssl_context=tls,
        header_timeout_s=cfg.header_timeout_s,
        access_log=None,
    )
    await site.start()
    port = runner.addresses[0][1]
    return RunningApi(runner, mux, bus, cfg.host, port, cfg, tls=tls is not None, placement=placement)
