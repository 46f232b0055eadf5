"""fd/engine/model/cpu_attention.py: RoPE and the cache writes, and each decode sequence's
attention read from its blocks in place, equal numpy's; inside the model they give the general
path's logits, and a sequence's output does not depend on its batch."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd.engine.model import cpu_attention
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.model import Blocks, random_prompt, run_batched, tiny_dir  # noqa: F401  (the fixture)


def _kernels_here():
    """The kernels are fd's own: on this project's machines (x86 with g++) they must build."""
    assert cpu_attention.unavailable() is None, cpu_attention.unavailable()


def _reference(q, k_cache, v_cache, tables, lengths, kvh, g, bs, window=None):
    """Softmax attention of each sequence's one query over its own context, in float64."""
    s, nh, hd = q.shape
    out = np.zeros((s, nh * hd))
    for i in range(s):
        first = 0 if window is None else max(0, lengths[i] - window)
        for h in range(kvh):
            k = np.concatenate([k_cache[h, b].reshape(bs, hd) for b in tables[i]])[first : lengths[i]]
            v = np.concatenate([v_cache[h, b].reshape(bs, hd) for b in tables[i]])[first : lengths[i]]
            sc = q[i, h * g : (h + 1) * g].astype(np.float64) @ k.T
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[i, h * g * hd : (h + 1) * g * hd] = (p @ v).ravel()
    return out


@pytest.mark.parametrize(
    "kvh,g,hd,window", [(3, 3, 64, None), (2, 2, 32, None), (1, 4, 16, 21), (4, 1, 128, 5)]
)
def test_decode_equals_softmax_attention_over_each_sequences_own_blocks(kvh, g, hd, window):
    _kernels_here()
    rng = np.random.default_rng(kvh * 100 + hd)
    bs, blocks, s = 16, 50, 7
    lengths = rng.integers(1, 5 * bs, s)
    lengths[0] = 1  # (a first token: its own key alone)
    nb = int(-(-lengths.max() // bs))
    # scattered tables, padded with a block of someone else's (stale) K/V, which must not count
    tables = np.stack([rng.permutation(blocks)[:nb] for _ in range(s)]).astype(np.int64)
    for i, n in enumerate(lengths):
        tables[i, -(-n // bs) :] = 0
    k_cache = (3 * rng.standard_normal((kvh, blocks, bs * hd))).astype(np.float32)
    v_cache = rng.standard_normal((kvh, blocks, bs * hd)).astype(np.float32)
    q = rng.standard_normal((s + 3, kvh * g, hd)).astype(np.float32)
    rows = rng.permutation(s + 3)[:s].astype(np.int64)  # (queries at any rows of q)
    shape = cpu_attention.LayerShape(kvh * g, kvh, hd, bs, blocks * bs, threads=2)
    got = cpu_attention.attend(
        shape,
        paddle.to_tensor(q.reshape(s + 3, -1)),
        rows,
        tables,
        lengths.astype(np.int64),
        window,
        paddle.to_tensor(k_cache),
        paddle.to_tensor(v_cache),
    )
    want = _reference(q[rows], k_cache, v_cache, tables, lengths, kvh, g, bs, window)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)


def test_rope_store_rotates_q_and_k_and_writes_k_and_v_at_their_slots():
    _kernels_here()
    rng = np.random.default_rng(3)
    nh, kvh, hd, bs, blocks, rows = 6, 2, 32, 16, 9, 11
    num_slots = blocks * bs
    qkv = rng.standard_normal((rows, (nh + 2 * kvh) * hd)).astype(np.float32)
    positions = rng.integers(0, 40, rows).astype(np.int64)
    slots = rng.permutation(num_slots)[:rows].astype(np.int64)
    ang = np.arange(64)[:, None] * rng.random(hd)[None, :]
    sign = np.r_[-np.ones(hd // 2), np.ones(hd // 2)]
    rope = np.stack([np.cos(ang), np.sin(ang) * sign], axis=1).astype(np.float32)  # [P, 2, hd]
    k_cache = paddle.zeros([kvh, blocks, bs * hd])
    v_cache = paddle.zeros([kvh, blocks, bs * hd])
    q_out = paddle.empty([rows, nh * hd])
    shape = cpu_attention.LayerShape(nh, kvh, hd, bs, num_slots, threads=2)
    cpu_attention.rope_store(
        shape,
        paddle.to_tensor(qkv),
        paddle.to_tensor(positions),
        paddle.to_tensor(slots),
        paddle.to_tensor(rope),
        k_cache,
        v_cache,
        q_out,
    )
    x = qkv[:, : (nh + kvh) * hd].reshape(rows, nh + kvh, hd)
    cos, sin = rope[positions, 0][:, None], rope[positions, 1][:, None]
    rotated = x * cos + np.roll(x, hd // 2, axis=-1) * sin  # (the model's RoPE: llama.py _qkv)
    np.testing.assert_allclose(q_out.numpy(), rotated[:, :nh].reshape(rows, -1), atol=1e-6)
    k_slots = k_cache.numpy().reshape(kvh, num_slots, hd)
    v_slots = v_cache.numpy().reshape(kvh, num_slots, hd)
    v = qkv[:, (nh + kvh) * hd :].reshape(rows, kvh, hd)
    for h in range(kvh):
        np.testing.assert_allclose(k_slots[h, slots], rotated[:, nh + h], atol=1e-6)
        np.testing.assert_array_equal(v_slots[h, slots], v[:, h])
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    assert not k_slots[:, untouched].any() and not v_slots[:, untouched].any()


def test_the_model_through_the_kernels_gives_the_general_paths_logits(tiny_dir):  # noqa: F811
    _kernels_here()
    runner = ModelRunner(tiny_dir, num_blocks=400, block_size=16)
    assert runner.model.cpu_attention is not None
    prompts = {f"r{i}": random_prompt(i, 20 + 7 * i) for i in range(12)}
    chunks = {f"r{i}": 16 for i in range(0, 12, 3)}  # (prefills chunked beside the decodes)
    # a chunk past MAX_CHUNK: the general path, beside the kernels' queries in the same step
    prompts["long"] = random_prompt(99, 2 * cpu_attention.MAX_CHUNK + 40)
    chunks["long"] = cpu_attention.MAX_CHUNK + 20
    got, got_logits = run_batched(runner, prompts, 6, chunks, Blocks(400, seed=5))
    runner.model.cpu_attention = None
    want, want_logits = run_batched(runner, prompts, 6, chunks, Blocks(400, seed=5))
    assert got == want
    for r in prompts:
        np.testing.assert_allclose(
            np.stack(got_logits[r]), np.stack(want_logits[r]), atol=1e-4
        )  # (sums in another order)


def test_a_sequences_output_does_not_depend_on_the_batch_around_it():
    """Each sequence is its own task, read in its own order: the same bits alone, in a batch of
    40, on one thread or two."""
    _kernels_here()
    rng = np.random.default_rng(11)
    kvh, g, hd, bs, blocks, s = 3, 3, 64, 16, 300, 40
    lengths = rng.integers(1, 7 * bs, s).astype(np.int64)
    tables = rng.permutation(blocks)[: s * 7].reshape(s, 7).astype(np.int64)
    k_cache = paddle.to_tensor(rng.standard_normal((kvh, blocks, bs * hd)).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal((kvh, blocks, bs * hd)).astype(np.float32))
    q = paddle.to_tensor(rng.standard_normal((s, kvh * g * hd)).astype(np.float32))
    rows = np.arange(s, dtype=np.int64)
    two = cpu_attention.LayerShape(kvh * g, kvh, hd, bs, blocks * bs, threads=2)
    one = cpu_attention.LayerShape(kvh * g, kvh, hd, bs, blocks * bs, threads=1)
    batch = cpu_attention.attend(two, q, rows, tables, lengths, None, k_cache, v_cache).numpy()
    for i in (0, 17, 39):
        alone = cpu_attention.attend(
            one, q, rows[i : i + 1], tables[i : i + 1], lengths[i : i + 1], None, k_cache, v_cache
        )
        np.testing.assert_array_equal(alone.numpy()[0], batch[i])
