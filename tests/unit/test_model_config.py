"""config.json as transformers 4 and 5 write it: RoPE as top-level ``rope_theta`` /
``rope_scaling`` or as 5's ``rope_parameters``, ``architectures`` or only ``model_type``, the
chat template inside tokenizer_config.json or beside it in chat_template.jinja. Either way the
same model, and what fd does not implement refused by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fd.control.sampling import SamplingParams
from fd.control.tokenizer import Tokenizer
from fd.engine.model.config import ModelConfig, UnsupportedModel, rope_inv_freq
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner

BASE = dict(
    hidden_size=4096,
    num_hidden_layers=1,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "default"},
        LLAMA3,
        {"rope_type": "linear", "factor": 2.0},
        {"type": "linear", "factor": 4.0},
    ],
)
def test_both_rope_spellings_make_the_same_model(scaling):
    arch = {"architectures": ["LlamaForCausalLM"], **BASE}
    old = ModelConfig.from_dict({**arch, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = ModelConfig.from_dict(
        {**arch, "rope_parameters": {"rope_theta": 500000.0, **(scaling or {"rope_type": "default"})}}
    )
    assert new == old
    assert new.rope_theta == 500000.0
    np.testing.assert_array_equal(rope_inv_freq(new), rope_inv_freq(old))
    if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
        assert not np.array_equal(
            rope_inv_freq(new), rope_inv_freq(ModelConfig.from_dict({**arch, "rope_theta": 500000.0}))
        )


@pytest.mark.parametrize(
    "params, says",
    [
        (
            {
                "rope_theta": 1e6,
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
            "'yarn'",
        ),
        ({"rope_theta": 1e6, "rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
        (
            {"rope_theta": 1e6, "rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            "'longrope'",
        ),
        (
            {
                "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
            },
            "one RoPE for every layer",
        ),
        (
            {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5",
        ),
        ({"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0}, "lacks one of"),
    ],
)
def test_rope_parameters_fd_does_not_implement_are_refused_by_name(params, says):
    with pytest.raises(UnsupportedModel, match="rope_parameters|partial_rotary_factor") as e:
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE, "rope_parameters": params})
    assert says in str(e.value)


def test_both_spellings_at_once_must_agree():
    arch = {"architectures": ["LlamaForCausalLM"], **BASE}
    same = ModelConfig.from_dict(
        {**arch, "rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    )
    assert same.rope_theta == 1e6
    for other in ({"rope_theta": 1e4}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        with pytest.raises(UnsupportedModel, match="disagree"):
            ModelConfig.from_dict(
                {**arch, **other, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
            )


def test_architectures_null_is_read_from_model_type():
    cfg = ModelConfig.from_dict({"architectures": None, "model_type": "qwen2", **BASE})
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias
    assert ModelConfig.from_dict({"model_type": "qwen3", **BASE}).qk_norm
    with pytest.raises(UnsupportedModel, match="unsupported architecture None"):
        ModelConfig.from_dict({"architectures": None, "model_type": "gpt2", **BASE})


def test_a_transformers_5_model_dir_serves_like_the_older_one(
    tiny_model_dir, tiny_runner, tiny_tokenizer, tmp_path
):
    """The tiny model saved transformers 5's way: rope_parameters, architectures null, the chat
    template in chat_template.jinja. Same tokens, same chat prompt."""
    d = tmp_path / "tiny-v5"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    cfg.pop("rope_scaling")
    cfg["architectures"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text(tcfg.pop("chat_template"))
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))

    tok = Tokenizer.from_dir(str(d))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == tiny_tokenizer.apply_chat_template(messages)
    prompt = tok.encode("Once upon a time")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = LLM(ModelRunner(str(d), num_blocks=16), tok).generate([prompt], sp)[0].token_ids
    assert got == LLM(tiny_runner, tiny_tokenizer).generate([prompt], sp)[0].token_ids
