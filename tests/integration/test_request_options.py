"""vLLM's per-request extensions a client of vLLM sends and expects to work: how chat messages
become the prompt (``add_generation_prompt``, ``continue_final_message``,
``add_special_tokens``), ``truncate_prompt_tokens`` and ``return_tokens_as_token_ids``.
Through the real tiny model, the embedded server and the ``openai`` client, whose greedy
output must equal the engine's own on the prompt the option describes."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from fd.control.events import Accepted, decode
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM

USER = {"role": "user", "content": "Name a colour."}
PARTIAL = {"role": "assistant", "content": "The colour is"}


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            return r.status, await r.json()


def _greedy(runner, tokenizer, ids, n: int = 4):
    return LLM(runner, tokenizer).generate(
        [list(ids)], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )[0]


async def test_continue_final_message_goes_on_with_the_assistants_text(
    openai_client, tiny_runner, tiny_tokenizer
):
    api, oa = openai_client
    whole = tiny_tokenizer.apply_chat_template([USER, PARTIAL], add_generation_prompt=False)
    cut = whole[: whole.rindex(PARTIAL["content"]) + len(PARTIAL["content"])]
    assert cut != whole  # (the template closes the turn: what continuing leaves out)
    want = tiny_tokenizer.encode(cut, add_special_tokens=False)
    status, body = await _post(
        f"{api.url}/tokenize",
        {"messages": [USER, PARTIAL], "continue_final_message": True, "add_generation_prompt": False},
    )
    assert status == 200 and body["tokens"] == want
    c = await oa.chat.completions.create(
        model=api.cfg.model_name,
        messages=[USER, PARTIAL],
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True},
    )
    assert c.usage.prompt_tokens == len(want)
    assert c.choices[0].message.content == _greedy(tiny_runner, tiny_tokenizer, want).text
    # without it the same messages are a finished turn, and a new one is opened
    c = await oa.chat.completions.create(model=api.cfg.model_name, messages=[USER, PARTIAL], max_tokens=1)
    assert c.usage.prompt_tokens == len(
        tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template([USER, PARTIAL]), add_special_tokens=False)
    )
    for body, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        (
            {"continue_final_message": True, "add_generation_prompt": False, "messages": [PARTIAL, USER]},
            "continue_final_message",
        ),  # the last is not the assistant's
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "messages": [USER, {"role": "assistant", "content": " "}],
            },
            "continue_final_message",
        ),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ):
        status, out = await _post(f"{api.url}/v1/chat/completions", {"messages": [USER, PARTIAL], **body})
        assert status == 400 and out["error"]["param"] == param, (body, out)


async def test_add_generation_prompt_and_add_special_tokens(openai_client, tiny_tokenizer):
    api, oa = openai_client
    bare = tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template([USER], add_generation_prompt=False), add_special_tokens=False
    )
    c = await oa.chat.completions.create(
        model=api.cfg.model_name, messages=[USER], max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert c.usage.prompt_tokens == len(bare)
    opened = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template([USER]), add_special_tokens=False)
    status, body = await _post(f"{api.url}/tokenize", {"messages": [USER], "add_special_tokens": True})
    assert status == 200 and body["tokens"] == tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template([USER]), add_special_tokens=True
    )
    status, body = await _post(f"{api.url}/tokenize", {"messages": [USER]})
    assert status == 200 and body["tokens"] == opened


async def test_truncate_prompt_tokens_keeps_the_prompts_end(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    prompt = list(range(20, 60))
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 8, "ignore_eos": True},
    )
    assert c.usage.prompt_tokens == 8
    assert c.choices[0].text == _greedy(tiny_runner, tiny_tokenizer, prompt[-8:]).text
    # echo shows what the model was given
    text = "one two three four five six seven eight nine ten"
    kept = tiny_tokenizer.encode(text, add_special_tokens=True)[-3:]
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=text,
        max_tokens=1,
        echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert c.choices[0].text.startswith(tiny_tokenizer.decode(kept)) and c.usage.prompt_tokens == 3
    # a prompt shorter than k, and -1 (the whole context), leave it whole
    for k in (100, -1):
        c = await oa.completions.create(
            model=api.cfg.model_name, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": k}
        )
        assert c.usage.prompt_tokens == len(prompt)
    # chat: the rendered prompt's end
    ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template([USER]), add_special_tokens=False)
    c = await oa.chat.completions.create(
        model=api.cfg.model_name,
        messages=[USER],
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True},
    )
    assert c.usage.prompt_tokens == 5
    assert c.choices[0].message.content == _greedy(tiny_runner, tiny_tokenizer, ids[-5:]).text
    for k in (0, -2, api.cfg.max_model_len + 1, "8"):
        status, out = await _post(
            f"{api.url}/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": k}
        )
        assert status == 400 and out["error"]["param"] == "truncate_prompt_tokens", (k, out)


async def test_return_tokens_as_token_ids(openai_client):
    api, oa = openai_client
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=[30, 31, 32],
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(t.startswith("token_id:") for t in lp.tokens)
    ids = [int(t.split(":")[1]) for t in lp.tokens]
    plain = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=[30, 31, 32],
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert all(f"token_id:{i}" in top for i, top in zip(ids, lp.top_logprobs))
    story = [decode(f) for _, f in await api.bus.redis.xrange(api.bus.keys.req(c.id))]
    assert isinstance(story[0], Accepted) and story[0].tokens_as_ids
    # the story says so: any replica renders the same
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/v1/requests/{c.id}/stream") as r:
            replay = (await r.read()).decode()
    assert '"tokens":["token_id:' in replay
    chat = await oa.chat.completions.create(
        model=api.cfg.model_name,
        messages=[USER],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for t in chat.choices[0].logprobs.content:
        assert t.token.startswith("token_id:") and bytes(t.bytes).decode() == t.token
        assert t.top_logprobs[0].token.startswith("token_id:")
    status, out = await _post(f"{api.url}/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": 1})
    assert status == 400 and out["error"]["param"] == "return_tokens_as_token_ids"


async def test_a_model_retrieved_by_name_and_the_liveness_route(openai_client):
    api, oa = openai_client
    m = await oa.models.retrieve(api.cfg.model_name)
    assert m.id == api.cfg.model_name and m.model_extra["max_model_len"] == api.cfg.max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        await oa.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found"
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            async with s.request(method, f"{api.url}/ping") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"


async def test_priority_is_refused_as_vllm_without_priority_scheduling(openai_client):
    api, oa = openai_client
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [USER]})):
        status, out = await _post(f"{api.url}{path}", {**body, "priority": 1, "max_tokens": 1})
        assert status == 400 and out["error"]["param"] == "priority", out
        status, _ = await _post(f"{api.url}{path}", {**body, "priority": 0, "max_tokens": 1})
        assert status == 200


async def test_allowed_token_ids_is_all_that_is_sampled(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    allowed = [7, 100, 250, 401]
    prompt = [20, 21, 22]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=tuple(allowed))
    want = LLM(tiny_runner, tiny_tokenizer).generate([prompt], sp)[0]
    free = _greedy(tiny_runner, tiny_tokenizer, prompt, 6)
    assert set(want.token_ids) <= set(allowed) and not set(free.token_ids) <= set(allowed)
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert [int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens] == want.token_ids
    for seed in range(3):  # sampled too
        c = await oa.completions.create(
            model=api.cfg.model_name,
            prompt=prompt,
            max_tokens=8,
            seed=seed,
            logprobs=0,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        assert {int(t.split(":")[1]) for t in c.choices[0].logprobs.tokens} <= set(allowed)
    for bad in ([], [-1], [tiny_runner.vocab_size], "7", [7, "x"]):
        status, out = await _post(f"{api.url}/v1/completions", {"prompt": "x", "allowed_token_ids": bad})
        assert status == 400 and out["error"]["param"] == "allowed_token_ids", (bad, out)


def test_allowed_token_ids_on_the_wire_only_when_set():
    from fd.control.bad_event import BadEvent

    assert "allowed_token_ids" not in SamplingParams().to_dict()
    d = SamplingParams(allowed_token_ids=(3, 9)).to_dict()
    assert SamplingParams.from_dict(d).allowed_token_ids == (3, 9)
    with pytest.raises(BadEvent, match="allowed_token_ids"):
        SamplingParams.from_dict({"allowed_token_ids": [1, -2]})


async def test_fields_nothing_read_are_said_to_be_ignored(openai_client, caplog):
    """As vLLM's "present in the request but ignored": a misspelt or unsupported field is
    named in the log (once a name), and every field the OpenAPI document lists is read."""
    import logging

    api, oa = openai_client
    with caplog.at_level(logging.WARNING, logger="fd.api"):
        for _ in range(2):
            status, _ = await _post(
                f"{api.url}/v1/completions",
                {"prompt": "x", "max_tokens": 1, "max_new_tokens": 5, "user": "u1"},
            )
            assert status == 200
    said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(said) == 1 and "'max_new_tokens'" in said[0] and "user" not in said[0], said
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/openapi.json") as r:
            schemas = (await r.json())["components"]["schemas"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fd.api"):
        for path, name, given in (
            ("/v1/completions", "CompletionRequest", {"prompt": "x"}),
            ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [USER]}),
        ):
            body = {**{k: None for k in schemas[name]["properties"]}, **given, "max_tokens": 1}
            status, out = await _post(f"{api.url}{path}", body)
            assert status == 200, out
    assert not [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]


async def test_return_token_ids(openai_client, tiny_runner, tiny_tokenizer):
    """vLLM's return_token_ids (what RL trainers read): the prompt's ids once, each choice's
    output ids — streamed, a token whose text is held back rides with the next chunk."""
    api, oa = openai_client
    prompt = [30, 31, 32]
    want = _greedy(tiny_runner, tiny_tokenizer, prompt, 8)
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ch = c.choices[0].model_extra
    assert ch["prompt_token_ids"] == prompt and ch["token_ids"] == want.token_ids
    messages = [USER]
    ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = _greedy(tiny_runner, tiny_tokenizer, ids, 12)
    stream = await oa.chat.completions.create(
        model=api.cfg.model_name,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    chunks = [ch async for ch in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert not any("prompt_token_ids" in ch.model_extra for ch in chunks[1:])
    got = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
    assert got == want.token_ids
    # n > 1: each choice its own ids, the prompt's with each (completions) / once (chat)
    c = await oa.chat.completions.create(
        model=api.cfg.model_name,
        messages=messages,
        max_tokens=3,
        n=2,
        seed=1,
        extra_body={"return_token_ids": True},
    )
    assert c.model_extra["prompt_token_ids"] == ids
    assert [len(x.model_extra["token_ids"]) for x in c.choices] == [3, 3]
    # the story says so: a replay shows them too
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{api.url}/v1/completions",
            headers={"X-Request-Id": "ids-1"},
            json={"prompt": prompt, "max_tokens": 3, "stream": True, "return_token_ids": True},
        ) as r:
            original = await r.read()
        async with s.get(f"{api.url}/v1/requests/ids-1/stream") as r:
            assert await r.read() == original and b'"prompt_token_ids":[30,31,32]' in original
    status, out = await _post(f"{api.url}/v1/completions", {"prompt": "x", "return_token_ids": "yes"})
    assert status == 400 and out["error"]["param"] == "return_token_ids"


def test_a_bad_words_last_token_is_banned_only_where_it_completes_it():
    import numpy as np

    from fd.engine.runner.sampler import adjust

    sp = SamplingParams(bad_words_ids=((5,), (7, 8)))
    row = np.zeros(16, dtype=np.float32)
    x = adjust(row, sp, 2, ((), (3, 7)), ())
    assert x[5] == -np.inf and x[8] == -np.inf and np.isfinite(x[7])
    x = adjust(row, sp, 2, ((), (7, 3)), ())
    assert x[5] == -np.inf and np.isfinite(x[8])


async def test_bad_words_through_the_api(openai_client, tiny_runner, tiny_tokenizer):
    api, oa = openai_client
    prompt = [40, 41, 42]
    free = _greedy(tiny_runner, tiny_tokenizer, prompt, 10).token_ids
    word = next(
        tiny_tokenizer.decode([t])
        for t in free
        if tiny_tokenizer.decode([t]).strip()
        and tiny_tokenizer.encode(tiny_tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    seqs = [tuple(tiny_tokenizer.encode(w, add_special_tokens=False)) for w in (word, " " + word)]
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        extra_body={"bad_words": [word], "ignore_eos": True, "return_token_ids": True},
    )
    out = c.choices[0].model_extra["token_ids"]
    assert out != free
    for seq in seqs:  # no window of the output is a bad word
        assert all(tuple(out[i : i + len(seq)]) != seq for i in range(len(out))), (seq, out)
    for bad in ("x", [1], ["ok"] * 65):
        status, body = await _post(f"{api.url}/v1/completions", {"prompt": "x", "bad_words": bad})
        assert status == 400 and body["error"]["param"] == "bad_words", (bad, body)
    assert SamplingParams.from_dict(SamplingParams(bad_words_ids=((1, 2),)).to_dict()).bad_words_ids == (
        (1, 2),
    )
    assert "bad_words_ids" not in SamplingParams().to_dict()


async def test_tokenize_returns_the_vocabularys_pieces_when_asked(openai_client, tiny_tokenizer):
    api, _ = openai_client
    status, body = await _post(f"{api.url}/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and len(body["token_strs"]) == body["count"]
    assert body["token_strs"] == [tiny_tokenizer._tok.id_to_token(t) for t in body["tokens"]]
    assert "".join(body["token_strs"]).replace("\u0120", " ").endswith("world")
    status, body = await _post(f"{api.url}/tokenize", {"prompt": "Hello"})
    assert "token_strs" not in body


async def test_the_token_that_stops_a_request_is_counted_not_shown(
    openai_client, tiny_runner, tiny_tokenizer
):
    """As vLLM: a stop_token_ids token (or an EOS, even with skip_special_tokens false) ends
    the answer without its text, and counts as a completion token; stop_reason names it."""
    api, oa = openai_client
    ids = tiny_tokenizer.encode("Hello there")
    base = _greedy(tiny_runner, tiny_tokenizer, ids, 4)
    stop = base.token_ids[2]
    assert stop not in base.token_ids[:2]
    for stream in (False, True):
        c = await oa.completions.create(
            model=api.cfg.model_name,
            prompt=ids,
            max_tokens=8,
            temperature=0,
            stream=stream,
            extra_body={"stop_token_ids": [stop]},
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = [x async for x in c]
            text = "".join(ch.text for x in chunks for ch in x.choices)
            reason = [ch.finish_reason for x in chunks for ch in x.choices if ch.finish_reason]
            assert [
                ch.model_extra["stop_reason"] for x in chunks for ch in x.choices if ch.finish_reason
            ] == [stop]
            usage = chunks[-1].usage
        else:
            text, reason, usage = c.choices[0].text, [c.choices[0].finish_reason], c.usage
            assert c.choices[0].model_extra["stop_reason"] == stop
        assert text == tiny_tokenizer.decode(base.token_ids[:2]) and reason == ["stop"]
        assert usage.completion_tokens == 3
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=ids,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True},
    )
    assert c.choices[0].text == tiny_tokenizer.decode(base.token_ids[:3])
    eos = tiny_tokenizer.eos_token_ids[0]
    c = await oa.completions.create(
        model=api.cfg.model_name,
        prompt=ids,
        max_tokens=8,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"skip_special_tokens": False},
    )
    assert c.choices[0].finish_reason == "stop" and c.choices[0].text == "" and c.usage.completion_tokens == 1
