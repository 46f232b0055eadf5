"""fd/engine/model/paged_attention.py: decode attention read from the paged cache in place equals
the gather path's, alone and inside the model."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd.engine.model import paged_attention
from fd.engine.model.llama import MASKED
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.model import Blocks, random_prompt, run_batched, tiny_dir  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(
    not paged_attention.available(), reason="this Paddle build's MKL has no cblas_sgemm_batch (x86 wheels do)"
)


def _reference(q, k_cache, v_cache, tables, lengths, kvh, g, bs):
    """Masked softmax attention of each sequence's one query over its own context, in numpy."""
    s, nh, hd = q.shape
    out = np.zeros((s, nh * hd), np.float32)
    for i in range(s):
        for h in range(kvh):
            k = np.concatenate([k_cache[h, b].reshape(bs, hd) for b in tables[i]])[: lengths[i]]
            v = np.concatenate([v_cache[h, b].reshape(bs, hd) for b in tables[i]])[: lengths[i]]
            sc = q[i, h * g : (h + 1) * g] @ k.T
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[i, h * g * hd : (h + 1) * g * hd] = (p @ v).ravel()
    return out


@pytest.mark.parametrize("kvh,g,hd", [(3, 3, 64), (2, 2, 32), (1, 4, 16)])
def test_it_equals_softmax_attention_over_each_sequences_own_blocks(kvh, g, hd):
    rng = np.random.default_rng(kvh * 100 + hd)
    bs, blocks, s = 16, 50, 7
    lengths = rng.integers(1, 5 * bs, s)
    nb = int(-(-lengths.max() // bs))
    # scattered tables, padded with a block of someone else's (stale, finite) K/V
    tables = np.stack([rng.permutation(blocks)[:nb] for _ in range(s)])
    for i, n in enumerate(lengths):
        tables[i, -(-n // bs) :] = 0
    k_cache = rng.standard_normal((kvh, blocks, bs * hd)).astype(np.float32)
    v_cache = rng.standard_normal((kvh, blocks, bs * hd)).astype(np.float32)
    q = rng.standard_normal((s, kvh * g, hd)).astype(np.float32)
    mask = np.where(np.arange(nb * bs)[None, :] < lengths[:, None], 0.0, MASKED).astype(np.float32)
    mask_t = paddle.expand(paddle.to_tensor(mask).reshape([1, s, 1, 1, nb * bs]), [kvh, s, 1, g, nb * bs])
    decode = paged_attention.PagedDecode(tables, kvh, g, hd, bs, blocks)
    got = decode(paddle.to_tensor(q), paddle.to_tensor(k_cache), paddle.to_tensor(v_cache), mask_t)
    want = _reference(q, k_cache, v_cache, tables, lengths, kvh, g, bs)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5)


def test_only_groups_with_enough_context_take_it():
    assert paged_attention.worth_it(32, 192, 3, 64) and paged_attention.worth_it(6, 160, 3, 64)
    assert not paged_attention.worth_it(1, 1024, 3, 64)  # (one sequence: too few products)
    assert not paged_attention.worth_it(8, 160, 2, 32)  # (the tiny model's 8: too little to copy)


def test_the_model_decodes_a_large_batch_in_place_to_the_gathers_logits(tiny_dir, monkeypatch):  # noqa: F811
    runner = ModelRunner(tiny_dir, num_blocks=400, block_size=16)
    assert runner.model.paged_decode
    calls = []
    real = paged_attention.PagedDecode.__call__
    monkeypatch.setattr(
        paged_attention.PagedDecode, "__call__", lambda self, *a: calls.append(1) or real(self, *a)
    )
    prompts = {f"r{i}": random_prompt(i, 60 + 3 * i) for i in range(32)}
    chunks = {f"r{i}": 64 for i in range(32)}  # (prefills chunked beside the decodes)
    got, got_logits = run_batched(runner, prompts, 6, chunks, Blocks(400, seed=5))
    assert calls, "no decode step took the in-place path"
    runner.model.paged_decode = False
    want, want_logits = run_batched(runner, prompts, 6, chunks, Blocks(400, seed=5))
    assert got == want
    for r in prompts:
        np.testing.assert_allclose(
            np.stack(got_logits[r]), np.stack(want_logits[r]), atol=1e-4
        )  # (sums in another order)
