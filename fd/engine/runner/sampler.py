"""Choosing the next token from a batch of logits.

Greedy rows are an argmax (ties go to the lowest id). Random rows order the vocabulary by
logit (ties again favour the lower id), cut it by top-k, min-p and top-p, and invert the CDF at
one uniform number; only as much of the order is sorted as the cut and the number reach into
(a real vocabulary's full sort is ~13 ms a row, more than a GPU step). That number is what makes sampling reproducible: for a request with
a ``seed`` it is drawn from an RNG keyed by ``(seed, num_generated)`` alone, so token n of a
seeded request is the same whatever else shares the batch, and across runs and restarts
(given batch-invariant logits, which the model provides). Unseeded rows use the runner's own
generator.

Before either, a request's own parameters reshape its row alone (:func:`adjust`, vLLM's
order): the repetition penalty on every token of the prompt or the output, frequency and
presence penalties on the output's tokens, the logit bias, and, before ``min_tokens`` tokens,
EOS and the stop token ids ruled out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fd.control.sampling import SamplingParams

_U64 = (1 << 64) - 1


def seeded_uniform(seed: int, num_generated: int) -> float:
    return float(np.random.default_rng((seed & _U64, num_generated)).random())


def apply_penalties(
    logits: np.ndarray, sp: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> np.ndarray:
    """A float64 copy of one row of logits, penalized for the tokens the request has seen."""
    x = logits.astype(np.float64)
    rp = sp.repetition_penalty
    if rp != 1.0:
        seen = np.unique(np.asarray([*prompt_ids, *output_ids], dtype=np.int64))
        v = x[seen]
        x[seen] = np.where(v > 0, v / rp, v * rp)
    if output_ids and (sp.frequency_penalty or sp.presence_penalty):
        tokens, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        x[tokens] -= sp.frequency_penalty * counts + sp.presence_penalty
    return x


def adjust(
    logits: np.ndarray,
    sp: SamplingParams,
    num_generated: int,
    seen: tuple[Sequence[int], Sequence[int]] | None,
    eos_token_ids: Sequence[int],
) -> np.ndarray:
    """A float64 copy of one row of logits as the request's parameters reshape it; ``seen``:
    its (prompt, output) tokens so far, for penalties."""
    x = logits.astype(np.float64) if seen is None else apply_penalties(logits, sp, *seen)
    for token, bias in sp.logit_bias:
        x[token] += bias
    if sp.bad_words_ids and seen is not None:
        out = tuple(seen[1])
        for w in sp.bad_words_ids:  # the word's last token, where it would complete the word
            k = len(w) - 1
            if k == 0 or (len(out) >= k and out[-k:] == w[:-1]):
                x[w[-1]] = -np.inf
    if sp.allowed_token_ids:
        keep = x[list(sp.allowed_token_ids)]
        x[:] = -np.inf
        x[list(sp.allowed_token_ids)] = keep
    if num_generated < sp.min_tokens:
        banned = [*sp.stop_token_ids, *(() if sp.ignore_eos else eos_token_ids)]
        if banned:
            x[banned] = -np.inf
    return x


def likeliest(x: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` ids of the vocabulary in descending order of ``x``, ties to the lower id:
    ``np.argsort(-x, kind="stable")[:k]``, in O(V + k log k) instead of O(V log V) — a stable
    sort of a 152k vocabulary takes ~13 ms, once per sampled row per step."""
    n = len(x)
    if k >= n:
        return np.argsort(-x, kind="stable")
    kth = np.partition(x, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(x > kth)
    idx = np.concatenate((above, np.flatnonzero(x == kth)[: k - len(above)]))
    return idx[np.lexsort((idx, -x[idx]))]


#: How many of the likeliest tokens :func:`sample_row` sorts first; it sorts 8x more each time
#: the mass it needs lies beyond them (rarely: a row's likeliest few dozen tokens usually hold
#: most of its mass).
FIRST_PREFIX = 64


def sample_row(logits: np.ndarray, sp: SamplingParams, u: float) -> int:
    """One token from one row of logits given a uniform ``u`` in [0, 1): the tokens in
    descending order of logit (ties to the lower id), cut by top-k, min-p and top-p, and the
    inverse of their CDF at ``u``. Only as long a prefix of that order is sorted as the cut and
    ``u`` reach into."""
    x = logits.astype(np.float64) / sp.temperature
    n = len(x)
    p = np.exp(x - x.max())  # relative to the likeliest token: its p is 1
    k = sp.top_k if 0 < sp.top_k < n else n
    if sp.min_p > 0:
        k = min(k, int(np.count_nonzero(p >= sp.min_p)))
    total = float(p.sum()) if k == n else float(p[likeliest(x, k)].sum())
    nucleus = sp.top_p < 1.0
    need = (sp.top_p if nucleus else u) * total  # the mass the sorted prefix must reach
    j = min(k, FIRST_PREFIX)
    while True:
        order = likeliest(x, j)
        cdf = np.cumsum(p[order])
        if j == k or cdf[-1] > need:
            break
        j = min(k, j * 8)
    if nucleus:
        # the smallest prefix whose mass reaches top_p (always at least the top token)
        keep = int(np.searchsorted(cdf, need, side="left")) + 1
        cdf = cdf[:keep]
        need = u * cdf[-1]
    i = int(np.searchsorted(cdf, need, side="right"))
    return int(order[min(i, len(cdf) - 1)])


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` under one row of logits, and the ``top`` likeliest
    tokens' (ties to the lower id), from the model's distribution as it is."""
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    best = likeliest(lp, top) if top else ()
    return float(lp[token]), tuple((int(t), float(lp[t])) for t in best)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = ()):
        self._rng = np.random.default_rng(seed)
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens holds back, with stop ids

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        num_generated: Sequence[int],
        seen: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
    ) -> list[int]:
        """Tokens for each row of ``logits`` [N, vocab]; ``num_generated[i]`` is how many tokens
        row i's request had generated before this one; ``seen[i]``, for a row with penalties,
        its (prompt, output) tokens so far."""
        out = np.argmax(logits, axis=-1).tolist()
        for i, sp in enumerate(params):
            row = logits[i]
            if not sp.plain:
                adjusted = adjust(
                    row, sp, num_generated[i], seen[i] if seen is not None else None, self.eos_token_ids
                )
                # min_tokens can rule out the last token a finished grammar allows (EOS): the
                # grammar wins, as the request cannot go on validly
                row = adjusted if np.isfinite(adjusted).any() else row.astype(np.float64)
            elif sp.greedy:
                continue
            if sp.greedy:
                out[i] = int(np.argmax(row))
                continue
            u = seeded_uniform(sp.seed, num_generated[i]) if sp.seed is not None else self._rng.random()
            out[i] = sample_row(row, sp, u)
        return out
