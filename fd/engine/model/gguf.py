"""GGUF checkpoints (llama.cpp's format), turned into the HF model directory fd loads.

As vLLM does, the weights are dequantized once, at load time, to float32 (``gguf``'s
``quants.dequantize``: every quantization type it implements), renamed from llama.cpp's tensor
names to HF's, and the model's shape and tokenizer are rebuilt from the file's metadata. The
result is an ordinary HF directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json): ``fd convert`` writes one where asked, and
``--model FILE.gguf`` writes one into a cache (fd/engine/model/gguf_cache.py), so that everything
after — the loader, the tokenizer both sides share, the served name — is the code that serves
any HF model, and an API node needs no GGUF reader of its own.

llama.cpp's HF-to-GGUF converter permutes the rows of the Q and K projections of Llama-family
models (``llama`` here), from HF's rotate-half RoPE layout to GGML's interleaved one; the
permutation is undone here, as transformers' GGUF loader does, so the tensors equal the HF
checkpoint the GGUF was made from (to the quantization's rounding). Qwen 2 and 3 GGUFs are not
permuted. Architectures, tensors, quantization types, RoPE variants and tokenizers fd cannot
convert faithfully are refused by name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from fd.engine.model.config import UnsupportedModel
from fd.engine.model.gguf_tokenizer import GGUFVocab

# general.architecture -> (HF architecture, HF model_type); all three are Llama's math with
# Qwen 2's q/k/v biases or Qwen 3's q/k norms (fd/engine/model/config.py). Mistral's GGUFs are
# written as `llama`.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp's per-layer tensor names -> HF's (below model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

# A quantization tag at the end of a GGUF file's name (Q4_K_M, IQ2_XS, F16, BF16, ...): not
# part of the model's name
_QUANT_SUFFIX = re.compile(r"[-._](?:I?Q\d\w*|T?Q\d_\d|F16|F32|BF16|MXFP4)$", re.IGNORECASE)


def model_name(path: str) -> str:
    """The name a GGUF file's model is served under: the file's name without ``.gguf`` and its
    quantization tag (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
    stem = os.path.basename(path)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a Q or K projection's rows ([heads * head_dim, ...]): in
    each head, GGML's interleaved (pairs of) rows back to HF's two halves."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class GGUFCheckpoint:
    """One GGUF file, read lazily (a memory map) and checked at open: its architecture, its
    tensors' names and quantization types, its RoPE and its tokenizer."""

    def __init__(self, path: str):
        import gguf

        self.path = os.fspath(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, KeyError) as e:  # (a bad magic, or a type this gguf does not know)
            raise UnsupportedModel(f"{self.path} is not a GGUF file fd can read: {e}") from None
        self.meta: dict[str, Any] = {
            k: f.contents() for k, f in self._reader.fields.items() if not k.startswith("GGUF.")
        }
        if int(self.meta.get("split.count") or 1) > 1:
            raise UnsupportedModel(
                f"{self.path} is one part of a split GGUF checkpoint: merge the "
                "parts first (llama.cpp's `llama-gguf-split --merge`)"
            )
        arch = self.meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        self.arch = arch
        self.vocab = GGUFVocab(self.meta)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_types()
        self._names = {name: self._hf_name(name) for name in self._tensors}
        self.config()  # (its refusals too, now)

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[name]
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in _LAYER_TENSORS:
            return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
        if name == "rope_freqs.weight":
            raise UnsupportedModel(
                "GGUF tensor rope_freqs.weight (Llama 3.1's RoPE scaling as "
                "per-frequency factors) is not supported"
            )
        if m and "_exps" in m.group(2):
            raise UnsupportedModel(f"GGUF tensor {name} (mixture of experts) is not supported")
        raise UnsupportedModel(f"GGUF tensor {name} is not supported for architecture {self.arch}")

    def _check_types(self) -> None:
        """Every tensor's type dequantizes (tried on its first row, so a type the ``gguf``
        package cannot dequantize is said now, by name, not halfway through)."""
        from gguf.quants import dequantize

        tried: set = set()
        for t in self._tensors.values():
            if t.tensor_type in tried:
                continue
            try:
                dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)
            except NotImplementedError:
                raise UnsupportedModel(
                    f"GGUF quantization type {t.tensor_type.name} (tensor "
                    f"{t.name}) is not supported: the gguf package cannot "
                    "dequantize it"
                ) from None
            tried.add(t.tensor_type)

    def _get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def weight_types(self) -> list[str]:
        """The quantization types of the dense layers' and the head's weights (``Q4_1``, ...)."""
        dense = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "ffn_gate.", "ffn_up.", "ffn_down.")
        names = [n for n in self._tensors if n.startswith("blk.") and any(d in n for d in dense)]
        names.append("output.weight" if "output.weight" in self._tensors else "token_embd.weight")
        return sorted({self._tensors[n].tensor_type.name for n in names if n.endswith(".weight")})

    # ------------------------------------------------------------------ what HF's files say

    def config(self) -> dict[str, Any]:
        """HF's config.json for the model (read back by fd/engine/model/config.py, and by vLLM)."""
        hf_arch, model_type = ARCHITECTURES[self.arch]
        if self._get("expert_count"):
            raise UnsupportedModel(
                f"GGUF {self.arch} with {self._get('expert_count')} experts "
                "(mixture of experts) is not supported"
            )
        heads = int(self._get("attention.head_count"))
        kv_heads = self._get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModel("GGUF attention.head_count_kv per layer is not supported")
        hidden = int(self._get("embedding_length"))
        head_dim = int(self._get("attention.key_length", hidden // heads))
        rotary = int(self._get("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise UnsupportedModel(
                f"GGUF rope.dimension_count {rotary} is not the head size "
                f"{head_dim} (partial RoPE is not supported)"
            )
        scaling = self._get("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModel(f"GGUF rope.scaling.type {scaling!r} is not supported (none, linear)")
        vocab = int(self._get("vocab_size", len(self.vocab.tokens)))
        eos = self.vocab.eos_ids()
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(self._get("feed_forward_length")),
            "num_hidden_layers": int(self._get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": int(self._get("context_length", 2048)),
            "rms_norm_eps": float(self._get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._get("rope.freq_base", 10000.0)),
            "rope_scaling": (
                {"rope_type": "linear", "factor": float(self._get("rope.scaling.factor"))}
                if scaling == "linear"
                else None
            ),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
            "mlp_bias": False,
            # (Llama's attention biases, on q/k/v and o; Qwen 2 has q/k/v biases by its type)
            "attention_bias": self.arch == "llama" and "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self.vocab.ids["bos"],
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "torch_dtype": "float32",
            # (fd's own key: what the file's dense weights were, for --quantization gguf and
            # --dtype auto, fd/engine/model/qgemm.py; other readers, vLLM's too, ignore it)
            "fd_gguf": {"weight_types": self.weight_types()},
        }
        if self.arch == "qwen2":
            cfg["use_sliding_window"] = False
        if self.vocab.ids["padding"] is not None:
            cfg["pad_token_id"] = self.vocab.ids["padding"]
        return cfg

    def generation_config(self) -> dict[str, Any]:
        eos = self.vocab.eos_ids()
        out = {"bos_token_id": self.vocab.ids["bos"], "eos_token_id": eos[0] if len(eos) == 1 else eos}
        if self.vocab.ids["padding"] is not None:
            out["pad_token_id"] = self.vocab.ids["padding"]
        return out

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor by its HF name, float32, in HF's layout."""
        from gguf.quants import dequantize

        cfg = self.config()
        heads = (
            {
                "self_attn.q_proj.weight": cfg["num_attention_heads"],
                "self_attn.k_proj.weight": cfg["num_key_value_heads"],
            }
            if self.arch == "llama"
            else {}
        )
        for name in tqdm(
            self._tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False
        ):
            t, hf = self._tensors[name], self._names[name]
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            part = hf.split(".", 3)[-1]
            if part in heads:
                w = reverse_permute(w, heads[part])
            yield hf, np.ascontiguousarray(w)

    # ------------------------------------------------------------------ writing

    def write_hf_dir(self, out_dir: str, progress: bool = True) -> str:
        """Write the model as an HF directory at ``out_dir`` (created; must not hold a model)."""
        from safetensors.numpy import save_file

        os.makedirs(out_dir, exist_ok=True)
        cfg = self.config()
        weights = dict(self.tensors(progress))
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)  # (safetensors writes 0600)
        self.vocab.tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
        _write_json(
            os.path.join(out_dir, "tokenizer_config.json"),
            self.vocab.tokenizer_config(cfg["max_position_embeddings"]),
        )
        _write_json(os.path.join(out_dir, "generation_config.json"), self.generation_config())
        _write_json(os.path.join(out_dir, "config.json"), cfg)  # (last: a dir with one is whole)
        return out_dir


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
