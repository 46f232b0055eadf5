"""An engine node's configuration (:class:`EngineConfig`), apart from :mod:`fd.engine.node.node`,
so a caller can configure a node without reading the node itself: its model and the process that
runs it, its KV cache, its scheduler's knobs (:class:`SchedulerSettings`, a part of it), its
place on the control plane and what it does about faults. What the node asks of its runner is
in :mod:`fd.engine.runner.runners`.

The scheduler's own :class:`~fd.engine.core.config.SchedulerConfig` needs what only the loaded
model knows (its KV blocks, EOS ids, vocabulary and context): :meth:`EngineConfig.scheduler_config`
makes it from the settings here and those facts.

A field that is a command-line flag of ``fd serve`` / ``fd engine`` says so in its metadata
(``flag``, ``help``, and argparse's keywords; ``negate``: a flag ``--no-...`` that turns the
field off), which fd's CLI builds the flag from, so its default and help are written here
alone.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from fd.control.bus import REQUEST_TTL_S, TOMBSTONE_TTL_S
from fd.engine.core.config import SCHEDULING_POLICIES, SchedulerConfig, default


def _env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment (vLLM's variables), else ``default``."""
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


@dataclass
class SchedulerSettings:
    """The scheduler's knobs an engine is given, with the engine's defaults: the scheduler's own
    (:func:`~fd.engine.core.config.default`) where they agree; where they differ, each says why."""

    max_num_seqs: int = field(
        default=default("max_num_seqs"),
        metadata={"flag": "--max-num-seqs", "help": "requests a step runs at most (vLLM's)"},
    )
    max_num_batched_tokens: int = field(
        default=default("max_num_batched_tokens"),
        metadata={
            "flag": "--max-num-batched-tokens",
            "type": "human_int",
            "help": "tokens a step computes at most (vLLM's; 8192 or 8k)",
        },
    )
    # Prompt tokens a step computes beside its decodes, per decode (SchedulerConfig): a wave of
    # new prompts goes in slices, so a running stream's next token waits for about its own
    # decode step and a slice, not a whole wave's prefill; 2 keeps a mixed step within about
    # twice a decode step, and gave the most throughput and the lowest TTFT of 1, 2 and 4 under
    # arriving prompts at 32 streams (bench/README.md has the figures).
    prefill_per_decode: int = field(
        default=2,
        metadata={
            "flag": "--prefill-per-decode",
            "help": "prompt tokens a step computes beside running decodes, per decode (at least a "
            "KV block's worth; 0: up to --max-num-batched-tokens): keeps streams' inter-token "
            "latency even while new prompts arrive",
        },
    )
    # At most this many claimed requests wait to start (what it cannot start soon stays in
    # Redis for another engine), so a step starts at most this many prompts of a burst that
    # is still coming in: a smaller cap puts the median request of a burst in an earlier,
    # shorter prefill (bench/README.md has the figures).
    max_num_waiting: int = 8
    # The longest prompt + output a request may have; None: the model's own
    # (max_position_embeddings). Over the model's own is refused: positions past it were never
    # trained. The API nodes take the flag too: they refuse longer requests.
    max_model_len: int | None = field(
        default=None,
        metadata={
            "flag": "--max-model-len",
            "type": "human_int_or_auto",
            "help": "the longest prompt + output a request may have, in tokens (as vLLM's: 4096, "
            "32k or auto; default: the model's max_position_embeddings; at most that). fd serve, "
            "fd api and fd engine must be given the same",
        },
    )
    # Decide step N+1 while step N runs (its decodes on placeholders the runner fills in), so
    # the runner never waits for this loop; off, each step is decided after the last one's
    # results are folded in.
    async_scheduling: bool = field(
        default=True,
        metadata={
            "flag": "--no-async-scheduling",
            "negate": True,
            "help": "decide each step only after the last one's results are in (by default "
            "step N+1 is decided while step N runs, so the model never waits for "
            "the engine loop)",
        },
    )
    # Reuse the KV of prompt prefixes computed before (fd.engine.core.block_manager); vLLM's default
    # (a bare scheduler's is off, so its block arithmetic in tests is the plain one).
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "flag": "--no-enable-prefix-caching",
            "negate": True,
            "help": "compute every prompt in full (by default full KV blocks of prompt "
            "prefixes computed before are reused, as vLLM's prefix caching)",
        },
    )
    # vLLM's --scheduling-policy (SchedulerConfig); the API nodes take it too (`priority`)
    scheduling_policy: str = field(
        default=default("scheduling_policy"),
        metadata={
            "flag": "--scheduling-policy",
            "choices": SCHEDULING_POLICIES,
            "help": "fcfs: requests start in arrival order; priority: by the request's "
            "`priority` (lower first), then arrival, and the lowest is preempted "
            "first (vLLM's). fd serve, fd api and fd engine must be given the same",
        },
    )


@dataclass(kw_only=True)
class EngineConfig:
    """Everything an engine node is configured with. ``fd serve`` and ``fd engine`` make one of
    their flags (fd/cli/serving.py); :func:`fd.compose.start_engine` starts a node of it. Built
    by keyword: its fields are many, and several of one type."""

    # --- the model, and the process that runs it
    model_dir: str
    device: str = field(default="cpu", metadata={"flag": "--device", "help": "cpu | gpu | gpu:N"})
    # "paddle": the model in a worker process (its own core and GIL, beside the engine's event
    # loop); "paddle-thread": in the engine's own process, in a thread (tests, debugging). The
    # flag's "timed" is no executor of a model: the CLI hands start_engine a TimedRunner.
    executor: str = field(
        default="paddle",
        metadata={
            "flag": "--executor",
            "choices": ("paddle", "paddle-thread", "timed"),
            "help": "paddle: the model in a worker process (default); paddle-thread: in this "
            "process; timed: the real scheduler, blocks and streams with the forward "
            "pass replaced by a wait of --step-ms (a stand-in for a GPU)",
        },
    )
    # Where the model worker runs (fd/engine/runner/affinity.py): "auto", a CPU list, or "none".
    worker_cpus: str = field(
        default="none",
        metadata={
            "flag": "--worker-cpus",
            "help": "CPUs of the model worker process (--executor paddle): auto (on two CPUs "
            "both at a lower priority than this process if its GEMMs gain by a second "
            "thread, else the last alone; on more, all but the first, which this process "
            "keeps), a list like 3 or "
            "2-3, or none (the kernel decides); default %(default)s (see "
            "fd/engine/runner/affinity.py)",
        },
    )
    # vLLM's --seed: where the sampler's random stream starts, for requests that give no seed
    # (a request's own seed draws from a stream of its own, engine or not)
    seed: int = field(
        default=0,
        metadata={
            "flag": "--seed",
            "help": "the sampler's seed for requests that give none (vLLM's; default %(default)s)",
        },
    )
    # vLLM's --quantization and --dtype: what the model's dense weights are held and computed
    # in (fd/engine/model/qgemm.py's choose_format: a GGUF in its own quantization unless asked
    # otherwise, any other checkpoint in float32)
    quantization: str | None = field(
        default=None,
        metadata={
            "flag": "--quantization",
            "aliases": ("-q",),
            "metavar": "none|int8|gguf",
            "help": "the weights in fewer bytes, on a CPU with AVX-512 (vLLM's): int8 (blocks of "
            "32 with a scale, from any checkpoint), gguf (a .gguf's own quantization), none "
            "(float32); default: a .gguf's own, else what --dtype says",
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "flag": "--dtype",
            "type": "dtype",
            "help": "the weights' precision where --quantization does not set it (vLLM's): "
            "bfloat16 (on a CPU with AVX512-BF16), float32, or auto (a .gguf's own quantization, "
            "else float32)",
        },
    )
    # vLLM's VLLM_BATCH_INVARIANT: a request's logits the same in any batch (fd/engine/model/llama.py),
    # at the price of batch 1 costing what batch 8 does
    batch_invariant: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)  # vLLM's --lora-modules: name -> path
    max_lora_rank: int | None = field(
        default=None,
        metadata={
            "flag": "--max-lora-rank",
            "help": "refuse adapters of a higher rank at start (default: any)",
        },
    )
    # --- its KV cache: blocks of block_size tokens, num_blocks of them or as many as fit in
    # kv_cache_mb (the runner allocates them; the scheduler hands them out)
    block_size: int = field(
        default=default("block_size"),
        metadata={"flag": "--block-size", "help": "tokens a KV cache block holds (vLLM's)"},
    )
    num_blocks: int | None = field(
        default=None, metadata={"flag": "--num-blocks", "help": "KV blocks (default: from --kv-cache-mb)"}
    )
    kv_cache_mb: int = field(default=256, metadata={"flag": "--kv-cache-mb", "help": "MiB of KV cache"})
    # --- its scheduler
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    # --- the node on the control plane
    # None: a new one (the host's name and a random suffix), as start_engine starts the node
    engine_id: str | None = field(
        default=None,
        metadata={
            "flag": "--engine-id",
            "help": "this engine's name on the control plane (default: a new one)",
        },
    )
    # one P:journal:<engine> entry per step, for `fd replay`
    journal: bool = field(
        default=True, metadata={"flag": "--no-journal", "negate": True, "help": "write no journal"}
    )
    journal_maxlen: int = field(
        default=10_000,
        metadata={
            "flag": "--journal-maxlen",
            "help": "journal entries kept per engine (one a step; MAXLEN ~) for `fd replay`",
        },
    )
    request_ttl_s: int = REQUEST_TTL_S  # a finished request's story and owner key are kept this long
    tombstone_ttl_s: int = field(
        default=TOMBSTONE_TTL_S,
        metadata={
            "flag": "--tombstone-ttl",
            "type": "seconds",
            "metavar": "S",
            "help": "seconds an abort of a request no engine has waits for that request "
            "(a later one runs); default %(default)s",
        },
    )
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 5
    claim_block_ms: int = 50  # idle wait for new requests; never cancelled (DESIGN §6)
    control_block_ms: int = 50
    # A starting engine also reads the control stream's recent past: an abort published while
    # no engine was up must still win over the request it names (tombstone via P:owner).
    control_lookback_ms: int = 30_000
    # --- faults
    max_attempts: int = field(
        default=3,
        metadata={
            "flag": "--max-attempts",
            "help": "engines a request may fail on (engine died) before it ends with an error",
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "flag": "--drain-timeout",
            "help": "on drain/SIGTERM: seconds to let running requests finish before handing "
            "the rest back to other engines",
        },
    )
    request_timeout_s: float = field(
        default=0.0,
        metadata={
            "flag": "--request-timeout",
            "help": "seconds without a new token before a request ends with an error (0: off)",
        },
    )
    steal_after_ms: int = field(
        default=250,
        metadata={
            "flag": "--steal-after-ms",
            "metavar": "MS",
            "help": "a request placed for another engine (prefix-aware placement) is taken by "
            "this one, when it can start it, after waiting this long; default %(default)s",
        },
    )
    failover_interval_s: float = 1.0  # how often to look for requests of dead engines
    failover_idle_ms: int = 1000  # pending entries younger than this are not even looked at
    retry_backoff_s: float = 0.05  # first wait after a Redis error, doubling ...
    retry_backoff_max_s: float = 2.0  # ... up to this
    # --- vLLM's periodic throughput line (fd.control.logs.StatsLine): every this many seconds
    # while the engine is busy; vLLM's VLLM_LOG_STATS_INTERVAL sets the default, as it does there
    log_stats_interval_s: float = field(
        default=_env_seconds("VLLM_LOG_STATS_INTERVAL", 10.0),
        metadata={
            "flag": "--log-stats-interval",
            "metavar": "S",
            "help": "seconds between the engine's throughput lines (prompt and generation "
            "tokens/s, running, waiting, KV cache usage, prefix cache hit rate), logged "
            "while it is busy; default $VLLM_LOG_STATS_INTERVAL or 10",
        },
    )
    disable_log_stats: bool = field(
        default=False,
        metadata={
            "flag": "--disable-log-stats",
            "action": "store_true",
            "help": "no periodic throughput line (vLLM's)",
        },
    )

    def scheduler_config(
        self, *, num_blocks: int, eos_token_ids: Iterable[int], vocab_size: int | None, model_max_len: int
    ) -> SchedulerConfig:
        """The scheduler's config: the settings here with the loaded model's facts, its KV
        blocks, EOS ids, vocabulary (None or 0: token ids unchecked) and own context, which
        ``scheduler.max_model_len`` may not exceed (:func:`~fd.control.tokenizer.served_context`)."""
        # (imported here: the CLI's parser imports this module, and the tokenizer's libraries
        # take a while to load)
        from fd.control.tokenizer import served_context

        s = self.scheduler
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=served_context(s.max_model_len, model_max_len),
            eos_token_ids=tuple(eos_token_ids),
            max_num_waiting=s.max_num_waiting,
            vocab_size=int(vocab_size or 0),
            max_steps_in_flight=2 if s.async_scheduling else 1,
            enable_prefix_caching=s.enable_prefix_caching,
            scheduling_policy=s.scheduling_policy,
            prefill_per_decode=s.prefill_per_decode,
        )


#: (its lines are the engine's: operators filter on that name)
log = logging.getLogger("fd.engine")


def engine_context(asked: int | None, model_len: int, kv_tokens: int, kv_flag: str = "--kv-cache-mb") -> int:
    """The context an engine serves. Not asked for (no ``--max-model-len``): the model's, or
    what its KV cache holds if that is less, said once. Asked for more than the KV cache holds:
    refused, as vLLM refuses it, since one request of that length could never run; a request
    that outgrows the cache is otherwise finished early with ``length``, which is no context."""
    if asked is None:
        served = min(model_len, kv_tokens)
        if served < model_len:
            log.info(
                "max_model_len %d: what the KV cache holds (the model's context is %d; give "
                "more %s for more)",
                served,
                model_len,
                kv_flag,
                extra={"max_model_len": served, "model_context": model_len, "kv_tokens": kv_tokens},
            )
        else:
            log.info(
                "max_model_len %d: the model's context (the KV cache holds %d tokens)",
                served,
                kv_tokens,
                extra={"max_model_len": served, "model_context": model_len, "kv_tokens": kv_tokens},
            )
        return served
    if asked > kv_tokens:
        raise ValueError(
            f"--max-model-len {asked} is more than the KV cache holds ({kv_tokens} tokens): "
            f"give --max-model-len {kv_tokens} or less, or more {kv_flag} (vLLM refuses this too)"
        )
    return asked
