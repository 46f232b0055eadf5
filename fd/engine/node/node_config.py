"""An engine node's settings (:class:`EngineConfig`), apart from :mod:`fd.engine.node.node`, so a
caller can configure a node without reading the node itself. What the node asks of its runner
is in :mod:`fd.engine.runner.runners`.

A field that is a command-line flag of ``fd serve`` / ``fd engine`` says so in its metadata
(``flag``, ``help``, and argparse's keywords; ``negate``: a flag ``--no-...`` that turns the
field off), which fd's CLI builds the flag from, so its default and help are written here
alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fd.control.bus import TOMBSTONE_TTL_S
from fd.engine.core.config import SCHEDULING_POLICIES, default


@dataclass
class EngineConfig:
    engine_id: str
    block_size: int = field(
        default=default("block_size"),
        metadata={"flag": "--block-size", "help": "tokens a KV cache block holds (vLLM's)"},
    )
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
    # At most this many claimed requests wait to start (what it cannot start soon stays in
    # Redis for another engine), so a step starts at most this many prompts of a burst that
    # is still coming in: a smaller cap puts the median request of a burst in an earlier,
    # shorter prefill (bench/README.md has the figures).
    max_num_waiting: int = 8
    # The longest prompt + output a request may have; None: the model's own
    # (max_position_embeddings). Over the model's own is refused: positions past it were never
    # trained.
    max_model_len: int | None = None
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: int = 5
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
    claim_block_ms: int = 50  # idle wait for new requests; never cancelled (DESIGN §6)
    control_block_ms: int = 50
    # A starting engine also reads the control stream's recent past: an abort published while
    # no engine was up must still win over the request it names (tombstone via P:owner).
    control_lookback_ms: int = 30_000
    # one P:journal:<engine> entry per step, for `fd replay`
    journal: bool = field(
        default=True, metadata={"flag": "--no-journal", "negate": True, "help": "write no journal"}
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
    failover_interval_s: float = 1.0  # how often to look for requests of dead engines
    failover_idle_ms: int = 1000  # pending entries younger than this are not even looked at
    retry_backoff_s: float = 0.05  # first wait after a Redis error, doubling ...
    retry_backoff_max_s: float = 2.0  # ... up to this


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
