"""Which tensors a Llama-family checkpoint holds, by their HF names and shapes, and how fd
fuses them (q|k|v and gate|up into one matrix each): what the loader checks a checkpoint
against (fd/engine/model/loader.py) and the model builds its layers from (:func:`layer_arrays`,
fd/engine/model/llama.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fd.engine.model.config import ModelConfig

#: a layer's tensors besides its matrices (None where the architecture has none)
LAYER_VECTORS = ("in_norm", "post_norm", "qkv_b", "qk_norm", "o_b")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by its HF name, with its HF shape ([out, in] for Linear)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
        )
        if n in cfg.sparse_layers:
            shapes.update(expert_shapes(cfg, n))
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                }
            )
        if cfg.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes.update(
                {
                    p + "self_attn.q_norm.weight": (cfg.head_dim,),
                    p + "self_attn.k_norm.weight": (cfg.head_dim,),
                }
            )
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def fused_parts(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Phi-3's fused projections: each tensor the model needs that Phi-3 checkpoints store as
    rows of another (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up), as (that tensor's
    name, first row, end row)."""
    if cfg.architecture != "Phi3ForCausalLM":
        return {}
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {}
    for n in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        out.update(
            {
                a + "q_proj.weight": (a + "qkv_proj.weight", 0, q),
                a + "k_proj.weight": (a + "qkv_proj.weight", q, q + kv),
                a + "v_proj.weight": (a + "qkv_proj.weight", q + kv, q + 2 * kv),
                m + "gate_proj.weight": (m + "gate_up_proj.weight", 0, i),
                m + "up_proj.weight": (m + "gate_up_proj.weight", i, 2 * i),
            }
        )
    return out


def expert_names(cfg: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """A sparse layer's router weight and each expert's (gate, up, down) weights, by HF name:
    Qwen's ``mlp.gate`` / ``mlp.experts.E.{gate,up,down}_proj``, or Mixtral's
    ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.E.{w1,w3,w2}``."""
    p = f"model.layers.{layer}."
    if cfg.architecture == "MixtralForCausalLM":
        e = p + "block_sparse_moe.experts."
        return p + "block_sparse_moe.gate.weight", [
            (f"{e}{k}.w1.weight", f"{e}{k}.w3.weight", f"{e}{k}.w2.weight") for k in range(cfg.num_experts)
        ]
    e = p + "mlp.experts."
    return p + "mlp.gate.weight", [
        (f"{e}{k}.gate_proj.weight", f"{e}{k}.up_proj.weight", f"{e}{k}.down_proj.weight")
        for k in range(cfg.num_experts)
    ]


def expert_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    h, mi = cfg.hidden_size, cfg.moe_intermediate_size
    router, experts = expert_names(cfg, layer)
    shapes: dict[str, tuple[int, ...]] = {router: (cfg.num_experts, h)}
    for gate, up, down in experts:
        shapes.update({gate: (mi, h), up: (mi, h), down: (h, mi)})
    si = cfg.shared_expert_intermediate_size
    if si:  # Qwen2-MoE's shared expert and its gate
        p = f"model.layers.{layer}.mlp.shared_expert"
        shapes.update(
            {
                p + ".gate_proj.weight": (si, h),
                p + ".up_proj.weight": (si, h),
                p + ".down_proj.weight": (h, si),
                p + "_gate.weight": (1, h),
            }
        )
    return shapes


def layer_arrays(cfg: ModelConfig, weights: Mapping[str, np.ndarray], n: int, scale: np.float32) -> dict:
    """Layer ``n``'s tensors as the model computes with them, from the checkpoint's HF names:
    the matrices [in, out] (contiguous products need no transposed GEMM), q|k|v and gate|up fused,
    the softmax ``scale`` folded into q's projection or, with Qwen3's q_norm (which undoes any
    scale of its input), into that norm's weight; :data:`LAYER_VECTORS` (None where absent); and
    a sparse layer's ``moe``: its router, experts' (gate|up, down) and any shared expert's
    (gate|up, down, gate) in place of ``gate_up`` and ``down``."""
    p = f"model.layers.{n}."
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    q_scale = 1 if cfg.qk_norm else scale
    out: dict = {
        "in_norm": weights[p + "input_layernorm.weight"],
        "post_norm": weights[p + "post_attention_layernorm.weight"],
        "qkv": np.concatenate(
            [
                weights[p + "self_attn.q_proj.weight"].T * q_scale,
                weights[p + "self_attn.k_proj.weight"].T,
                weights[p + "self_attn.v_proj.weight"].T,
            ],
            axis=1,
        ),
        "qkv_b": np.concatenate(
            [
                weights[p + "self_attn.q_proj.bias"] * q_scale,
                weights[p + "self_attn.k_proj.bias"],
                weights[p + "self_attn.v_proj.bias"],
            ]
        )
        if cfg.qkv_bias
        else None,
        # Qwen3: one [heads, head_dim] weight for the q heads' norm and the k heads'
        "qk_norm": np.concatenate(
            [
                np.tile(weights[p + "self_attn.q_norm.weight"] * scale, (nh, 1)),
                np.tile(weights[p + "self_attn.k_norm.weight"], (nkv, 1)),
            ]
        )
        if cfg.qk_norm
        else None,
        "o": weights[p + "self_attn.o_proj.weight"].T,
        "o_b": weights[p + "self_attn.o_proj.bias"] if cfg.o_bias else None,
    }
    if n in cfg.sparse_layers:
        router, experts = expert_names(cfg, n)
        moe: dict = {
            "router": weights[router].T,
            "experts": [
                (np.concatenate([weights[g].T, weights[u].T], axis=1), weights[d].T) for g, u, d in experts
            ],
        }
        if cfg.shared_expert_intermediate_size:
            s = p + "mlp.shared_expert"
            moe["shared"] = (
                np.concatenate(
                    [weights[s + ".gate_proj.weight"].T, weights[s + ".up_proj.weight"].T], axis=1
                ),
                weights[s + ".down_proj.weight"].T,
                weights[s + "_gate.weight"].T,
            )
        out["moe"] = moe
    else:
        out["gate_up"] = np.concatenate(
            [weights[p + "mlp.gate_proj.weight"].T, weights[p + "mlp.up_proj.weight"].T], axis=1
        )
        out["down"] = weights[p + "mlp.down_proj.weight"].T
    return out
