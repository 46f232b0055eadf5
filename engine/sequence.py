"""One request's state inside the engine.

Tokens are one list, prompt then generated, because after a preemption the recompute prefill
feeds both alike; ``num_computed_tokens`` is how many of them have KV in the request's blocks.
A decode is then just the case where exactly one token (the last sampled) is not computed.
The block table itself lives in the BlockManager, the single owner of the pool.
"""

from __future__ import annotations

import enum

from control.events import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # holds no blocks: never started, or preempted
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request_id", "arrival", "sampling", "num_prompt_tokens", "token_ids",
                 "num_computed_tokens", "status", "aborting", "num_preemptions")

    def __init__(self, request_id: str, prompt_token_ids: tuple[int, ...],
                 sampling: SamplingParams, arrival: int):
        self.request_id = request_id
        self.arrival = arrival  # admission order: FCFS priority, and who gets preempted first
        self.sampling = sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        # The abort source once an abort arrived while the request was in the in-flight step:
        # it must not be scheduled again, but its blocks stay held until that step is folded in.
        self.aborting: str | None = None
        self.num_preemptions = 0

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
        return self.num_output_tokens > 0 and self.num_uncomputed == 1

    def usage(self) -> dict[str, int]:
        # Every generated token was emitted in a Tokens event (tokens of an aborted in-flight
        # step are never appended), so this is what the client has seen.
        out = self.num_output_tokens
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": out,
                "total_tokens": self.num_prompt_tokens + out}

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, aborting={self.aborting!r})")
