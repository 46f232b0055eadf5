"""The model's shape, read from an HF ``config.json``.

Only the Llama family is supported (Qwen2 adds q/k/v biases to Llama; Phi-3 fuses q|k|v and
gate|up in its checkpoints; Qwen3 instead normalises
each head's q and k, RMSNorm before RoPE; Qwen2-MoE, Qwen3-MoE and Mixtral replace the MLP of their
sparse layers by experts, a token going to its top-k; Mistral and Phi-3 may attend over a
sliding window); anything the model code does not implement (RoPE scaling other than Llama 3's
and linear, partial RoPE, windows on some layers only, MLP biases) is refused here with a
clear message rather than producing silently wrong text.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

# (Mistral's is Llama's, weights and math, but for the sliding window of its first release)
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
)
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k, before RoPE
    # rope_scaling: () or its items, sorted ("rope_type" llama3 or linear; see rope_inv_freq)
    rope_scaling: tuple[tuple[str, float | str], ...] = ()
    torch_dtype: str = "float32"
    # Mistral's and Phi-3's sliding window: a position attends to this many, its own included
    # (None: the whole context)
    sliding_window: int | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): in the layers listed, the MLP is num_experts
    # experts of moe_intermediate_size; a token goes to the num_experts_per_tok likeliest by the
    # router's softmax, weighted by their probabilities (renormalised over the chosen with
    # norm_topk_prob). Weights are named the Qwen way, or Mixtral's (block_sparse_moe, w1/w2/w3).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # Qwen2-MoE: beside the experts, a shared expert every token goes through, scaled by a
    # sigmoid gate (0: none)
    shared_expert_intermediate_size: int = 0
    # A checkpoint converted from a GGUF (fd/engine/model/gguf.py): the quantization types of
    # its dense weights as the file held them (Q4_1, Q8_0, ...); () for any other checkpoint.
    gguf_types: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        file = os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"missing config.json in {path}")
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        # (transformers 5 sometimes writes `architectures: null` beside the model_type)
        arch = archs[0] if archs else ARCHITECTURE_OF_MODEL_TYPE.get(d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        theta, scaling, rotary = _rope(d)
        window = (
            d.get("sliding_window")
            if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
            else None
        )
        if d.get("use_sliding_window"):  # (Qwen2's: windows on some layers only)
            raise UnsupportedModel("use_sliding_window (sliding windows on some layers) is not supported")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise UnsupportedModel(f"sliding_window {window!r} is not a positive integer")
        if window and window >= int(d.get("max_position_embeddings", 2048)):
            window = None  # (as wide as the context: changes nothing)
        if rotary != 1.0:
            raise UnsupportedModel(
                f"partial_rotary_factor {rotary} is not supported (RoPE over whole heads only)"
            )
        if d.get("mlp_bias"):
            raise UnsupportedModel("mlp_bias is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            if heads % kv_heads:
                raise UnsupportedModel(f"{heads} attention heads do not share {kv_heads} KV heads evenly")
            bias = bool(d.get("attention_bias", False))
            layers = int(d["num_hidden_layers"])
            moe = _experts(arch, d, layers)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama's attention_bias adds them to o_proj too,
                # Qwen3's to q/k/v only
                qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or bias,
                o_bias=arch == "LlamaForCausalLM" and bias,
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                rope_scaling=scaling,
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                sliding_window=window or None,
                gguf_types=tuple(str(t) for t in (d.get("fd_gguf") or {}).get("weight_types", ())),
                **moe,
            )
        except KeyError as e:
            raise UnsupportedModel(f"config.json lacks {e.args[0]!r}") from None


def _experts(arch: str, d: dict, layers: int) -> dict:
    """The MoE fields of a Qwen3-MoE or Mixtral config (as transformers reads them)."""
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size, renormalised
        n = int(d.get("num_local_experts", 8))
        return dict(
            num_experts=n,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(d["intermediate_size"]),
            norm_topk_prob=True,
            sparse_layers=tuple(range(layers)),
        )
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    n, step = int(d.get("num_experts", 0)), int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and n > 0 and (i + 1) % step == 0)
    k = int(d.get("num_experts_per_tok", 0))
    if sparse and not 0 < k <= n:
        raise UnsupportedModel(f"num_experts_per_tok {k} with {n} experts")
    shared = int(d.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(
        num_experts=n,
        num_experts_per_tok=k,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
    )


ROPE_TYPES = ("llama3", "linear")


def _rope(d: dict) -> tuple[float, tuple[tuple[str, float | str], ...], float]:
    """RoPE's (theta, scaling, partial rotary factor) from either spelling of config.json:
    transformers 5's ``rope_parameters`` (theta, type and scaling fields in one dict) or the
    older top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``. Both may be
    present (a config written by one version and edited by another); they must then agree, or
    the model would run with whichever fd happened to read."""
    old_theta = float(d.get("rope_theta") or 10000.0)
    old_rotary = float(d.get("partial_rotary_factor") or 1.0)
    old = _rope_scaling(d.get("rope_scaling"))
    params = d.get("rope_parameters")
    if params is None:
        return old_theta, old, old_rotary
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        # (per layer type, as Gemma 3 writes it: {"full_attention": {...}, ...})
        raise UnsupportedModel(f"rope_parameters {params!r} is not supported (one RoPE for every layer)")
    theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rotary = float(params.get("partial_rotary_factor") or old_rotary)
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling = _rope_scaling(rest or None, "rope_parameters")
    if (d.get("rope_theta") is not None and float(d["rope_theta"]) != theta) or (
        d.get("rope_scaling") and old != scaling
    ):
        raise UnsupportedModel(
            f"rope_parameters {params!r} and rope_theta {d.get('rope_theta')!r} / "
            f"rope_scaling {d.get('rope_scaling')!r} disagree"
        )
    return theta, scaling, rotary


def _rope_scaling(raw, field: str = "rope_scaling") -> tuple[tuple[str, float | str], ...]:
    """config.json's ``rope_scaling`` (or the scaling part of ``rope_parameters``), checked:
    None, ``default``, Llama 3's (every Llama 3.1+ checkpoint has one) or linear; anything else
    refused."""
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{field} {raw!r} is not supported")
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return ()
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"{field} {raw!r} is not supported (rope_type: {', '.join(ROPE_TYPES)})")
    need = (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if kind == "llama3"
        else ("factor",)
    )
    try:
        values = {k: float(raw[k]) for k in need}
    except (KeyError, TypeError, ValueError):
        raise UnsupportedModel(f"{field} {raw!r} lacks one of {', '.join(need)}") from None
    if values["factor"] <= 0 or (
        kind == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]
    ):
        raise UnsupportedModel(f"{field} {raw!r} has impossible factors")
    return tuple(sorted({"rope_type": kind, **values}.items()))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE's inverse frequencies [head_dim / 2] (float64), scaled as the config says.

    Llama 3's scaling (its paper, and HF's ``_compute_llama3_parameters``) leaves the high
    frequencies alone (wavelength under original_len / high_freq_factor), slows the low ones
    (wavelength over original_len / low_freq_factor) by ``factor``, and blends the two in
    between, so positions past the original context stay apart. Linear divides them all."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = dict(cfg.rope_scaling)
    if not s:
        return inv
    factor = s["factor"]
    if s["rope_type"] == "linear":
        return inv / factor
    low, high, orig = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen < orig / high, inv, np.where(wavelen > orig / low, inv / factor, blended))
