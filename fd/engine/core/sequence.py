"""One request's state inside the engine.

Tokens are one list, prompt then generated, because after a preemption the recompute prefill
feeds both alike; ``num_computed_tokens`` is how many of them have KV in the request's blocks.
A decode is then just the case where exactly one token (the last sampled) is not computed.
The block table itself lives in the BlockManager, the single owner of the pool.

With async scheduling a step is scheduled while the previous one still runs, so two counts
describe what is in flight: ``num_in_flight`` tokens fed to steps not folded back yet, and
``num_pending`` tokens those steps will sample. A decode scheduled on top of a pending token
feeds :data:`PLACEHOLDER`: the runner substitutes the token it sampled for the request one
step earlier, which the scheduler cannot know yet.
"""

from __future__ import annotations

import enum

from fd.control.sampling import SamplingParams

#: The token id of a decode whose input is the token the previous (in-flight) step samples.
PLACEHOLDER = -1


class Status(enum.Enum):
    WAITING = "waiting"  # holds no blocks: never started, or preempted
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "arrival",
        "sampling",
        "num_prompt_tokens",
        "token_ids",
        "num_computed_tokens",
        "status",
        "aborting",
        "num_preemptions",
        "num_in_flight",
        "num_pending",
        "finishing",
        "num_discarded",
        "block_hashes",
        "num_registered",
        "num_cached_tokens",
        "priority",
        "error",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        arrival: int,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.arrival = arrival  # admission order: FCFS priority, and who gets preempted first
        self.priority = priority  # (only with the priority policy: lower first, then arrival)
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        # The abort source once an abort arrived while the request was in the in-flight step:
        # it must not be scheduled again, but its blocks stay held until that step is folded in.
        self.aborting: str | None = None
        self.num_preemptions = 0
        self.num_in_flight = 0  # tokens fed to in-flight steps (async scheduling)
        self.num_pending = 0  # tokens those steps will sample, not in token_ids yet
        # (finish_reason, stop_reason) of a request that finished while a later step holding it
        # was already in flight: like an abort, its blocks wait for that step.
        self.finishing: tuple[str, str | int | None] | None = None
        self.error: str | None = None  # why its step failed (finish_reason "error"), for its Final
        self.num_discarded = 0  # sampled tokens dropped because of the above or an abort
        # prefix caching: the hashes of its full blocks' contents so far (block_hash, each
        # chained to the one before), and how many of its table's blocks it has registered
        self.block_hashes: list[bytes] = []
        self.num_registered = 0
        self.num_cached_tokens = -1  # prompt tokens the cache spared at its first start (-1: not yet)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_output_tokens + self.num_pending > 0 and self.num_unscheduled == 1

    @property
    def num_scheduled(self) -> int:
        """Tokens computed or being computed: where the next step starts."""
        return self.num_computed_tokens + self.num_in_flight

    @property
    def num_unscheduled(self) -> int:
        """Tokens (pending ones included) no step has been given yet."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens - self.num_in_flight

    @property
    def done(self) -> bool:
        """No more steps: aborting, or finished while a step holding it was in flight."""
        return self.aborting is not None or self.finishing is not None

    def usage(self) -> dict[str, int]:
        # Every generated token was emitted in a Tokens event (tokens of an aborted in-flight
        # step are never appended), so this is what the client has seen.
        out = self.num_output_tokens
        u = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": out,
            "total_tokens": self.num_prompt_tokens + out,
        }
        if self.num_cached_tokens > 0:  # (OpenAI's prompt_tokens_details.cached_tokens)
            u["cached_tokens"] = min(self.num_cached_tokens, self.num_prompt_tokens)
        return u

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, aborting={self.aborting!r})"
        )
