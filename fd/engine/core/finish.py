"""When a request is finished by its tokens: an end token, a stop string, ``max_tokens``, or
the context (``max_model_len``); and whether the tokens its in-flight steps will sample reach
the last two, which the scheduler does not schedule past."""

from __future__ import annotations

from fd.engine.core.config import SchedulerConfig
from fd.engine.core.sequence import Sequence


def reason(
    seq: Sequence, token: int, stop_string: str | None, config: SchedulerConfig
) -> tuple[str | None, str | int | None]:
    """(finish_reason, stop_reason) once ``token``, its last, is in ``seq``; (None, None) if
    it goes on. ``stop_string``: the stop string the runner found it ending with, if any."""
    sp = seq.sampling
    if sp.ends_on(token, config.eos_token_ids):
        return "stop", token if token in sp.stop_token_ids else None
    if stop_string is not None:
        return "stop", stop_string
    if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= config.max_model_len:
        return "length", None
    return None, None


def ends_on_pending(seq: Sequence, config: SchedulerConfig) -> bool:
    """Its pending tokens reach ``max_tokens`` or the context: nothing to schedule after."""
    return (
        seq.num_output_tokens + seq.num_pending >= seq.sampling.max_tokens
        or seq.num_tokens + seq.num_pending >= config.max_model_len
    )
