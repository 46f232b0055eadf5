"""GGUF checkpoints as fd reads them: the real default model's tensors and tokenizer against
transformers' (tests/data/smollm2_reference.json), small GGUF files written here with
``gguf.GGUFWriter`` from the tiny model (llama.cpp's Q/K permutation applied, as its converter
does) converted back to the same weights and tokens, `fd convert`, and the clear errors for
what fd cannot convert."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from fd.cli.main import main
from fd.control.sampling import SamplingParams
from fd.control.tokenizer import Tokenizer
from fd.engine.model.config import ModelConfig, UnsupportedModel
from fd.engine.model.gguf import GGUFCheckpoint, model_name
from fd.engine.model.gguf_cache import cached_hf_dir
from fd.engine.model.loader import load_weights
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- the real model


def test_dequantized_tensors_equal_transformers(smollm2_dir, smollm2_reference):
    """Q8_0, Q4_1 and F32 tensors, among them Q and K projections whose rows llama.cpp
    permuted: each row's sum (a permutation moves them) and a corner of values."""
    weights = load_file(str(smollm2_dir / "model.safetensors"))
    for name, ref in smollm2_reference["tensors"].items():
        w = weights[name]
        assert list(w.shape) == ref["shape"], name
        rows = w.reshape(w.shape[0], -1)[: len(ref["row_sums"])]
        np.testing.assert_allclose(
            rows.astype(np.float64).sum(axis=1), ref["row_sums"], rtol=1e-6, atol=1e-6, err_msg=name
        )
        np.testing.assert_allclose(rows[:4, :8], np.array(ref["corner"], np.float32), rtol=1e-7, err_msg=name)


def test_tokenizer_from_gguf_metadata_encodes_and_decodes_like_transformers(
    smollm2_tokenizer, smollm2_reference
):
    for case in smollm2_reference["texts"]:
        ids = smollm2_tokenizer.encode(case["text"])
        assert ids == case["ids"], case["text"]
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == case["text"]
    tok = smollm2_tokenizer
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<|im_start|>", "<|im_end|>", (2,))
    assert tok.is_special(0) and tok.is_special(2) and not tok.is_special(17)
    assert tok.decode(smollm2_reference["chat"]["output_ids"]) == "The capital of France is Paris."


def test_the_default_model_is_named_for_itself(smollm2_dir, smollm2_tokenizer):
    assert smollm2_dir.name == "SmolLM2-135M-Instruct" == smollm2_tokenizer.name
    assert model_name("/m/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct"
    assert model_name("/m/Llama-3.2-1B-Instruct.f16.gguf") == "Llama-3.2-1B-Instruct"


def test_fd_convert_writes_a_directory_fd_serves_with_the_same_greedy_ids(
    smollm2_gguf, smollm2_reference, tmp_path
):
    out = tmp_path / "smollm2-hf"
    assert main(["convert", str(smollm2_gguf), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    # (HF's layout, as vLLM and transformers read it: the older rope_theta spelling)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_theta"] == 100000.0
    tok = Tokenizer.from_dir(str(out))
    chat = smollm2_reference["chat"]
    llm = LLM(ModelRunner(str(out), num_blocks=16), tok)
    got = llm.generate(
        [chat["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=len(chat["output_ids"]))
    )
    assert got[0].token_ids == chat["output_ids"]
    # a second conversion into the same place is refused, not silently mixed
    with pytest.raises(SystemExit, match="already holds a model"):
        main(["convert", str(smollm2_gguf), str(out)])


# --------------------------------------------------------------------------- GGUF files made here


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: HF's rotate-half rows to GGML's pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _hf_weights(hf_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """The tiny model's weights, with Qwen 2's biases or Qwen 3's norms added for those."""
    w = load_file(str(hf_dir / "model.safetensors"))
    rng = np.random.default_rng(5)
    cfg = json.loads((hf_dir / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if arch == "qwen2":
            for n in ("q", "k", "v"):
                w[p + f"{n}_proj.bias"] = rng.standard_normal(w[p + f"{n}_proj.weight"].shape[0]).astype(
                    np.float32
                )
        if arch == "qwen3":
            for n in ("q", "k"):
                w[p + f"{n}_norm.weight"] = (1 + 0.1 * rng.standard_normal(cfg["head_dim"])).astype(
                    np.float32
                )
    return w


def write_gguf(
    path: Path,
    hf_dir: Path,
    arch: str = "llama",
    quant=Q.F32,
    meta=None,
    pre="gpt-2",
    tokenizer_model="gpt2",
    extra=None,
) -> dict[str, np.ndarray]:
    """The tiny HF model at ``hf_dir`` as a GGUF file, as llama.cpp's converter writes one
    (``quant``: the 2-D weights' type); returns the HF weights it holds."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = _hf_weights(hf_dir, arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"][-1])
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    heads = {
        "self_attn.q_proj.weight": cfg["num_attention_heads"],
        "self_attn.k_proj.weight": cfg["num_key_value_heads"],
    }
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name, t in weights.items():
        if name in globals_:
            gname = globals_[name]
        else:
            _, _, layer, part = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_NAMES[part]}"
            if arch == "llama" and part in heads:
                t = _permute(t, heads[part])
        if t.ndim == 2 and quant != Q.F32:
            w.add_tensor(gname, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, t)
    for gname, (data, qtype) in (extra or {}).items():
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_gguf_converts_back_to_the_checkpoint_it_was_made_from(arch, tiny_model_dir, tmp_path):
    src = tmp_path / f"tiny-{arch}.F32.gguf"
    want = write_gguf(src, tiny_model_dir, arch)
    out = cached_hf_dir(src, tmp_path / "cache", progress=False)
    assert out.name == f"tiny-{arch}"
    cfg = ModelConfig.from_dir(str(out))
    assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
    got = load_weights(str(out), cfg, progress=False)  # (every tensor the model needs, by shape)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    tiny, back = Tokenizer.from_dir(str(tiny_model_dir)), Tokenizer.from_dir(str(out))
    for text in ("Hello there, 12345!", "<|im_start|>user\nnaïve 🚀<|im_end|>\n", "  a\n\n b"):
        assert back.encode(text) == tiny.encode(text)
    assert back.chat_template == tiny.chat_template
    assert back.eos_token_ids == (tiny.eos_token_ids[-1],)


def test_a_quantized_gguf_converts_to_its_dequantized_weights_in_hf_layout(tiny_model_dir, tmp_path):
    """Q8_0, converted by `fd convert`: each weight is what dequantizing the file's gives, its
    rows put back in HF's order (the permutation inverted here by index, not by the code's
    reshape); and the directory serves."""
    src = tmp_path / "tiny.Q8_0.gguf"
    want = write_gguf(src, tiny_model_dir, quant=Q.Q8_0)
    out = tmp_path / "hf"
    assert main(["convert", str(src), str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    for name, heads in (
        ("model.layers.1.self_attn.q_proj.weight", cfg["num_attention_heads"]),
        ("model.layers.1.self_attn.k_proj.weight", cfg["num_key_value_heads"]),
        ("model.layers.1.mlp.down_proj.weight", None),
    ):
        w = want[name]
        order = _permute(np.arange(w.shape[0])[:, None], heads).ravel() if heads else np.arange(w.shape[0])
        stored = gguf.quants.dequantize(gguf.quants.quantize(w[order], Q.Q8_0), Q.Q8_0)
        expected = np.empty_like(stored)
        expected[order] = stored
        assert not np.array_equal(expected, w)  # (really quantized: rounded)
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tok = Tokenizer.from_dir(str(out))
    gen = LLM(ModelRunner(str(out), num_blocks=16), tok).generate([tok.encode("Once upon a time")], sp)
    assert len(gen[0].token_ids) == 4 and gen[0].finish_reason == "length"


@pytest.mark.parametrize(
    "pre, words",
    [
        # how each model's own tokenizer.json splits text into words before BPE
        ("gpt-2", ["Hi", "Ġ12345", "Ġ!!"]),  # GPT-2: numbers whole
        ("smollm", ["Hi", "Ġ", "1", "2", "3", "4", "5", "Ġ!!"]),  # SmolLM, StarCoder: digit by digit
        ("llama-bpe", ["Hi", "Ġ", "123", "45", "Ġ!!"]),  # Llama 3: up to three digits
        ("qwen2", ["Hi", "Ġ", "1", "2", "3", "4", "5", "Ġ!!"]),  # Qwen 2 and 3: digit by digit
    ],
)
def test_the_gguf_pre_tokenizer_name_splits_words_as_that_models_tokenizer(
    pre, words, tiny_model_dir, tmp_path
):
    src = tmp_path / "t.gguf"
    write_gguf(src, tiny_model_dir, pre=pre)
    tok = GGUFCheckpoint(str(src)).vocab.tokenizer()
    assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("Hi 12345 !!")] == words


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported"),
        (dict(tokenizer_model="llama"), "tokenizer.ggml.model 'llama' is not supported"),
        (dict(pre="tekken"), "tokenizer.ggml.pre 'tekken' is not supported"),
        (
            dict(extra={"blk.0.attn_q.scales": (np.zeros((4, 40), np.uint8), Q.Q8_1)}),
            "GGUF quantization type Q8_1 (tensor blk.0.attn_q.scales) is not supported",
        ),
        (dict(extra={"rope_freqs.weight": (np.ones(16, np.float32), Q.F32)}), "rope_freqs.weight"),
        (dict(meta={"llama.rope.scaling.type": "yarn"}), "rope.scaling.type 'yarn' is not supported"),
        (dict(meta={"llama.expert_count": 8}), "mixture of experts"),
    ],
)
def test_what_fd_cannot_convert_is_refused_by_name(change, says, tiny_model_dir, tmp_path, capsys):
    src = tmp_path / "bad.gguf"
    write_gguf(src, tiny_model_dir, **change)
    with pytest.raises(UnsupportedModel, match=re.escape(says)):
        GGUFCheckpoint(str(src))
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out)]) == 1  # (one line, no traceback, nothing written)
    err = capsys.readouterr().err
    assert "fd convert: error: " in err and says in err and "Traceback" not in err
    assert not (out / "config.json").exists()


def test_a_model_dir_or_gguf_is_resolved_once_for_both_sides(tiny_model_dir, tmp_path, monkeypatch):
    from fd.cli.models import resolve_model

    monkeypatch.setenv("FD_CACHE_DIR", str(tmp_path / "cache"))
    src_dir = tmp_path / "ggufs"
    src_dir.mkdir()
    write_gguf(src_dir / "tiny.Q8_0.gguf", tiny_model_dir, quant=Q.Q8_0)
    by_file = resolve_model(str(src_dir / "tiny.Q8_0.gguf"))
    assert by_file.parent.parent == tmp_path / "cache" / "gguf" and by_file.name == "tiny"
    assert resolve_model(str(src_dir)) == by_file  # (a dir holding one .gguf: that one; cached)
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    write_gguf(src_dir / "other.gguf", tiny_model_dir)
    with pytest.raises(SystemExit, match="several GGUF files"):
        resolve_model(str(src_dir))
    with pytest.raises(SystemExit, match="is not a model directory"):
        resolve_model(str(tmp_path / "nowhere"))
