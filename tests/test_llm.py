"""The engine core with the real tiny model and no Redis: preemption under block pressure and
seeded sampling, judged by the tokens a user would get."""

from __future__ import annotations

import pytest

from control.events import SamplingParams
from engine.llm import LLM
from engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["Hello there", "The quick brown fox jumps", "a", "Once upon a time in a far land",
             "1 2 3 4 5 6 7 8 9", "What is the capital of", "zz", "Tell me a story about"]
    return [tiny_tokenizer.encode(t) for t in texts]


def test_preemption_keeps_greedy_output_and_frees_every_block(tiny_model_dir, tiny_runner,
                                                             tiny_tokenizer, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(tiny_runner, tiny_tokenizer).generate(prompts, sp)
    # 8 requests of up to ~46 tokens need ~3 blocks of 16 each (24 in all); give them 10, so
    # the scheduler must preempt and recompute again and again
    small = ModelRunner(str(tiny_model_dir), num_blocks=10, block_size=16)
    llm = LLM(small, tiny_tokenizer)
    events = []
    tight = llm.generate(prompts, sp, on_event=events.append)
    assert sum(e.TYPE == "preempted" for e in events) >= 3
    for a, b in zip(ample, tight):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == "length"
    assert llm.last_free_blocks == small.num_blocks


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_runner, tiny_tokenizer,
                                                                   prompts):
    llm = LLM(tiny_runner, tiny_tokenizer)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded)[0]
    again = llm.generate([prompts[1]], seeded)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    crowd = llm.generate([prompts[0], prompts[1], prompts[3], prompts[5]],
                         [others[0], seeded, others[1], others[2]])[1]
    assert alone.token_ids == again.token_ids == crowd.token_ids
    # and it is sampling, not greedy: another seed gives another continuation
    other_seed = llm.generate([prompts[1]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24,
                                                            seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_async_scheduling_gives_the_same_output_as_one_step_at_a_time(tiny_model_dir, tiny_runner,
                                                                      tiny_tokenizer, prompts):
    """Step N+1 fed placeholders for step N's tokens, the real runner filling them in: greedy,
    seeded sampling, stop strings, EOS and max_tokens end where they do one step at a time,
    also while preemptions (which a speculative schedule leaves to the next ordinary one) run."""
    sps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=30),
           SamplingParams(temperature=0.0, max_tokens=1),
           SamplingParams(temperature=0.9, top_k=20, max_tokens=35, seed=3)]
    sync = LLM(tiny_runner, tiny_tokenizer).generate(prompts, [sps[i % 5] for i in range(8)])
    # a stop string on text the greedy run is known to produce
    stop_at = sync[0].text[5:8]
    sps_stop = sps + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                     stop=(stop_at,))]
    batch = [sps_stop[i % 5] for i in range(8)]
    batch[0] = sps_stop[5]
    sync = LLM(tiny_runner, tiny_tokenizer).generate(prompts, batch)
    assert sync[0].finish_reason == "stop" and stop_at not in sync[0].text
    for runner in (tiny_runner, ModelRunner(str(tiny_model_dir), num_blocks=10, block_size=16)):
        llm = LLM(runner, tiny_tokenizer, async_scheduling=True)
        events = []
        got = llm.generate(prompts, batch, on_event=events.append)
        for a, b in zip(sync, got):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert llm.last_free_blocks == runner.num_blocks
    assert sum(e.TYPE == "preempted" for e in events) >= 1
