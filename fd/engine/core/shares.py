"""A request's share of a step (:class:`~fd.engine.core.outputs.ScheduledSeq`), made from the
scheduler's :class:`~fd.engine.core.sequence.Sequence`: what the runner is told of it, and no
more, since with a model worker every share crosses a pipe each step."""

from __future__ import annotations

from dataclasses import replace

from fd.engine.core.outputs import ScheduledSeq
from fd.engine.core.sequence import PLACEHOLDER, Sequence


def share(seq: Sequence, n: int, block_table: tuple[int, ...]) -> ScheduledSeq:
    """``seq``'s next ``n`` tokens as a step's share, from where the steps before (in flight
    or done) leave it; ``block_table``: its KV blocks, covering them."""
    start = seq.num_scheduled
    token_ids = tuple(seq.token_ids[start : start + n])
    if len(token_ids) < n:  # the pending token: only ever a decode of exactly that one
        token_ids = (PLACEHOLDER,)
    sample = start + n == seq.num_tokens + seq.num_pending
    penalized = sample and seq.sampling.needs_history
    # (the prompt only for the repetition penalty: the others count the output alone, and
    # a long prompt would cross the worker's pipe again every step)
    from_ = 0 if not penalized or seq.sampling.repetition_penalty != 1.0 else seq.num_prompt_tokens
    ss = ScheduledSeq(
        request_id=seq.request_id,
        token_ids=token_ids,
        start_pos=start,
        block_table=block_table,
        sample=sample,
        sampling=seq.sampling,
        num_generated=seq.num_output_tokens + seq.num_pending,
        history=tuple(seq.token_ids[from_:]) if penalized else (),
        num_prompt_tokens=seq.num_prompt_tokens - from_ if penalized else 0,
    )
    if seq.sampling.prompt_logprobs is not None and start < seq.num_prompt_tokens:
        end = start + n
        ss = replace(
            ss,
            prompt_len=seq.num_prompt_tokens,
            prompt_next=seq.token_ids[end] if end < seq.num_prompt_tokens else None,
        )
    return ss
