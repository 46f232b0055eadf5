"""The boundary between the scheduler and the model runner (vLLM v1's split).

The scheduler decides (:class:`SchedulerOutput`), the runner computes (:class:`RunnerOutput`),
and the scheduler folds the result back in. Both are plain values so a step can be journaled
and replayed without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from fd.control.events import Event
from fd.control.sampling import SamplingParams

#: A token's log-probability and the likeliest tokens' as (id, log-probability), likeliest first.
Logprob: TypeAlias = tuple[float, tuple[tuple[int, float], ...]]
#: A prompt token's: the same, and its rank among its row's tokens (1: the likeliest).
PromptLogprob: TypeAlias = tuple[float, tuple[tuple[int, float], ...], int]


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens fed this step: a prefill chunk, or the one decode token
    start_pos: int  # position of token_ids[0] in the sequence
    block_table: tuple[int, ...]  # KV blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when this step ends the prompt or decodes: the runner samples a token
    sampling: SamplingParams
    num_generated: int  # tokens generated before this step; keys the seeded RNG per token
    # Only when it samples with penalties (SamplingParams.penalized): the request's tokens the
    # scheduler knows, prompt (only for a repetition penalty) then generated, and how many are
    # prompt. A token sampled by the step just before (async scheduling) is not among them:
    # the runner adds its own.
    history: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    # Only when it asked for prompt log-probabilities and this chunk is within its prompt: the
    # prompt's length, and the prompt token after the chunk (None at the prompt's end): what
    # the chunk's last position is scored against.
    prompt_len: int = 0
    prompt_next: int | None = None


@dataclass(frozen=True, slots=True)
class Aborted:
    """What an abort decided: its events (stage 1, and stages 2-3 for a request no step
    holds), and ``drop``, the aborted requests a step in flight still holds, which the runner
    is told to leave out of any step it has not started (their blocks then come back after the
    running step, not after the queued one too)."""

    events: list[Event] = field(default_factory=list)
    drop: tuple[str, ...] = ()

    def __add__(self, other: Aborted) -> Aborted:
        return Aborted(self.events + other.events, self.drop + other.drop)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step: int
    seqs: tuple[ScheduledSeq, ...]
    num_batched_tokens: int = 0
    # What deciding this step did to requests besides scheduling them (``Preempted``, and the
    # ``Final`` of a request that outgrew the whole pool), in order: the caller publishes
    # them. Never sent to the runner.
    events: tuple[Event, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    step: int
    sampled: dict[str, int]  # request_id -> sampled token, for every seq with sample=True
    # requests whose new text hit a stop string (found by the node's detokenizer before
    # update(); the scheduler then finishes them with finish_reason="stop")
    stopped: dict[str, str] = field(default_factory=dict)  # request_id -> the stop string
    # Requests that asked for log-probabilities: request_id -> (the sampled token's, and the
    # likeliest tokens' as (id, log-probability), likeliest first). Data, never a decision.
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    # Requests that asked for prompt log-probabilities and had prompt in this step:
    # request_id -> (position of the first prompt token scored, one entry a token as above).
    prompt_logprobs: dict[str, tuple[int, tuple[PromptLogprob, ...]]] = field(default_factory=dict)
    # Embeddings requests (SamplingParams.embed) whose prompt ended in this step: request_id ->
    # the model's final hidden state at the prompt's last position, float32 little-endian.
    embeddings: dict[str, bytes] = field(default_factory=dict)
    # When the runner ran the step, wall-clock ms (start, end), if it says: informational,
    # for the journal (when each step really ran); never part of a decision.
    ran: tuple[int, int] | None = None
    # Requests whose share of the step failed (an exception in the forward, the sampler, the
    # grammar, or the detokenizer as the node folds the step in): request_id -> what went
    # wrong. They have no token here; the scheduler ends each with an error.
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def failure(cls, out: SchedulerOutput, error: str) -> RunnerOutput:
        """The result of a step that failed as a whole, for each of its requests: what a
        runner that cannot tell which request broke the step says."""
        return cls(step=out.step, sampled={}, failed={s.request_id: error for s in out.seqs})
