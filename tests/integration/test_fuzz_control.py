"""Bad input on the control plane, generated: a real engine node reads random entries that
anyone with redis-cli could XADD to ``P:control`` and ``P:requests`` (unknown types, valid
types with bad fields, binary, oversize values, aborts of random ids, drains and abort_alls
aimed at other engines). Afterwards the engine is still running, a normal request still
completes exactly as offline, and every entry that does not decode -- and only those -- is in
``P:dead`` with a reason.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fd.compose import start_engine
from fd.control.bad_event import BadEvent
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import CONTROL_TYPES, MAX_FIELD_BYTES, Accepted, Request, decode
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.node.node_config import EngineConfig
from fd.engine.runner.llm import LLM
from tests.kit.engine import story, submit, text_of, tokens_of

ENGINE = "fz-e0"
OTHER_ENGINES = ["e1", "fz-e1", "fz-e0x", "fz-e", "FZ-E0", "other@host:1"]
IDS = ["r1", "r2", "q.1", "a:b@c-d_e", "x" * 128]
BAD_IDS = ["", "{r1}", "a b", "r*", "x" * 129, "é", "r1\n", "a,", ","]
VOCAB = 512

text = st.text(max_size=20)
binary = st.binary(max_size=20) | st.sampled_from([b"\xff\xfe", b"\x00", b"\xc3"])
huge = st.sampled_from([b"x" * (MAX_FIELD_BYTES + 1), b"1" * (MAX_FIELD_BYTES + 1)])
numberish = st.sampled_from(["0", "-1", "1e9", "999999999999999999999999", "nan", "1.5", " 1", "0x10"])
some_id = st.sampled_from(IDS) | st.sampled_from(BAD_IDS) | text
value = text | binary | numberish | some_id | st.just(b"")
# huge values are costly (1 MiB each): rarely
rare_huge = st.one_of(value, value, value, value, value, value, value, huge)
FIELD_NAMES = [
    "type",
    "request_id",
    "request_ids",
    "engine",
    "source",
    "reason",
    "abort_id",
    "data",
    "v",
    "ts",
    "resume",
]


def ids_field(draw_ids: list[str]) -> str:
    return ",".join(draw_ids)


sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6)},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, -1.0, "hot", None]),
        "top_p": st.sampled_from([1.0, 0.5, 0.9, 0.0, 2.0]),
        "top_k": st.sampled_from([0, -1, 1, 5, 10**6]),
        # (seeds that are not ints and stops that are not strings: POISON below)
        "seed": st.sampled_from([None, 0, -5, 2**63]),
        "stop": st.sampled_from([[], ["a"], "a"]),
        "stop_token_ids": st.sampled_from([[], [3], [-1], ["x"], [10**6]]),
        "ignore_eos": st.sampled_from([True, False, "yes"]),
        # an embeddings request, a LoRA adapter this engine lacks, and their wrong types
        "embed": st.sampled_from([True, False, "yes"]),
        "lora": st.sampled_from(["", "missing", 5]),
        "bogus_param": st.just(1),
    },
)
request_data = st.fixed_dictionaries(
    {
        "prompt_token_ids": st.one_of(
            *[st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)] * 3,
            st.sampled_from([[], [-1], ["a"], [1.5], None, "1,2"]),
        ),  # past vocab: POISON
        "sampling": st.one_of(
            sampling, sampling, st.sampled_from([None, [], "x", {"max_tokens": 0}, {"max_tokens": "3"}])
        ),
    },
    optional={
        "arrival_ts": st.sampled_from([0, None, 1.5, 2**63]),
        "model": text,  # "x": POISON
        "background": st.booleans(),
        "api": text,
    },
)


def _json_text(d) -> str:
    try:
        return orjson.dumps(d).decode()
    except TypeError:  # ints past 64 bits: the stdlib writes them, a client could too
        import json

        return json.dumps(d)


@st.composite
def valid_looking(draw) -> tuple[str, dict]:
    """An event of a real type with plausible, sometimes wrong, fields."""
    kind = draw(
        st.sampled_from(
            [
                "abort",
                "abort_ids",
                "abort_all",
                "drain",
                "request",
                "request",
                "request",
                "request_on_control",
                "abort_on_requests",
            ]
        )
    )
    if kind == "abort":
        f = {"type": "abort", "request_id": draw(some_id)}
    elif kind == "abort_ids":
        f = {"type": "abort", "request_ids": ",".join(draw(st.lists(some_id, max_size=4)))}
    elif kind == "abort_all":
        f = {"type": "abort_all", "engine": draw(st.sampled_from(OTHER_ENGINES) | st.sampled_from(BAD_IDS))}
    elif kind == "drain":
        f = {"type": "drain", "engine": draw(st.sampled_from(OTHER_ENGINES) | st.sampled_from(BAD_IDS))}
    elif kind in ("request", "request_on_control"):
        rid = draw(st.sampled_from(IDS) | st.from_regex(r"[a-z0-9]{1,6}", fullmatch=True) | some_id)
        f = {"type": "request", "request_id": rid, "data": _json_text(draw(request_data))}
        if draw(st.booleans()):
            f["resume"] = draw(st.sampled_from(["1", "0", "maybe"]))
    else:
        f = {"type": "abort", "request_id": draw(st.sampled_from(IDS))}
    extra = (
        draw(st.lists(st.sampled_from(FIELD_NAMES[3:]), max_size=2)) if draw(st.integers(0, 3)) == 0 else []
    )
    for name in extra:
        if name in ("engine",) and f["type"] in ("drain", "abort_all"):
            continue  # never aim a drain or abort_all at the engine under test
        f[name] = draw(value)
    stream = (
        "requests"
        if kind.startswith("request") and kind != "request_on_control" or kind == "abort_on_requests"
        else "control"
    )
    return stream, f


@st.composite
def junk(draw) -> tuple[str, dict]:
    names = draw(st.lists(st.sampled_from(FIELD_NAMES) | text | binary, min_size=1, max_size=4))
    f = {n: draw(rare_huge) for n in names}
    if draw(st.booleans()):
        f["type"] = draw(
            st.sampled_from(
                [
                    "abort",
                    "abort_all",
                    "drain",
                    "request",
                    "final",
                    "tokens",
                    "accepted",
                    "ABORT",
                    "",
                    "step",
                    "journal_start",
                ]
            )
            | text
        )
    return draw(st.sampled_from(["control", "requests"])), f


def _safe(f: dict) -> bool:
    """Nothing that would stop the engine under test on purpose."""
    return not (f.get("type") == "drain" and f.get("engine") in (ENGINE, ENGINE.encode()))


def expect_dead(stream: str, fields: dict, eid: bytes) -> bool:
    try:
        ev = decode(fields, eid)
    except BadEvent:
        return True
    return not isinstance(ev, CONTROL_TYPES if stream == "control" else Request)


def _req(rid: str, data) -> dict:
    return {"type": "request", "request_id": rid, "data": _json_text(data)}


SHARP = [  # entries a generator finds only by luck; each decodes, so each must be *handled*
    ("requests", _req("too-long", {"prompt_token_ids": [5] * 2049, "sampling": {"max_tokens": 2}})),
    ("requests", _req("neg-seed", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2, "seed": -7}})),
    (
        "requests",
        _req("big-topk", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2, "top_k": 10**6}}),
    ),
    ("requests", _req("neg-topk", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2, "top_k": -9}})),
    (
        "requests",
        _req(
            "big-stop-id",
            {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "stop_token_ids": [10**6, 2**63]}},
        ),
    ),
    (
        "requests",
        _req("temp-big", {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "temperature": 1e308}}),
    ),
    (
        "requests",
        _req("temp-str", {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "temperature": "1"}}),
    ),
    ("requests", _req("stop-str", {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "stop": "ab"}})),
    ("requests", _req("mt-float", {"prompt_token_ids": [5], "sampling": {"max_tokens": 2.5}})),
    ("requests", _req("mt-bool", {"prompt_token_ids": [5], "sampling": {"max_tokens": True}})),
    ("requests", _req("ids-bool", {"prompt_token_ids": [True, False], "sampling": {"max_tokens": 2}})),
    ("requests", _req("dup", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3}})),
    ("requests", _req("dup", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 3}})),
    (
        "requests",
        {**_req("resumed", {"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2}}), "resume": "1"},
    ),
    ("requests", {"type": "request", "request_id": "no-data"}),
    ("requests", {"type": "request", "request_id": "v-new", "data": "{}", "v": "2"}),
    ("control", {"type": "abort", "request_ids": ",".join(f"id{i}" for i in range(10_001))}),
    ("control", {"type": "abort", "request_ids": ",".join(f"id{i}" for i in range(300))}),
    ("control", {"type": "abort_all", "engine": "other"}),
    ("control", {"type": "abort_all", "engine": ""}),  # all engines: harmless here, nothing runs
    ("control", {"type": "drain", "engine": "other"}),
    ("control", {"type": "drain", "engine": ""}),
    ("control", {"type": "abort", "request_id": "dup"}),
]


async def send_sharp(bus, sent) -> None:
    for stream, fields in SHARP:
        key = bus.keys.control if stream == "control" else bus.keys.requests
        eid = await bus.redis.execute_command("XADD", key, "*", *[x for kv in fields.items() for x in kv])
        sent.append((stream, eid, fields))
        await asyncio.sleep(0.002)


def test_random_entries_never_stop_the_engine(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    prompt = tiny_tokenizer.encode("The quick brown fox")
    ref = LLM(tiny_runner, tiny_tokenizer).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    loop = asyncio.new_event_loop()
    url = redis_server.url
    eng = loop.run_until_complete(
        start_engine(
            lambda: connect(url),
            keys,
            EngineConfig(model_dir=str(tiny_model_dir), engine_id=ENGINE),
            runner=tiny_runner,
            tokenizer=tiny_tokenizer,
        )
    )
    bus = Bus(connect(url), keys)
    sent: list[tuple[str, bytes, dict]] = []
    try:

        @settings(
            max_examples=100,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=st.lists(st.one_of(valid_looking(), valid_looking(), junk()), min_size=1, max_size=5))
        def one(batch):
            async def go():
                for stream, fields in batch:
                    if not fields or not _safe(fields):
                        continue
                    key = keys.control if stream == "control" else keys.requests
                    flat = [x for kv in fields.items() for x in kv]
                    eid = await bus.redis.execute_command("XADD", key, "*", *flat)
                    sent.append((stream, eid, fields))
                await asyncio.sleep(0.005)  # let the engine read some of it now

            loop.run_until_complete(go())
            assert not eng.task.done(), eng.task

        one()
        loop.run_until_complete(send_sharp(bus, sent))

        async def after():
            dead_expected = {(s, eid) for s, eid, f in sent if expect_dead(s, f, eid)}
            assert dead_expected, "the generator should produce undecodable entries"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if (
                    await bus.redis.xlen(keys.dead) >= len(dead_expected)
                    and await bus.redis.xlen(keys.requests) == 0
                ):
                    break
                await asyncio.sleep(0.05)
            assert not eng.task.done(), eng.task
            dead = await bus.redis.xrange(keys.dead)
            got = {}
            for _, f in dead:
                stream = "control" if f[b"stream"] == keys.control.encode() else "requests"
                assert f[b"reason"], f
                got[(stream, f[b"entry_id"])] = f[b"reason"].decode()
            missing = dead_expected - set(got)
            extra = set(got) - dead_expected
            assert not missing, f"undecodable entries not dead-lettered: {sorted(missing)[:5]}"
            assert not extra, f"harmless entries dead-lettered: {[(k, got[k]) for k in sorted(extra)[:5]]}"
            # everything it claimed, it finished and acked (nothing stuck pending)
            pending = await bus.redis.xpending(keys.requests, "engines")
            assert pending["pending"] == 0, pending
            # and it still serves, exactly as offline
            # (accepted now, as the API stamps it: an abort_all of the fuzz that the engine
            # reads only after claiming it does not end it)
            await bus.submit(
                Request(
                    request_id="after-fuzz",
                    data=RequestData(
                        prompt_token_ids=tuple(prompt),
                        arrival_ts=int(time.time() * 1000),
                        sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                    ),
                ),
                Accepted(request_id="after-fuzz", prompt_tokens=len(prompt), endpoint="completion"),
            )
            evs = await story(bus, "after-fuzz", timeout=30)
            assert evs[-1].finish_reason == "length"
            assert tokens_of(evs) == ref.token_ids and text_of(evs) == ref.text
            assert not eng.task.done()
            assert eng.node.sched.num_free_blocks == eng.node.sched.num_total_blocks

        loop.run_until_complete(after())
    finally:
        loop.run_until_complete(eng.stop())
        loop.run_until_complete(bus.redis.aclose())
        loop.close()


# Requests that once decoded and then killed the engine node (the step raised out of
# EngineNode.run, or decode raised something other than BadEvent): each must now be refused
# -- a dead letter, or a final with an error -- while the engine goes on serving.
POISON = {
    "prompt-id-past-vocab": {"prompt_token_ids": [1, VOCAB], "sampling": {"max_tokens": 2}},
    "seed-past-64-bits": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "seed": 2**64 + 1}},
    "seed-float": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "seed": 1.5}},
    "seed-string": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "seed": "3"}},
    "top_k-float": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "top_k": 2.5}},
    "stop-not-strings": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "stop": [1, None]}},
    # decode() raised ValueError/TypeError instead of BadEvent, which the bus does not catch
    "arrival_ts-not-a-number": {"prompt_token_ids": [5], "arrival_ts": "x"},
    "arrival_ts-a-list": {"prompt_token_ids": [5], "arrival_ts": [1]},
    # fields of later releases, typed wrong or naming what this engine lacks
    "lora-unknown": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "lora": "missing"}},
    "lora-not-a-name": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "lora": ["x"]}},
    "embed-not-a-boolean": {"prompt_token_ids": [5], "sampling": {"max_tokens": 2, "embed": "yes"}},
}


@pytest.mark.parametrize("name", sorted(POISON))
async def test_poisonous_request_is_refused_not_fatal(
    name, real_bus, redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    url = redis_server.url
    eng = await start_engine(
        lambda: connect(url),
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id=ENGINE),
        runner=tiny_runner,
        tokenizer=tiny_tokenizer,
    )
    try:
        fields = _req("poison", POISON[name])
        await real_bus.redis.execute_command(
            "XADD", keys.requests, "*", *[x for kv in fields.items() for x in kv]
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not eng.task.done():
            dead = await real_bus.redis.xlen(keys.dead)
            final = [ev for _, ev in await real_bus.read_req("poison") if ev.TYPE == "final"]
            if dead or final:
                break
            await asyncio.sleep(0.02)
        assert not eng.task.done(), eng.task.exception()
        # refused: dead-lettered, or finished with an error the client can read
        assert dead or final[0].finish_reason == "error"
        await submit(real_bus, "after", [5, 6, 7], max_tokens=2)
        assert (await story(real_bus, "after", timeout=10))[-1].finish_reason == "length"
    finally:
        await eng.stop()
