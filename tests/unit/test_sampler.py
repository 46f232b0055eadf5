"""Sampling: greedy, temperature, top-k, top-p, and seeded reproducibility."""

from __future__ import annotations

import numpy as np

from fd.control.sampling import SamplingParams
from fd.engine.runner.sampler import Sampler

V = 64


def _logits(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, V)) * 2).astype(np.float32)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    x = _logits(5)
    x[4, [7, 30]] = 100.0
    greedy = SamplingParams(temperature=0.0)
    got = Sampler().sample(x, [greedy] * 5, [0] * 5)
    assert got[:4] == np.argmax(x[:4], axis=-1).tolist()
    assert got[4] == 7


def test_top_k_one_is_greedy_even_when_hot():
    x = _logits(8, 1)
    sp = SamplingParams(temperature=5.0, top_k=1)
    assert Sampler(3).sample(x, [sp] * 8, list(range(8))) == np.argmax(x, axis=-1).tolist()


def test_tiny_top_p_is_argmax():
    x = _logits(8, 2)
    sp = SamplingParams(temperature=1.5, top_p=1e-6)
    assert Sampler(4).sample(x, [sp] * 8, list(range(8))) == np.argmax(x, axis=-1).tolist()


def test_temperature_spreads_and_top_k_bounds():
    row = _logits(1, 3)
    s = Sampler(5)
    hot = SamplingParams(temperature=1.0)
    drawn = [s.sample(row, [hot], [0])[0] for _ in range(400)]
    assert len(set(drawn)) > 10
    # the empirical distribution follows softmax(row)
    p = np.exp(row[0] - row[0].max())
    p /= p.sum()
    top = int(np.argmax(p))
    assert abs(drawn.count(top) / 400 - p[top]) < 0.08
    k3 = SamplingParams(temperature=1.0, top_k=3)
    allowed = set(np.argsort(-row[0])[:3].tolist())
    assert {s.sample(row, [k3], [0])[0] for _ in range(200)} == allowed


def test_top_p_keeps_the_nucleus():
    row = np.full((1, V), -10.0, dtype=np.float32)
    row[0, [3, 9, 20]] = [2.0, 1.5, 1.0]  # ~0.5, 0.3, 0.2 of the mass
    sp = SamplingParams(temperature=1.0, top_p=0.7)
    s = Sampler(6)
    assert {s.sample(row, [sp], [0])[0] for _ in range(300)} == {3, 9}


def test_seeded_sampling_is_reproducible_across_runs_and_batches():
    x = _logits(6, 4)
    a = SamplingParams(temperature=1.0, seed=42)
    b = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    free = SamplingParams(temperature=1.0)
    alone = [Sampler(0).sample(x[i : i + 1], [a], [n])[0] for i, n in enumerate(range(6))]
    # another run, another generator, other neighbours in the batch, another order
    params = [free, a, b, a, free, a, a, b, a, a]
    rows = np.stack([x[5], x[0], x[2], x[1], x[3], x[2], x[3], x[4], x[4], x[5]])
    ngen = [9, 0, 3, 1, 0, 2, 3, 1, 4, 5]
    got = Sampler(123).sample(rows, params, ngen)
    assert [got[1], got[3], got[5], got[6], got[8], got[9]] == alone
    # token n depends on (seed, n): different steps draw differently
    many = [Sampler(0).sample(x[:1], [a], [n])[0] for n in range(50)]
    assert len(set(many)) > 5
    # and a different seed gives a different sequence
    other = [Sampler(0).sample(x[:1], [SamplingParams(temperature=1.0, seed=43)], [n])[0] for n in range(50)]
    assert other != many


def test_unseeded_uses_the_runner_generator():
    x = _logits(1, 5)
    sp = SamplingParams(temperature=1.0)
    first = [Sampler(1).sample(x, [sp], [0])[0] for _ in range(20)]
    assert len(set(first)) == 1  # same runner seed, fresh generator: same first draw
    s = Sampler(1)
    assert len({s.sample(x, [sp], [0])[0] for _ in range(50)}) > 1


def test_frequency_and_presence_penalties_take_openais_formula_off_the_output_tokens():
    from fd.engine.runner.sampler import apply_penalties

    row = _logits(1, 11)[0]
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(row, sp, prompt_ids=[1, 2], output_ids=[5, 9, 5])
    want = row.astype(np.float64)
    want[5] -= 2 * 0.5 + 0.25
    want[9] -= 1 * 0.5 + 0.25  # the prompt's tokens 1 and 2 are not penalized
    np.testing.assert_allclose(got, want)
    assert got is not row and row.dtype == np.float32  # the logits themselves are untouched


def test_repetition_penalty_shrinks_every_seen_tokens_logit_whatever_its_sign():
    from fd.engine.runner.sampler import apply_penalties

    row = np.zeros(V, dtype=np.float32)
    row[[1, 2, 3, 4]] = [2.0, -1.0, 3.0, 5.0]
    got = apply_penalties(row, SamplingParams(repetition_penalty=2.0), prompt_ids=[1, 2, 1], output_ids=[3])
    assert got[[1, 2, 3, 4]].tolist() == [1.0, -2.0, 1.5, 5.0]  # 4 was never seen
    # below 1 it rewards repeats instead, as in vLLM
    assert apply_penalties(row, SamplingParams(repetition_penalty=0.5), [1], [])[1] == 4.0


def test_penalties_change_what_greedy_and_seeded_rows_pick():
    x = np.zeros((2, V), dtype=np.float32)
    x[:, 10], x[:, 11] = 5.0, 4.5
    greedy = SamplingParams(temperature=0.0, presence_penalty=1.0)
    hot = SamplingParams(temperature=0.05, top_k=2, seed=3, frequency_penalty=2.0)
    seen = [((), (10,)), ((), (10, 10))]
    assert Sampler().sample(x, [greedy, hot], [1, 2]) == [10, 10]  # (no history: no penalty)
    assert Sampler().sample(x, [greedy, hot], [1, 2], seen) == [11, 11]


def test_logit_bias_moves_a_token_up_or_out():
    x = _logits(2, 12)
    top = int(np.argmax(x[0]))
    sp = SamplingParams(temperature=0.0, logit_bias=((3, 100.0), (top, -100.0)))
    assert Sampler().sample(x[:1], [sp], [0]) == [3]
    gone = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    second = int(np.argsort(-x[0], kind="stable")[1])
    assert Sampler().sample(x[:1], [gone], [0]) == [second]


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_then():
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 2], x[0, 7], x[0, 9] = 9.0, 8.0, 7.0  # 2 is EOS, 7 a stop token id
    s = Sampler(eos_token_ids=(2,))
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    assert [s.sample(x, [sp], [n])[0] for n in range(5)] == [9, 9, 9, 2, 2]
    keep_eos = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert s.sample(x, [keep_eos], [0]) == [2]  # EOS ends nothing here: not held back


def test_min_p_drops_tokens_much_less_likely_than_the_top():
    row = np.log(np.asarray([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4), dtype=np.float32))
    us = np.linspace(0, 0.999, 400)
    plain = SamplingParams(temperature=1.0)
    cut = SamplingParams(temperature=1.0, min_p=0.4)  # keeps p >= 0.2: tokens 0 and 1
    assert {sample_row_u(row, plain, u) for u in us} >= {0, 1, 2, 3}
    assert {sample_row_u(row, cut, u) for u in us} == {0, 1}


def sample_row_u(row, sp, u):
    from fd.engine.runner.sampler import sample_row

    return sample_row(row, sp, float(u))


def _reference_row(row, sp, u):
    """The sampler's definition written out the slow way: the whole vocabulary sorted."""
    x = row.astype(np.float64) / sp.temperature
    order = np.argsort(-x, kind="stable")
    if 0 < sp.top_k < len(order):
        order = order[: sp.top_k]
    p = np.exp(x[order] - x[order[0]])
    if sp.min_p > 0:
        keep = int(np.count_nonzero(p >= sp.min_p))
        order, p = order[:keep], p[:keep]
    cdf = np.cumsum(p)
    if sp.top_p < 1.0:
        keep = int(np.searchsorted(cdf, sp.top_p * cdf[-1], side="left")) + 1
        cdf = cdf[:keep]
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(order[min(i, len(cdf) - 1)])


def test_the_partial_sort_draws_what_a_full_sort_would():
    """sample_row sorts only the prefix of the vocabulary it needs; every draw must equal the
    full sort's, over flat and peaked rows, ties, banned (-inf) tokens and every cut, including
    draws far into the tail (u near 1) that make it sort more."""
    from fd.engine.runner.sampler import likeliest, sample_row

    rng = np.random.default_rng(11)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
        for t in (0.7, 1.0, 2.5)
        for k in (0, 5, 300)
        for tp in (1.0, 0.9, 0.3)
        for mp in (0.0, 0.01)
    ]
    n_draws = 0
    for v, scale in ((50, 1.0), (5000, 1.0), (5000, 6.0), (20000, 0.2)):
        row = (rng.standard_normal(v) * scale).astype(np.float32)
        row[rng.choice(v, 30, replace=False)] = row.max()  # ties at the top
        m = min(100, v // 2)
        row[rng.choice(v, m, replace=False)] = np.round(row[:m], 1)  # ties elsewhere
        row[rng.choice(v, 10, replace=False)] = -np.inf  # banned (min_tokens, logit bias)
        for sp in params:
            for u in (*rng.random(8), 0.0, 0.999999):
                assert sample_row(row, sp, float(u)) == _reference_row(row, sp, float(u)), (v, sp, u)
                n_draws += 1
        for k in (1, 7, 64, v - 1, v):
            assert likeliest(row, k).tolist() == np.argsort(-row, kind="stable")[:k].tolist()
    assert n_draws == 4 * len(params) * 10
