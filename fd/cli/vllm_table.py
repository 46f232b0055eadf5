"""Every flag of ``vllm serve`` (vLLM 0.32), and what ``fd serve`` does with it, as data: *applied*
where fd has the feature (most of those are fd's own flags, declared where fd declares them),
*ignored* and named once at start where it means nothing here (a GPU kernel's choice, a download
directory), *refused* with a one-line message where ignoring it would silently change the
outputs (a quantization or KV cache dtype fd cannot run, a watermark, a tokenizer other than the
model's) or where it cannot work (a Unix socket, a model split over devices).

:data:`TABLE` is the one place that says so; fd/cli/vllm_flags.py reads it (the flags, what a
command line comes to, docs/vllm-flags.md). tests/data/vllm_serve_flags_0.32.json (written by
bench/vllm_flags_dump.py from vLLM's own parser) is what tests/integration/test_vllm_flags.py
holds it to.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

APPLY, IGNORE, REFUSE = "apply", "ignore", "refuse"
#: vLLM's release whose ``vllm serve`` flags :data:`TABLE` holds
VLLM_VERSION = "0.32"


def human_int(text: str) -> int:
    """vLLM's human-readable integer: ``25.6k`` is 25600 (k, m, g, t: powers of 1000),
    ``1K`` 1024 (K, M, G, T: powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (as 4096, 32k or 1G)")
    number, suffix = m.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
        return int(number)
    scale = 1000 ** ("kmgt".index(suffix) + 1) if suffix.islower() else 1024 ** ("KMGT".index(suffix) + 1)
    return int(float(number) * scale)


#: vLLM's ``--dtype`` values
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def dtype(text: str) -> str:
    """vLLM's ``--dtype``: one of :data:`DTYPES` (what each comes to: fd/engine/model/qgemm.py's
    ``choose_format``)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text}: not one of {', '.join(DTYPES)}")
    return text


def human_int_or_auto(text: str) -> int | None:
    """vLLM's ``--max-model-len``: a human-readable int, or ``auto`` (or -1): the model's."""
    if text.strip() in ("auto", "-1"):
        return None
    return human_int(text)


#: how a flag's value is read, by the letter of its spec (see :func:`_flags`)
_TYPES: dict[str, Callable[[str], Any] | None] = {"s": None, "i": int, "f": float, "h": human_int, "j": None}


@dataclass(frozen=True)
class Rule:
    """What fd does with a vLLM flag: ``kind`` is what it comes to when given (``apply``,
    ``ignore``, ``refuse``); ``ok`` the values that ask for what fd does anyway, taken without
    a word (``--tensor-parallel-size 1``); ``why`` says why, in the note at start, the refusal
    and ``--help``; ``act`` sets fd's own flags from the value."""

    kind: str
    why: str
    ok: tuple[Any, ...] = ()
    act: Callable[[argparse.Namespace, Any], None] | None = None

    def verdict(self, value: Any) -> str:
        """``apply``, ``ignore`` or ``refuse`` for this value (False, a ``--no-X``, turns off
        what fd does not do: ignored)."""
        if value in self.ok:
            return APPLY
        if value is False and self.kind == REFUSE:
            return IGNORE
        return self.kind

    def help(self) -> str:
        if self.kind == APPLY:
            return f"vLLM's; {self.why}"
        if self.kind == IGNORE:
            return f"vLLM's; ignored here: {self.why}"
        ok = [str(v) for v in self.ok if v is not None]
        unless = f" unless {' or '.join(ok)}" if ok else ""
        return f"vLLM's; refused{unless}: {self.why}"


def ignore(why: str) -> Rule:
    return Rule(IGNORE, why)


def refuse(why: str, ok: tuple[Any, ...] = ()) -> Rule:
    return Rule(REFUSE, why, ok)


def apply(why: str, act: Callable[[argparse.Namespace, Any], None] | None = None, ok=()) -> Rule:
    return Rule(APPLY, why, ok, act)


@dataclass(frozen=True)
class VllmFlag:
    """One ``vllm serve`` flag: its names (the first the long one; a ``bool`` flag's ``--no-``
    form is made from it), how its value is written (``bool``: ``--x`` / ``--no-x``;
    ``store_true``: ``--x``; ``value``: ``--x V``, ``nargs`` ``+`` for several, ``?`` for one
    or none), and its :class:`Rule`; ``fd``: fd declares the flag itself (its parser, help and
    default are fd's)."""

    names: tuple[str, ...]
    kind: str
    rule: Rule
    type: Callable[[str], Any] | None = None
    nargs: str | None = None
    fd: bool = False
    choices: tuple[str, ...] | None = None
    secret: bool = False  # (its value is never logged)

    @property
    def flag(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def negation(self) -> str | None:
        return "--no-" + self.flag[2:] if self.kind == "bool" else None


def _flags(rule: Rule, *specs: str, fd: bool = False) -> list[VllmFlag]:
    """Flags of one rule, each spec ``--name[/-alias...] K`` where K is how it is written:
    ``b`` --x/--no-x, ``t`` --x alone, ``s`` a string, ``i`` an int, ``f`` a float, ``h`` a
    human-readable int (32k), ``j`` JSON (kept as its text); a ``+`` after it: several values,
    a ``?``: an optional one."""
    out = []
    for spec in specs:
        names, k = spec.split()
        nargs = k[1:] or None
        kind = {"b": "bool", "t": "store_true"}.get(k[0], "value")
        out.append(VllmFlag(tuple(names.split("/")), kind, rule, _TYPES.get(k[0]), nargs, fd))
    return out


def _fd(why: str, *specs: str, rule: Rule | None = None) -> list[VllmFlag]:
    """Flags fd declares itself (fd's parser, help and default): applied as fd's flag."""
    return _flags(rule or apply(why), *specs, fd=True)


# --- the rules that need more than a list of values


def _kv_cache_bytes(args: argparse.Namespace, value: int) -> None:
    args.kv_cache_mb = max(1, value // 2**20)


def _num_blocks(args: argparse.Namespace, value: int) -> None:
    args.num_blocks = value


def _shutdown_timeout(args: argparse.Namespace, value: int) -> None:
    args.drain_timeout = float(value)


_ONE_DEVICE = "an fd engine runs its model on one device; run more engines to scale out"
_GPU_ONLY = "a GPU build's kernel, graph or memory choice; fd's outputs do not depend on it"
_PARALLEL = "multi-GPU and multi-node settings; fd serve runs one engine on one device"
_MM = "fd serves text models: a request with images or audio is refused"
_OBSERVE = "vLLM's own metrics, traces and logs; fd has /metrics and `fd trace`"
_FRONTEND = "a setting of vLLM's HTTP server that no answer's content depends on"
_LOAD = "fd loads the model dir (or .gguf) it is given, and downloads nothing"
_CODE = "it loads Python code into the server, which fd does not run"
_OUTPUTS = "it changes what the model answers, and fd does not have it"

#: every ``vllm serve`` flag of vLLM 0.32, and a few of earlier releases that manifests still
#: carry (``--disable-log-requests``, ``--swap-space`` ...); the first rows are in the order
#: their notes are logged
TABLE: tuple[VllmFlag, ...] = tuple(
    [
        *_flags(ignore("fd runs no code from a model dir"), "--trust-remote-code b"),
        *_flags(ignore("fd has no graphs to capture"), "--enforce-eager b"),
        *_flags(ignore("prompts are always chunked"), "--enable-chunked-prefill b"),
        *_flags(
            ignore("requests' contents are logged only with --enable-log-requests"),
            "--disable-log-requests t",
        ),
        *_fd(
            "a line for each request with its prompt and parameters",
            "--enable-log-requests b",
            "--max-log-len i",
        ),
        VllmFlag(
            ("--gpu-memory-utilization", "--device-memory-utilization"),
            "value",
            apply(
                "on a CPU taken and ignored (the KV cache is --kv-cache-mb); on a GPU refused: give --kv-cache-mb"
            ),
            float,
        ),
        *_fd(
            "fd's flag: the weights' precision (bfloat16 on a CPU with AVX512-BF16; half computes in bfloat16)",
            "--dtype s",
        ),
        *_flags(
            refuse(_ONE_DEVICE, ok=(1,)), "--tensor-parallel-size/-tp i", "--pipeline-parallel-size/-pp i"
        ),
        *_fd("", "--max-loras i", rule=ignore("every adapter is loaded, any mix of them in a batch")),
        # --- fd's own flags, with vLLM's meaning
        *_fd(
            "fd's flag",
            "--model s",
            "--host s",
            "--port i",
            "--api-key s+",
            "--served-model-name s+",
            "--max-model-len h",
            "--max-num-seqs i",
            "--max-num-batched-tokens i",
            "--block-size i",
            "--seed i",
            "--scheduling-policy s",
            "--async-scheduling b",
            "--enable-prefix-caching b",
            "--chat-template s",
            "--generation-config s",
            "--tool-call-parser s",
            "--enable-auto-tool-choice b",
            "--reasoning-parser s",
            "--return-tokens-as-token-ids b",
            "--enable-force-include-usage b",
            "--enable-lora b",
            "--lora-modules s+",
            "--max-lora-rank i",
            "--allowed-origins j",
            "--allowed-methods j",
            "--allowed-headers j",
            "--allow-credentials b",
            "--api-server-count/-asc i",
            "--log-level s",
        ),
        *_flags(apply("fd's flag (fd/engine/node/node_config.py's)"), "--disable-log-stats t"),
        *_flags(
            apply("fd's flag (fd/api/config.py's)"),
            "--disable-uvicorn-access-log b",
            "--disable-access-log-for-endpoints s",
        ),
        # --- what fd does anyway, or does from another of its flags
        *_flags(
            apply("sets --kv-cache-mb (the KV cache's size)", _kv_cache_bytes),
            "--kv-cache-memory-bytes h",
        ),
        *_flags(apply("sets --num-blocks", _num_blocks), "--num-gpu-blocks-override i"),
        *_flags(
            apply("sets --drain-timeout (running requests may finish)", _shutdown_timeout),
            "--shutdown-timeout i",
        ),
        *_flags(
            refuse("fd's log-probabilities are the model's own distribution's", ok=("raw_logprobs",)),
            "--logprobs-mode s",
        ),
        VllmFlag(
            ("--tokenizer",),
            "value",
            apply("taken where it is the model itself; refused otherwise (fd reads the model's)"),
        ),
        *_flags(
            apply("taken: the config is read from the command line as vLLM's (a YAML of flags)"),
            "--config s",
        ),
        # --- refused: ignoring them would change the outputs, or they cannot work here
        *_fd(
            "",
            "--quantization/-q s",
            rule=refuse(
                "fd serves int8 weights (from any checkpoint), a .gguf's own (gguf) or float32 (none)",
                ok=(None, "none", "int8", "gguf"),
            ),
        ),
        *_flags(refuse("fd quantizes by --quantization alone"), "--quantization-config j"),
        *_flags(refuse("fd's KV cache is the model's dtype", ok=("auto",)), "--kv-cache-dtype s"),
        *_flags(refuse(_ONE_DEVICE, ok=(1,)), "--decode-context-parallel-size/-dcp i"),
        *_flags(refuse(_ONE_DEVICE, ok=(1,)), "--prefill-context-parallel-size/-pcp i"),
        *_flags(refuse("fd serve runs on this host alone", ok=(1,)), "--nnodes/-n i"),
        *_flags(
            refuse("fd serve's engine and API run together; `fd engine` is an engine alone"),
            "--headless t",
        ),
        *_flags(refuse("fd serves HTTP; it has no gRPC server"), "--grpc t", "--grpc-port i"),
        *_flags(refuse("fd listens on TCP (--host, --port)"), "--uds s"),
        *_fd(
            "HTTPS as vLLM serves it",
            "--ssl-keyfile s",
            "--ssl-certfile s",
            "--ssl-ca-certs s",
            "--ssl-cert-reqs i",
            "--ssl-ciphers s",
        ),
        *_flags(refuse(_CODE), "--middleware s"),
        *_flags(refuse(_CODE, ok=("",)), "--tool-parser-plugin s", "--reasoning-parser-plugin s"),
        *_flags(refuse(_CODE, ok=("auto",)), "--worker-cls s"),
        *_flags(refuse(_CODE, ok=("",)), "--worker-extension-cls s"),
        *_flags(
            refuse(_CODE, ok=(None,)),
            "--logits-processors s+",
            "--io-processor-plugin s",
            "--scheduler-cls s",
        ),
        *_flags(refuse("fd's chat answers are the assistant's", ok=("assistant",)), "--response-role s"),
        *_flags(
            refuse("fd renders a message's content as the model's template takes it", ok=("auto",)),
            "--chat-template-content-format s",
        ),
        *_flags(
            refuse(_OUTPUTS),
            "--default-chat-template-kwargs j",
            "--exclude-tools-when-tool-choice-none b",
            "--hf-overrides j",
            "--hf-config-path s",
            "--model-class-overrides j",
            "--override-generation-config j",
            "--pooler-config j",
            "--lora-target-modules s+",
            "--kv-sharing-fast-prefill b",
            "--watermark-config j",
            "--diffusion-config/-dc j",
            "--reasoning-config j",
            "--engram-config j",
            "--tool-server s",
            "--skip-tokenizer-init b",
            "--tokens-only b",
        ),
        *_flags(refuse("fd serves generation models as they are", ok=("auto", "generate")), "--runner s"),
        *_flags(refuse("fd serves generation models as they are", ok=("auto", "none")), "--convert s"),
        *_flags(refuse("fd's tool calls follow the model's output", ok=("auto",)), "--tool-strict-level s"),
        *_flags(
            refuse("fd tokenizes with the model's tokenizer.json", ok=("auto", "hf", "slow")),
            "--tokenizer-mode s",
        ),
        *_flags(
            refuse(
                "fd loads the model's real weights (safetensors or GGUF)",
                ok=("auto", "safetensors", "pt", "gguf", "npcache", "fastsafetensors", "runai_streamer"),
            ),
            "--load-format s",
        ),
        *_flags(
            refuse("a disaggregated prefill/decode instance works only beside its peers"),
            "--kv-transfer-config j",
            "--ec-transfer-config j",
        ),
        # --- ignored: named once at start
        *_flags(
            ignore("speculative decoding leaves the outputs as they are; fd decodes a token a step"),
            "--speculative-config/-sc j",
            "--spec-method s",
            "--spec-model s",
            "--spec-tokens i",
        ),
        *_flags(
            ignore("fd serve runs one engine: scale out with more `fd engine`s on one Redis"),
            "--data-parallel-size/-dp i",
        ),
        *_flags(
            ignore(_PARALLEL),
            "--distributed-executor-backend s",
            "--master-addr s",
            "--master-port i",
            "--node-rank/-r i",
            "--distributed-timeout-seconds i",
            "--cpu-distributed-timeout-seconds i",
            "--numa-bind b",
            "--numa-bind-nodes i+",
            "--numa-bind-cpus s+",
            "--device-ids s",
            "--dcp-comm-backend s",
            "--dcp-q-replicate b",
            "--dcp-kv-cache-interleave-size i",
            "--cp-kv-cache-interleave-size i",
            "--data-parallel-rank/-dpn i",
            "--data-parallel-start-rank/-dpr i",
            "--data-parallel-size-local/-dpl i",
            "--data-parallel-address/-dpa s",
            "--data-parallel-rpc-port/-dpp i",
            "--data-parallel-backend/-dpb s",
            "--data-parallel-hybrid-lb/-dph b",
            "--data-parallel-external-lb/-dpe b",
            "--data-parallel-multi-port-external-lb/-dpm t",
            "--data-parallel-supervisor-port i",
            "--dp-supervisor-probe-interval-s f",
            "--dp-supervisor-probe-timeout-s f",
            "--dp-supervisor-probe-failure-threshold i",
            "--enable-hc-sp b",
            "--enable-expert-parallel/-ep b",
            "--enable-batch-sharded-sampling b",
            "--enable-ep-weight-filter b",
            "--all2all-backend s",
            "--enable-dbo b",
            "--enable-shm-tensor-arena b",
            "--ubatch-size i",
            "--enable-elastic-ep b",
            "--elastic-ep-max-dp-size i",
            "--dbo-decode-token-threshold i",
            "--dp-sync-interval i",
            "--dbo-prefill-token-threshold i",
            "--disable-nccl-for-dp-synchronization b",
            "--enable-eplb b",
            "--eplb-config j",
            "--expert-placement-strategy s",
            "--max-parallel-loading-workers i",
            "--ray-workers-use-nsight b",
            "--disable-custom-all-reduce b",
            "--enable-fault-tolerance b",
            "--fault-tolerance-config j",
            "--enable-scale-out b",
            "--mm-encoder-tp-mode s",
        ),
        *_flags(
            ignore(_GPU_ONLY),
            "--attention-backend s",
            "--model-impl s",
            "--mamba-backend s",
            "--mamba-ssu-algorithm s",
            "--enable-mamba-cache-stochastic-rounding b",
            "--mamba-cache-philox-rounds i",
            "--disable-sliding-window b",
            "--disable-cascade-attn b",
            "--use-fp64-gumbel b",
            "--enable-sleep-mode b",
            "--sleep-mode-offload-cudagraph b",
            "--sleep-preserve-parameter-names s+",
            "--enable-cumem-allocator b",
            "--enable-nccl-comm-suspend b",
            "--swa-bounded-replay b",
            "--mamba-cache-dtype s",
            "--mamba-ssm-cache-dtype s",
            "--mamba-block-size i",
            "--mamba-cache-mode s",
            "--enable-mamba-shared-prefix-checkpoint b",
            "--replayssm-buffer-len i",
            "--use-replayssm b",
            "--prefix-match-unit i",
            "--prefix-caching-hash-algo s",
            "--prefix-cache-retention-interval i",
            "--kv-cache-dtype-skip-layers s+",
            "--kv-offloading-size f",
            "--kv-offloading-backend s",
            "--offload-backend s",
            "--cpu-offload-gb f",
            "--cpu-offload-params s+",
            "--offload-group-size i",
            "--offload-num-in-group i",
            "--offload-prefetch-step i",
            "--offload-params s+",
            "--disable-hybrid-kv-cache-manager b",
            "--cudagraph-capture-sizes i+",
            "--max-cudagraph-capture-size i",
            "--ir-op-priority j",
            "--enable-flashinfer-autotune b",
            "--moe-backend s",
            "--linear-backend s",
            "--sparse-indexer-topk-backend s",
            "--compilation-config/-cc j",
            "--attention-config/-ac j",
            "--kernel-config j",
            "--additional-config j",
            "--optimization-level s",
            "--performance-mode s",
            "--gdn-prefill-backend s",
            "--kda-prefill-backend s",
            "--kda-decode-backend s",
            "--ec-manager-config j",
            "--lora-dtype s",
            "--max-cpu-loras i",
            "--fully-sharded-loras b",
            "--specialize-active-lora b",
            "--enable-mixed-moe-lora-format b",
            "--enable-moe-shared-loras b",
            "--max-lora-cls-labels i",
            "--enable-tower-connector-lora b",
            "--swap-space f",
            "--max-seq-len-to-capture i",
            "--use-v2-block-manager t",
            "--num-scheduler-steps i",
        ),
        *_flags(
            ignore("fd's scheduler packs each step by --max-num-seqs and --max-num-batched-tokens"),
            "--max-num-scheduled-tokens h",
            "--max-num-active-seqs i",
            "--max-num-queued-reqs i",
            "--max-num-queued-tokens h",
            "--long-prefill-token-threshold i",
            "--long-prefill-token-threshold-adaptive b",
            "--disable-chunked-mm-input b",
            "--scheduler-reserve-full-isl b",
            "--watermark f",
            "--prefill-schedule-interval i",
            "--stream-interval i",
        ),
        *_flags(
            ignore(_LOAD),
            "--download-dir s",
            "--revision s",
            "--code-revision s",
            "--tokenizer-revision s",
            "--config-format s",
            "--safetensors-load-strategy s",
            "--safetensors-prefetch-num-threads i",
            "--safetensors-prefetch-block-size h",
            "--model-loader-extra-config j",
            "--ignore-patterns s+",
            "--use-tqdm-on-load b",
            "--pt-load-map-location j",
            "--allow-deprecated-quantization b",
            "--renderer-num-workers i",
        ),
        *_flags(
            ignore(_MM),
            "--language-model-only b",
            "--limit-mm-per-prompt j",
            "--enable-mm-embeds b",
            "--media-io-kwargs j",
            "--mm-processor-kwargs j",
            "--mm-processor-cache-gb f",
            "--mm-processor-cache-type s",
            "--mm-hasher-algorithm s",
            "--mm-shm-cache-max-object-size-mb i",
            "--mm-encoder-only b",
            "--mm-encoder-attn-backend s",
            "--mm-encoder-attn-dtype s",
            "--mm-encoder-fp8-scale-path s",
            "--mm-encoder-fp8-scale-save-path s",
            "--mm-encoder-fp8-scale-save-margin f",
            "--interleave-mm-strings b",
            "--skip-mm-profiling b",
            "--video-pruning-rate f",
            "--video-pruning-method s",
            "--mm-tensor-ipc s",
            "--mm-processor-device s",
            "--mm-ipc-gpu-memory-gb f",
            "--mm-device-do-normalize b",
            "--default-mm-loras j",
            "--allowed-local-media-path s",
            "--allowed-media-domains s+",
            "--trust-request-mm-kwargs b",
            "--enable-flash-late-interaction b",
        ),
        *_flags(
            ignore(_OBSERVE),
            "--aggregate-engine-logging t",
            "--enable-per-request-metrics b",
            "--enable-server-load-tracking b",
            "--enable-log-outputs b",
            "--enable-log-deltas b",
            "--log-error-stack b",
            "--uvicorn-log-level s",
            "--logging-config j",
            "--log-config-file s",
            "--show-hidden-metrics-for-version s",
            "--otlp-traces-endpoint s",
            "--collect-detailed-traces s+",
            "--per-request-spec-decode-metrics s",
            "--kv-cache-metrics b",
            "--kv-cache-metrics-sample f",
            "--custom-histogram-buckets j",
            "--cudagraph-metrics b",
            "--enable-layerwise-nvtx-tracing b",
            "--enable-mfu-metrics b",
            "--enable-logging-iteration-details b",
            "--jit-monitor-mode s",
            "--jit-monitor-verbose b",
            "--profiler-config j",
            "--kv-events-config j",
            "--fail-on-environ-validation b",
            "--enable-return-routed-experts b",
            "--return-sampling-mask b",
            "--enable-trace-replay b",
            "--aux-output-config j",
            "--weight-transfer-config j",
        ),
        *_flags(
            ignore(_FRONTEND),
            "--root-path s",
            "--enable-ssl-refresh b",
            "--enable-request-id-headers b",
            "--disable-fastapi-docs b",
            "--enable-offline-docs b",
            "--h11-max-incomplete-event-size i",
            "--h11-max-header-count i",
            "--sse-keep-alive-interval i",
            "--enable-prompt-tokens-details b",
            "--enable-tokenizer-info-endpoint b",
            "--trust-request-chat-template b",
            "--fingerprint-mode s",
            "--fingerprint-value s",
            "--cohere-is-reasoning-model b",
            "--cohere-format s",
            "--anthropic-disabled-thinking-effort s",
            "--enable-prompt-embeds b",
            "--structured-outputs-config j",
            "--guided-decoding-backend s",
            "--enable-reasoning t",
            "--disable-frontend-multiprocessing t",
        ),
        *_flags(ignore("fd allows up to 20 alternatives a token"), "--max-logprobs i"),
        VllmFlag(("--hf-token",), "value", ignore(_LOAD), str, "?", secret=True),
    ]
)
#: the table by every name of its flags
BY_NAME: dict[str, VllmFlag] = {n: f for f in TABLE for n in f.names}
