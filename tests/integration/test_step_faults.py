"""Faults inside a step, and token ids past the vocabulary (issue 24).

A token id a request names is checked against the model's vocabulary twice: by the API (a 400
naming the field) and by the engine, for requests written by hand on ``P:requests`` (an
``error`` final). Whatever still fails inside a step (the forward, the sampler, a grammar, the
detokenizer) fails only the request whose share it was: that request ends with an ``error``
final, its blocks released, and the engine goes on with the rest of the batch. A request whose
engine died in its step has been counted as an attempt, so failover gives it up after
``max_attempts`` engines instead of handing it round for ever.

All against a real redis-server.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import orjson
import pytest

from fd.api.config import ApiConfig
from fd.compose import start_api, start_engine
from fd.control.connect import connect
from fd.control.events import BlocksReleased, Claimed, Final, Tokens
from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from fd.engine.core.sequence import PLACEHOLDER
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.llm import LLM
from fd.engine.runner.runners import InProcessRunner
from fd.engine.runner.sampler import Sampler
from tests.kit.engine import story, submit, submit_together, tokens_of, types
from tests.kit.faults import all_blocks_free, engines, kill, wait_for  # noqa: F401


async def _engine(url, keys, model_dir, runner, tokenizer):
    """An engine ``e0`` on the Redis at ``url``, computing with ``runner``."""
    return await start_engine(
        lambda: connect(url),
        keys,
        EngineConfig(model_dir=str(model_dir), engine_id="e0"),
        runner=runner,
        tokenizer=tokenizer,
    )


VOCAB = 512  # the tiny model's
PROMPT = [5, 17, 33, 9, 41, 12, 7, 19]
FAR = 10**9


def _reference(runner, tokenizer, prompt, n: int):
    return LLM(runner, tokenizer).generate(
        [list(prompt)], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )[0]


def _finals(evs) -> list[Final]:
    return [e for e in evs if isinstance(e, Final)]


async def _assert_serves(bus, eng, runner, tokenizer, rid: str = "after") -> None:
    """The engine is alive and a normal request gets exactly the model's own tokens."""
    ref = _reference(runner, tokenizer, PROMPT, 6)
    await submit(bus, rid, PROMPT, max_tokens=6, ignore_eos=True)
    evs = await story(bus, rid, timeout=20)
    assert tokens_of(evs) == ref.token_ids and evs[-1].finish_reason == "length"
    assert not eng.task.done()
    await all_blocks_free(eng.node)


# ----------------------------------------------------------------------------- the API


@pytest.fixture
async def api_and_engine(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """``fd api`` and ``fd engine`` as separate nodes on one real Redis."""
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    api = await start_api(
        lambda: connect(url), keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
    )
    yield api, eng
    await api.stop()
    await eng.stop()


async def _stories(bus) -> int:
    """How many requests have a story (the API writes `accepted` as it submits one)."""
    return len([k async for k in bus.redis.scan_iter(match=bus.keys.req("*"))])


async def _post(url: str, body: dict) -> tuple[int, dict]:
    # (bounded: an engine that died on the request would leave it unanswered)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.post(url, json=body) as r:
            return r.status, await r.json()


BAD_FIELDS = [  # (field, what the body adds): every id a client can give, one past the vocabulary
    ("stop_token_ids", {"stop_token_ids": [VOCAB], "min_tokens": 1}),
    ("stop_token_ids", {"stop_token_ids": [FAR]}),  # (harmless without min_tokens, and still refused)
    ("allowed_token_ids", {"allowed_token_ids": [3, VOCAB]}),
    ("logit_bias", {"logit_bias": {str(VOCAB): 5}}),
]


async def test_the_testers_body_is_a_400_naming_stop_token_ids(
    api_and_engine, real_bus, tiny_runner, tiny_tokenizer
):
    api, eng = api_and_engine
    status, body = await _post(
        f"{api.url}/v1/completions",
        {"prompt": "x", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [512]},
    )
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "stop_token_ids" and err["type"] == "invalid_request_error"
    assert "512" in err["message"] and str(VOCAB) in err["message"]
    assert await _stories(real_bus) == 0  # nothing was submitted
    # the server goes on serving
    ref = _reference(tiny_runner, tiny_tokenizer, tiny_tokenizer.encode("x", add_special_tokens=True), 4)
    status, body = await _post(
        f"{api.url}/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    assert status == 200 and body["choices"][0]["text"] == ref.text
    assert not eng.task.done()


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions", "responses"])
async def test_every_token_id_field_is_checked_against_the_vocabulary(endpoint, api_and_engine, real_bus):
    api, eng = api_and_engine
    base = {
        "completions": {"prompt": "x", "max_tokens": 4},
        "chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
        "responses": {"input": "x", "max_output_tokens": 4},
    }[endpoint]
    cases = list(BAD_FIELDS)
    if endpoint == "completions":  # a prompt given as token ids, alone or in a batch
        cases += [("prompt", {"prompt": [5, VOCAB]}), ("prompt", {"prompt": [[5], [6, FAR]]})]
    for field, extra in cases:
        status, body = await _post(f"{api.url}/v1/{endpoint}", {**base, **extra})
        assert status == 400, (field, extra, body)
        assert body["error"]["param"] == field and body["error"]["type"] == "invalid_request_error", body
    # the ids at the vocabulary's end are fine, and the server still answers
    ok = {
        **base,
        "stop_token_ids": [VOCAB - 1],
        "min_tokens": 1,
        "allowed_token_ids": [VOCAB - 1, 7],
        "logit_bias": {str(VOCAB - 1): 1},
    }
    status, body = await _post(f"{api.url}/v1/{endpoint}", ok)
    assert status == 200, body
    assert await _stories(real_bus) == 1  # only that one was submitted
    assert not eng.task.done()


# ----------------------------------------------------------------------------- hand-written


def _xadd_fields(rid: str, data_json: str) -> list:
    # what an operator types: XADD fd:requests * type request request_id <id> data <json>
    return ["type", "request", "request_id", rid, "data", data_json]


HAND_WRITTEN = {  # name -> (the request's data, the field its error names)
    "allowed": (
        {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3, "allowed_token_ids": [FAR]}},
        "allowed_token_ids",
    ),
    "bad-word": (
        {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3, "bad_words_ids": [[FAR]]}},
        "bad_words_ids",
    ),
    "stop-min": (
        {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3, "min_tokens": 1, "stop_token_ids": [FAR]}},
        "stop_token_ids",
    ),
    "prompt": ({"prompt_token_ids": [5, FAR], "sampling": {"max_tokens": 3}}, "prompt"),
    "bias": (
        {"prompt_token_ids": [5], "sampling": {"max_tokens": 3, "logit_bias": [[FAR, 1.0]]}},
        "logit_bias",
    ),
    "after": (
        {
            "prompt_token_ids": [5],
            "sampling": {"max_tokens": 3, "guided": orjson.dumps({"after": FAR, "regex": "a+"}).decode()},
        },
        "guided",
    ),
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
async def test_a_hand_written_id_past_the_vocabulary_ends_its_request(
    name, real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    data, field = HAND_WRITTEN[name]
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        await real_bus.redis.execute_command(
            "XADD", keys.requests, "*", *_xadd_fields("poison", orjson.dumps(data).decode())
        )
        evs = await story(real_bus, "poison", timeout=10)
        (final,) = _finals(evs)
        assert types(evs) == ["claimed", "final"] and final.finish_reason == "error"
        assert f"{field} token id {FAR}" in final.error and str(VOCAB) in final.error
        assert (await real_bus.redis.xpending(keys.requests, "engines"))["pending"] == 0
        assert await real_bus.redis.xlen(keys.dead) == 0
        await _assert_serves(real_bus, eng, tiny_runner, tiny_tokenizer)
    finally:
        await eng.stop()


async def test_ids_typed_as_1e9_are_dead_letters(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """JSON's ``1e9`` is a number with an exponent, not an integer: such a request does not
    decode, and goes to ``P:dead`` with a reason naming the field."""
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    texts = {
        "allowed_token_ids": '{"prompt_token_ids":[5],"sampling":{"max_tokens":2,"allowed_token_ids":[1e9]}}',
        "bad_words_ids": '{"prompt_token_ids":[5],"sampling":{"max_tokens":2,"bad_words_ids":[[1e9]]}}',
        "stop_token_ids": '{"prompt_token_ids":[5],"sampling":{"max_tokens":2,"min_tokens":1,'
        '"stop_token_ids":[1e9]}}',
        "prompt_token_ids": '{"prompt_token_ids":[5,1e9],"sampling":{"max_tokens":2}}',
    }
    try:
        for i, text in enumerate(texts.values()):
            await real_bus.redis.execute_command("XADD", keys.requests, "*", *_xadd_fields(f"p{i}", text))
        await wait_for(lambda: real_bus.redis.xlen(keys.dead), what="dead letters")
        await wait_for(lambda: _xlen_is(real_bus, keys.dead, len(texts)), what="every dead letter")
        reasons = [f[b"reason"].decode() for _, f in await real_bus.redis.xrange(keys.dead)]
        for field, reason in zip(texts, reasons):
            assert field in reason, (field, reason)
        assert (await real_bus.redis.xpending(keys.requests, "engines"))["pending"] == 0
        await _assert_serves(real_bus, eng, tiny_runner, tiny_tokenizer)
    finally:
        await eng.stop()


async def _xlen_is(bus, key, n) -> bool:
    return await bus.redis.xlen(key) == n


class VocabBlindRunner(InProcessRunner):
    """The tiny runner without its vocabulary size: the engine cannot refuse an id past it at
    admission, so the request reaches the sampler and its step fails there."""

    def __init__(self, inner):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.inner.execute(out)


async def test_a_step_that_fails_in_the_sampler_ends_only_that_request(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    refs = {
        rid: _reference(tiny_runner, tiny_tokenizer, p, 8) for rid, p in (("a", PROMPT), ("b", PROMPT[:5]))
    }
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, VocabBlindRunner(tiny_runner), tiny_tokenizer)
    try:
        await submit_together(
            real_bus,
            [
                ("a", PROMPT, {"max_tokens": 8, "ignore_eos": True}),
                ("poison", [5, 6], {"max_tokens": 8, "min_tokens": 2, "stop_token_ids": (FAR,)}),
                ("b", PROMPT[:5], {"max_tokens": 8, "ignore_eos": True}),
            ],
        )
        evs = await story(real_bus, "poison", timeout=20)
        (final,) = _finals(evs)
        assert final.finish_reason == "error" and "IndexError" in final.error
        assert types(evs) == ["accepted", "claimed", "blocks_released", "final"]
        assert next(e for e in evs if isinstance(e, BlocksReleased)).count > 0
        for rid, ref in refs.items():
            got = await story(real_bus, rid, timeout=20)
            assert tokens_of(got) == ref.token_ids and got[-1].finish_reason == "length"
        assert not eng.task.done()
        await all_blocks_free(eng.node)
        await _assert_serves(real_bus, eng, tiny_runner, tiny_tokenizer)
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- a step that fails

POISON_SEED = 424242


class FailingSampler(Sampler):
    """The runner's own sampler, except that it raises for a row of the seed ``POISON_SEED``
    once that request has generated two tokens: a fault of one request, in a batch."""

    def sample(self, logits, params, num_generated, seen=None):
        for sp, n in zip(params, num_generated):
            if sp.seed == POISON_SEED and n >= 2:
                raise RuntimeError("injected sampler fault")
        return super().sample(logits, params, num_generated, seen)


@pytest.fixture
def failing_sampler(tiny_runner, monkeypatch):
    s = FailingSampler(0, tiny_runner.eos_token_ids)
    monkeypatch.setattr(tiny_runner, "sampler", s)
    return s


async def test_an_injected_step_failure_ends_only_its_request(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer, request
):
    refs = {
        rid: _reference(tiny_runner, tiny_tokenizer, p, 10) for rid, p in (("a", PROMPT), ("b", PROMPT[2:]))
    }
    request.getfixturevalue("failing_sampler")  # (after the references: they use the real one)
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        await submit_together(
            real_bus,
            [
                ("a", PROMPT, {"max_tokens": 10, "ignore_eos": True}),
                (
                    "poison",
                    [7, 8, 9],
                    {"max_tokens": 10, "ignore_eos": True, "temperature": 0.8, "seed": POISON_SEED},
                ),
                ("b", PROMPT[2:], {"max_tokens": 10, "ignore_eos": True}),
            ],
        )
        evs = await story(real_bus, "poison", timeout=20)
        (final,) = _finals(evs)
        assert final.finish_reason == "error" and "injected sampler fault" in final.error
        # its two tokens, then its blocks, then its one final, and nothing after
        assert [t for t in types(evs) if t != "tokens"] == ["accepted", "claimed", "blocks_released", "final"]
        assert len(tokens_of(evs)) == 2 and types(evs).index("blocks_released") > max(
            i for i, t in enumerate(types(evs)) if t == "tokens"
        )
        assert next(e for e in evs if isinstance(e, BlocksReleased)).count > 0
        assert final.usage["completion_tokens"] == 2
        failed_step = [e.step for e in evs if isinstance(e, Tokens) and e.token_ids][-1] + 1
        for rid, ref in refs.items():
            got = await story(real_bus, rid, timeout=20)
            assert tokens_of(got) == ref.token_ids and got[-1].finish_reason == "length"
            # they were in the step that failed, and got their token from it
            assert failed_step in [e.step for e in got if isinstance(e, Tokens) and e.token_ids]
        await all_blocks_free(eng.node)
        await asyncio.sleep(0.3)
        assert types([e for _, e in await real_bus.read_req("poison")]) == types(evs)
        await _assert_serves(real_bus, eng, tiny_runner, tiny_tokenizer)
        report = replay(await load_journal_from_redis(real_bus, "e0"))
        assert report.divergence is None and not report.analysis.violations
    finally:
        await eng.stop()


class BrokenRunner(InProcessRunner):
    """A runner that cannot tell whose share broke a step: any step with ``boom`` raises."""

    def __init__(self, inner):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if any(s.request_id == "boom" for s in out.seqs):
            raise ValueError("the runner broke")
        return self.inner.execute(out)


async def test_a_runner_that_raises_fails_the_steps_requests_not_the_engine(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    url = redis_server.url
    eng = await _engine(url, keys, tiny_model_dir, BrokenRunner(tiny_runner), tiny_tokenizer)
    try:
        await submit(real_bus, "boom", PROMPT, max_tokens=4)
        evs = await story(real_bus, "boom", timeout=10)
        (final,) = _finals(evs)
        assert final.finish_reason == "error" and "the runner broke" in final.error
        assert types(evs) == ["accepted", "claimed", "blocks_released", "final"]
        await _assert_serves(real_bus, eng, tiny_runner, tiny_tokenizer)
    finally:
        await eng.stop()


# ----------------------------------------------------------------------------- the scheduler


def test_the_scheduler_ends_a_failed_request_after_the_steps_holding_it():
    """A request named in a step's ``failed``: no token, nothing of that step cached, and with
    the next step already holding it (async scheduling), its blocks and its one error final
    come when that step is folded in. The other request of the batch goes on as without it."""
    from dataclasses import replace

    from tests.kit.scheduler import make, req

    def ok_tokens(evs):
        return [t for e in evs if isinstance(e, Tokens) and e.request_id == "ok" for t in e.token_ids]

    ref_sched, ref_runner = make(max_steps_in_flight=2, enable_prefix_caching=True)
    ref_sched.add("ok", req(6, max_tokens=5, start=60))
    ref = []
    while ref_sched.has_work():
        o = ref_sched.schedule()
        ref += ref_sched.update(o, ref_runner.run(o))

    sched, runner = make(max_steps_in_flight=2, enable_prefix_caching=True)
    sched.add("ok", req(6, max_tokens=5, start=60))
    sched.add("bad", req(9, max_tokens=5))  # two full blocks of 4 in its prompt
    out1 = sched.schedule()
    out2 = sched.schedule()  # both decode on placeholders, behind the prefill
    assert {s.request_id for s in out2.seqs} == {"ok", "bad"}
    res1 = runner.run(out1)
    evs = sched.update(out1, replace(res1, sampled={"ok": res1.sampled["ok"]}, failed={"bad": "boom"}))
    assert not [e for e in evs if e.request_id == "bad"]  # the step behind it still holds its blocks
    res2 = runner.run(out2)
    evs += sched.update(out2, replace(res2, sampled={"ok": res2.sampled["ok"]}, failed={"bad": "gone"}))
    bad = [e for e in evs if e.request_id == "bad"]
    assert [type(e).__name__ for e in bad] == ["BlocksReleased", "Final"]
    assert bad[0].count == 3 and bad[1].finish_reason == "error" and bad[1].error == "boom"
    assert bad[1].usage["completion_tokens"] == 0
    while sched.has_work():
        o = sched.schedule()
        evs += sched.update(o, runner.run(o))
    assert ok_tokens(evs) == ok_tokens(ref) and len(ok_tokens(ref)) == 5
    assert sched.num_free_blocks == sched.num_total_blocks
    # nothing of the failed prefill was cached: the same prompt again computes all of it (while
    # the prompt of the request that went on is found in the cache)
    sched.add("again", req(9, max_tokens=1))
    sched.add("ok-again", req(6, max_tokens=1, start=60))
    starts = {s.request_id: s.start_pos for s in sched.schedule().seqs}
    assert starts == {"again": 0, "ok-again": 4}


# ----------------------------------------------------------------------------- the runner itself


def test_the_runner_fails_only_the_request_that_breaks_its_step(tiny_runner):
    """ModelRunner.execute: a batch whose sampling fails for one request is run again one
    request at a time; the other gets the token it gets alone, and the failed one's decode in
    the next step (a placeholder for a token it never got) fails too, without the batch."""
    good = ScheduledSeq("good", tuple(PROMPT), 0, (1,), True, SamplingParams(temperature=0.0), 0)
    bad_sp = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(FAR,))
    bad = ScheduledSeq("bad", (5, 6, 7), 0, (2,), True, bad_sp, 0)
    alone = tiny_runner.logits(SchedulerOutput(step=-1, seqs=(good,)))[0]
    res = tiny_runner.execute(SchedulerOutput(step=1, seqs=(good, bad)))
    assert set(res.failed) == {"bad"} and "IndexError" in res.failed["bad"]
    assert res.sampled == {"good": int(np.argmax(alone))}
    nxt = (
        ScheduledSeq("good", (PLACEHOLDER,), len(PROMPT), (1,), True, SamplingParams(temperature=0.0), 1),
        ScheduledSeq("bad", (PLACEHOLDER,), 3, (2,), True, bad_sp, 1),
    )
    res2 = tiny_runner.execute(SchedulerOutput(step=2, seqs=nxt))
    assert set(res2.failed) == {"bad"} and set(res2.sampled) == {"good"}


def test_a_failed_step_crosses_the_workers_pipe(tiny_model_dir, tiny_runner):
    """In a worker process (``--executor paddle``) the same: the failed request comes back in
    ``failed``, the other with its token, and the worker goes on."""
    from fd.engine.runner.worker import ProcessRunner

    good = ScheduledSeq("good", tuple(PROMPT), 0, (1,), True, SamplingParams(temperature=0.0), 0)
    bad = ScheduledSeq(
        "bad", (5, 6, 7), 0, (2,), True, SamplingParams(temperature=0.0, allowed_token_ids=(FAR,)), 0
    )
    want = tiny_runner.execute(SchedulerOutput(step=1, seqs=(good,))).sampled
    worker = ProcessRunner(str(tiny_model_dir), num_blocks=16)
    try:
        res = worker.execute(SchedulerOutput(step=1, seqs=(good, bad)))
        assert set(res.failed) == {"bad"} and res.sampled == want
        again = worker.execute(SchedulerOutput(step=2, seqs=(good,)))
        assert again.sampled == want and not again.failed
    finally:
        worker.close()


# ----------------------------------------------------------------------------- failover


class ClaimWatcher(InProcessRunner):
    """A runner that, as each step starts, reads the stream of every request in it (a client
    of its own): its ``claimed`` must be there already, or an engine that died in that step
    would not have counted as an attempt."""

    def __init__(self, inner, url, keys):
        import redis

        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size
        self.r = redis.Redis.from_url(url)
        self.keys = keys
        self.unclaimed: list[str] = []
        self.seen: set[str] = set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for s in out.seqs:
            if s.request_id not in self.seen:
                self.seen.add(s.request_id)
                fields = [f for _, f in self.r.xrange(self.keys.req(s.request_id))]
                if not any(f.get(b"type") == b"claimed" for f in fields):
                    self.unclaimed.append(s.request_id)
        return self.inner.execute(out)


async def test_claimed_is_on_the_stream_before_the_request_runs(
    real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """Even on a slow link to Redis (each publish 50 ms late), no step runs a request whose
    ``claimed`` is not on its stream yet."""
    url = redis_server.url
    watcher = ClaimWatcher(tiny_runner, url, keys)
    eng = await _engine(url, keys, tiny_model_dir, watcher, tiny_tokenizer)
    publish = eng.node.bus.publish_many

    async def slow_publish(*args, **kw):
        await asyncio.sleep(0.05)
        return await publish(*args, **kw)

    eng.node.bus.publish_many = slow_publish
    try:
        await submit(real_bus, "first", PROMPT, max_tokens=12, ignore_eos=True)
        await wait_for(lambda: "first" in watcher.seen, what="the first request's step")
        # more, while the first one decodes (claimed between its steps)
        for i in range(4):
            await submit(real_bus, f"r{i}", PROMPT[i:], max_tokens=3, ignore_eos=True)
        for rid in ["first"] + [f"r{i}" for i in range(4)]:
            assert (await story(real_bus, rid, timeout=20))[-1].finish_reason == "length"
        assert watcher.seen >= {"first", "r0", "r1", "r2", "r3"}
        assert watcher.unclaimed == []
    finally:
        await eng.stop()
        watcher.r.close()


async def test_a_request_whose_engines_die_in_its_step_is_given_up(real_bus, engines):
    """Each engine that takes the request dies while its step runs; after ``max_attempts``
    of them the next engine ends it with an error, without running it."""
    a = await engines.start("A", gated=True)
    engines.gates["A"].close()
    await submit(real_bus, "poison", PROMPT, max_tokens=8, ignore_eos=True)
    await engines.gates["A"].wait_entered(lambda out: any(s.request_id == "poison" for s in out.seqs))
    b = await engines.start("B", gated=True)
    engines.gates["B"].close()
    a.task.cancel()  # dies in the step (what it had not published is lost)
    engines.gates["A"].open()
    await kill(a)
    await engines.gates["B"].wait_entered(lambda out: any(s.request_id == "poison" for s in out.seqs))
    c = await engines.start("C", gated=True, max_attempts=2)
    b.task.cancel()
    engines.gates["B"].open()
    await kill(b)
    evs = await story(real_bus, "poison", timeout=20)
    assert [(e.engine, e.attempt) for e in evs if isinstance(e, Claimed)] == [("A", 1), ("B", 2)]
    (final,) = _finals(evs)
    assert final.finish_reason == "error" and "max_attempts=2" in final.error and final.engine == "C"
    assert "poison" not in engines.gates["C"].scheduled_ids()
    assert (await real_bus.redis.xpending(real_bus.keys.requests, "engines"))["pending"] == 0
    await all_blocks_free(c.node)
