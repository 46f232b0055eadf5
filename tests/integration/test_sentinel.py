"""fd on Redis Sentinel (``--redis-url redis+sentinel://host:26379/<service>``), against a real
primary, replica and sentinel of the test's own (tests/kit/sentinel.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ConnectionError

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.bus import Bus
from fd.control.connect import MASTER_CHECK_S, connect
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from tests.kit.engine import submit, types
from tests.kit.faults import Engines, dump_tasks_after, sse_objects, wait_for
from tests.kit.redis import free_port
from tests.kit.sentinel import SERVICE, SentinelSet


@pytest.fixture
def sentinels(tmp_path):
    s = SentinelSet(str(tmp_path))
    try:
        yield s.start()
    finally:
        s.stop()


async def test_a_sentinel_url_reaches_the_primary_and_a_bus_works_on_it(sentinels, keys):
    client = connect(sentinels.url)
    try:
        await client.set(f"{keys.prefix}:k", b"v")
        assert await client.get(f"{keys.prefix}:k") == b"v"
        assert sentinels.direct("primary").get(f"{keys.prefix}:k") == b"v"  # (the primary's)
        bus = Bus(client, keys)
        await submit(bus, "r1", [5, 17, 33], max_tokens=3)
        assert types([ev for _, ev in await bus.read_req("r1")]) == ["accepted"]
    finally:
        await client.aclose()


async def test_a_sentinel_url_takes_several_sentinels_a_db_and_the_data_nodes_password(sentinels, keys):
    sentinels.sentinel().execute_command("SENTINEL", "SET", SERVICE, "auth-pass", "s3cret")
    sentinels.direct("replica").config_set("masterauth", "s3cret")
    sentinels.direct("primary").config_set("requirepass", "s3cret")
    nobody = f"127.0.0.1:{free_port()}"  # (named first, not there: the next sentinel answers)
    there = f"127.0.0.1:{sentinels.ports['sentinel']}"
    client = connect(f"redis+sentinel://:s3cret@{nobody},{there}/{SERVICE}/3")
    wrong = connect(f"redis+sentinel://:nope@{there}/{SERVICE}/3")
    try:
        await client.set(f"{keys.prefix}:k", b"v3")
        primary = redis.Redis(port=sentinels.ports["primary"], db=3, password="s3cret")
        assert primary.get(f"{keys.prefix}:k") == b"v3"
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError):
            await wrong.get(f"{keys.prefix}:k")
        assert time.monotonic() - t0 < 1  # (a wrong password is not retried)
    finally:
        await client.aclose()
        await wrong.aclose()


async def test_a_sentinel_client_has_the_settings_of_a_plain_one():
    plain = connect("redis://127.0.0.1:6379/0", 3)
    sentinel = connect("redis+sentinel://127.0.0.1:26379/m", 3)  # (nothing connects yet)
    try:
        a, b = plain.connection_pool, sentinel.connection_pool
        for name in ("max_connections", "timeout"):  # (a pool that waits for a connection)
            assert getattr(b, name) == getattr(a, name), name
        for name in (
            "socket_timeout",
            "socket_connect_timeout",
            "socket_keepalive",
            "protocol",
            "health_check_interval",
            "retry_on_error",
            "decode_responses",
        ):
            assert b.connection_kwargs[name] == a.connection_kwargs[name], name
        assert type(b.connection_kwargs["retry"]) is type(a.connection_kwargs["retry"])
        assert b.connection_kwargs["retry"].get_retries() == a.connection_kwargs["retry"].get_retries()
        assert type(b.make_connection()).__mro__[1] is type(a.make_connection()).__mro__[1]  # fd's
    finally:
        await plain.aclose()
        await sentinel.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://127.0.0.1:26379",  # no service
        "redis+sentinel://127.0.0.1:26379/",
        "redis+sentinel://127.0.0.1:26379/m/x",  # a db that is no number
        "redis+sentinel://127.0.0.1:26379/m/0/more",
        "redis+sentinel:///m",  # no sentinel
        "redis+sentinel://127.0.0.1:port/m",
    ],
)
def test_a_sentinel_url_without_its_parts_is_refused_when_given(url):
    with pytest.raises(ValueError, match="Redis URL"):
        connect(url)


async def test_after_a_failover_the_client_writes_to_the_new_primary_not_the_old_one_still_up(
    sentinels, keys
):
    # SENTINEL FAILOVER leaves the old primary up and a primary, taking writes, until the
    # sentinel turns it into a replica some 10 s later; what it took meanwhile is lost then.
    client = connect(sentinels.url)
    key = f"{keys.prefix}:n"
    try:
        await client.set(key, 0)
        sentinels.failover()
        sentinels.wait_promoted()
        n = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < MASTER_CHECK_S + 0.5:  # (a busy client looks every 1 s)
            n += 1
            await client.set(key, n)
            await asyncio.sleep(0.05)
        n += 1
        await client.set(key, n)
        assert sentinels.direct("replica").get(key) == str(n).encode()  # the new primary has it
        assert sentinels.direct("primary").get(key) != str(n).encode()
    finally:
        await client.aclose()


async def test_a_command_that_meets_the_old_primary_turned_replica_goes_to_the_new_one(
    sentinels, keys, monkeypatch
):
    # (no look-up of the primary is due: what moves the client here is the READONLY reply)
    monkeypatch.setattr("fd.control.connect.MASTER_CHECK_S", 3600.0)
    client = connect(sentinels.url)
    bare = connect(sentinels.url)  # (no retries, as the engine's clients: it retries itself)
    bare.set_retry(Retry(NoBackoff(), 0))
    key = f"{keys.prefix}:k"
    try:
        await client.set(key, b"before")
        await bare.set(key, b"before")
        sentinels.failover()
        sentinels.wait_promoted()
        # what the sentinel does to the old primary some 10 s later, done now
        sentinels.direct("primary").replicaof("127.0.0.1", sentinels.ports["replica"])
        await client.set(key, b"after")  # READONLY from the old primary; sent again to the new
        assert sentinels.direct("replica").get(key) == b"after"
        with pytest.raises(ConnectionError, match="previous master is now a slave"):
            await bare.set(key, b"bare")
        await bare.set(key, b"bare")  # (its next command connects to the new primary)
        assert sentinels.direct("replica").get(key) == b"bare"
    finally:
        await client.aclose()
        await bare.aclose()


async def stream(url: str, body: dict, rid: str) -> dict:
    """A streaming client: what it saw, in order (text, one error, [DONE])."""
    out = {"status": None, "text": "", "finish_reason": None, "errors": [], "done": False, "after_error": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(
            f"{url}/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": rid}
        ) as r:
            out["status"] = r.status
            if r.status != 200:
                out["errors"].append(await r.text())
                return out
            async for obj in sse_objects(r):
                if obj is None:
                    out["done"] = True
                    break
                if out["errors"]:
                    out["after_error"] += 1  # (an error is the last event before [DONE])
                if "error" in obj:
                    out["errors"].append(obj["error"])
                    continue
                for ch in obj.get("choices") or ():
                    out["text"] += ch.get("text") or ""
                    if ch.get("finish_reason"):
                        out["finish_reason"] = ch["finish_reason"]
    return out


def _differ(res: dict, ref: str) -> str:
    text = res["text"]
    same = next((i for i, (a, b) in enumerate(zip(text, ref)) if a != b), min(len(text), len(ref)))
    return (
        f"{len(text)} chars seen, {len(ref)} expected, the first {same} alike; "
        f"then seen {text[same : same + 40]!r}, expected {ref[same : same + 40]!r}; "
        f"finish_reason={res['finish_reason']!r}, errors={res['errors']!r}, after them {res['after_error']}"
    )


@pytest.mark.parametrize("fault", ["failover", "kill"])
async def test_streams_live_through_a_primary_failover(
    sentinels, fault, keys, tiny_model_dir, tiny_runner, tiny_tokenizer
):
    """Four greedy streams of 150 tokens on an engine and an API over the sentinel URL; the
    primary fails over in the middle: by the operator's ``SENTINEL FAILOVER`` (the old primary
    stays up, a replica of the new one ~10 s later) or by its death. Each client's stream ends,
    exactly the greedy reference or with one error event and then [DONE]; none hangs, and no
    request's story has anything after its final."""
    url = sentinels.url
    engines = Engines(lambda: connect(url), keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    api = None
    bus = Bus(connect(url), keys)
    prompts = ["Once upon a time", "The quick brown fox", "In the beginning", "It was a dark night"]
    rids = [f"s{i}" for i in range(len(prompts))]
    try:
        eng = await engines.start("E", delay=0.03)
        api = await start_api(
            lambda: connect(url), keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
        )
        refs = LLM(tiny_runner, tiny_tokenizer).generate(
            [tiny_tokenizer.encode(p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True),
        )
        body = {"model": api.cfg.model_name, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        clients = [
            asyncio.create_task(stream(api.url, {**body, "prompt": p}, rid)) for p, rid in zip(prompts, rids)
        ]
        await wait_for(
            lambda: all(eng.node.sched.knows(r) for r in rids) and eng.node.steps > 20,
            what="all four decoding",
        )
        assert not any(c.done() for c in clients)  # (the fault lands mid-stream)
        if fault == "failover":
            sentinels.failover()
        else:
            sentinels.kill_primary()
        await asyncio.to_thread(sentinels.wait_promoted)
        hang = dump_tasks_after(90, "streams through a failover", sentinels.logs)
        try:
            results = await asyncio.gather(*clients)
        finally:
            hang.cancel()
        wrong = []  # (every stream's verdict, not only the first one's)
        for rid, ref, res in zip(rids, refs, results):
            exact = not res["errors"] and res["text"] == ref.text and res["finish_reason"] == "length"
            # (an error: one event, the last before [DONE], after text the reference begins with,
            # but for a character the cut left half-written, shown as U+FFFD)
            seen = res["text"].rstrip("\ufffd")
            failed = len(res["errors"]) == 1 and res["after_error"] == 0 and ref.text.startswith(seen)
            if res["status"] != 200 or not res["done"] or not (exact or failed):
                wrong.append((rid, res["status"], res["done"], _differ(res, ref.text)))
        assert not wrong, wrong
        for rid in rids:
            evs = [ev for _, ev in await bus.read_req(rid)]
            finals = [i for i, t in enumerate(types(evs)) if t == "final"]
            assert finals in ([], [len(evs) - 1]), (rid, types(evs))  # nothing after a final
    finally:
        if api is not None:
            await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()
