"""Structured outputs: the real (random-weight) tiny model, whose unconstrained text is noise,
answers in the shape asked for — a JSON Schema, any JSON object, a regex, one of a few
choices — greedy and sampled, one step at a time or ahead, across preemptions, through the
engine and the `openai` client, streamed and not."""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest

from fd.control.guided import canonical
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "age", "ok"],
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
}
SPECS = {
    "json": ({"json": PERSON}, lambda t: _person(_loads(t))),
    "regex": ({"regex": r"[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
    "choice": ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _person(obj) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == {"city", "age", "ok"}
        and obj["city"] in ("Paris", "Rome", "Oslo")
        and isinstance(obj["age"], int)
        and 0 <= obj["age"] <= 120
        and isinstance(obj["ok"], bool)
    )


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_model_answers_in_the_shape_asked(kind, async_scheduling, tiny_model_dir, tiny_tokenizer):
    spec, valid = SPECS[kind]
    prompts = [tiny_tokenizer.encode(t) for t in ("Who are you?", "Tell me", "x y z", "The harbour")]
    # a pool small enough that the requests preempt each other: rebuilt matchers must agree
    runner = ModelRunner(str(tiny_model_dir), num_blocks=6, block_size=16)
    llm = LLM(runner, tiny_tokenizer, max_num_seqs=4, async_scheduling=async_scheduling)
    sps = [
        SamplingParams(temperature=0.0, max_tokens=60, guided=canonical(spec)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, guided=canonical(spec)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=60, guided=canonical(spec)),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=60, guided=canonical(spec)),
    ]
    events = []
    gens = llm.generate(prompts, sps, on_event=events.append)
    for g in gens:
        assert g.finish_reason == "stop", (g.text, g.finish_reason)
        assert valid(g.text), g.text
    assert llm.last_free_blocks == runner.num_blocks
    # unconstrained, the same model writes none of that
    free = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=20))[0].text
    assert not valid(free)


def test_preemption_and_one_step_ahead_give_the_same_guided_output(tiny_model_dir, tiny_tokenizer):
    spec = canonical({"json": PERSON})
    prompts = [tiny_tokenizer.encode(t) for t in ("a", "b c", "d e f", "g h i j", "k")]
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=60, guided=spec)
    outs = []
    for blocks, ahead in ((64, False), (5, False), (5, True)):
        runner = ModelRunner(str(tiny_model_dir), num_blocks=blocks, block_size=16)
        events = []
        outs.append(
            [
                g.token_ids
                for g in LLM(runner, tiny_tokenizer, max_num_seqs=5, async_scheduling=ahead).generate(
                    prompts, sp, on_event=events.append
                )
            ]
        )
        if blocks == 5:
            assert any(e.TYPE == "preempted" for e in events)
    assert outs[0] == outs[1] == outs[2]


def test_the_mask_is_llguidances_and_survives_a_rebuild(tiny_model_dir, tiny_runner, tiny_tokenizer):
    import llguidance
    import llguidance.numpy as lnp

    from fd.control.guided import grammar
    from fd.engine.runner.guided import Guides

    spec = canonical({"json": PERSON})
    tj = (tiny_model_dir / "tokenizer.json").read_text()
    guides = Guides(tj, tiny_runner.vocab_size, tiny_runner.eos_token_ids)
    ref = llguidance.LLMatcher(
        llguidance.LLTokenizer(tj, n_vocab=tiny_runner.vocab_size, eos_token=list(tiny_runner.eos_token_ids)),
        grammar(spec),
    )
    out: list[int] = []
    rng = np.random.default_rng(0)
    bitmask = lnp.allocate_token_bitmask(1, tiny_runner.vocab_size)
    for step in range(40):
        mask = guides.allowed("r", spec, out)
        lnp.fill_next_token_bitmask(ref, bitmask)
        want = np.unpackbits(bitmask.view(np.uint8)[0], bitorder="little")[: tiny_runner.vocab_size].astype(
            bool
        )
        assert (mask == want).all(), step
        token = int(rng.choice(np.flatnonzero(mask)))
        if token in tiny_runner.eos_token_ids:
            break
        guides.took("r", token)
        ref.consume_token(token)
        out.append(token)
        if step % 7 == 3:
            guides.keep_only(set())  # forgotten (the request skipped a step): rebuilt from `out`
    assert len(out) > 5
    # a spec that does not compile against this vocabulary allows only EOS: the request ends
    bad = Guides(tj, tiny_runner.vocab_size, tiny_runner.eos_token_ids)
    m = bad.allowed("x", canonical({"grammar": "start: nothing_defined"}), [])
    assert set(np.flatnonzero(m)) == set(tiny_runner.eos_token_ids)


async def test_structured_outputs_through_the_api(served):
    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    model = api.cfg.model_name
    msgs = [{"role": "user", "content": "Describe someone."}]
    c = await client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert c.choices[0].finish_reason == "stop" and _person(json.loads(c.choices[0].message.content))
    c = await client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=60,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_object"},
    )
    text = c.choices[0].message.content
    assert c.choices[0].finish_reason in ("stop", "length")
    if c.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert text.startswith("{")
    stream = await client.completions.create(
        model=model,
        prompt="Answer:",
        max_tokens=10,
        temperature=1.0,
        stream=True,
        extra_body={"guided_choice": ["yes", "no", "maybe so"]},
    )
    text = "".join([ch.text async for chunk in stream for ch in chunk.choices])
    assert text in ("yes", "no", "maybe so")
    r = await client.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": r"[a-c]{3}-[0-9]{2}"},
    )
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.choices[0].text)
    assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks
    await client.close()


def test_a_hand_written_request_with_a_spec(tiny_runner, tiny_tokenizer):
    """The spec is plain JSON text on the request event: what an operator can XADD."""
    from fd.control.events import Request, decode, encode

    spec = json.dumps({"choice": ["left", "right"]})
    ev = decode(
        encode(
            Request(
                request_id="h",
                data=RequestData(
                    prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=5, guided=spec)
                ),
            )
        )
    )
    assert ev.data.sampling.guided == spec
    g = LLM(tiny_runner, tiny_tokenizer).generate([list(ev.data.prompt_token_ids)], ev.data.sampling)[0]
    assert g.text in ("left", "right")
    from fd.control.bad_event import BadEvent

    with pytest.raises(BadEvent):
        SamplingParams.from_dict({"guided": '{"regex": 5}'})


async def test_a_hand_written_spec_that_does_not_compile_ends_with_an_error(served):
    """`redis-cli XADD fd:requests ...` with a grammar that names an undefined rule: the
    engine answers with an error final instead of generating unconstrained text."""
    from fd.control.events import Final, Request, encode
    from tests.kit.api import wait_for

    api, eng = served
    bad = json.dumps({"grammar": "start: nothing_defined"})
    await api.bus.redis.xadd(
        api.bus.keys.requests,
        encode(
            Request(
                request_id="hw",
                data=RequestData(
                    prompt_token_ids=(5, 6, 7), sampling=SamplingParams(max_tokens=5, guided=bad)
                ),
            )
        ),
    )

    async def ended():
        story = await api.bus.read_req("hw")
        return bool(story) and isinstance(story[-1][1], Final)

    assert await wait_for(ended)
    final = (await api.bus.read_req("hw"))[-1][1]
    assert final.finish_reason == "error" and "does not compile" in final.error


def test_a_finished_grammar_wins_over_min_tokens(tiny_runner, tiny_tokenizer):
    sp = SamplingParams(
        temperature=0.0, max_tokens=40, min_tokens=30, guided=canonical({"choice": ["yes", "no"]})
    )
    g = LLM(tiny_runner, tiny_tokenizer).generate([tiny_tokenizer.encode("Answer:")], sp)[0]
    assert g.text in ("yes", "no") and g.finish_reason == "stop"
    # and it ended there, not after min_tokens tokens of whatever an all-banned row gives
    assert len(g.token_ids) <= len(tiny_tokenizer.encode(g.text)) + 1
