"""The ``fd`` command line: its parser and the dispatch to each command. It is the one
composition root that wires the API, the engine and the control plane together (with the
fd/cli_*.py modules it dispatches to); everything else imports ``control`` only. The commands
import ``fd.api`` and ``engine`` lazily, so ``fd abort`` does not load PaddlePaddle."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from fd.cli.args import (
    add_chat_args,
    add_engine_args,
    add_http_args,
    add_log_args,
    add_lora_args,
    add_max_model_len,
    add_redis_args,
    add_response_args,
    add_scheduling_policy,
    add_served_name,
    add_tool_args,
    add_ttl_args,
    add_vllm_compat_args,
    vllm_compat,
)
from fd.cli.flags import HelpFormatter, add_field_flags
from fd.cli.models import cmd_convert, cmd_make_tiny
from fd.cli.operator import cmd_abort, cmd_status, cmd_trace
from fd.cli.serving import cmd_api, cmd_engine, cmd_run_batch, cmd_serve
from fd.cli.vllm_flags import CommandFlags

_USER_ERRORS: tuple[type[BaseException], ...] = ()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fd",
        description="fd: an OpenAI-compatible LLM server whose control plane is an event log on Redis Streams.",
    )
    p.add_argument("--version", action="version", version=f"fd {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    # What a command without the flag reads (its subparser's own default wins where it has it):
    # every attribute the code reads is there, so nothing asks the namespace what it holds.
    p.set_defaults(
        log_level="warning",
        log_format="text",
        json=False,
        api_server_count=1,
        model_tag=None,
        field_flags={},
        vllm_flags=CommandFlags(),
        gpu_memory_utilization=None,
        tokenizer=None,
    )

    # (the usage line alone: with vLLM's flags, argparse's own would fill a screen before an error)
    s = sub.add_parser(
        "serve",
        help="API + engine + embedded control plane in one process",
        usage="%(prog)s [MODEL] [options]",
        formatter_class=HelpFormatter,
    )
    add_redis_args(s)
    add_engine_args(s, worker_cpus="auto")  # (one engine by construction: no CPU to share)
    add_lora_args(s)
    add_log_args(s)
    _add_listen_args(s, port=8000)
    s.add_argument("--embedded-port", type=int, default=0, help="port of the embedded Redis (0: free)")
    add_served_name(s)
    add_chat_args(s)
    add_response_args(s)
    add_http_args(s)
    add_tool_args(s)
    s.add_argument(
        "--api-server-count",
        "-asc",
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
    add_vllm_compat_args(s)  # (last: it adds the vLLM flags the ones above do not declare)

    rb = sub.add_parser(
        "run-batch",
        help="a file of OpenAI batch requests (JSONL) through fd (vLLM's run-batch)",
        usage="%(prog)s -i FILE -o FILE [options]",
        formatter_class=HelpFormatter,
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
    add_redis_args(rb)
    add_engine_args(rb, worker_cpus="auto")
    add_lora_args(rb)
    add_log_args(rb)
    _add_listen_args(rb, port=0)
    rb.add_argument("--embedded-port", type=int, default=0, help="port of the embedded Redis (0: free)")
    add_served_name(rb)
    add_chat_args(rb)
    add_response_args(rb)
    add_http_args(rb)
    add_tool_args(rb)
    add_vllm_compat_args(rb)

    a = sub.add_parser("api", help="an API node against --redis-url", formatter_class=HelpFormatter)
    add_redis_args(a)
    add_log_args(a)
    a.add_argument(
        "--model", default=None, help="the engines' model, as they are given it (for its tokenizer and name)"
    )
    _add_listen_args(a, port=8000)
    add_served_name(a)
    add_max_model_len(a)
    add_ttl_args(a, tombstone=False)
    add_scheduling_policy(a)
    add_lora_args(a, engine=False)
    add_chat_args(a)
    add_response_args(a)
    add_http_args(a)
    add_tool_args(a)

    e = sub.add_parser(
        "engine",
        help="an engine node against --redis-url",
        usage="%(prog)s [MODEL] [options]",
        formatter_class=HelpFormatter,
    )
    add_redis_args(e)
    add_engine_args(e)
    add_lora_args(e, api=False)
    add_log_args(e)
    add_vllm_compat_args(e)

    ab = sub.add_parser("abort", help="abort requests by id, or --all")
    add_redis_args(ab)
    ab.add_argument("ids", nargs="*")
    ab.add_argument("--all", action="store_true")
    ab.add_argument("--engine", default=None, help="with --all: only this engine")
    ab.add_argument("--json", action="store_true")

    st = sub.add_parser("status", help="engines, blocks, stream lengths, dead letters")
    add_redis_args(st)
    st.add_argument("--json", action="store_true")
    st.add_argument(
        "--watch", action="store_true", help="then follow the lifecycle stream (P:lifecycle) until Ctrl-C"
    )

    tr = sub.add_parser(
        "trace", help="a request's events as a timeline (a response of n choices: each choice's too)"
    )
    add_redis_args(tr)
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


def _add_listen_args(p: argparse.ArgumentParser, port: int) -> None:
    from fd.api.config import ApiConfig

    add_field_flags(p, ApiConfig, "host", "port", port=port)


def _user_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError

    from fd.engine.runner.worker import WorkerError

    return (WorkerError, RedisConnectionError, ResponseError, FileNotFoundError, ValueError, OSError)


def _loop_factory():
    """uvloop's loop where it is installed (as uvicorn and vLLM's API server take it), else
    asyncio's own: fd uses only the public loop API (``add_reader`` for the model worker's
    pipe), so either runs every command."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("fd")
    except importlib.metadata.PackageNotFoundError:  # (run from a tree that is not installed)
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    from fd.engine.runner.process import tune

    tune()  # (a command that loads the model: before Paddle does)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # (`fd` alone: what it can do, not an error)
        build_parser().print_help()
        return 0
    # replay and export parse their own flags (fd.engine.journal.replay owns them)
    if argv[:1] == ["replay"]:
        from fd.engine.journal.replay import main as replay_main

        return replay_main(argv[1:])
    if argv[:1] == ["bench"]:
        from fd.tools.loadgen.main import main as bench_main

        return bench_main(argv[1:])
    if argv[:2] == ["events", "export"]:
        from fd.engine.journal.replay import export_main

        return export_main(argv[2:])
    if argv[:1] in (["serve"], ["engine"], ["run-batch"]):
        from fd.cli.vllm_flags import expand_argv

        argv = expand_argv(argv)  # (vLLM's --config FILE, --flag_name and -O3)
    args = build_parser().parse_args(argv)
    compat_notes = vllm_compat(args) if args.cmd in ("serve", "engine", "run-batch") else []
    if args.cmd in ("serve", "engine", "run-batch"):
        # The model step runs in a worker thread beside the event loop. Its many short paddle
        # ops each re-take the GIL; at Python's default 5 ms switch interval the loop's I/O keeps
        # the step waiting. 0.5 ms: +12-15% tokens/s at 32 streams in `fd serve` (one run).
        sys.setswitchinterval(0.0005)
        from fd.engine.runner.affinity import plan

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
    from fd.control.logs import setup_logging

    setup_logging(
        args.log_level,
        args.log_format,
    )
    if compat_notes:
        logging.getLogger("fd").info("vLLM flags taken and ignored: %s", "; ".join(compat_notes))
    if args.cmd == "make-tiny-model":
        return cmd_make_tiny(args)
    global _USER_ERRORS
    _USER_ERRORS = _user_errors()
    fn = {
        "serve": cmd_serve,
        "api": cmd_api,
        "engine": cmd_engine,
        "abort": cmd_abort,
        "status": cmd_status,
        "trace": cmd_trace,
        "run-batch": cmd_run_batch,
        "convert": cmd_convert,
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
