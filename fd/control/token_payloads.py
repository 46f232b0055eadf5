"""The payloads a ``tokens`` event carries beside its token ids: log-probabilities (of the
output's and of the prompt's tokens) and an embedding, as the JSON-able fields of the event.

Each ``*_field`` function is the engine's writer; its reader, the API's, reads a field back
or answers None when it is not that shape (a hand-typed event), so the tokens are still shown.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, TypeAlias

from fd.control.events import JsonObject

#: One token's log-probability and its likeliest alternatives, (token id, log-probability),
#: likeliest first.
LogprobEntry: TypeAlias = tuple[float, Sequence[tuple[int, float]]]
#: A prompt token's entry: a :data:`LogprobEntry`, with the token's rank where the runner has it.
PromptLogprobEntry: TypeAlias = LogprobEntry | tuple[float, Sequence[tuple[int, float]], int]
#: An entry read back from an event: its alternatives as a list.
ReadLogprobEntry: TypeAlias = tuple[float, list[tuple[int, float]]]


def embedding_field(vector: bytes) -> str:
    """A tokens event's ``embedding``: the runner's float32 bytes, as base64 text."""
    return base64.b64encode(vector).decode("ascii")


def embedding_vector(field: Any) -> Any:
    """:func:`embedding_field` read back, a float32 numpy array; None when it is not that
    shape (a hand-typed event)."""
    import numpy as np

    try:
        raw = base64.b64decode(field, validate=True)
    except (TypeError, ValueError):
        return None
    if not raw or len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<f4")


def prompt_logprobs_field(prompt: Sequence[int], entries: Sequence[PromptLogprobEntry]) -> JsonObject:
    """Entries of (log-probability, alternatives[, rank]): the rank (1: the likeliest token of
    its position) rides as ``rank`` when every entry has one."""
    out = {"ids": list(prompt), **logprobs_field([e[:2] for e in entries])}
    ranked = [e for e in entries if len(e) > 2]  # (the entries with a rank, typed as such)
    if entries and len(ranked) == len(entries):
        out["rank"] = [int(e[2]) for e in ranked]
    return out


def prompt_logprob_ranks(field: Any, n: int) -> list[int] | None:
    """:func:`prompt_logprobs_field`'s ranks read back (``n`` of them), or None."""
    try:
        ranks = [int(r) for r in field["rank"]]
    except (TypeError, KeyError, ValueError):
        return None
    return ranks if len(ranks) == n else None


def prompt_logprobs_entries(field: Any) -> tuple[list[int], list[ReadLogprobEntry]] | None:
    """:func:`prompt_logprobs_field` read back: the prompt's ids and an entry for each but the
    first; None when it is not that shape."""
    try:
        ids = [int(t) for t in field["ids"]]
    except (TypeError, KeyError, ValueError):
        return None
    entries = logprobs_entries(field, len(ids) - 1)
    return None if entries is None else (ids, entries)


def logprobs_field(entries: Sequence[LogprobEntry]) -> JsonObject:
    """A tokens event's ``logprobs``: per token, its log-probability and the likeliest
    alternatives as (token id, log-probability), likeliest first."""
    return {"lp": [lp for lp, _ in entries], "top": [[list(pair) for pair in top] for _, top in entries]}


def logprobs_entries(field: Any, n_tokens: int) -> list[ReadLogprobEntry] | None:
    """:func:`logprobs_field` read back, one entry per token; None when it is not that shape
    (a hand-typed event: its tokens are shown without log-probabilities)."""
    try:
        lps, tops = field["lp"], field["top"]
        if len(lps) != n_tokens or len(tops) != n_tokens:
            return None
        return [(float(lp), [(int(t), float(v)) for t, v in top]) for lp, top in zip(lps, tops, strict=True)]
    except (TypeError, KeyError, ValueError):
        return None
