"""Steps reach the runner in the order the scheduler decided them, whoever decides them: the
step loop (after a claim, whose ``claimed`` it publishes first) or the driver's callback as a
result comes in (fd/engine/node/node.py ``_result_in``)."""

from __future__ import annotations

import asyncio

from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, tokens_of, types
from tests.kit.faults import engines  # noqa: F401  (a fixture)


async def test_requests_arriving_while_steps_run_get_their_tokens_in_order(
    engines,  # noqa: F811
    redis_server,
    keys,
    tiny_runner,
    tiny_tokenizer,
):
    """Requests arriving one by one while steps are in flight: each claim publishes its
    ``claimed`` before the step that runs the request is handed over, and results come in
    meanwhile. Every request gets the tokens greedy decoding gives it alone, and none fails
    (a step handed over out of order fails its requests: a token it expects is missing)."""
    n, max_tokens = 48, 12
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(n)]
    refs = LLM(tiny_runner, tiny_tokenizer).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    client = connect(redis_server.url)
    bus = Bus(client, keys)
    try:
        await engines.start("A", delay=0.002, max_num_seqs=64)
        for i, prompt in enumerate(prompts):
            await submit(bus, f"o{i}", prompt, max_tokens=max_tokens, ignore_eos=True)
            await asyncio.sleep(0.001 * (i % 3))
        for i, ref in enumerate(refs):
            evs = await story(bus, f"o{i}", timeout=60)
            assert types(evs)[-1] == "final" and evs[-1].finish_reason == "length", (i, evs[-1])
            assert tokens_of(evs) == ref.token_ids, i
    finally:
        await client.aclose()
