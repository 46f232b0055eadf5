"""The event catalogue's wire format: what redis-cli can type and what readers must reject."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from fd.control import events as E
from fd.control.bad_event import BadEvent
from fd.control.events import decode
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams

TS = 1_700_000_000_123

REQ_DATA = RequestData(
    prompt_token_ids=(1, 2, 3),
    sampling=SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        seed=42,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 9),
        ignore_eos=True,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
    ),
    arrival_ts=TS,
    model="tiny",
    api="api-1",
    background=True,
)

SAMPLES = [
    E.Abort(request_ids=("r1",), source="cli", reason="user", abort_id="a1", ts=TS),
    E.Abort(request_ids=("a", "b", "c"), ts=TS),
    E.AbortAll(engine="e1", source="http", reason="maintenance", abort_id="a2", ts=TS),
    E.AbortAll(ts=TS),
    E.Drain(engine="e-2", ts=TS),
    E.LoadLora(name="sql-adapter", path="/adapters/sql", ts=TS),
    E.UnloadLora(name="sql-adapter", ts=TS),
    E.Request(request_id="r1", data=REQ_DATA, ts=TS),
    E.Accepted(request_id="r1", api="api-1", prompt_tokens=3, ts=TS),
    E.Claimed(request_id="r1", engine="e1", attempt=2, ts=TS),
    E.Tokens(request_id="r1", token_ids=(5, 6, 7), text='hé, "x"\n', step=12, ts=TS),
    E.Tokens(request_id="r1", token_ids=(), text="", ts=TS),
    E.Tokens(
        request_id="r1",
        token_ids=(9,),
        text="a",
        step=3,
        ts=TS,
        logprobs={"lp": [-0.25], "top": [[[9, -0.25], [4, -1.5]]]},
    ),
    E.Preempted(request_id="r1", count=4, engine="e1", step=3, ts=TS),
    E.AbortRequested(request_id="r1", source="disconnect", engine="e1", step=3, ts=TS),
    E.Drained(request_id="r1", engine="e1", step=4, discarded_tokens=1, ts=TS),
    E.BlocksReleased(request_id="r1", count=3, engine="e1", step=4, ts=TS),
    E.Final(
        request_id="r1",
        finish_reason="stop",
        usage={"prompt_tokens": 3, "completion_tokens": 2},
        engine="e1",
        stop_reason="END",
        ts=TS,
    ),
    E.Final(request_id="r1", finish_reason="error", error="boom", ts=TS),
    E.RequestAccepted(request_id="r1", api="api-1", endpoint="chat", prompt_tokens=12, ts=TS),
    E.RequestClaimed(request_id="r1", engine="e1", attempt=2, ts=TS),
    E.FirstToken(request_id="r1", engine="e1", ts=TS),
    E.RequestFinished(
        request_id="r1", engine="e1", finish_reason="length", prompt_tokens=12, completion_tokens=64, ts=TS
    ),
    E.EngineLoad(
        engine="e1",
        step=812,
        running=8,
        waiting=2,
        blocks_free=100,
        blocks_total=512,
        prefix_blocks=40,
        ts=TS,
    ),
    E.JournalStart(engine="e1", config={"block_size": 16, "num_blocks": 64}, ts=TS),
    E.JournalStep(
        engine="e1", step=9, seq=3, data={"calls": [["schedule", {}], ["update", {"r1": 5}]]}, ts=TS
    ),
]


def test_samples_cover_every_event_type():
    assert {type(s) for s in SAMPLES} == set(E._REGISTRY.values())


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda e: e.TYPE)
def test_round_trip(ev):
    wire = ev.encode()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in wire.items()), wire
    assert wire["type"] == ev.TYPE
    assert decode(wire) == ev
    # as the bytes redis-py hands back
    assert decode({k.encode(): v.encode() for k, v in wire.items()}) == ev


def test_one_abort_id_is_written_as_request_id():
    wire = E.Abort(request_ids=("r1",), ts=TS).encode()
    assert wire["request_id"] == "r1" and "request_ids" not in wire
    assert E.Abort(request_ids=("a", "b"), ts=TS).encode()["request_ids"] == "a,b"


def test_encode_stamps_ts_when_missing():
    wire = E.Drain(engine="e1").encode()
    assert int(wire["ts"]) > TS


def test_hand_typed_abort():
    ev = decode({b"type": b"abort", b"request_id": b"r1"}, entry_id=b"1700000000999-3")
    assert isinstance(ev, E.Abort)
    assert ev.request_ids == ("r1",)
    assert ev.source == "redis"
    assert ev.v == E.SCHEMA_VERSION
    assert ev.ts == 1700000000999


def test_hand_typed_abort_of_many():
    ev = decode({"type": "abort", "request_ids": "a, b,c"}, entry_id="5-0")
    assert ev.request_ids == ("a", "b", "c") and ev.ts == 5


def test_hand_typed_abort_all_and_drain():
    assert decode({"type": "abort_all"}, "7-0") == E.AbortAll(ts=7)
    assert decode({"type": "drain", "engine": "e1"}, "7-1") == E.Drain(engine="e1", ts=7)


def _req(**over):
    wire = E.Request(request_id="r1", data=REQ_DATA, ts=TS).encode()
    wire.update(over)
    return wire


BAD = [
    ("unknown type", {"type": "explode", "request_id": "r1"}, "type"),
    ("no type", {"request_id": "r1"}, "type"),
    ("abort without id", {"type": "abort"}, "request_id"),
    ("tokens without request_id", {"type": "tokens", "token_ids": "1"}, "request_id"),
    ("drain without engine", {"type": "drain"}, "engine"),
    ("non-JSON data", _req(data="{not json"), "data"),
    ("data not an object", _req(data="[1,2]"), "data"),
    ("empty prompt", _req(data=orjson.dumps({"prompt_token_ids": []}).decode()), "data"),
    (
        "unknown sampling key",
        _req(data=orjson.dumps({"prompt_token_ids": [1], "sampling": {"temp": 1}}).decode()),
        "data",
    ),
    (
        "max_tokens 0",
        _req(data=orjson.dumps({"prompt_token_ids": [1], "sampling": {"max_tokens": 0}}).decode()),
        "data",
    ),
    (
        "presence_penalty 3",
        _req(data=orjson.dumps({"prompt_token_ids": [1], "sampling": {"presence_penalty": 3}}).decode()),
        "data",
    ),
    (
        "repetition_penalty -1",
        _req(data=orjson.dumps({"prompt_token_ids": [1], "sampling": {"repetition_penalty": -1}}).decode()),
        "data",
    ),
    (
        "oversize field",
        {"type": "abort", "request_id": "r1", "reason": "x" * (E.MAX_FIELD_BYTES + 1)},
        "reason",
    ),
    ("binary junk value", {b"type": b"abort", b"request_id": b"\xff\xfe\x00"}, "request_id"),
    ("binary junk name", {b"type": b"abort", b"request_id": b"r1", b"\xc3\x28": b"x"}, "<field name>"),
    ("hash tag in id", {"type": "abort", "request_id": "a{b}"}, "request_ids"),
    ("hash tag in request_id", {"type": "claimed", "request_id": "a{b}", "engine": "e1"}, "request_id"),
    ("space in one of many ids", {"type": "abort", "request_ids": "a,b c"}, "request_ids"),
    ("glob in engine id", {"type": "drain", "engine": "e*"}, "engine"),
    (
        "int field not int",
        {"type": "claimed", "request_id": "r1", "engine": "e1", "attempt": "two"},
        "attempt",
    ),
    ("token ids not ints", {"type": "tokens", "request_id": "r1", "token_ids": "1,x"}, "token_ids"),
    ("bad finish_reason", {"type": "final", "request_id": "r1", "finish_reason": "bored"}, "finish_reason"),
    (
        "usage not JSON",
        {"type": "final", "request_id": "r1", "finish_reason": "stop", "usage": "nope"},
        "usage",
    ),
    ("newer schema", {"type": "abort", "request_id": "r1", "v": str(E.SCHEMA_VERSION + 1)}, "v"),
]


@pytest.mark.parametrize("fields,field", [(f, n) for _, f, n in BAD], ids=[d for d, _, _ in BAD])
def test_bad_events_raise_bad_event_naming_the_field(fields, field):
    with pytest.raises(BadEvent) as info:
        decode(fields, "1-0")
    assert info.value.field == field
    assert field in str(info.value)


def test_events_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES[0].ts = 1  # type: ignore[misc]


def test_lora_commands_as_an_operator_types_them():
    assert decode({"type": "load_lora", "name": "sql", "path": "/a"}, "5-0") == E.LoadLora(
        name="sql", path="/a", ts=5
    )
    for fields, field in (
        ({"type": "load_lora", "name": "sql"}, "path"),
        ({"type": "load_lora", "name": "a b", "path": "/a"}, "name"),
        ({"type": "load_lora", "name": "sql", "path": ""}, "path"),
        ({"type": "unload_lora"}, "name"),
    ):
        with pytest.raises(BadEvent) as e:
            decode(fields)
        assert e.value.field == field, fields
