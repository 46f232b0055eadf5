"""Session fixtures for tests that need the tiny model: made once, loaded once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny_model(d)
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from control.tokenizer import Tokenizer

    return Tokenizer.from_dir(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir):
    """One runner shared by the engine tests (sequentially): its KV cache is scratch space that
    every request overwrites through its own block table."""
    from engine.model_runner import ModelRunner

    return ModelRunner(str(tiny_model_dir), device="cpu", num_blocks=512, block_size=16)
