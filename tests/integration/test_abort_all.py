"""``abort_all`` (DESIGN.md §3, §4) on real Redis with two engines reading ``P:control``: it
ends what the engines run and what waits in ``P:requests`` (never delivered, or delivered to a
consumer that never owned it), each request with exactly one final and its abort story; the
unclaimed ones are never prefilled. Requests accepted after the event run as usual."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.bus import Bus
from fd.control.connect import connect
from fd.control.events import Abort, AbortAll, Accepted, BlocksReleased, Final, Request, Tokens
from fd.control.keys import GROUP_ENGINES, owner_engine
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from tests.kit.engine import story, submit, types
from tests.kit.faults import Engines, all_blocks_free, wait_for

PROMPT = list(range(10, 30))
RUNNING_STORY = ["accepted", "claimed", "abort_requested", "drained", "blocks_released", "final"]
QUEUED_STORY = ["accepted", "abort_requested", "drained", "blocks_released", "final"]
#: no failover scan within the test: the entries read by a consumer that never owns them must
#: still be unowned when the abort_all comes
SLOW_FAILOVER = dict(failover_interval_s=30.0, failover_idle_ms=30_000)


async def _start_two(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    for eid in ("A", "B"):  # two running slots each: the rest stays in P:requests
        await engines.start(eid, delay=0.02, gated=True, max_num_seqs=2, **SLOW_FAILOVER)
    return engines


async def _fill(bus: Bus, engines: Engines, n_run: int, n_wait: int) -> tuple[list[str], list[str]]:
    running = [f"run{i}" for i in range(n_run)]
    waiting = [f"wait{i}" for i in range(n_wait)]
    for rid in running:
        await submit(bus, rid, PROMPT, max_tokens=500, ignore_eos=True)
    for rid in running:
        await story(bus, rid, until=Tokens)
    for rid in waiting:
        await submit(bus, rid, PROMPT, max_tokens=500, ignore_eos=True)
    return running, waiting


def _scheduled(engines: Engines) -> set[str]:
    return set().union(*(g.scheduled_ids() for g in engines.gates.values()))


async def test_abort_all_ends_running_and_unclaimed_requests_once(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    engines = await _start_two(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis_server.url), keys)
    api = await start_api(
        lambda: connect(redis_server.url),
        keys,
        ApiConfig(model_dir=str(tiny_model_dir)),
        tokenizer=tiny_tokenizer,
    )
    try:
        running, waiting = await _fill(bus, engines, 4, 8)
        # two of the waiting are delivered to a consumer that never owns them (one that died
        # between XREADGROUP and its SET NX): pending, with no owner key
        got = await bus.redis.xreadgroup(GROUP_ENGINES, "gone", {keys.requests: ">"}, count=2)
        delivered = [e[1][b"request_id"].decode() for _, entries in got for e in entries]
        assert len(delivered) == 2 and set(delivered) <= set(waiting)
        assert not any([await bus.owner(r) for r in waiting])  # none of them claimed
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{api.url}/v1/abort_requests", json={"abort_all": True}) as r:
                assert r.status == 200 and (await r.json())["abort_all"] is True
        # accepted after the abort_all: not part of "all", it runs to its end
        await submit(bus, "later", PROMPT, max_tokens=3, ignore_eos=True)
        for rid in running:
            evs = await story(bus, rid)
            assert [t for t in types(evs) if t != "tokens"] == RUNNING_STORY, rid
            assert evs[-1].finish_reason == "abort"
        for rid in waiting:
            evs = await story(bus, rid)
            assert types(evs) == QUEUED_STORY, rid
            assert evs[1].source == "http" and evs[-1].finish_reason == "abort"
            assert [e.count for e in evs if isinstance(e, BlocksReleased)] == [0]
        later = await story(bus, "later")
        assert later[-1].finish_reason == "length" and "abort_requested" not in types(later)
        for eng in engines.started:
            await all_blocks_free(eng.node)
        # the unclaimed ones are gone from P:requests, and stay unprefilled and final
        await wait_for(_queue_empty(bus), what="P:requests empty")
        await asyncio.sleep(0.5)
        assert not _scheduled(engines) & set(waiting)
        for rid in running + waiting:
            evs = [e for _, e in await bus.read_req(rid)]
            assert sum(isinstance(e, Final) for e in evs) == 1 and isinstance(evs[-1], Final), rid
            assert 0 < await bus.redis.ttl(keys.req(rid)) <= bus.req_ttl_s
    finally:
        await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()


def _queue_empty(bus: Bus):
    async def empty() -> bool:
        return await bus.redis.xlen(bus.keys.requests) == 0

    return empty


async def test_abort_all_of_one_engine_leaves_the_queue(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """``engine=<id>``: that engine's requests end; the queue belongs to no engine, and its
    requests run later as usual."""
    engines = await _start_two(redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis_server.url), keys)
    try:
        running, waiting = await _fill(bus, engines, 4, 2)
        on_a = [r for r in running if owner_engine(await bus.owner(r)) == "A"]
        assert len(on_a) == 2
        await bus.publish(keys.control, AbortAll(engine="A", source="cli"))
        for rid in on_a:
            evs = await story(bus, rid)
            assert [t for t in types(evs) if t != "tokens"] == RUNNING_STORY
        for rid in waiting:  # claimed by A (or B) once there is room, and run
            evs = await story(bus, rid, until=Tokens)
            assert "abort_requested" not in types(evs)
        await bus.publish(keys.control, AbortAll(source="cli"))
        for rid in running + waiting:
            assert (await story(bus, rid))[-1].finish_reason == "abort"
        for eng in engines.started:
            await all_blocks_free(eng.node)
    finally:
        await engines.stop_all()
        await bus.redis.aclose()


async def test_queued_until_lists_what_was_accepted_by_then(bus):
    """On both servers, paged: the requests on ``P:requests`` up to another stream's entry."""
    for i in range(3):
        await submit(bus, f"q{i}", PROMPT, max_tokens=1)
    cut = await bus.publish(bus.keys.control, AbortAll(source="cli"))
    await asyncio.sleep(0.005)  # (a later millisecond)
    await submit(bus, "q3", PROMPT, max_tokens=1)
    got = await bus.queued_until(cut, page=2)
    assert [rid for _, rid in got] == ["q0", "q1", "q2"]
    assert all(isinstance(e, bytes) for e, _ in got)


async def test_abort_all_read_late_spares_what_was_accepted_after_it(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """An engine that reads an ``abort_all`` only after it claimed a request accepted later
    (its control reader behind its claims) lets that request run: the event ends what was
    accepted (``arrival_ts``, which the API sets) by its millisecond. (Here the event's id is of long ago, as a late read makes it.)"""
    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    bus = Bus(connect(redis_server.url), keys)
    try:
        eng = await engines.start("A", delay=0.02)
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        await bus.submit(
            Request(
                request_id="later",
                data=RequestData(
                    prompt_token_ids=(5, 17, 33, 9), sampling=sp, arrival_ts=int(time.time() * 1000)
                ),
            ),
            Accepted(request_id="later", prompt_tokens=4, endpoint="completion"),
        )
        await story(bus, "later", until=Tokens)
        await bus.redis.xadd(keys.control, {"type": "abort_all", "source": "cli"}, id="1-0")
        evs = await story(bus, "later")
        assert evs[-1].finish_reason == "length" and "abort_requested" not in types(evs)
        # one of now ends what runs
        await submit(bus, "now", [5, 17, 33, 9], max_tokens=200, ignore_eos=True)
        await story(bus, "now", until=Tokens)
        await bus.publish(keys.control, AbortAll(source="cli"))
        assert (await story(bus, "now"))[-1].finish_reason == "abort"
        await all_blocks_free(eng.node)
    finally:
        await engines.stop_all()
        await bus.redis.aclose()


async def test_aborts_published_while_no_engine_runs_are_applied_before_the_first_claim(
    redis_server, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """Requests queued while no engine is up, then ``abort_all`` (and an abort by id of one
    more): the engine that starts later reads them back and applies them before it claims
    anything, so none of those requests is ever claimed or prefilled; one submitted after
    runs as usual."""
    bus = Bus(connect(redis_server.url), keys)
    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    try:
        queued = [f"q{i}" for i in range(6)]
        for rid in queued:
            await submit(bus, rid, PROMPT, max_tokens=20)
        await asyncio.sleep(0.005)  # (the abort_all's millisecond after the last accepted)
        await bus.publish(keys.control, AbortAll(source="cli"))
        await asyncio.sleep(0.005)
        await submit(bus, "later", PROMPT, max_tokens=20)  # accepted after it: runs
        await submit(bus, "by-id", PROMPT, max_tokens=20)
        await bus.publish(keys.control, Abort(request_ids=("by-id",), source="cli"))
        eng = await engines.start("E", gated=True)
        for rid in [*queued, "by-id"]:
            evs = await story(bus, rid)
            assert types(evs) == QUEUED_STORY, rid  # no `claimed`: never prefilled
            assert evs[-1].finish_reason == "abort"
        evs = await story(bus, "later")
        assert evs[-1].finish_reason == "length" and "claimed" in types(evs)
        assert not (_scheduled(engines) & {*queued, "by-id"})  # never in a step
        await all_blocks_free(eng.node)
    finally:
        await engines.stop_all()
        await bus.redis.aclose()
