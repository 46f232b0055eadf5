"""OpenAI's embeddings API (``POST /v1/embeddings``), as vLLM serves it for a decoder model,
and vLLM's score and rerank over it:
each input's vector is the model's final hidden state at its last token, normalized. Checked
through the ``openai`` client against the engine's own hidden state, and against the model's
head (the raw vector times the LM head picks the token greedy decoding picks next); each input
is a request with a story of its own, aborted with its siblings when the client goes."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil

import aiohttp
import numpy as np
import openai
import pytest

from fd.api.embeddings import SAMPLING
from fd.control.events import Abort, Accepted, BlocksReleased, Claimed, Final, Tokens, decode
from fd.control.sampling import SamplingParams
from fd.control.token_payloads import embedding_vector
from fd.control.tokenizer import Tokenizer
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.runner.llm import LLM
from fd.engine.runner.timed_runner import EMBED_DIM, TimedRunner
from tests.kit.api import (
    MAX_LEN,
    FakeEngine,
    api_client,
    assert_openai_error,
    control_events,
    setup,
    wait_for,
)

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog " * 6, "a"]


def _unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


async def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers=headers or {}) as r:
            return r.status, await r.json()


async def _story(bus, rid: str) -> list:
    return [decode(f, e) for e, f in await bus.redis.xrange(bus.keys.req(rid))]


async def test_embeddings_are_the_models_last_hidden_state(
    served, openai_client, tiny_runner, tiny_tokenizer
):
    api, eng = served
    _, oa = openai_client
    total = eng.node.sched.num_free_blocks
    ids = [tiny_tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    raw = [np.frombuffer(v, dtype="<f4") for v in LLM(tiny_runner, tiny_tokenizer).embed(ids)]
    # (the openai client asks for base64 and decodes it itself)
    r = await oa.embeddings.create(model=api.cfg.model_name, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, want in zip(r.data, raw):
        assert len(d.embedding) == tiny_runner.model.cfg.hidden_size
        np.testing.assert_allclose(d.embedding, _unit(want), atol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    # floats, token ids, a list of token id lists: the same vectors
    f = await oa.embeddings.create(model=api.cfg.model_name, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(f.data[0].embedding, r.data[0].embedding, atol=1e-6)
    t = await oa.embeddings.create(model=api.cfg.model_name, input=[ids[2], ids[0]])
    np.testing.assert_allclose(t.data[1].embedding, r.data[0].embedding, atol=1e-6)
    np.testing.assert_allclose(t.data[0].embedding, r.data[2].embedding, atol=1e-6)
    one = await oa.embeddings.create(model=api.cfg.model_name, input=ids[1])
    np.testing.assert_allclose(one.data[0].embedding, r.data[1].embedding, atol=1e-6)

    # normalize false: the hidden state itself, which the head turns into the next token's
    # logits: its argmax is the token the engine's greedy decoding gives after the same prompt
    status, body = await _post(f"{api.url}/v1/embeddings", {"input": TEXTS, "normalize": False})
    assert status == 200, body
    head = tiny_runner.model.lm_head.numpy()
    for k, d in enumerate(body["data"]):
        np.testing.assert_allclose(d["embedding"], raw[k], rtol=1e-6, atol=1e-6)
        g = LLM(tiny_runner, tiny_tokenizer).generate(
            [ids[k]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        )[0]
        assert int(np.argmax(np.asarray(d["embedding"], dtype=np.float32) @ head)) == g.token_ids[0]

    # vLLM's truncate_prompt_tokens: the input's last k tokens
    status, body = await _post(f"{api.url}/v1/embeddings", {"input": TEXTS[1], "truncate_prompt_tokens": 7})
    assert status == 200 and body["usage"]["prompt_tokens"] == 7
    cut = np.frombuffer(LLM(tiny_runner, tiny_tokenizer).embed([ids[1][-7:]])[0], dtype="<f4")
    np.testing.assert_allclose(body["data"][0]["embedding"], _unit(cut), atol=1e-6)

    # each input a request of its own: `<id>.<k>` under the response's id, with its whole story
    status, body = await _post(f"{api.url}/v1/embeddings", {"input": TEXTS[:2]}, {"X-Request-Id": "emb-1"})
    assert status == 200 and body["id"] == "emb-1" and body["object"] == "list"
    parent = await _story(api.bus, "emb-1")
    assert isinstance(parent[0], Accepted) and parent[0].choices == 2 and parent[0].endpoint == "embeddings"
    for k in range(2):
        story = await _story(api.bus, f"emb-1.{k}")
        assert [type(e) for e in story] == [Accepted, Claimed, Tokens, BlocksReleased, Final], story
        assert story[0].endpoint == "embeddings" and (story[0].parent, story[0].index) == ("emb-1", k)
        np.testing.assert_allclose(
            _unit(embedding_vector(story[2].embedding)), body["data"][k]["embedding"], atol=1e-6
        )
        assert story[-1].finish_reason == "length"
    assert await wait_for(lambda: _idle(eng, total))
    # an embeddings request has no stream to replay
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/v1/requests/emb-1.0/stream") as resp:
            assert resp.status == 400 and "embeddings" in (await resp.json())["error"]["message"]


async def _idle(eng, total) -> bool:
    await asyncio.sleep(0)
    return eng.node.sched.num_free_blocks == total and not eng.node.sched.has_work()


async def test_dimensions_only_for_a_matryoshka_model(
    openai_client, tiny_runner, tiny_tokenizer, tiny_model_dir, tmp_path
):
    api, oa = openai_client
    ids = tiny_tokenizer.encode(TEXTS[0], add_special_tokens=True)
    raw = np.frombuffer(LLM(tiny_runner, tiny_tokenizer).embed([ids])[0], dtype="<f4")
    with pytest.raises(openai.BadRequestError) as e:
        await oa.embeddings.create(model=api.cfg.model_name, input=TEXTS[0], dimensions=8)
    assert e.value.body["param"] == "dimensions" and "matryoshka" in e.value.body["message"]
    tiny_tokenizer.matryoshka = (8, 32)
    try:
        r = await oa.embeddings.create(model=api.cfg.model_name, input=TEXTS[0], dimensions=8)
        np.testing.assert_allclose(r.data[0].embedding, _unit(raw[:8]), atol=1e-6)  # cut, then normalized
        with pytest.raises(openai.BadRequestError) as e:
            await oa.embeddings.create(model=api.cfg.model_name, input=TEXTS[0], dimensions=16)
        assert "[8, 32]" in e.value.body["message"]
    finally:
        tiny_tokenizer.matryoshka = False
    # what config.json says is what the tokenizer says
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [32, 64, 128]}))
    assert Tokenizer.from_dir(str(d)).matryoshka == (32, 64, 128)
    (d / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    assert Tokenizer.from_dir(str(d)).matryoshka is True
    assert Tokenizer.from_dir(str(tiny_model_dir)).matryoshka is False


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({}, 400, "input", "missing_required_parameter"),
        ({"input": ""}, 400, "input", "invalid_value"),
        ({"input": []}, 400, "input", "invalid_type"),
        ({"input": 5}, 400, "input", "invalid_type"),
        ({"input": ["ok", ""]}, 400, "input", "invalid_value"),
        ({"input": ["ok", []]}, 400, "input", "invalid_value"),
        ({"input": [["x"]]}, 400, "input", "invalid_value"),
        ({"input": [1, 999]}, 400, "input", "invalid_value"),  # not a token id of the vocabulary
        ({"input": ["x"] * 2049}, 400, "input", "invalid_value"),
        ({"input": "y" * MAX_LEN}, 400, "input", "context_length_exceeded"),
        ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "invalid_type"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions", "invalid_value"),
        ({"input": "x", "dimensions": 8}, 400, "dimensions", "unsupported"),
        ({"input": "x", "normalize": "yes"}, 400, "normalize", "invalid_type"),
        ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "invalid_value"),
        ({"input": "x", "model": "other"}, 404, "model", "model_not_found"),
    ],
)
async def test_bad_embeddings_requests_reach_no_engine(real_bus, body, status, param, code):
    async with api_client(real_bus) as client:
        resp = await client.post("/v1/embeddings", json=body)
        assert resp.status == status
        err = assert_openai_error(await resp.json())
        assert (err["param"], err["code"]) == (param, code), err
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_a_long_input_cut_by_truncate_prompt_tokens_is_taken(real_bus):
    async with setup(real_bus, FakeEngine(real_bus)) as client:
        await client.post("/v1/embeddings", json={"input": "y" * (MAX_LEN + 10), "truncate_prompt_tokens": 5})
    (req,) = [decode(f, e) for e, f in await real_bus.redis.xrange(real_bus.keys.requests)]
    assert req.data.prompt_token_ids == tuple(b"yyyyy") and req.data.sampling == SAMPLING


async def test_a_hang_up_aborts_every_input(real_bus):
    eng = FakeEngine(real_bus, hold=True)
    async with setup(real_bus, eng) as client:
        task = asyncio.create_task(
            client.post("/v1/embeddings", headers={"X-Request-Id": "gone"}, json={"input": ["a", "b", "c"]})
        )
        assert await wait_for(lambda: _claimed(eng, 3))
        task.cancel()  # the client goes before the answer
        ids = ["gone.0", "gone.1", "gone.2"]
        assert await wait_for(lambda: _all_end(real_bus, ids, "abort"))
        aborts = [ev for ev in await control_events(real_bus) if isinstance(ev, Abort)]
        assert (
            len(aborts) == 1 and aborts[0].source == "disconnect" and set(aborts[0].request_ids) == set(ids)
        )


async def _claimed(eng, n) -> bool:
    return len(eng.claimed) >= n


async def _all_end(bus, ids, reason) -> bool:
    for rid in ids:
        evs = await _story(bus, rid)
        if not evs or not isinstance(evs[-1], Final) or evs[-1].finish_reason != reason:
            return False
    return True


async def test_an_aborted_input_fails_the_answer_and_stops_the_rest(real_bus):
    eng = FakeEngine(real_bus, hold=True)
    async with setup(real_bus, eng) as client:
        task = asyncio.create_task(
            client.post("/v1/embeddings", headers={"X-Request-Id": "op"}, json={"input": ["a", "b"]})
        )
        assert await wait_for(lambda: _claimed(eng, 2))
        await real_bus.redis.xadd(real_bus.keys.control, {"type": "abort", "request_id": "op.1"})
        resp = await task
        assert resp.status == 503
        err = assert_openai_error(await resp.json())
        assert err["code"] == "request_aborted" and "Input 1" in err["message"]
        assert await wait_for(lambda: _all_end(real_bus, ["op.0", "op.1"], "abort"))


async def test_an_engine_that_gives_no_vector_is_a_clear_error(real_bus):
    async with setup(real_bus, FakeEngine(real_bus, vectors=False)) as client:
        resp = await client.post("/v1/embeddings", json={"input": "hi"})
        assert resp.status == 500
        err = assert_openai_error(await resp.json())
        assert err["code"] == "engine_error" and "no embedding" in err["message"]


async def test_every_documented_field_is_read(openai_client, caplog):
    api, _ = openai_client
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{api.url}/openapi.json") as r:
            doc = await r.json()
    schemas = doc["components"]["schemas"]
    with caplog.at_level(logging.WARNING, logger="fd.api"):
        chat_only = {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
        for path, name, given, leave in (
            ("/v1/embeddings", "EmbeddingRequest", {"input": "x"}, chat_only),
            (
                "/v1/embeddings",
                "EmbeddingRequest",
                {"messages": [{"role": "user", "content": "x"}]},
                {"input"},
            ),
            ("/score", "ScoreRequest", {"text_1": "x", "text_2": "y"}, set()),
            ("/v2/rerank", "RerankRequest", {"query": "x", "documents": ["y"]}, set()),
        ):
            assert path in doc["paths"]
            status, out = await _post(
                f"{api.url}{path}",
                {**{k: None for k in schemas[name]["properties"] if k not in leave}, **given},
            )
            assert status == 200, out
    assert not [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]


def test_timed_runner_vectors_are_the_same_for_the_same_request():
    runner = TimedRunner(step_ms=0, per_token_ms=0)
    sp = SamplingParams(max_tokens=1, embed=True)

    def step(rid: str) -> bytes:
        seq = ScheduledSeq(
            request_id=rid,
            token_ids=(1, 2),
            start_pos=0,
            block_table=(0,),
            sample=True,
            sampling=sp,
            num_generated=0,
        )
        return runner.execute(SchedulerOutput(step=0, seqs=(seq,))).embeddings[rid]

    assert step("a") == step("a") != step("b")
    assert len(np.frombuffer(step("a"), dtype="<f4")) == EMBED_DIM
    assert base64.b64encode(step("a"))  # (bytes, as the worker's pipe and the event carry them)


def _cos(a: bytes, b: bytes) -> float:
    return float(np.dot(_unit(np.frombuffer(a, dtype="<f4")), _unit(np.frombuffer(b, dtype="<f4"))))


async def test_score_and_rerank_are_cosine_similarities_of_the_embeddings(
    served, tiny_runner, tiny_tokenizer
):
    """vLLM's /score and /rerank over an embedding model: each pair's cosine similarity,
    each distinct text embedded once (a request of its own on the engines)."""
    api, eng = served
    q, docs = "capital of France", ["Bananas are yellow", "Paris is the capital", "capital of France"]
    vec = dict(
        zip(
            [q, *docs],
            LLM(tiny_runner, tiny_tokenizer).embed(
                [tiny_tokenizer.encode(t, add_special_tokens=True) for t in [q, *docs]]
            ),
        )
    )
    status, body = await _post(f"{api.url}/score", {"text_1": q, "text_2": docs}, {"X-Request-Id": "sc"})
    assert status == 200 and body["object"] == "list" and body["id"] == "sc"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose(
        [d["score"] for d in body["data"]], [_cos(vec[q], vec[d]) for d in docs], atol=1e-6
    )
    assert body["data"][2]["score"] == pytest.approx(1.0, abs=1e-9)  # the query itself
    # the query is among the documents: three texts, three requests, not four
    parent = await _story(api.bus, "sc")
    assert parent[0].choices == 3 and await _story(api.bus, "sc.2") and not await _story(api.bus, "sc.3")
    assert body["usage"]["prompt_tokens"] == sum(
        len(tiny_tokenizer.encode(t, add_special_tokens=True)) for t in [q, *docs[:2]]
    )
    # pairwise: as many text_1 as text_2
    status, body = await _post(f"{api.url}/v1/score", {"text_1": [q, docs[0]], "text_2": [docs[1], docs[0]]})
    assert status == 200
    np.testing.assert_allclose(
        [d["score"] for d in body["data"]], [_cos(vec[q], vec[docs[1]]), 1.0], atol=1e-6
    )

    status, body = await _post(f"{api.url}/v1/rerank", {"query": q, "documents": docs, "top_n": 2})
    assert status == 200, body
    want = sorted(range(3), key=lambda k: -_cos(vec[q], vec[docs[k]]))[:2]
    assert [r["index"] for r in body["results"]] == want and want[0] == 2
    assert [r["document"]["text"] for r in body["results"]] == [docs[k] for k in want]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], [_cos(vec[q], vec[docs[k]]) for k in want], atol=1e-6
    )
    for path in ("/rerank", "/v2/rerank"):
        status, body = await _post(f"{api.url}{path}", {"query": q, "documents": docs})
        assert status == 200 and len(body["results"]) == 3  # (no top_n: every document)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/score", {"text_2": "x"}, "text_1"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": ""}, "text_2"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/rerank", {"query": ["a"], "documents": ["a"]}, "query"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/v2/rerank", {"query": "a", "documents": ["y" * MAX_LEN]}, "documents"),
    ],
)
async def test_bad_score_and_rerank_requests_reach_no_engine(real_bus, path, body, param):
    async with api_client(real_bus) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 400
        assert assert_openai_error(await resp.json())["param"] == param
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_scoring_routes_outside_v1_need_the_api_key(real_bus):
    async with api_client(real_bus, api_key="k") as client:
        for path in ("/score", "/rerank", "/v2/rerank"):
            resp = await client.post(
                path, json={"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
            )
            assert resp.status == 401, path
            assert assert_openai_error(await resp.json())["type"] == "authentication_error"
        assert await real_bus.redis.xlen(real_bus.keys.requests) == 0


async def test_a_conversation_embedded_as_vllms_chat_embeddings(openai_client, tiny_runner, tiny_tokenizer):
    """``messages`` instead of ``input``: the chat template's rendering, with no generation
    prompt unless asked (vLLM's defaults), embedded like any input."""
    api, _ = openai_client
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    for extra, gen in (({}, False), ({"add_generation_prompt": True}, True)):
        ids = tiny_tokenizer.encode(
            tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=gen), add_special_tokens=False
        )
        want = _unit(np.frombuffer(LLM(tiny_runner, tiny_tokenizer).embed([ids])[0], dtype="<f4"))
        status, body = await _post(f"{api.url}/v1/embeddings", {"messages": msgs, **extra})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(ids), body
        np.testing.assert_allclose(body["data"][0]["embedding"], want, atol=1e-6)
    status, body = await _post(f"{api.url}/v1/embeddings", {"messages": msgs, "input": "x"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = await _post(f"{api.url}/v1/embeddings", {"messages": "hi"})
    assert status == 400
