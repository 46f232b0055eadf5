"""Knobs of the sans-IO scheduler, validated once so the scheduler can trust them.

The defaults here are the scheduler's and the engine's alike: an engine's knob that is a
scheduler's (``EngineConfig``, ``LLM``) takes its default from :func:`default`, so each is
written once. Where the engine's default differs on purpose (prefix caching, the waiting cap,
the model's own context), both say why.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

#: What the ``scheduling_policy`` knob takes.
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks the runner allocated; the only memory the scheduler reasons about
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests holding a running slot (and so at most this many per step)
    max_num_batched_tokens: int = 2048  # tokens fed to the model in one step
    max_model_len: int = 2048  # prompt + generated tokens of one request
    eos_token_ids: tuple[int, ...] = ()
    # Split a prompt that does not fit the step's token budget across steps. Off, a prompt must
    # fit one step whole, so the budget has to cover max_model_len (checked below).
    enable_chunked_prefill: bool = True
    # Cap on one request's prefill chunk per step (vLLM's long_prefill_token_threshold) so a
    # long prompt cannot take the whole budget from others arriving with it; 0 turns it off.
    # Only with chunked prefill: otherwise a prompt runs whole.
    long_prefill_threshold: int = 0
    # Prompt tokens a step computes beside its decodes, at most this many per decode (and at
    # least a KV block's worth; 0: only max_num_batched_tokens). Every running stream waits for
    # the whole step, so a step that also prefills a wave of new prompts is a gap in each of
    # them. A decode step's time grows with its decodes, so a cap in proportion to them keeps a
    # mixed step within a small multiple of the decode step it holds up, at 8 streams as at 32.
    # A step with no decodes takes the whole budget. Only with chunked prefill (otherwise a
    # prompt runs whole).
    prefill_per_decode: int = 0
    # can_admit() keeps at most this many claimed-but-not-started requests: anything beyond
    # would sit here instead of in Redis, where another engine could have taken it.
    max_num_waiting: int = 16
    # Token ids at or past this are refused at add() (finished with an error): a hand-written
    # request must not index past the embedding table. 0: unchecked.
    vocab_size: int = 0
    # Steps handed to the runner and not folded back yet. 2 is async scheduling: step N+1 is
    # decided while step N runs, its decodes fed placeholders for step N's tokens, so the
    # runner never waits for the engine loop. 1 decides each step after the last one's results.
    max_steps_in_flight: int = 1
    # Reuse the KV of full blocks whose tokens (and every token before them) another request
    # already computed (vLLM's automatic prefix caching; fd.engine.core.block_manager). Off here, so a
    # bare scheduler's arithmetic is the plain one; the engine turns it on unless told not to.
    enable_prefix_caching: bool = False
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority": waiting requests start
    # by (priority, arrival), lower first, and the running request preempted first is the one
    # with the greatest (priority, arrival). An older journal, without it, replays fcfs.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_num_waiting",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_steps_in_flight not in (1, 2):
            raise ValueError(
                "SchedulerConfig.max_steps_in_flight must be 1 or 2 (a placeholder "
                "stands only for the token of the step just before)"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError("SchedulerConfig.scheduling_policy must be fcfs or priority")
        if self.long_prefill_threshold < 0:
            raise ValueError("SchedulerConfig.long_prefill_threshold must be >= 0")
        if not isinstance(self.prefill_per_decode, int) or self.prefill_per_decode < 0:
            raise ValueError("SchedulerConfig.prefill_per_decode must be an integer >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len, "
                "or a long prompt (or a preempted request's recompute) could never be scheduled"
            )


def default(name: str) -> Any:
    """SchedulerConfig's default for the knob ``name``."""
    return _DEFAULTS[name]


_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig) if f.default is not MISSING}
