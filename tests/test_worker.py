"""The model in a worker process: the same tokens as in-process, errors that say what broke,
and no worker outliving its engine."""

from __future__ import annotations

import time

import pytest

from control.events import SamplingParams
from engine.llm import LLM
from engine.worker import ProcessRunner, WorkerError


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=256, block_size=16)
    runner.warmup()
    yield runner
    runner.close()


def test_worker_gives_the_same_tokens_as_in_process(worker, tiny_runner, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(t) for t in ("Hello there", "a", "The quick brown fox jumps")]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    for sp in (greedy, seeded):
        here = LLM(tiny_runner, tiny_tokenizer).generate(prompts, sp)
        there = LLM(worker, tiny_tokenizer).generate(prompts, sp)
        assert [g.token_ids for g in there] == [g.token_ids for g in here]
        # async scheduling: the worker fills each placeholder with the token it sampled a step
        # earlier, which the engine has not seen yet
        ahead = LLM(worker, tiny_tokenizer, async_scheduling=True).generate(prompts, sp)
        assert [g.token_ids for g in ahead] == [g.token_ids for g in here]
    assert worker.busy_seconds > 0
    assert worker.num_blocks == 256 and worker.vocab_size == tiny_runner.vocab_size
    assert worker.eos_token_ids == tuple(tiny_runner.eos_token_ids)


def test_a_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(WorkerError, match="FileNotFoundError: model directory .*nowhere does not exist"):
        ProcessRunner(str(tmp_path / "nowhere"))


def test_worker_exits_when_its_engine_goes_away(tiny_model_dir):
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16)
    proc = runner._proc
    assert proc.is_alive()
    runner._conn.close()  # what the kernel does to the pipe when the engine dies, SIGKILL too
    deadline = time.monotonic() + 10
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc.is_alive()
