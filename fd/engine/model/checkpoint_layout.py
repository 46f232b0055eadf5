"""Which tensors a Llama-family checkpoint holds, by their HF names and shapes, and how fd
fuses them (q|k|v and gate|up into one matrix each): what the loader checks a checkpoint
against and builds the model's weights by (fd/engine/model/loader.py)."""

from __future__ import annotations

from fd.engine.model.config import ModelConfig


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
