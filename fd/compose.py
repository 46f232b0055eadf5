"""Wiring of API nodes and engine nodes in one process, for ``fd serve`` and the tests.

This is the composition root: the only module besides the CLI that imports both ``fd.api``
and ``engine``. Each part gets its own Redis connections, exactly as separate processes would.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import secrets
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fd.api.cors import Cors
from fd.api.listen import HeldPort
from fd.api.reasoning import PARSERS as REASONING_PARSERS
from fd.api.tool_calls import PARSERS as TOOL_PARSERS
from fd.control.bus import REQUEST_TTL_S, Bus
from fd.control.keys import Keys
from fd.control.metrics import Metrics
from fd.control.mux import StreamMux
from fd.engine.node.node_config import EngineConfig, engine_context

log = logging.getLogger("fd.api")


def endpoint_list(text: str) -> tuple[str, ...]:
    """vLLM's ``--disable-access-log-for-endpoints``: paths, comma-separated."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def timeout_s(text: str) -> float:
    """A timeout flag's seconds (fractions too); 0 turns it off."""
    try:
        s = float(text)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return s


@dataclass
class ApiOptions:
    """An API node's options (the fields with a flag in their metadata are ``fd serve`` and
    ``fd api`` flags: fd.cli.flags)."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    # the name(s) requests use (vLLM's --served-model-name: the first is the one answers
    # give); None: the model dir's name
    served_model_name: str | list[str] | None = field(
        default=None,
        metadata={
            "flag": "--served-model-name",
            "nargs": "+",
            "help": "the model name(s) requests use (default: the model dir's name); "
            "answers give the first, as vLLM's",
        },
    )
    api_key: str | list[str] | None = None  # one key, or several (each a tenant: fd.api.tenancy)
    admin_key: str | None = None
    tool_parser: str | None = field(  # see fd.api.tool_calls
        default=None,
        metadata={
            "flag": "--tool-call-parser",
            "choices": TOOL_PARSERS,
            "help": "how the model writes a tool call: hermes = <tool_call>{json}</tool_call> "
            "(Qwen 2.5/3, Hermes); llama3_json = an answer that is {json}; {json} "
            "(Llama 3.1-3.3)",
        },
    )
    reasoning_parser: str | None = field(  # see fd.api.reasoning
        default=None,
        metadata={
            "flag": "--reasoning-parser",
            "choices": REASONING_PARSERS,
            "help": "show a reasoning model's <think>...</think> as reasoning_content in "
            "chat responses: deepseek_r1 (R1, QwQ, Qwen3 2507 thinking: the output "
            "thinks until </think>) or qwen3 (Qwen3 hybrid: only an output that "
            "begins with <think>)",
        },
    )
    max_model_len: int | None = None  # prompt + output; None: the model's own
    # vLLM's --chat-template: a Jinja file, or the template itself; None: the model's own
    chat_template: str | None = field(
        default=None,
        metadata={
            "flag": "--chat-template",
            "help": "a Jinja chat template file, or the template itself, instead of the model's (as vLLM's)",
        },
    )
    # vLLM's --generation-config: "auto" (the model dir's generation_config.json), "vllm"
    # (none: fd's own defaults), or another dir holding one
    generation_config: str = field(
        default="auto",
        metadata={
            "flag": "--generation-config",
            "help": "auto: a request that leaves out temperature, top_p, top_k, min_p or "
            "repetition_penalty gets the model's generation_config.json value, and "
            "its max_new_tokens caps every output (vLLM's default); vllm: fd's own "
            "defaults; or a dir with another generation_config.json",
        },
    )
    cors: Cors | None = field(default_factory=Cors)  # vLLM's --allowed-origins etc. (fd.api.cors)
    force_include_usage: bool = field(  # vLLM's
        default=False,
        metadata={
            "flag": "--enable-force-include-usage",
            "action": "store_true",
            "help": "every stream ends with its usage chunk, asked for or not",
        },
    )
    tokens_as_ids: bool = field(  # vLLM's
        default=False,
        metadata={
            "flag": "--return-tokens-as-token-ids",
            "action": "store_true",
            "help": 'log-probabilities name their tokens "token_id:<id>" unless a request says otherwise',
        },
    )
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may carry a priority
    lora_modules: dict[str, str] = field(default_factory=dict)  # the adapters' names (and where)
    runtime_lora: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    reuse_port: bool = False  # several API processes on one port (fd serve --api-server-count)
    # a client that opens a connection, or starts a request on a kept-alive one, and does not
    # finish the request's head in time is cut off (slowloris: fd.api.server.ApiProtocol)
    header_timeout_s: float = field(
        default=20.0,
        metadata={
            "flag": "--header-timeout",
            "type": timeout_s,
            "metavar": "S",
            "help": "seconds a client has to send a request's head (line and headers), from "
            "its connection's start or the head's first byte; else the connection is "
            "closed (default %(default)s; 0: no limit)",
        },
    )
    request_ttl_s: int = REQUEST_TTL_S  # a story (from its accept) and conversation are kept this long
    # an access line per HTTP request (fd.api.server's, uvicorn's in vLLM): on by default
    disable_uvicorn_access_log: bool = field(
        default=False,
        metadata={
            "flag": "--disable-uvicorn-access-log",
            "action": "store_true",
            "help": "no access line per HTTP request (vLLM's name for it)",
        },
    )
    disable_access_log_for_endpoints: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--disable-access-log-for-endpoints",
            "type": endpoint_list,
            "metavar": "PATHS",
            "help": "paths whose requests get no access line, comma-separated (vLLM's; "
            "e.g. /health,/metrics)",
        },
    )
    log_requests: bool = field(
        default=False,
        metadata={
            "flag": "--enable-log-requests",
            "action": "store_true",
            "help": "a log line for each generating request with its prompt and sampling "
            "parameters (vLLM's; off: prompts are the users' data)",
        },
    )
    max_log_len: int | None = field(
        default=None,
        metadata={
            "flag": "--max-log-len",
            "metavar": "N",
            "help": "at most N characters and token ids of a prompt in --enable-log-requests' "
            "lines (vLLM's; default: all)",
        },
    )
    # HTTPS as vLLM serves it (its uvicorn's settings): a key and a certificate chain, and for
    # client certificates the CAs and whether one is required
    ssl_keyfile: str | None = field(
        default=None, metadata={"flag": "--ssl-keyfile", "metavar": "FILE", "help": "HTTPS: the key"}
    )
    ssl_certfile: str | None = field(
        default=None,
        metadata={"flag": "--ssl-certfile", "metavar": "FILE", "help": "HTTPS: the certificate chain"},
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata={
            "flag": "--ssl-ca-certs",
            "metavar": "FILE",
            "help": "HTTPS: the CAs of client certificates",
        },
    )
    ssl_cert_reqs: int = field(
        default=0,
        metadata={
            "flag": "--ssl-cert-reqs",
            "choices": (0, 1, 2),
            "help": "HTTPS: client certificates 0 not asked for, 1 checked if given, 2 required "
            "(Python's ssl.CERT_*, as vLLM's)",
        },
    )
    ssl_ciphers: str | None = field(
        default=None, metadata={"flag": "--ssl-ciphers", "help": "HTTPS: the ciphers (OpenSSL's list)"}
    )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTPS context of the ``ssl_*`` settings (None: plain HTTP). Raises ValueError,
        naming the flag, for one that does not go with the others or a file that cannot be read."""
        if self.ssl_certfile is None:
            if self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs:
                raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs:
                ctx.load_verify_locations(self.ssl_ca_certs)
            if self.ssl_ciphers:
                ctx.set_ciphers(self.ssl_ciphers)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-ciphers: {e}") from None
        ctx.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return ctx


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
    cfg: Any
    tls: bool = False

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


def make_runner(cfg: EngineConfig, progress: bool = True):
    kw = dict(
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
    """API and engine in one process (``fd serve``): the engine hears the API's aborts as
    they are published, a few event-loop turns before its control read brings them (which it
    still does: the stream is the record, and the second delivery is a no-op), ..."""
    api.bus.local_control.append(engine.node.on_local_control)
    # ... and of the requests it submits, so it claims when there is something to claim
    # instead of asking P:requests every step.
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
    opts: ApiOptions,
    *,
    metrics: Metrics | None = None,
    tokenizer: Any = None,
    held: HeldPort | None = None,
) -> RunningApi:
    """``held``: the port, bound already (:func:`fd.api.listen.hold_port`); else ``opts.host``:``opts.port``
    is bound here."""
    from aiohttp import web

    from fd.api import parse_errors
    from fd.api.sampling import generation_defaults
    from fd.api.server import ApiConfig, ApiSite, make_app
    from fd.control.tokenizer import Tokenizer, served_context

    if opts.reasoning_parser is not None and opts.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {opts.reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}"
        )
    tls = opts.ssl_context()
    tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(opts.model_dir)
    if opts.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(read_chat_template(opts.chat_template))
    defaults, cap, ignored = generation_defaults(
        read_generation_config(opts.generation_config, opts.model_dir)
    )
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
    names = opts.served_model_name or [Path(opts.model_dir).name]
    if isinstance(names, str):
        names = [names]
    name, aliases = names[0], tuple(n for n in names[1:] if n != names[0])
    cfg = ApiConfig(
        model_name=name,
        model_aliases=aliases,
        max_model_len=served_context(opts.max_model_len, tokenizer.max_model_len),
        api_key=opts.api_key,
        admin_key=opts.admin_key,
        tool_parser=opts.tool_parser,
        sampling_defaults=defaults,
        max_output_tokens=cap,
        reasoning_parser=opts.reasoning_parser,
        cors=opts.cors,
        force_include_usage=opts.force_include_usage,
        tokens_as_ids=opts.tokens_as_ids,
        priority_scheduling=opts.priority_scheduling,
        lora_modules=dict(opts.lora_modules),
        runtime_lora=opts.runtime_lora,
        log_requests=opts.log_requests,
        max_log_len=opts.max_log_len,
    )
    metrics = metrics if metrics is not None else Metrics()
    mux = StreamMux(redis_factory(), keys, cfg.api_id)
    await mux.start()
    bus = Bus(redis_factory(), keys, req_ttl_s=opts.request_ttl_s)
    bus.on_dead_letter = mux.on_dead_letter = metrics.dead_letters_total.inc
    app = make_app(
        cfg,
        bus,
        mux,
        tokenizer,
        metrics,
        access=not opts.disable_uvicorn_access_log,
        access_skip=opts.disable_access_log_for_endpoints or (),
    )
    parse_errors.install()  # (a client's malformed request: one log line, not a traceback)
    # handler_cancellation: a client that goes away cancels its handler, which is how
    # fd.api.cancellation notices a disconnect before anything is written.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    # (the site makes each connection's protocol, so the protocol's settings go to it)
    site = ApiSite(
        runner,
        opts.host,
        opts.port,
        reuse_port=opts.reuse_port,
        sock=held.take() if held is not None else None,
        ssl_context=tls,
        header_timeout_s=opts.header_timeout_s,
        access_log=None,
    )
    await site.start()
    port = runner.addresses[0][1]
    return RunningApi(runner, mux, bus, opts.host, port, cfg, tls=tls is not None)
