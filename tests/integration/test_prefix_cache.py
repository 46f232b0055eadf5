"""Prefix caching end to end: through `fd serve`'s engine and API with the real tiny model,
a shared system prompt is computed once, the answers are the model's own, an abort of a
request sharing blocks leaves the others' alone, and every block comes back."""

from __future__ import annotations

import asyncio

import openai

from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.api import wait_for

SYSTEM = (
    "You are a helpful assistant for the harbour town. Answer briefly, kindly, and never "
    "make things up about the boats, the bakery or the tide."
)


async def _metric(api, name: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/metrics") as r:
            text = await r.text()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_a_shared_system_prompt_is_computed_once(served, tiny_runner, tiny_tokenizer):
    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    questions = ["Who bakes the bread?", "When do the boats come back?", "Who bakes the bread?"]
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    plain = LLM(tiny_runner, tiny_tokenizer, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [
        g.text
        for g in plain.generate(
            [tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(m)) for m in msgs], sp
        )
    ]
    got, cached = [], []
    for m in msgs:  # one after another: each finds what the ones before computed
        c = await client.chat.completions.create(
            model=api.cfg.model_name,
            messages=m,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        got.append(c.choices[0].message.content)
        details = c.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)
    assert got == want
    # OpenAI's usage says how much of each prompt the cache spared (whole 16-token blocks)
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] > cached[1] and all(n % 16 == 0 for n in cached)
    stream = await client.chat.completions.create(
        model=api.cfg.model_name,
        messages=msgs[2],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = [chunk async for chunk in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached[2]
    prompt_len = len(tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(msgs[0])))
    hits = eng.node.sched.num_cache_hits
    assert hits >= 2 * 32 and eng.node.sched.num_cache_queries >= 3 * prompt_len - 16
    assert await _metric(api, "fd_prefix_cache_hits_tokens") == hits
    assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks
    eng.node.sched.scheduler.blocks.check()
    await client.close()


async def test_aborting_a_request_that_shares_blocks_leaves_the_others_whole(
    served, tiny_runner, tiny_tokenizer
):
    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    model = api.cfg.model_name
    prompt = SYSTEM + " Tell me about the tide."
    want = (
        LLM(tiny_runner, tiny_tokenizer, enable_prefix_caching=False)
        .generate(
            [tiny_tokenizer.encode(prompt)], SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
        )[0]
        .text
    )
    await client.completions.create(model=model, prompt=prompt, max_tokens=1)  # computes the prefix
    keeper = asyncio.create_task(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=240, temperature=0, extra_body={"ignore_eos": True}
        )
    )
    # (long enough to be still running when the doomed one's first token comes, however loaded
    # the machine: 60 tokens were once all done before it)
    # The keeper's request may be sent after the doomed one's (its own connection): wait until
    # the engine runs it, so the doomed request finds it holding the shared blocks.
    assert await wait_for(lambda: _running(eng, 1))
    doomed = await client.completions.create(
        model=model, prompt=prompt, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    first = await doomed.__anext__()
    shared = set(eng.node.sched.scheduler.blocks.table(first.id)) & {
        b for rid, t in eng.node.sched.scheduler.blocks.tables().items() if rid != first.id for b in t
    }
    assert shared  # it holds blocks another request holds too
    await api.bus.redis.xadd(api.bus.keys.control, {"type": "abort", "request_id": first.id})
    reasons = [ch.finish_reason async for chunk in doomed for ch in chunk.choices if ch.finish_reason]
    assert reasons == ["abort"]
    assert (await keeper).choices[0].text == want
    assert await wait_for(lambda: _idle(eng))
    eng.node.sched.scheduler.blocks.check()
    await client.close()


async def _running(eng, n: int) -> bool:
    await asyncio.sleep(0)
    return len(eng.node.sched.scheduler.blocks.tables()) >= n


async def _idle(eng) -> bool:
    await asyncio.sleep(0)
    s = eng.node.sched
    return s.num_free_blocks == s.num_total_blocks and not s.has_work()


async def test_a_response_of_choices_counts_each_prompts_cached_tokens_once(served):
    """n > 1 and completions batches: the prompt is counted once in usage, so its cached
    tokens are one choice's (not n times), summed over the batch's prompts; a replay says
    the same."""
    import aiohttp

    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    model = api.cfg.model_name
    prompts = [SYSTEM + " Tell me about the bakery.", SYSTEM + " And the boats?"]
    single = []
    for p in prompts:
        await client.completions.create(model=model, prompt=p, max_tokens=1)  # computes it
        c = await client.completions.create(model=model, prompt=p, max_tokens=1)
        single.append(c.usage.prompt_tokens_details.cached_tokens)
    assert all(n >= 32 for n in single)
    c = await client.completions.create(model=model, prompt=prompts[0], max_tokens=3, n=3)
    assert len(c.choices) == 3 and c.usage.prompt_tokens_details.cached_tokens == single[0]
    c = await client.completions.create(model=model, prompt=prompts, max_tokens=3, n=2)
    assert len(c.choices) == 4 and c.usage.prompt_tokens_details.cached_tokens == sum(single)
    stream = await client.completions.create(
        model=model, prompt=prompts, max_tokens=3, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == sum(single)
    async with aiohttp.ClientSession() as s:  # any replica's replay renders the same usage
        async with s.get(f"{api.url}/v1/requests/{chunks[0].id}/stream") as r:
            body = await r.text()
    frames = [line[6:] for line in body.splitlines() if line.startswith("data: {")]
    assert f'"cached_tokens":{sum(single)}' in frames[-1].replace(" ", "")
    assert await wait_for(lambda: _idle(eng))
    await client.close()
