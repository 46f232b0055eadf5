"""vLLM's serving flags an operator reaches for first: ``--max-model-len`` (the context served,
which the API and the engine both hold requests to), ``--chat-template`` (a model without one,
or a better one) and ``--generation-config`` (the model maker's sampling defaults and output
cap). Through the real tiny model, the embedded server and the ``openai`` client."""

from __future__ import annotations

import json
import logging

import aiohttp
import openai
import pytest

from fd.api import protocol, sampling, validation
from fd.api.config import ApiConfig
from fd.compose import (
    join_in_process,
    read_chat_template,
    read_generation_config,
    start_api,
    start_engine,
)
from fd.control.events import Final
from fd.control.sampling import SamplingParams
from fd.control.tokenizer import served_context
from fd.engine.node.node_config import EngineConfig, SchedulerSettings
from fd.engine.runner.llm import LLM
from tests.kit.api import FakeTokenizer, wait_for

CONTEXT = 64


async def _serve(
    embedded_redis,
    keys,
    tiny_model_dir,
    tiny_runner,
    tiny_tokenizer,
    *,
    engine_max: int | None = None,
    policy: str = "fcfs",
    **api_kw,
):
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(
            model_dir=str(tiny_model_dir),
            engine_id="e-opts",
            scheduler=SchedulerSettings(max_model_len=engine_max, scheduling_policy=policy),
        ),
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), **api_kw),
        tokenizer=tiny_tokenizer,
    )
    join_in_process(api, eng)
    return api, eng


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            return r.status, await r.json()


def test_the_context_served_is_at_most_the_models():
    assert served_context(None, 2048) == 2048
    assert served_context(CONTEXT, 2048) == CONTEXT
    for bad in (4096, 1, 0):
        with pytest.raises(ValueError, match="max_position_embeddings"):
            served_context(bad, 2048)


async def test_max_model_len_holds_the_api_and_the_engine_to_a_shorter_context(
    embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    api, eng = await _serve(
        embedded_redis,
        keys,
        tiny_model_dir,
        tiny_runner,
        tiny_tokenizer,
        engine_max=CONTEXT,
        max_model_len=CONTEXT,
    )
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    try:
        models = await client.models.list()
        assert models.data[0].model_extra["max_model_len"] == CONTEXT
        prompt = list(range(10, 70))  # 60 tokens: 4 left to generate
        status, body = await _post(f"{api.url}/v1/completions", {"prompt": prompt, "max_tokens": 10})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert f"This model's maximum context length is {CONTEXT} tokens" in body["error"]["message"]
        c = await client.completions.create(
            model=api.cfg.model_name, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
        )
        assert c.usage.completion_tokens == CONTEXT - len(prompt) and c.choices[0].finish_reason == "length"
        # The engine holds a request that never passed an API (a hand-written one) to it too.
        rid = "hand-written-long"
        from fd.control.events import Request
        from fd.control.request_data import RequestData

        await api.bus.publish(
            api.bus.keys.requests,
            Request(
                request_id=rid,
                data=RequestData(
                    prompt_token_ids=tuple(range(10, 80)), sampling=SamplingParams(max_tokens=4)
                ),
            ),
        )
        finals = []

        async def final() -> bool:
            finals[:] = [ev for _, ev in await api.bus.read_req(rid) if isinstance(ev, Final)]
            return bool(finals)

        assert await wait_for(final)
        assert finals[0].finish_reason == "error" and f"max_model_len {CONTEXT}" in finals[0].error
    finally:
        await client.close()
        await api.stop()
        await eng.stop()


async def test_a_longer_context_than_the_model_has_is_refused_at_start(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer
):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        await start_api(
            embedded_redis.client,
            keys,
            ApiConfig(model_dir=str(tiny_model_dir), max_model_len=10**6),
            tokenizer=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="max_position_embeddings"):  # before the model loads
        await start_engine(
            embedded_redis.client,
            keys,
            EngineConfig(model_dir=str(tiny_model_dir), scheduler=SchedulerSettings(max_model_len=10**6)),
        )


async def test_chat_template_replaces_the_models(
    embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, tmp_path
):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = tiny_tokenizer.encode("[system] Be brief.\n[user] Hi there\n[assistant]")
    assert tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages)) != want
    for given in (str(path), template):  # a file, or the template itself
        api, eng = await _serve(
            embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, chat_template=given
        )
        client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
        try:
            status, body = await _post(f"{api.url}/tokenize", {"messages": messages})
            assert status == 200 and body["tokens"] == want
            c = await client.chat.completions.create(
                model=api.cfg.model_name,
                messages=messages,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            greedy = LLM(tiny_runner, tiny_tokenizer).generate(
                [want], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            )[0]
            assert c.usage.prompt_tokens == len(want) and c.choices[0].message.content == greedy.text
        finally:
            await client.close()
            await api.stop()
            await eng.stop()
    # the shared tokenizer kept the model's own
    assert tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages)) != want


async def test_a_chat_template_that_cannot_be_used_is_said_at_start(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, tmp_path
):
    with pytest.raises(ValueError, match="does not compile"):
        await start_api(
            embedded_redis.client,
            keys,
            ApiConfig(model_dir=str(tiny_model_dir), chat_template="{% for m in %}"),
            tokenizer=tiny_tokenizer,
        )
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_generation_config_gives_defaults_a_cap_and_leaves_out_what_a_request_could_not_have():
    defaults, cap, ignored = sampling.generation_defaults(
        {
            "temperature": 0.6,
            "top_p": 7,
            "top_k": 50,
            "repetition_penalty": 1.05,
            "min_p": None,
            "do_sample": True,
            "max_new_tokens": 5,
            "eos_token_id": [1],
        }
    )
    assert defaults == {"temperature": 0.6, "repetition_penalty": 1.05}  # top_k 50: transformers'
    assert cap == 5 and len(ignored) == 1 and ignored[0].startswith("top_p")
    limits = validation.Limits(
        model_name="m", max_model_len=2048, sampling_defaults=defaults, max_output_tokens=cap
    )
    tok = _Ids()
    s = protocol.parse_completion({"prompt": [5, 6], "max_tokens": 20}, limits, tok).sampling
    assert (s.temperature, s.repetition_penalty, s.max_tokens, s.top_p) == (0.6, 1.05, 5, 1.0)
    s = protocol.parse_completion(
        {"prompt": [5, 6], "temperature": 1.3, "repetition_penalty": 1.0}, limits, tok
    ).sampling
    assert (s.temperature, s.repetition_penalty) == (1.3, 1.0)  # a request's own values win
    assert sampling.generation_defaults({"max_new_tokens": "many"})[2] == [
        "max_new_tokens: 'many' is not a positive integer"
    ]


class _Ids(FakeTokenizer):
    """The fake tokenizer, for prompts given as token ids only."""

    vocab_size = 512

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise AssertionError("token id prompts only")


async def test_generation_config_through_the_api(
    embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, tmp_path, caplog
):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5, "top_p": 7})
    )
    assert read_generation_config("vllm", str(tmp_path)) == {}
    assert read_generation_config("auto", str(tmp_path / "elsewhere")) == {}  # a model without one
    with pytest.raises(FileNotFoundError):
        read_generation_config(str(tmp_path / "elsewhere"), str(tiny_model_dir))
    prompt = list(range(20, 40))
    greedy = LLM(tiny_runner, tiny_tokenizer).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )[0]
    with caplog.at_level(logging.WARNING, logger="fd.api"):
        api, eng = await _serve(
            embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, generation_config=str(tmp_path)
        )
    assert any("top_p" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)
    assert any("'temperature': 0.0" in r.getMessage() for r in caplog.records)
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    try:  # no temperature given: the model's 0 (greedy); max_tokens 20 capped at its 5
        c = await client.completions.create(
            model=api.cfg.model_name, prompt=prompt, max_tokens=20, extra_body={"ignore_eos": True}
        )
        assert c.choices[0].text == greedy.text and c.usage.completion_tokens == 5
    finally:
        await client.close()
        await api.stop()
        await eng.stop()


async def test_skip_special_tokens_false_keeps_their_text(served):
    """vLLM's skip_special_tokens: special tokens (the tiny model's <|im_start|> is one) are
    left out of the text by default; false keeps them, streamed and not."""
    api, eng = served
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    force = {"logit_bias": {"2": 100}}  # token 2, <|im_start|>, every step
    try:
        c = await client.completions.create(
            model=api.cfg.model_name, prompt="Hi", max_tokens=3, temperature=0, **force
        )
        assert c.choices[0].text == "" and c.usage.completion_tokens == 3
        c = await client.completions.create(
            model=api.cfg.model_name,
            prompt="Hi",
            max_tokens=3,
            temperature=0,
            extra_body={"skip_special_tokens": False},
            **force,
        )
        assert c.choices[0].text == "<|im_start|>" * 3
        stream = await client.chat.completions.create(
            model=api.cfg.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
            stream=True,
            extra_body={"skip_special_tokens": False},
            **force,
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        assert text == "<|im_start|>" * 2
        status, body = await _post(f"{api.url}/v1/completions", {"prompt": "Hi", "skip_special_tokens": "no"})
        assert status == 400 and body["error"]["param"] == "skip_special_tokens"
    finally:
        await client.close()


def test_skip_special_tokens_is_on_the_wire_only_when_false():
    from fd.control.bad_event import BadEvent

    assert "skip_special_tokens" not in SamplingParams().to_dict()
    d = SamplingParams(skip_special_tokens=False).to_dict()
    assert d["skip_special_tokens"] is False
    assert SamplingParams.from_dict(d).skip_special_tokens is False
    with pytest.raises(BadEvent, match="skip_special_tokens"):
        SamplingParams.from_dict({"skip_special_tokens": "no"})


async def test_several_served_model_names(embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """vLLM's --served-model-name a b: a request may name either, every answer names the first."""
    from fd.cli.main import build_parser

    names = (
        build_parser().parse_args(["serve", "--served-model-name", "main", "gpt-4o-mini"]).served_model_name
    )
    assert names == ["main", "gpt-4o-mini"]
    api, eng = await _serve(
        embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, served_model_name=names
    )
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    try:
        assert [m.id for m in (await client.models.list()).data] == names
        for asked in names:
            c = await client.completions.create(model=asked, prompt="Hi", max_tokens=2)
            assert c.model == "main"
        status, body = await _post(f"{api.url}/v1/completions", {"model": "other", "prompt": "Hi"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{api.url}/openapi.json") as r:
                doc = await r.json()
        assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == names
    finally:
        await client.close()
        await api.stop()
        await eng.stop()


def test_seed_starts_the_samplers_stream_for_unseeded_requests(tiny_model_dir):
    """vLLM's --seed: two engines with the same seed sample an unseeded request alike, with
    another seed not (a request's own seed is its own stream either way)."""
    from fd.cli.main import build_parser
    from fd.cli.serving import _engine_config
    from fd.compose import make_runner
    from fd.engine.runner.llm import LLM

    args = build_parser().parse_args(["serve", "--seed", "7", "--executor", "paddle"])
    assert _engine_config(args, tiny_model_dir).seed == 7

    def sample(seed: int, sp: SamplingParams) -> list[list[int]]:
        opts = _engine_config(build_parser().parse_args(["serve", "--seed", str(seed)]), tiny_model_dir)
        opts.executor, opts.num_blocks = "paddle-thread", 64
        runner = make_runner(opts, progress=False)
        from fd.control.tokenizer import Tokenizer

        return [
            g.token_ids
            for g in LLM(runner, Tokenizer.from_dir(str(tiny_model_dir))).generate(
                [[20, 21, 22], [30, 31]], sp
            )
        ]

    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert sample(1, free) == sample(1, free) != sample(2, free)
    own = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    assert sample(1, own) == sample(2, own)


async def test_server_wide_usage_and_token_id_defaults(
    embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """vLLM's --enable-force-include-usage (every stream ends with its usage) and
    --return-tokens-as-token-ids (unless a request says otherwise)."""
    from fd.cli.main import build_parser
    from fd.cli.serving import _api_config

    args = build_parser().parse_args(
        ["serve", "--enable-force-include-usage", "--return-tokens-as-token-ids"]
    )
    opts = _api_config(args, tiny_model_dir)
    assert opts.force_include_usage and opts.tokens_as_ids
    api, eng = await _serve(
        embedded_redis,
        keys,
        tiny_model_dir,
        tiny_runner,
        tiny_tokenizer,
        force_include_usage=True,
        tokens_as_ids=True,
    )
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    try:
        # (ignore_eos: sampled at temperature 1, the random model ends "Hi" with EOS within 3
        # tokens about once in a hundred: this test failed now and then)
        stream = await client.completions.create(
            model=api.cfg.model_name,
            prompt="Hi",
            max_tokens=3,
            stream=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        named = [
            t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
        ]
        assert len(named) == 3 and all(t.startswith("token_id:") for t in named)
        c = await client.completions.create(
            model=api.cfg.model_name,
            prompt="Hi",
            max_tokens=2,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": False},
        )
        assert not any(t.startswith("token_id:") for t in c.choices[0].logprobs.tokens)
    finally:
        await client.close()
        await api.stop()
        await eng.stop()


async def test_scheduling_policy_priority(embedded_redis, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """vLLM's --scheduling-policy priority: the API takes a request's `priority` and the
    engine's scheduler orders by it (tests/unit/test_scheduler.py); the request event and the
    journal carry it, so a replay decides the same."""
    from fd.cli.main import build_parser
    from fd.cli.serving import _api_config, _engine_config

    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert _api_config(args, tiny_model_dir).priority_scheduling
    assert _engine_config(args, tiny_model_dir).scheduler.scheduling_policy == "priority"
    assert (
        build_parser().parse_args(["api", "--scheduling-policy", "priority"]).scheduling_policy == "priority"
    )
    api, eng = await _serve(
        embedded_redis,
        keys,
        tiny_model_dir,
        tiny_runner,
        tiny_tokenizer,
        policy="priority",
        priority_scheduling=True,
    )
    try:
        assert eng.node.sched.config.scheduling_policy == "priority"
        status, body = await _post(
            f"{api.url}/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -3}
        )
        assert status == 200, body
        adds: list = []

        async def journaled() -> bool:
            journal = [
                json.loads(f[b"data"])
                for _, f in await api.bus.redis.xrange(keys.journal(eng.id))
                if f.get(b"type") == b"step"
            ]
            adds[:] = [c["data"] for e in journal for c in e["calls"] if c["op"] == "add"]
            return bool(adds)

        assert await wait_for(journaled)
        assert adds[-1]["priority"] == -3
        status, body = await _post(f"{api.url}/v1/completions", {"prompt": "Hi", "priority": 2**40})
        assert status == 400 and body["error"]["param"] == "priority"
    finally:
        await api.stop()
        await eng.stop()
