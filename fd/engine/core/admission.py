"""Admission, the scheduler's side: how many requests an engine claims now (:func:`claimable`),
and whether one it claimed can ever run here (:func:`refusal`), which :meth:`Scheduler.can_admit
<fd.engine.core.scheduler.Scheduler.can_admit>` and :meth:`Scheduler.add
<fd.engine.core.scheduler.Scheduler.add>` answer with. (Claiming and starting requests, the
node's side, is fd/engine/node/admission.py.)

A request that cannot run (an empty prompt, one the context or the KV cache cannot hold, a
token id the model does not have) is finished with ``error`` at admission, before any step
could fail on it, rather than left to wait for room that never comes.
"""

from __future__ import annotations

from collections.abc import Collection

from fd.control.guided import GuidedError, after_token
from fd.control.request_data import RequestData
from fd.engine.core.block_manager import BlockManager
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.sequence import Sequence


def claimable(
    config: SchedulerConfig, blocks: BlockManager, num_running: int, waiting: Collection[Sequence]
) -> int:
    """How many more requests to claim now.

    Claiming is pull-based, so a request this engine cannot start soon is better left in
    Redis for another engine. Bounded by free running slots, by a small waiting queue,
    and by the blocks not already spoken for by the waiting requests' prompts (each new
    request needs at least one block).
    """
    slots = config.max_num_seqs - num_running - len(waiting)
    queue = config.max_num_waiting - len(waiting)
    committed = sum(blocks.blocks_for(s.num_tokens + 1) for s in waiting)
    spare_blocks = blocks.num_free - committed
    return max(0, min(slots, queue, spare_blocks))


def refusal(data: RequestData, config: SchedulerConfig, blocks: BlockManager) -> str | None:
    """Why the request can never run here (its error), or None if it can."""
    n = len(data.prompt_token_ids)
    if n == 0:
        return "empty prompt"
    if n + 1 > config.max_model_len:
        return f"prompt has {n} tokens; max_model_len {config.max_model_len} leaves no room to generate"
    if config.vocab_size and (outside := outside_vocabulary(data, config.vocab_size)):
        return outside
    if blocks.blocks_for(n + 1) > blocks.num_total:
        return f"prompt has {n} tokens; the KV cache holds only {blocks.num_total * blocks.block_size}"
    return None


def outside_vocabulary(data: RequestData, vocab_size: int) -> str | None:
    """What is wrong with a request that names a token id the model does not have (in its
    prompt, or in a sampling field that the sampler indexes the logits with), or None. The API
    refuses such requests; a hand-written one is ended here, before any step could fail on it."""
    sp = data.sampling
    try:
        after = after_token(sp.guided) if sp.guided else None
    except GuidedError:
        after = None  # (a malformed spec is the guided check's to refuse)
    named = (
        ("prompt", data.prompt_token_ids),
        ("stop_token_ids", sp.stop_token_ids),
        ("allowed_token_ids", sp.allowed_token_ids),
        ("bad_words_ids", tuple(t for w in sp.bad_words_ids for t in w)),
        ("logit_bias", tuple(t for t, _ in sp.logit_bias)),
        ("guided", () if after is None else (after,)),
    )
    for name, ids in named:
        if ids and max(ids) >= vocab_size:
            return f"{name} token id {max(ids)} is outside the model's vocabulary of {vocab_size}"
    return None
