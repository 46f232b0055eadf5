"""The model, its loader and the paged runner, checked against a non-paged full recompute."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.model.config import ModelConfig, UnsupportedModel
from fd.engine.model.loader import WeightError, load_model
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.model import BLOCK, GREEDY, Blocks, greedy_reference, random_prompt, run_batched, tiny_dir  # noqa: F401  (tiny_dir: a fixture)


@pytest.fixture(scope="module")
def runner(tiny_dir):
    # batch-invariant: these tests hold the paged path to full recompute and to each request
    # alone, token for token
    return ModelRunner(tiny_dir, num_blocks=160, block_size=BLOCK, batch_invariant=True)


def _copy(tiny_dir, tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(tiny_dir, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _assert_same_tokens(got, want, got_logits, want_logits, what):
    """Token-for-token equal; a difference is only excused by a near-tie at that very step,
    shown by both logit rows agreeing closely (after which the sequences legitimately part)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = np.sort(want_logits[i])[-2:]
            assert top2[1] - top2[0] < 1e-3, f"{what}: token {i} differs ({a} vs {b}), no near-tie"
            np.testing.assert_allclose(got_logits[i], want_logits[i], atol=1e-4)
            return
    assert got == want


# --------------------------------------------------------------------------- loading


def test_load_and_reference_is_deterministic(tiny_dir):
    prompt = random_prompt(0, 20)
    a = load_model(tiny_dir, progress=False).reference_logits(prompt)
    b = load_model(tiny_dir, progress=False).reference_logits(prompt)
    assert a.shape == (20, 512) and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert len(set(np.argmax(a, axis=-1).tolist())) > 5  # not a constant prediction
    # causal: logits at position i do not depend on later tokens
    c = load_model(tiny_dir, progress=False).reference_logits(prompt[:7])
    # (1e-4: row counts change how the CPU matmul rounds; a leak from later tokens is O(1))
    np.testing.assert_allclose(c, a[:7], atol=1e-4)


def test_greedy_output_varies(runner):
    out = greedy_reference(runner.model, random_prompt(1, 5), 16)
    assert len(set(out)) > 8


def test_missing_config(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(d))


def test_missing_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(d))


def test_unsupported_architecture_and_rope_scaling(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        load_model(str(d))
    _edit_config(d, architectures=["LlamaForCausalLM"], rope_scaling={"type": "yarn", "factor": 4})
    with pytest.raises(UnsupportedModel, match="rope_scaling"):
        load_model(str(d))


def test_shape_mismatch_and_missing_tensor_are_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    w = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    w[name] = w[name][:100]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(
        WeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\[100, 128\].*\[256, 128\]"
    ):
        load_model(str(d), progress=False)
    del w[name]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(d), progress=False)


def test_a_checkpoint_cut_short_is_refused_by_name(tiny_dir, tmp_path):
    """A partial download: the header promises more bytes than the file has."""
    d = _copy(tiny_dir, tmp_path, "cut")
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(WeightError, match=r"model\.safetensors ends inside a tensor"):
        load_model(str(d), progress=False)


def _save_bf16(tensors: dict[str, np.ndarray], path):
    """A bf16 safetensors file written by hand (numpy has no bfloat16)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        raw = (tensors[name].astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bf16_and_sharded_checkpoints_load_the_same_weights(tiny_dir, tmp_path):
    w = load_file(os.path.join(tiny_dir, "model.safetensors"))
    truncated = {k: (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in w.items()}
    f32 = _copy(tiny_dir, tmp_path, "f32")
    save_file(truncated, str(f32 / "model.safetensors"))
    bf16 = _copy(tiny_dir, tmp_path, "bf16")
    _save_bf16(w, bf16 / "model.safetensors")
    sharded = _copy(tiny_dir, tmp_path, "sharded")
    os.remove(sharded / "model.safetensors")
    names = sorted(truncated)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in parts.items():
        save_file({k: truncated[k] for k in keys}, str(sharded / fname))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in parts.items() for k in ks}})
    )
    prompt = random_prompt(2, 12)
    want = load_model(str(f32), progress=False).reference_logits(prompt)
    assert np.array_equal(load_model(str(bf16), progress=False).reference_logits(prompt), want)
    assert np.array_equal(load_model(str(sharded), progress=False).reference_logits(prompt), want)


# --------------------------------------------------------------------------- paged runner


def test_batching_invariance(runner):
    """16 requests in one batch (prompts prefilled whole or in chunks next to other requests'
    decodes) give token for token what each gives alone, and what full recompute gives."""
    lengths = [1, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 60]
    prompts = {f"r{i}": random_prompt(100 + i, n) for i, n in enumerate(lengths)}
    chunk = {"r10": 7, "r12": 13, "r13": 16, "r15": 25, "r14": 20}  # the rest: whole prompt
    steps = 12
    blocks = Blocks(runner.num_blocks, seed=0)
    batched, batched_logits = run_batched(runner, prompts, steps, chunk, blocks)
    for r, p in prompts.items():
        alone, alone_logits = run_batched(runner, {r: p}, steps, {}, blocks)
        _assert_same_tokens(batched[r], alone[r], batched_logits[r], alone_logits[r], f"{r} alone")
        ids = list(p)
        ref_logits = []
        for t in batched[r]:
            ref_logits.append(runner.model.reference_logits(ids)[-1])
            ids.append(t)
        ref = [int(np.argmax(x)) for x in ref_logits]
        _assert_same_tokens(batched[r], ref, batched_logits[r], ref_logits, f"{r} reference")
        np.testing.assert_allclose(np.stack(batched_logits[r]), np.stack(ref_logits), atol=1e-4)


def test_execute_samples_greedy_and_seeded(runner):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    blocks = Blocks(runner.num_blocks, seed=1)
    p = random_prompt(3, 10)
    t = blocks.table((), 10)
    seqs = (
        ScheduledSeq("g", tuple(p), 0, t, True, GREEDY, 0),
        ScheduledSeq("s", tuple(p), 0, t, True, seeded, 0),
    )
    res = runner.execute(SchedulerOutput(step=0, seqs=seqs))
    assert res.sampled["g"] == int(np.argmax(runner.model.reference_logits(p)[-1]))
    again = runner.execute(SchedulerOutput(step=1, seqs=seqs[1:]))
    assert again.sampled["s"] == res.sampled["s"]
    # a chunk that does not end the prompt samples nothing
    part = runner.execute(
        SchedulerOutput(step=2, seqs=(ScheduledSeq("g", tuple(p[:4]), 0, t, False, GREEDY, 0),))
    )
    assert part.sampled == {}
    blocks.release(t)


def test_num_blocks_from_budget(tiny_dir):
    r = ModelRunner(tiny_dir, kv_cache_bytes=1 << 20, block_size=16)
    # 2 layers x (K and V) x 16 slots x 2 heads x 32 dims x 4 bytes = 16 KiB per block
    assert r.num_blocks == 64
    assert r.max_model_len == 2048 and r.eos_token_ids == (1, 3)


def test_qwen2_with_biases_and_untied_head(tiny_dir, tmp_path, runner):
    d = _copy(tiny_dir, tmp_path, "qwen2")
    _edit_config(d, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False)
    w = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(5)
    for i in range(2):
        for proj, n in (("q", 128), ("k", 64), ("v", 64)):
            w[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
    save_file(w, str(d / "model.safetensors"))
    assert ModelConfig.from_dir(str(d)).qkv_bias
    qwen = ModelRunner(str(d), num_blocks=64)
    prompts = {f"q{i}": random_prompt(200 + i, n) for i, n in enumerate([4, 19, 33])}
    gen, logits = run_batched(qwen, prompts, 6, {"q2": 10}, Blocks(64, seed=2))
    for r, p in prompts.items():
        assert gen[r] == greedy_reference(qwen.model, p, 6), r
    p = prompts["q1"]
    assert not np.allclose(qwen.model.reference_logits(p), runner.model.reference_logits(p), atol=1e-2)
    # missing biases are named
    del w["model.layers.0.self_attn.k_proj.bias"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_model(str(d), progress=False)


def test_tied_embeddings(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, "tied")
    _edit_config(d, tie_word_embeddings=True)
    w = load_file(str(d / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(d / "model.safetensors"))
    m = load_model(str(d), progress=False)
    np.testing.assert_array_equal(m.lm_head.numpy(), w["model.embed_tokens.weight"].T)
    assert m.reference_logits(random_prompt(4, 6)).shape == (6, 512)


def _numpy_llama(model_dir, ids):
    """HF's Llama/Qwen2/Qwen3 forward written out in float64 numpy from the checkpoint itself:
    an independent check of the fused layout, RoPE, GQA head mapping, biases and Qwen3's
    per-head q/k norms."""
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    n = len(ids)
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":  # Meta's reference, one frequency at a time
        lo_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
        hi_wl = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
        scaled = []
        for f in inv:
            wl = 2 * np.pi / f
            if wl < hi_wl:
                scaled.append(f)
            elif wl > lo_wl:
                scaled.append(f / rs["factor"])
            else:
                sm = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / (
                    rs["high_freq_factor"] - rs["low_freq_factor"]
                )
                scaled.append((1 - sm) * f / rs["factor"] + sm * f)
        inv = np.array(scaled)
    ang = np.arange(n)[:, None] * np.concatenate([inv, inv])[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * g

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    def proj(h, name):
        return h @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)

    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    window = (
        cfg.get("sliding_window")
        if cfg["architectures"][0] in ("MistralForCausalLM", "Phi3ForCausalLM")
        else None
    )
    if window:  # key k seen from q only when q - window < k (transformers' sliding window)
        causal = causal + np.tril(np.full((n, n), -np.inf), -window)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k = (
            proj(h, p + "self_attn.q_proj").reshape(n, nh, hd),
            proj(h, p + "self_attn.k_proj").reshape(n, nkv, hd),
        )
        if p + "self_attn.q_norm.weight" in w:  # Qwen3
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q = rope(q)
        k = np.repeat(rope(k), nh // nkv, axis=1)
        v = np.repeat(proj(h, p + "self_attn.v_proj").reshape(n, nkv, hd), nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + proj(np.einsum("hqk,khd->qhd", a, v).reshape(n, nh * hd), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if p + "mlp.gate.weight" in w or p + "block_sparse_moe.gate.weight" in w:
            x = x + _numpy_moe(cfg, w, p, h, proj)
            continue
        g = proj(h, p + "mlp.gate_proj")
        x = x + proj(g / (1 + np.exp(-g)) * proj(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ head.T


def _numpy_moe(cfg, w, p, h, proj):
    """transformers' Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock, token by token: softmax
    over the router's logits, the top k, renormalised (Mixtral always; Qwen3-MoE with
    norm_topk_prob), each chosen expert's SwiGLU MLP weighted by its probability."""
    mixtral = p + "block_sparse_moe.gate.weight" in w
    router = w[p + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight")]
    k = cfg["num_experts_per_tok"]
    out = np.zeros_like(h)
    for t in range(len(h)):
        logits = router @ h[t]
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        top = np.argsort(-prob, kind="stable")[:k]
        weight = prob[top] / (prob[top].sum() if mixtral or cfg.get("norm_topk_prob") else 1.0)
        if p + "mlp.shared_expert_gate.weight" in w:  # Qwen2-MoE's shared expert, sigmoid-gated
            g = proj(h[t : t + 1], p + "mlp.shared_expert.gate_proj")
            shared = proj(
                g / (1 + np.exp(-g)) * proj(h[t : t + 1], p + "mlp.shared_expert.up_proj"),
                p + "mlp.shared_expert.down_proj",
            )[0]
            out[t] += shared / (1 + np.exp(-(w[p + "mlp.shared_expert_gate.weight"] @ h[t])[0]))
        for e, wt in zip(top, weight):
            names = (
                (
                    f"block_sparse_moe.experts.{e}.w1",
                    f"block_sparse_moe.experts.{e}.w3",
                    f"block_sparse_moe.experts.{e}.w2",
                )
                if mixtral
                else (f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj", f"mlp.experts.{e}.down_proj")
            )
            g = proj(h[t : t + 1], p + names[0])
            out[t] += wt * proj(g / (1 + np.exp(-g)) * proj(h[t : t + 1], p + names[1]), p + names[2])[0]
    return out


def _moe(tiny_dir, tmp_path, arch: str):
    """The tiny model made a mixture of experts: 4 experts of 64, 2 a token. Qwen3-MoE with its
    second layer dense (mlp_only_layers) and q/k norms; Mixtral sparse throughout."""
    d = _copy(tiny_dir, tmp_path, arch)
    rng = np.random.default_rng(21)
    w = load_file(str(d / "model.safetensors"))
    if arch == "qwen2_moe":  # (q/k/v biases, a shared expert; the top 2 not renormalised)
        _edit_config(
            d,
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )
        for i in range(2):
            for proj, n in (("q", 128), ("k", 64), ("v", 64)):
                w[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = (rng.standard_normal(n) * 0.1).astype(
                    np.float32
                )
            s = f"model.layers.{i}.mlp.shared_expert"
            w[s + ".gate_proj.weight"] = (rng.standard_normal((96, 128)) / np.sqrt(128)).astype(np.float32)
            w[s + ".up_proj.weight"] = (rng.standard_normal((96, 128)) / np.sqrt(128)).astype(np.float32)
            w[s + ".down_proj.weight"] = (rng.standard_normal((128, 96)) * 2 / np.sqrt(96)).astype(np.float32)
            w[s + "_gate.weight"] = (rng.standard_normal((1, 128)) * 0.2).astype(np.float32)
        sparse, router, names = (
            [0, 1],
            "mlp.gate",
            ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj"),
        )
    elif arch == "qwen3_moe":
        _edit_config(
            d,
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        for i in range(2):
            for norm in ("q_norm", "k_norm"):
                w[f"model.layers.{i}.self_attn.{norm}.weight"] = rng.uniform(0.5, 1.5, 32).astype(np.float32)
        sparse, router, names = (
            [0],
            "mlp.gate",
            ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj"),
        )
    else:
        _edit_config(
            d,
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=None,
        )
        sparse, router, names = (
            [0, 1],
            "block_sparse_moe.gate",
            (
                "block_sparse_moe.experts.{}.w1",
                "block_sparse_moe.experts.{}.w3",
                "block_sparse_moe.experts.{}.w2",
            ),
        )
    for i in sparse:
        p = f"model.layers.{i}."
        for m in ("gate_proj", "up_proj", "down_proj"):
            del w[p + f"mlp.{m}.weight"]
        w[p + router + ".weight"] = (rng.standard_normal((4, 128)) * 0.3).astype(np.float32)
        for e in range(4):
            w[p + names[0].format(e) + ".weight"] = (rng.standard_normal((64, 128)) / np.sqrt(128)).astype(
                np.float32
            )
            w[p + names[1].format(e) + ".weight"] = (rng.standard_normal((64, 128)) / np.sqrt(128)).astype(
                np.float32
            )
            w[p + names[2].format(e) + ".weight"] = (rng.standard_normal((128, 64)) * 2 / 8).astype(
                np.float32
            )
    save_file(w, str(d / "model.safetensors"))
    return d, w


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_mixture_of_experts_matches_numpy_forward_and_its_paged_path(tiny_dir, tmp_path, arch):
    d, w = _moe(tiny_dir, tmp_path, arch)
    cfg = ModelConfig.from_dir(str(d))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 64)
    assert cfg.sparse_layers == ((0,) if arch == "qwen3_moe" else (0, 1))
    assert cfg.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)
    prompt = random_prompt(13, 30)
    model = load_model(str(d), progress=False)
    np.testing.assert_allclose(
        model.reference_logits(prompt), _numpy_llama(str(d), prompt), atol=2e-3, rtol=0
    )
    # the router matters: every expert is chosen by some token of the prompt
    h = np.random.default_rng(0).standard_normal((64, 128))
    router = w["model.layers.0." + ("block_sparse_moe.gate" if arch == "mixtral" else "mlp.gate") + ".weight"]
    assert len(set(np.argsort(-(h @ router.T), axis=1)[:, :2].ravel())) == 4
    # batched with chunks and decodes: each request's tokens are what it gets alone and what
    # full recompute gives
    moe = ModelRunner(str(d), num_blocks=64, batch_invariant=True)
    prompts = {f"m{i}": random_prompt(400 + i, n) for i, n in enumerate([3, 9, 21, 34])}
    blocks = Blocks(64, seed=4)
    batched, batched_logits = run_batched(moe, prompts, 6, {"m3": 10}, blocks)
    for r, p in prompts.items():
        alone, alone_logits = run_batched(moe, {r: p}, 6, {}, blocks)
        _assert_same_tokens(batched[r], alone[r], batched_logits[r], alone_logits[r], f"{r} alone")
        np.testing.assert_allclose(
            np.stack(batched_logits[r]),
            np.stack(alone_logits[r][: len(batched_logits[r])]),
            atol=1e-4,
            err_msg=r,
        )
        assert batched[r] == greedy_reference(moe.model, p, 6), r
    # an expert missing is named
    del w[
        "model.layers.0."
        + ("block_sparse_moe.experts.3.w2" if arch == "mixtral" else "mlp.experts.3.down_proj")
        + ".weight"
    ]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match="experts.3"):
        load_model(str(d), progress=False)


def test_matches_an_independent_numpy_forward(tiny_dir, runner):
    prompt = random_prompt(6, 40)
    np.testing.assert_allclose(
        runner.model.reference_logits(prompt), _numpy_llama(tiny_dir, prompt), atol=2e-3, rtol=0
    )


def test_qwen2_matches_numpy_forward(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path, "qwen2np")
    _edit_config(d, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    w = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(8)
    for i in range(2):
        for proj, n in (("q", 128), ("k", 64), ("v", 64)):
            w[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
    save_file(w, str(d / "model.safetensors"))
    prompt = random_prompt(7, 25)
    np.testing.assert_allclose(
        load_model(str(d), progress=False).reference_logits(prompt),
        _numpy_llama(str(d), prompt),
        atol=2e-3,
        rtol=0,
    )


def test_fast_mode_is_close_to_the_reference(tiny_dir, runner):
    fast = ModelRunner(tiny_dir, num_blocks=32, batch_invariant=False)
    p = random_prompt(9, 3)
    seq = ScheduledSeq("f", tuple(p), 0, (0,), True, GREEDY, 0)
    got = fast.logits(SchedulerOutput(step=0, seqs=(seq,)))[0]
    np.testing.assert_allclose(got, runner.model.reference_logits(p)[-1], atol=1e-4)


def test_packed_gemms_agree_with_the_eager_ones(tiny_dir, runner):
    """Off batch invariance a CPU runner takes its GEMMs over MKL-packed weights (Paddle's x86
    CPU wheel ships MKL, as CI's does): products of 1 to 700 rows are the eager ones, a
    200-token prefill's last logits are the reference's, and the decodes after it give its
    greedy tokens."""
    from fd.engine.model import packed_gemm

    assert packed_gemm.available()
    fast = ModelRunner(tiny_dir, num_blocks=32, gemms="packed")
    assert fast.model.gemms == "packed" and fast.model.lm_head_packed is not None
    w = fast.model.layers[0]["gate_up"]
    for threads in (1, 2):  # (packed for the CPUs it may use; MKL's threads are per thread)
        packed_gemm.use_threads(threads)
        for rows in (1, 8, 33, 700):
            x = np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32)
            np.testing.assert_allclose(
                fast.model.layers[0]["gate_up_packed"](fast.model.tensor(x)).numpy(), x @ w.numpy(), atol=1e-4
            )
    packed_gemm.use_threads(1)
    with pytest.raises(ValueError, match="float32 \\[rows, 128\\]"):
        fast.model.layers[0]["gate_up_packed"](fast.model.tensor(np.ones((2, 64), np.float32)))
    p = random_prompt(21, 200)
    blocks = tuple(range(13))
    seq = ScheduledSeq("f", tuple(p), 0, blocks, True, GREEDY, 0)
    rows = fast.logits(SchedulerOutput(step=0, seqs=(seq,)))
    np.testing.assert_allclose(rows[0], runner.model.reference_logits(p)[-1], atol=1e-4)
    out = fast.execute(SchedulerOutput(step=1, seqs=(seq,))).sampled["f"]
    got = [out]
    for k in range(5):
        step = ScheduledSeq("f", (got[-1],), 200 + k, blocks, True, GREEDY, k + 1)
        got.append(fast.execute(SchedulerOutput(step=2 + k, seqs=(step,))).sampled["f"])
    assert got == greedy_reference(runner.model, p, 6)


def test_a_gemm_plan_serves_each_row_count_by_its_bucket():
    """A plan timed at 1, 8 and 32 rows serves 1-3 rows by the first choice, 4-15 by the
    second and every count above by the last; its threads are the most any choice takes."""
    from fd.engine.model.packed_gemm import GemmChoice, GemmPlan

    one, eight, many = GemmChoice("eager", 2), GemmChoice("packed", 1), GemmChoice("packed", 2)
    plan = GemmPlan(((3, one), (15, eight), (None, many)))
    assert [plan.choice(n) for n in (1, 3, 4, 15, 16, 700)] == [one, one, eight, eight, many, many]
    assert plan.routes == {"eager", "packed"} and plan.max_threads == 2
    assert str(plan) == (
        "eager on 2 thread(s) at 1-3 rows, packed on 1 thread(s) at 4-15 rows, packed on 2 thread(s) at 16+ rows"
    )
    assert GemmPlan.always("eager", 0).choice(5) == GemmChoice("eager", 0)


def test_gemms_auto_keeps_the_faster_route_and_the_same_logits(tiny_dir, runner):
    """By default a CPU runner times packed against eager GEMMs on its own weights at load and
    keeps one; either way its logits are the reference's. An unknown route is refused."""
    auto = ModelRunner(tiny_dir, num_blocks=32)
    routes = auto.model.gemm_plan.routes
    assert routes <= {"packed", "eager"} and routes
    assert (auto.model.lm_head_packed is None) == ("packed" not in routes)
    assert all(("qkv_packed" in layer) == ("packed" in routes) for layer in auto.model.layers)
    p = random_prompt(5, 40)
    seq = ScheduledSeq("a", tuple(p), 0, (0, 1, 2), True, GREEDY, 0)
    got = auto.logits(SchedulerOutput(step=0, seqs=(seq,)))[0]
    np.testing.assert_allclose(got, runner.model.reference_logits(p)[-1], atol=1e-4)
    with pytest.raises(ValueError, match="gemms must be eager, packed or auto"):
        ModelRunner(tiny_dir, num_blocks=32, gemms="fast")


def _qwen3(tiny_dir, tmp_path, name: str, head_dim: int = 48):
    """The tiny model made a Qwen3: per-head q/k norms, and a head_dim that is not
    hidden_size / heads (as Qwen3-0.6B's 128 against 1024 / 16)."""
    d = _copy(tiny_dir, tmp_path, name)
    _edit_config(d, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=head_dim)
    w = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(11)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        for proj, rows in (("q", 4 * head_dim), ("k", 2 * head_dim), ("v", 2 * head_dim)):
            w[p + f"{proj}_proj.weight"] = (rng.standard_normal((rows, 128)) * 0.05).astype(np.float32)
        w[p + "o_proj.weight"] = (rng.standard_normal((128, 4 * head_dim)) * 0.05).astype(np.float32)
        for norm in ("q_norm", "k_norm"):
            w[p + f"{norm}.weight"] = rng.uniform(0.5, 1.5, head_dim).astype(np.float32)
    save_file(w, str(d / "model.safetensors"))
    return d, w


def test_qwen3_matches_numpy_forward_and_its_paged_path(tiny_dir, tmp_path):
    d, w = _qwen3(tiny_dir, tmp_path, "qwen3")
    cfg = ModelConfig.from_dir(str(d))
    assert cfg.qk_norm and cfg.head_dim == 48 and not cfg.qkv_bias
    prompt = random_prompt(12, 30)
    model = load_model(str(d), progress=False)
    np.testing.assert_allclose(
        model.reference_logits(prompt), _numpy_llama(str(d), prompt), atol=2e-3, rtol=0
    )
    qwen = ModelRunner(str(d), num_blocks=64)
    prompts = {f"q{i}": random_prompt(300 + i, n) for i, n in enumerate([5, 21, 34])}
    gen, _ = run_batched(qwen, prompts, 6, {"q2": 10}, Blocks(64, seed=3))
    for r, p in prompts.items():
        assert gen[r] == greedy_reference(qwen.model, p, 6), r
    # the norms matter (a Qwen3 read as a Llama would answer differently), and are named when missing
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(str(d), progress=False)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_rope_scaling_frequencies():
    """Llama 3.1's own numbers (head_dim 128, theta 500,000): high frequencies untouched, low
    ones slowed by the factor, the band between blended, the whole still decreasing."""
    from fd.engine.model.config import rope_inv_freq

    base = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
    )
    plain = rope_inv_freq(ModelConfig.from_dict(base))
    got = rope_inv_freq(ModelConfig.from_dict({**base, "rope_scaling": LLAMA3_ROPE}))
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert high.sum() > 10 and low.sum() > 10 and (~high & ~low).sum() > 0
    np.testing.assert_array_equal(got[high], plain[high])
    np.testing.assert_allclose(got[low], plain[low] / 8)
    mid = ~high & ~low
    assert ((got[mid] < plain[mid]) & (got[mid] > plain[mid] / 8)).all()
    assert (np.diff(got) < 0).all()
    lin = rope_inv_freq(ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    np.testing.assert_allclose(lin, plain / 2)
    for bad in ({"rope_type": "llama3", "factor": 8.0}, {"rope_type": "dynamic", "factor": 2.0}, "x"):
        with pytest.raises(UnsupportedModel, match="rope_scaling"):
            ModelConfig.from_dict({**base, "rope_scaling": bad})


def test_a_llama3_scaled_model_matches_numpy_forward_and_its_paged_path(tiny_dir, tmp_path):
    # an original context short enough that the tiny model's 16 frequencies fall in all three bands
    d = _copy(tiny_dir, tmp_path, "llama31")
    _edit_config(d, rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 64}, rope_theta=5000.0)
    prompt = random_prompt(13, 40)
    model = load_model(str(d), progress=False)
    np.testing.assert_allclose(
        model.reference_logits(prompt), _numpy_llama(str(d), prompt), atol=2e-3, rtol=0
    )
    plain = _copy(tiny_dir, tmp_path, "llama31-plain")
    _edit_config(plain, rope_theta=5000.0)
    assert not np.allclose(
        model.reference_logits(prompt),
        load_model(str(plain), progress=False).reference_logits(prompt),
        atol=1e-2,
    )
    runner = ModelRunner(str(d), num_blocks=64)
    prompts = {f"l{i}": random_prompt(400 + i, n) for i, n in enumerate([6, 23, 37])}
    gen, _ = run_batched(runner, prompts, 6, {"l2": 10}, Blocks(64, seed=4))
    for r, p in prompts.items():
        assert gen[r] == greedy_reference(runner.model, p, 6), r


def test_mistral_is_llama_with_a_sliding_window(tiny_dir, tmp_path, runner):
    """Mistral 7B v0.1's sliding window (4096 of 32768), here 6: a position attends to the 6
    up to its own. The same logits as the numpy forward's; through the paged path (chunks and
    decodes past the window) the reference's greedy tokens; a window as wide as the context
    changes nothing."""
    d = _copy(tiny_dir, tmp_path, "mistral")
    _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    p = random_prompt(14, 20)
    np.testing.assert_array_equal(
        load_model(str(d), progress=False, batch_invariant=True).reference_logits(p),
        runner.model.reference_logits(p),
    )
    _edit_config(d, sliding_window=4096)  # a window as wide as the context changes nothing
    assert ModelConfig.from_dir(str(d)).sliding_window is None
    _edit_config(d, sliding_window=6)
    model = load_model(str(d), progress=False)
    assert model.cfg.sliding_window == 6
    got = model.reference_logits(p)
    np.testing.assert_allclose(got, _numpy_llama(str(d), p), atol=2e-3, rtol=0)
    np.testing.assert_array_equal(
        got[:6], runner.model.reference_logits(p)[:6]
    )  # (within the window: the same)
    assert np.abs(got[6:] - runner.model.reference_logits(p)[6:]).max() > 0.1  # (past it: not)
    windowed = ModelRunner(str(d), num_blocks=64)
    prompts = {f"w{i}": random_prompt(500 + i, n) for i, n in enumerate([4, 11, 30])}
    gen, _ = run_batched(windowed, prompts, 8, {"w2": 7}, Blocks(64, seed=5))
    for r, q in prompts.items():
        assert gen[r] == greedy_reference(windowed.model, q, 8), r
    for bad in (0, "4096", True):
        _edit_config(d, sliding_window=bad)
        with pytest.raises(UnsupportedModel, match="sliding_window"):
            ModelConfig.from_dir(str(d))


def test_phi3_reads_its_fused_projections(tiny_dir, tmp_path):
    """Phi-3 / Phi-4 checkpoints fuse q|k|v into qkv_proj and gate|up into gate_up_proj (gate
    first, as transformers' Phi3MLP chunks it); otherwise Llama's math: the same logits as the
    unfused checkpoint, and the numpy forward's of it."""
    d = _copy(tiny_dir, tmp_path, "phi3")
    _edit_config(d, architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=None)
    w = load_file(str(d / "model.safetensors"))
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w[a + "qkv_proj.weight"] = np.concatenate([w.pop(a + f"{p}_proj.weight") for p in "qkv"])
        w[m + "gate_up_proj.weight"] = np.concatenate(
            [w.pop(m + "gate_proj.weight"), w.pop(m + "up_proj.weight")]
        )
    save_file(w, str(d / "model.safetensors"))
    prompt = random_prompt(14, 25)
    got = load_model(str(d), progress=False).reference_logits(prompt)
    np.testing.assert_array_equal(got, load_model(tiny_dir, progress=False).reference_logits(prompt))
    np.testing.assert_allclose(got, _numpy_llama(tiny_dir, prompt), atol=2e-3, rtol=0)
    # a fused tensor of the wrong size is named; partial RoPE (Phi-4-mini's) is refused
    w["model.layers.1.mlp.gate_up_proj.weight"] = w["model.layers.1.mlp.gate_up_proj.weight"][:-2]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(WeightError, match="gate_up_proj"):
        load_model(str(d), progress=False)
    _edit_config(d, partial_rotary_factor=0.75)
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor"):
        ModelConfig.from_dir(str(d))
