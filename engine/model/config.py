"""The model's shape, read from an HF ``config.json``.

Only the Llama family is supported (Qwen2 adds q/k/v biases to Llama; Qwen3 instead normalises
each head's q and k, RMSNorm before RoPE); anything the model code does not implement (RoPE
scaling, sliding windows, MLP biases) is refused here with a clear message rather than
producing silently wrong text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    torch_dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        file = os.path.join(path, "config.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"missing config.json in {path}")
        with open(file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"unsupported architecture {arch!r}; supported: "
                                   f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if d.get("rope_scaling"):
            raise UnsupportedModel(f"rope_scaling {d['rope_scaling']!r} is not supported")
        if d.get("use_sliding_window"):
            raise UnsupportedModel("sliding-window attention is not supported")
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
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama's attention_bias adds them to o_proj too,
                # Qwen3's to q/k/v only
                qkv_bias=arch == "Qwen2ForCausalLM" or bias,
                o_bias=arch == "LlamaForCausalLM" and bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise UnsupportedModel(f"config.json lacks {e.args[0]!r}") from None
