"""An engine node's settings (:class:`EngineConfig`), apart from :mod:`engine.node`, so a
caller can configure a node without reading the node itself. What the node asks of its runner
is in :mod:`engine.runners`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    engine_id: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
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
    tombstone_ttl_s: int = 600
    claim_block_ms: int = 50  # idle wait for new requests; never cancelled (DESIGN §6)
    control_block_ms: int = 50
    # A starting engine also reads the control stream's recent past: an abort published while
    # no engine was up must still win over the request it names (tombstone via P:owner).
    control_lookback_ms: int = 30_000
    journal: bool = True  # one P:journal:<engine> entry per step, for `fd replay`
    # Decide step N+1 while step N runs (its decodes on placeholders the runner fills in), so
    # the runner never waits for this loop; off, each step is decided after the last one's
    # results are folded in.
    async_scheduling: bool = True
    # Reuse the KV of prompt prefixes computed before (engine.block_manager); vLLM's default.
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy (SchedulerConfig)
    # --- faults
    max_attempts: int = 3  # engines a request may fail on before it ends with an error
    drain_timeout_s: float = 30.0  # running requests get this long to finish on a drain
    request_timeout_s: float = 0.0  # no token for this long: the request ends with an error; 0 off
    failover_interval_s: float = 1.0  # how often to look for requests of dead engines
    failover_idle_ms: int = 1000  # pending entries younger than this are not even looked at
    retry_backoff_s: float = 0.05  # first wait after a Redis error, doubling ...
    retry_backoff_max_s: float = 2.0  # ... up to this
