"""Session fixtures for tests that need the tiny model: made once, loaded once; and ``served``,
what ``fd serve`` runs, on the embedded server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from fd.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny_model(d)
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from fd.control.tokenizer import Tokenizer

    return Tokenizer.from_dir(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir):
    """One runner shared by the engine tests (sequentially): its KV cache is scratch space that
    every request overwrites through its own block table. Batch-invariant: the tests that
    share it hold requests to the same tokens and vectors alone and batched, and to those of
    other (equally invariant) runners."""
    from fd.engine.runner.model_runner import ModelRunner

    return ModelRunner(str(tiny_model_dir), device="cpu", num_blocks=512, block_size=16, batch_invariant=True)


@pytest.fixture
async def served(embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """What `fd serve` runs, in this process: one engine and one API node on the embedded
    server, sharing one Metrics object. Yields (api, engine)."""
    from fd.api.config import ApiConfig
    from fd.compose import join_in_process, start_api, start_engine
    from fd.control.metrics import Metrics
    from fd.engine.node.node_config import EngineConfig

    metrics = Metrics()
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e0"),
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
        metrics=metrics,
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir)),
        metrics=metrics,
        tokenizer=tiny_tokenizer,
    )
    join_in_process(api, eng)
    yield api, eng
    await api.stop()
    await eng.stop()


@pytest.fixture
async def openai_client(served):
    """``served``'s API node and an ``openai`` client of it: (api, client)."""
    import openai

    api, _ = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    yield api, client
    await client.close()
