"""Every ``vllm serve`` flag of vLLM 0.32 (tests/data/vllm_serve_flags_0.32.json, written by
bench/vllm_flags_dump.py from vLLM's own parser) is taken by ``fd serve``: applied, ignored
with a note at start, or refused with a one-line message naming it; ``vllm serve`` lines from
vLLM's docs and its Helm chart run here; ``--help`` gives every flag a help and a default."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import aiohttp
import pytest

from fd.cli import vllm_flags
from fd.cli.args import vllm_compat
from fd.cli.flags import HelpFormatter
from fd.cli.main import build_parser, main
from tests.kit.redis import free_port

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "vllm_serve_flags_0.32.json").read_text())
FLAGS = [f for f in DATA["flags"] if f["kind"] != "positional"]

#: a value of each kind of flag, as a command line gives it (a flag's first choice if it has any)
TYPICAL = {
    "int": "1",
    "float": "0.5",
    "human_readable_int": "1k",
    "human_readable_int_or_auto": "1k",
    "loads": "{}",
    "parse_dataclass": "{}",
    "union_dict_and_str": "{}",
}
#: values that name fd's own choices where vLLM's first is not one fd has
FD_VALUES = {
    "--dtype": "auto",
    "--tool-call-parser": "hermes",
    "--reasoning-parser": "deepseek_r1",
    "--allowed-origins": '["*"]',
    "--allowed-methods": '["*"]',
    "--allowed-headers": '["*"]',
    "--lora-modules": "a=/x",
    "--scheduling-policy": "fcfs",
    "--log-level": "INFO",
    "--model": "tiny",
    "--tokenizer": "tiny",
    "--max-lora-rank": "8",
    "--config": None,  # (a file: tested below)
}


def _value(f: dict) -> str:
    name = f["options"][0]
    if name in FD_VALUES:
        return FD_VALUES[name]
    if f["choices"]:
        return str(next(c for c in f["choices"] if c is not None))
    return TYPICAL.get(f["type"] or "", "x")


def _argv(f: dict) -> list[str]:
    name = f["options"][0]
    if f["kind"] in ("bool", "store_true"):
        return [name]
    argv = [name, _value(f)]
    if name in ("--lora-modules",):
        argv.append("--enable-lora")
    if name in ("--tool-call-parser",):
        argv.append("--enable-auto-tool-choice")
    return argv


def _outcome(argv: list[str]) -> tuple[str, str]:
    """What fd serve makes of a command line: ("parse", argparse's error) if it does not parse,
    ("refuse", the message), or ("take", the notes)."""
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            args = build_parser().parse_args(vllm_flags.expand_argv(["serve", *argv]))
    except SystemExit:
        return "parse", err.getvalue()
    try:
        return "take", "; ".join(vllm_compat(args))
    except SystemExit as e:
        return "refuse", str(e)


def test_the_data_is_vllms_parser():
    assert DATA["vllm_version"] == "0.32.0" and "make_arg_parser" in DATA["produced_by"]
    assert DATA["count"] == len(DATA["flags"]) > 300


def test_the_table_has_every_flag_of_vllm_once():
    names = [n for f in vllm_flags.TABLE for n in f.names]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    missing = [f["options"][0] for f in FLAGS if not all(n in vllm_flags.BY_NAME for n in f["options"])]
    assert not missing
    for f in FLAGS:  # (each written as vLLM writes it: --x/--no-x, a value, several)
        row = vllm_flags.BY_NAME[f["options"][0]]
        assert row.negation == f["negation"], f["options"]
        if f["kind"] == "value":
            assert row.kind == "value" and row.nargs == f["nargs"], f["options"]


# (--config names a file: test_a_config_file_is_read_as_vllm_reads_it)
@pytest.mark.parametrize(
    "f", [f for f in FLAGS if f["options"][0] != "--config"], ids=lambda f: f["options"][0]
)
def test_every_vllm_flag_is_taken_or_refused_never_unrecognized(f):
    outcome, text = _outcome(_argv(f))
    assert outcome != "parse", text
    row = vllm_flags.BY_NAME[f["options"][0]]
    if outcome == "refuse":
        assert "\n" not in text and f["options"][0] in text, text
        assert row.rule.kind == vllm_flags.REFUSE or row.flag in ("--tokenizer", "--gpu-memory-utilization")
    elif row.rule.kind == vllm_flags.IGNORE and not row.fd and _value(f) not in map(str, row.rule.ok):
        assert f["options"][0] in text  # named at start (a value asking for what fd does: silently)
    if f["negation"]:  # --no-x too, and never refused: it asks for nothing
        outcome, text = _outcome([f["negation"]])
        assert outcome == "take", text


def test_each_kind_of_value_parses_as_vllms():
    args = build_parser().parse_args(
        ["serve", "--swap-space", "4", "/models/m", "--kv-cache-memory-bytes", "1G"]
    )
    assert args.model_tag == "/models/m" and args.swap_space == 4.0  # (the 4 is the flag's)
    assert args.kv_cache_memory_bytes == 2**30
    assert vllm_flags.human_int("25.6k") == 25600 and vllm_flags.human_int("1K") == 1024
    args = build_parser().parse_args(["serve", "--numa-bind-nodes", "0", "1", "--no-enforce-eager", "m"])
    assert args.numa_bind_nodes == [0, 1] and args.enforce_eager is False and args.model_tag == "m"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--master-port", "not-a-port"])


def test_applied_flags_set_fds_own():
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-cache-memory-bytes",
            "512M",
            "--num-gpu-blocks-override",
            "64",
            "--shutdown-timeout",
            "5",
        ]
    )
    assert vllm_compat(args) == []
    assert (args.kv_cache_mb, args.num_blocks, args.drain_timeout) == (512, 64, 5.0)
    args = build_parser().parse_args(["serve", "m", "--tokenizer", "m", "--logprobs-mode", "raw_logprobs"])
    assert vllm_compat(args) == []


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--quantization", "awq"], "--quantization awq"),
        (["-q", "fp8"], "--quantization fp8"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
        (["-tp", "2"], "--tensor-parallel-size 2"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
        (["--uds", "/tmp/fd.sock"], "--uds"),
        (["--load-format", "dummy"], "--load-format dummy"),
        (["m", "--tokenizer", "other/tok"], "--tokenizer other/tok"),
        (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "--default-chat-template-kwargs"),
        (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode processed_logprobs"),
    ],
)
def test_refused_flags_exit_with_one_line_naming_the_flag(argv, flag):
    outcome, text = _outcome(argv)
    assert outcome == "refuse" and text.startswith(f"error: {flag}") and "\n" not in text, text


def test_a_refused_flag_exits_fd_serve_before_it_starts_anything():
    r = subprocess.run(
        [sys.executable, "-m", "fd", "serve", "--model", "tiny", "--quantization", "gptq"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: --quantization gptq is not supported: fd serves int8 weights (from any "
        "checkpoint), a .gguf's own (gguf) or float32 (none)"
    ]
    r = subprocess.run(
        [sys.executable, "-m", "fd", "serve", "--dtype", "int3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--dtype" in r.stderr and "bfloat16" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2  # (the short usage line, then the error)


#: `vllm serve` lines as published, each with where it comes from
PUBLISHED = [
    (
        # vLLM docs/deployment/k8s.md, the NVIDIA GPU Deployment's container args
        "vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code --enable-chunked-prefill "
        "--max_num_batched_tokens 1024",
        {"model": "mistralai/Mistral-7B-Instruct-v0.3", "max_num_batched_tokens": 1024},
        ["--trust-remote-code", "--enable-chunked-prefill"],
    ),
    (
        # vLLM docs/deployment/k8s.md, the AMD GPU Deployment's container args
        "vllm serve mistralai/Mistral-7B-v0.3 --port 8000 --trust-remote-code --enable-chunked-prefill "
        "--max_num_batched_tokens 1024",
        {"model": "mistralai/Mistral-7B-v0.3", "port": 8000, "max_num_batched_tokens": 1024},
        ["--trust-remote-code", "--enable-chunked-prefill"],
    ),
    (
        # vLLM docs/serving/openai_compatible_server.md
        "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123",
        {"model": "NousResearch/Meta-Llama-3-8B-Instruct", "api_key": ["token-abc123"]},
        [],
    ),
    (
        # vLLM examples/online_serving/chart-helm/values.yaml, image.command
        "vllm serve /data/ --served-model-name opt-125m --enforce-eager --dtype bfloat16 --block-size 16 "
        "--host 0.0.0.0 --port 8000",
        {
            "model": "/data/",
            "served_model_name": ["opt-125m"],
            "block_size": 16,
            "host": "0.0.0.0",
            "dtype": "bfloat16",
        },
        ["--enforce-eager"],
    ),
]


@pytest.mark.parametrize("line, want, noted", PUBLISHED, ids=lambda x: x[:40] if isinstance(x, str) else "")
def test_published_vllm_serve_lines_parse_to_fds_config(line, want, noted):
    argv = vllm_flags.expand_argv(["serve", *line.split()[2:]])
    args = build_parser().parse_args(argv)
    notes = vllm_compat(args)
    assert {k: getattr(args, k) for k in want} == want
    assert [n.split(" ")[0] for n in notes] == noted


def test_dtype_and_quantization_are_fds_own_and_come_to_a_weight_format():
    """vLLM's chart's command has --dtype bfloat16: fd takes it (bfloat16 weights where the CPU
    has AVX512-BF16); --quantization int8|gguf|none too, and each comes to a weight format
    against the checkpoint (a .gguf's own quantization unless asked otherwise)."""
    from fd.engine.model.formats import choose_format

    for argv, want in (
        (["--dtype", "bfloat16"], (None, "bfloat16")),
        (["--dtype", "float32"], (None, "float32")),
        (["-q", "int8"], ("int8", "auto")),
        (["--quantization", "gguf", "--dtype", "auto"], ("gguf", "auto")),
        ([], (None, "auto")),
    ):
        args = build_parser().parse_args(["serve", *argv])
        assert vllm_compat(args) == [] and (args.quantization, args.dtype) == want, argv
    q4 = ("Q4_1", "Q8_0")
    assert choose_format(None, "auto", ()) == ("float32", None)
    assert choose_format(None, "auto", q4) == ("int4", None)  # (the Q8_0 head: int8, exactly)
    fmt, note = choose_format(None, "auto", ("Q6_K", "Q8_0"))
    assert fmt == "int8" and "Q6_K" in note and "Q8_0" not in note
    assert choose_format("gguf", "auto", ("Q4_1", "Q6_K")) == ("int4", note)  # (its Q6_K: int8)
    assert choose_format("gguf", "auto", ("Q4_K", "Q6_K"))[0] == "int8"  # (Q4_K's scales: not fp16)
    assert choose_format(None, "auto", ("Q8_0",)) == ("int8", None)
    assert choose_format(None, "auto", ("Q4_0", "Q6_K")) == ("int4", note)
    assert choose_format("none", "auto", q4) == ("float32", None)
    assert choose_format(None, "float32", q4) == ("float32", None)
    assert choose_format(None, "bfloat16", ()) == ("bfloat16", None)
    assert choose_format(None, "half", ())[0] == "bfloat16"
    assert choose_format("int8", "bfloat16", ()) == ("int8", None)
    with pytest.raises(ValueError, match="give a .gguf"):
        choose_format("gguf", "auto", ())


def test_a_config_file_is_read_as_vllm_reads_it(tmp_path):
    conf = tmp_path / "config.yaml"
    conf.write_text("max_model_len: 2048\nenforce_eager: true\nserved-model-name: [a, b]\nport: 9000\n")
    argv = vllm_flags.expand_argv(["serve", "m", "--config", str(conf), "--port", "8001"])
    args = build_parser().parse_args(argv)
    assert (args.model_tag, args.max_model_len, args.served_model_name) == ("m", 2048, ["a", "b"])
    assert args.port == 8001  # (the command line wins over the file)
    assert [n.split(" ")[0] for n in vllm_compat(args)] == ["--enforce-eager"]
    assert vllm_flags.expand_argv(["serve", "-O3", "--max_num_seqs", "4"]) == [
        "serve",
        "--optimization-level",
        "3",
        "--max-num-seqs",
        "4",
    ]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("cmd", ["serve", "engine", "api", "run-batch"])
def test_help_gives_every_flag_a_help_and_its_default(cmd):
    p = _subparsers()[cmd]
    fmt = HelpFormatter(cmd)
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        assert a.help, a.option_strings or a.dest
        assert "default" in (fmt._get_help_string(a) or "").lower(), a.option_strings or a.dest
    text = p.format_help()
    for a in p._actions:
        for name in a.option_strings:
            assert re.search(rf"(^|[\s,]){re.escape(name)}([\s,=]|$)", text, re.M), name
    if cmd == "serve":
        assert "vLLM compatibility:" in text and "--swap-space" in text and "--no-enable-lora" in text


def test_fd_serve_help_runs():
    out = io.StringIO()
    with pytest.raises(SystemExit) as e, redirect_stderr(io.StringIO()):
        sys.stdout, old = out, sys.stdout
        try:
            main(["serve", "--help"])
        finally:
            sys.stdout = old
    assert e.value.code == 0 and "usage: fd serve [MODEL] [options]" in out.getvalue()
    for f in FLAGS:
        assert f["options"][0] in out.getvalue()


def test_the_doc_is_the_table():
    doc = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"
    assert doc.read_text() == vllm_flags.markdown(), "regenerate docs/vllm-flags.md (see its header)"


async def test_fd_serve_runs_a_vllm_serve_line(tmp_path):
    """vLLM's k8s.md line, the model swapped for the tiny one: fd serve starts and answers."""
    from tests.kit.processes import spawn_fd, stop_fd, wait_healthy

    port = free_port()
    line = (
        "vllm serve tiny --trust-remote-code --enable-chunked-prefill --max_num_batched_tokens 1024 "
        f"--gpu-memory-utilization 0.9 --swap-space 4 -tp 1 --port {port}"
    )
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache")}
    serve = spawn_fd("serve", *line.split()[2:], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, [serve], timeout=90)
        async with aiohttp.ClientSession() as http, http.get(f"{base}/v1/models") as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["id"]
    finally:
        code, out = stop_fd(serve, signal.SIGINT)
    assert code == 0, out
    said = next(line for line in out.splitlines() if "vLLM flags taken and ignored" in line)
    for flag in (
        "--trust-remote-code",
        "--enable-chunked-prefill",
        "--gpu-memory-utilization",
        "--swap-space",
    ):
        assert flag in said
