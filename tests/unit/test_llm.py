"""The engine core with the real tiny model and no Redis: preemption under block pressure and
seeded sampling, judged by the tokens a user would get."""

from __future__ import annotations

import pytest

from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = [
        "Hello there",
        "The quick brown fox jumps",
        "a",
        "Once upon a time in a far land",
        "1 2 3 4 5 6 7 8 9",
        "What is the capital of",
        "zz",
        "Tell me a story about",
    ]
    return [tiny_tokenizer.encode(t) for t in texts]


def test_preemption_keeps_greedy_output_and_frees_every_block(
    tiny_model_dir, tiny_runner, tiny_tokenizer, prompts
):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ample = LLM(tiny_runner, tiny_tokenizer).generate(prompts, sp)
    # 8 requests of up to ~46 tokens need ~3 blocks of 16 each (24 in all); give them 10, so
    # the scheduler must preempt and recompute again and again
    small = ModelRunner(str(tiny_model_dir), num_blocks=10, block_size=16, batch_invariant=True)
    llm = LLM(small, tiny_tokenizer)
    events = []
    tight = llm.generate(prompts, sp, on_event=events.append)
    assert sum(e.TYPE == "preempted" for e in events) >= 3
    for a, b in zip(ample, tight):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == "length"
    assert llm.last_free_blocks == small.num_blocks


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_runner, tiny_tokenizer, prompts):
    llm = LLM(tiny_runner, tiny_tokenizer)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded)[0]
    again = llm.generate([prompts[1]], seeded)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    crowd = llm.generate(
        [prompts[0], prompts[1], prompts[3], prompts[5]], [others[0], seeded, others[1], others[2]]
    )[1]
    assert alone.token_ids == again.token_ids == crowd.token_ids
    # and it is sampling, not greedy: another seed gives another continuation
    other_seed = llm.generate(
        [prompts[1]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=99, ignore_eos=True)
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_async_scheduling_gives_the_same_output_as_one_step_at_a_time(
    tiny_model_dir, tiny_runner, tiny_tokenizer, prompts
):
    """Step N+1 fed placeholders for step N's tokens, the real runner filling them in: greedy,
    seeded sampling, stop strings, EOS and max_tokens end where they do one step at a time,
    also while preemptions (which a speculative schedule leaves to the next ordinary one) run."""
    sps = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=35, seed=3),
    ]
    sync = LLM(tiny_runner, tiny_tokenizer).generate(prompts, [sps[i % 5] for i in range(8)])
    # a stop string on text the greedy run is known to produce
    stop_at = sync[0].text[5:8]
    sps_stop = sps + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop_at,))]
    batch = [sps_stop[i % 5] for i in range(8)]
    batch[0] = sps_stop[5]
    sync = LLM(tiny_runner, tiny_tokenizer).generate(prompts, batch)
    assert sync[0].finish_reason == "stop" and stop_at not in sync[0].text
    for runner in (
        tiny_runner,
        ModelRunner(str(tiny_model_dir), num_blocks=10, block_size=16, batch_invariant=True),
    ):
        llm = LLM(runner, tiny_tokenizer, async_scheduling=True)
        events = []
        got = llm.generate(prompts, batch, on_event=events.append)
        for a, b in zip(sync, got):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert llm.last_free_blocks == runner.num_blocks
    assert sum(e.TYPE == "preempted" for e in events) >= 1


def _penalized_reference(runner, prompt: list[int], out: list[int], sp: SamplingParams) -> list[int]:
    """What greedy decoding with ``sp``'s penalties must pick after each prefix of ``out``: the
    model's logits for the whole prefix (one prefill in scratch blocks), penalized here by the
    formulas themselves, not by the sampler's code."""
    import numpy as np

    from tests.kit.engine import prefix_logits

    picks = []
    for k in range(len(out)):
        toks = prompt + out[:k]
        x = prefix_logits(runner, toks)
        seen = set(toks)
        for t in seen:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        for t in set(out[:k]):
            x[t] -= sp.frequency_penalty * out[:k].count(t) + sp.presence_penalty
        picks.append(int(np.argmax(x)))
    return picks


def test_penalties_reach_the_model_one_step_at_a_time_ahead_and_after_preemption(
    tiny_model_dir, tiny_runner, tiny_tokenizer, prompts
):
    """frequency/presence/repetition penalties, greedy: each token is the argmax of that step's
    logits penalized for what the request has seen so far, also when the step was decided
    before the last token was known (async scheduling) and after a recompute (preemption)."""
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # penalizing repeats, and (below 0 and 1) rewarding them, which makes a request's newest
    # token, the one async scheduling feeds as a placeholder, decide what comes next
    sps = [
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            frequency_penalty=0.7,
            presence_penalty=0.4,
            repetition_penalty=1.3,
        ),
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=-0.5, repetition_penalty=0.8
        ),
        # (without a repetition penalty only the output counts: the prompt is not sent)
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=-1.0, presence_penalty=-0.5
        ),
    ]
    batch = [sps[i % 3] for i in range(len(prompts))]
    base = LLM(tiny_runner, tiny_tokenizer).generate(prompts, plain)
    sync = LLM(tiny_runner, tiny_tokenizer).generate(prompts, batch)
    for sp in sps:  # each of them changes some output
        assert any(a.token_ids != b.token_ids for a, b, s in zip(base, sync, batch) if s is sp)
    for p, g, sp in list(zip(prompts, sync, batch))[:6]:
        assert g.token_ids == _penalized_reference(tiny_runner, list(p), list(g.token_ids), sp)
    tight = ModelRunner(str(tiny_model_dir), num_blocks=10, block_size=16, batch_invariant=True)
    for runner, async_scheduling in ((tiny_runner, True), (tight, False), (tight, True)):
        llm = LLM(runner, tiny_tokenizer, async_scheduling=async_scheduling)
        events = []
        got = llm.generate(prompts, batch, on_event=events.append)
        assert [g.token_ids for g in got] == [g.token_ids for g in sync]
        if runner is tight:
            assert any(e.TYPE == "preempted" for e in events)


def test_logit_bias_and_min_tokens_decide_what_the_user_gets(tiny_runner, tiny_tokenizer, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = LLM(tiny_runner, tiny_tokenizer).generate(prompts[:2], greedy)
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias=((77, 100.0),))
    hot = SamplingParams(temperature=1.0, seed=5, max_tokens=5, logit_bias=((77, 100.0),))
    for g in LLM(tiny_runner, tiny_tokenizer, async_scheduling=True).generate(prompts[:2], [forced, hot]):
        assert g.token_ids == [77] * 5
    # a stop token id the greedy output reaches at its 3rd token: there it stops, unless
    # min_tokens holds it back
    stop_id = base[0].token_ids[2]
    assert stop_id not in base[0].token_ids[:2]
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,))
    held = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,), min_tokens=8)
    early, late = LLM(tiny_runner, tiny_tokenizer).generate([prompts[0]] * 2, [stop, held])
    assert early.finish_reason == "stop" and len(early.token_ids) == 3
    # (the stop token is output, but its text is not shown: vLLM's rule)
    assert early.text == tiny_tokenizer.decode(base[0].token_ids[:2])
    assert len(late.token_ids) >= 8 and stop_id not in late.token_ids[:7]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_caching_gives_the_real_models_own_output(tiny_model_dir, tiny_tokenizer, async_scheduling):
    """Requests whose prompts share a 40-token prefix (two and a half 16-token blocks), one
    at a time so the later ones find it cached, in a pool that preempts and evicts: greedy
    output equals a run that computes every prompt whole, and every block comes back."""
    system = tiny_tokenizer.encode(
        "You are a helpful assistant. Answer briefly and kindly, "
        "and never make things up about the harbour town."
    )[:40]
    assert len(system) == 40
    prompts = [
        system + tiny_tokenizer.encode(q)
        for q in (" Who bakes?", " Boats?", " Tide", " Who bakes?", " Nets and fish")
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs, hits = {}, {}
    for caching in (False, True):
        runner = ModelRunner(str(tiny_model_dir), num_blocks=12, block_size=16, batch_invariant=True)
        llm = LLM(
            runner,
            tiny_tokenizer,
            max_num_seqs=2,
            async_scheduling=async_scheduling,
            enable_prefix_caching=caching,
        )
        outs[caching] = [g.token_ids for g in llm.generate(prompts, sp)]
        hits[caching] = llm.last_cache_hits
        assert llm.last_free_blocks == runner.num_blocks
    assert outs[True] == outs[False]
    assert hits[False] == 0 and hits[True] >= 3 * 32  # later prompts took two blocks each
