"""Chaos: two engines and two API nodes on real Redis, many streamed requests, and everything
going wrong at once: clients that hang up, aborts over HTTP, Redis connections killed under an
engine, and one engine killed mid-run. At the end every request has told one whole story.

Every prompt begins with the same sentence, so the engines' prefix caches are shared all the
time (and dropped with the killed engine); some requests are guided to a regular expression,
so a takeover must bring a grammar to where another engine left the output.

``FD_CHAOS_REQUESTS`` sets the number of requests (default 60, so CI stays fast; the issue's
200 is ``FD_CHAOS_REQUESTS=200``); ``FD_CHAOS_SEED`` the random plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import sys
import time

import aiohttp
from redis.exceptions import RedisError

from fd.api.config import ApiConfig
from fd.compose import start_api
from fd.control.connect import connect
from fd.control.events import Abort, Final
from fd.control.guided import canonical
from fd.control.outage import is_outage
from fd.control.sampling import SamplingParams
from fd.engine.journal.journal_reader import load_journal_from_redis
from fd.engine.journal.replay import replay
from fd.engine.runner.llm import LLM
from tests.kit.engine import text_of, tokens_of, types
from tests.kit.faults import Engines, all_blocks_free, dump_tasks_after, kill, sse_objects, wait_for

N = int(os.environ.get("FD_CHAOS_REQUESTS", "60"))
SEED = int(os.environ.get("FD_CHAOS_SEED", "7"))
CONCURRENCY = 12
LONG = 200  # requests that will be cut short run long, so they are surely running when cut
SHARED = "The harbour town woke slowly on winter mornings, and the boats came back with the tide. "
GUIDED = r"[a-z]{3,12}( [a-z]{3,12}){0,3}\."  # finite: a guided request ends with `stop`


async def _client(
    url: str, rid: str, body: dict, kind: str, abort_url: str, cut_after: int, log: dict
) -> None:
    rec = log[rid] = {
        "kind": kind,
        "text": "",
        "finish_reason": None,
        "done": False,
        "errors": [],
        "status": None,
        "t0": time.monotonic(),
        "t1": None,
    }
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
            rec["status"] = resp.status
            if resp.status != 200:  # a 503 while Redis stalls, a 400 for a poison body
                rec["body"] = await resp.json(content_type=None)
                rec["t1"] = time.monotonic()
                return
            chunks = 0
            async for obj in sse_objects(resp):
                if obj is None:
                    rec["done"] = True
                    break
                if "error" in obj:
                    rec["errors"].append(obj["error"])
                    continue
                for ch in obj.get("choices") or ():
                    rec["text"] += ch.get("text") or ""
                    rec["finish_reason"] = ch.get("finish_reason") or rec["finish_reason"]
                    if ch.get("text"):
                        chunks += 1
                if chunks == cut_after:
                    if kind == "disconnect":
                        rec["t1"] = time.monotonic()
                        return  # leaving the block closes the connection mid-stream
                    if kind == "abort":
                        await _abort(s, abort_url, rid)
    rec["t1"] = time.monotonic()


async def _abort(s: aiohttp.ClientSession, url: str, rid: str) -> None:
    # a 503 (Redis stalled) is retried, as a client would; anything else is an answer
    deadline = time.monotonic() + 60
    while True:
        async with s.post(f"{url}/v1/abort_requests", json={"request_ids": [rid]}) as a:
            if a.status != 503 or time.monotonic() > deadline:
                assert a.status == 200, await a.text()
                return
        await asyncio.sleep(0.2)


async def test_chaos(redis_server, real_bus, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    rnd = random.Random(SEED)
    engines = Engines(redis_server.url, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    apis = []
    try:
        a = await engines.start("A", delay=0.005)
        b = await engines.start("B", delay=0.005)
        for _ in range(2):
            apis.append(
                await start_api(
                    lambda: connect(redis_server.url),
                    keys,
                    ApiConfig(model_dir=str(tiny_model_dir)),
                    tokenizer=tiny_tokenizer,
                )
            )
        words = ["fox", "river", "cloud", "stone", "lamp", "tree", "bird", "sand"]
        plan = []
        for i in range(N):
            r = rnd.random()
            kind = "disconnect" if r < 0.15 else "abort" if r < 0.25 else "complete"
            prompt = f"{SHARED}{i} {rnd.choice(words)} {rnd.choice(words)} and the {rnd.choice(words)}"
            max_tokens = LONG if kind != "complete" else rnd.randint(8, 40)
            guided = kind == "complete" and rnd.random() < 0.3
            plan.append((f"c{i}", kind, prompt, 80 if guided else max_tokens, rnd.randint(1, 4), guided))
        refs = {}
        done_plan = [p for p in plan if p[1] == "complete"]
        complete = {p[0] for p in done_plan}
        llm = LLM(tiny_runner, tiny_tokenizer, enable_prefix_caching=False)
        for rid, _, prompt, max_tokens, _, guided in done_plan:
            (refs[rid],) = llm.generate(
                [tiny_tokenizer.encode(prompt)],
                SamplingParams(
                    temperature=0.0,
                    max_tokens=max_tokens,
                    ignore_eos=not guided,
                    guided=canonical({"regex": GUIDED}) if guided else "",
                ),
            )

        log: dict = {}
        finished = 0
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i, rid, kind, prompt, max_tokens, cut, guided):
            nonlocal finished
            body = {
                "model": apis[0].cfg.model_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": not guided,
                "stream": True,
            }
            if guided:
                body["guided_regex"] = GUIDED
            async with sem:
                await _client(apis[i % 2].url, rid, body, kind, apis[(i + 1) % 2].url, cut, log)
            finished += 1

        async def chaos():
            await wait_for(lambda: finished >= N // 5, 60, "a fifth of the requests")
            # every Redis connection but the test's own is killed under its user, a few times
            # over, so commands in flight (blocking reads, pipelines) are cut, not just idle ones
            for _ in range(3):
                await real_bus.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                await asyncio.sleep(0.05)
            await wait_for(lambda: finished >= 2 * N // 5, 60, "two fifths of the requests")

            # (kill A while it runs a request nobody aborts and whose `claimed` is out, so B
            # must take one over; with requests still flowing it soon does)
            async def a_runs_a_claimed_request() -> bool:
                for rid in [r for r in complete if a.node.sched.knows(r)]:
                    evs = [e for _, e in await real_bus.read_req(rid)]
                    if any(e.TYPE == "claimed" and e.engine == "A" for e in evs) and a.node.sched.knows(rid):
                        return True  # (and nothing runs between here and the kill)
                return False

            await wait_for(a_runs_a_claimed_request, 30, "A running a claimed request")
            await kill(a)

        t0 = time.monotonic()
        chaos_task = asyncio.create_task(chaos())
        await asyncio.wait_for(asyncio.gather(*[one(i, *p) for i, p in enumerate(plan)]), 120)
        await asyncio.wait_for(chaos_task, 5)
        elapsed = time.monotonic() - t0

        # every request's story: one final, last; cut requests ended abort; the rest are whole
        for rid, kind, _prompt, _max_tokens, _, guided in plan:
            evs = [e for _, e in await real_bus.read_req(rid)]
            if kind == "disconnect" and "final" not in types(evs):
                await wait_for(lambda rid=rid: _has_final(real_bus, rid), 20, f"final of {rid}")
                evs = [e for _, e in await real_bus.read_req(rid)]
            t = types(evs)
            assert t.count("final") == 1 and t[-1] == "final", (rid, kind, t)
            final = evs[-1]
            rec = log[rid]
            if kind == "disconnect":
                assert final.finish_reason == "abort", (rid, final)
                continue
            assert rec["status"] == 200 and rec["done"] and not rec["errors"], (rid, rec)
            if kind == "abort":
                assert final.finish_reason == "abort" and rec["finish_reason"] == "abort", rid
                assert rec["text"] == text_of(evs)
                continue
            ref = refs[rid]
            assert tokens_of(evs) == ref.token_ids, (rid, t)  # no duplicate, none lost
            assert rec["text"] == ref.text == text_of(evs), rid
            if guided:
                assert re.fullmatch(GUIDED, rec["text"]), (rid, rec["text"])
            assert final.finish_reason == rec["finish_reason"] == ("stop" if guided else "length"), rid
        await all_blocks_free(b.node, timeout=10)
        assert (await real_bus.redis.xpending(keys.requests, "engines"))["pending"] == 0
        report = replay(await load_journal_from_redis(real_bus, "B"))
        assert report.divergence is None and not report.analysis.violations, report.analysis.violations
        kinds = [p[1] for p in plan]
        guided_moved = 0
        for p in plan:
            if p[5]:
                claims = [e.engine for _, e in await real_bus.read_req(p[0]) if e.TYPE == "claimed"]
                guided_moved += len(set(claims)) > 1
        assert (
            sum(p[5] for p in plan) >= 3 and (a.node.sched.num_cache_hits + b.node.sched.num_cache_hits) > 0
        )
        print(
            f"\nchaos: {N} requests ({kinds.count('complete')} complete, "
            f"{kinds.count('disconnect')} disconnected, {kinds.count('abort')} aborted) in "
            f"{elapsed:.1f} s; B took over {b.node.taken_over} from the killed A; "
            f"{b.node.redis_errors} Redis errors retried; {guided_moved} guided requests moved "
            f"engines; prefix cache hits {a.node.sched.num_cache_hits + b.node.sched.num_cache_hits} tokens"
        )
        assert b.node.taken_over >= 1
        assert b.node.redis_errors >= 1  # the killed connections did hit the engine
    finally:
        for api in apis:
            await api.stop()
        await engines.stop_all()


async def _has_final(bus, rid) -> bool:
    return any(isinstance(e, Final) for _, e in await bus.read_req(rid))


# ----------------------------------------------------------------------------- outside faults

VOCAB = 512  # the tiny model's
FAR = 10**9
STALL_S = 3.0  # redis-server under SIGSTOP: longer than the nodes' --redis-timeout
REDIS_TIMEOUT = 2.0
SEATS = 4  # each engine's max_num_seqs: the abort_all's burst is more than all of them hold
#: (a request may move more than max_attempts' default of 3 times here: a kill, a pause and the
#: heartbeats the Redis stall lets expire; moving is what is tested, not giving up)
ATTEMPTS = 20
POISON_HTTP = [  # (the field the 400 names, what the body adds)
    ("stop_token_ids", {"stop_token_ids": [VOCAB], "min_tokens": 1}),
    ("allowed_token_ids", {"allowed_token_ids": [3, VOCAB]}),
    ("logit_bias", {"logit_bias": {str(FAR): 5}}),
    ("prompt", {"prompt": [5, 6, VOCAB]}),
]
#: hand-written `P:requests` entries: (the entry's fields but the id, what it must come to)
HAND_WRITTEN = {
    "far-allowed": (
        '{"prompt_token_ids":[5,6],"sampling":{"max_tokens":3,"allowed_token_ids":[' + str(FAR) + "]}}",
        "allowed_token_ids",
    ),
    "far-prompt": ('{"prompt_token_ids":[5,' + str(VOCAB + 3) + '],"sampling":{"max_tokens":3}}', "prompt"),
    "e-notation": ('{"prompt_token_ids":[5],"sampling":{"max_tokens":2,"allowed_token_ids":[1e9]}}', None),
    "bad-json": ('{"prompt_token_ids":[5],"sampling":', None),
    "no-data": (None, None),
}
FAULTS = [
    "kill-connections",
    "kill-engine",
    "pause-engine",
    "abort-all",
    "stall-redis",
    "oom-redis",
    "flush-redis",
]
#: the faults during which a new request may get a 503 and an abort may not get through
REFUSING = ("stall-redis", "oom-redis")


async def _heartbeat(bus, engine_id: str) -> dict[str, str]:
    raw = await bus.redis.hgetall(bus.keys.engine(engine_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


async def test_chaos_with_outside_faults(tmp_path, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """The faults of issue 24 on top of the ones above, each at a seeded point of the run:
    poison bodies over HTTP (400s, nothing on the log) and poison entries written by hand on
    ``P:requests`` (an error final, or a dead letter), an ``fd engine`` process paused until a
    peer takes its requests over and then resumed, an ``abort_all`` while requests run and wait
    beyond every engine's seats, redis-server paused for longer than the nodes' Redis timeout,
    Redis connections killed, an engine killed; and Redis's own (issue 43): writes refused for
    a while (OOM), everything emptied (FLUSHALL). Every request ends with one final and nothing
    after it, or, where its story went with the emptying, its client's stream ends with
    ``story_lost``; no engine dies and the live ones give every block back."""
    from fd.control.bus import Bus
    from fd.control.keys import owner_engine
    from tests.kit.faults import OwnRedis, reap, spawn_engine

    rnd = random.Random(SEED)
    redis = OwnRedis(str(tmp_path))
    redis.start()
    factory = lambda: connect(redis.url, REDIS_TIMEOUT)  # noqa: E731
    bus = Bus(connect(redis.url), keys)  # the test's own: no timeout, it waits a stall out
    # P, the engine to pause, is a process of its own: SIGSTOP stops all of it, its clocks too
    proc = spawn_engine(
        redis.url,
        keys,
        tiny_model_dir,
        "P",
        "--redis-timeout",
        str(REDIS_TIMEOUT),
        "--max-num-seqs",
        str(SEATS),
        "--max-attempts",
        str(ATTEMPTS),
    )
    engines = Engines(factory, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    apis = []
    paused: list[int] = []
    watchdog = None
    try:
        # ---- the plan: requests in segments, one fault during each segment but the last
        words = ["fox", "river", "cloud", "stone", "lamp", "tree", "bird", "sand"]
        faults = rnd.sample(FAULTS, len(FAULTS))
        plan: list[tuple] = []  # (rid, kind, prompt, max_tokens, cut, extra)

        def request(rid, kind, long=False):
            prompt = f"{SHARED}{rid} {rnd.choice(words)} {rnd.choice(words)} and the {rnd.choice(words)}"
            max_tokens = LONG if kind != "complete" or long else rnd.randint(8, 40)
            return (rid, kind, prompt, max_tokens, rnd.randint(1, 4), None)

        per = max(4, N // (len(FAULTS) + 1))
        segments = []
        for s_i in range(len(FAULTS) + 1):
            seg = []
            for j in range(per):
                r = rnd.random()
                kind = "disconnect" if r < 0.15 else "abort" if r < 0.25 else "complete"
                seg.append(request(f"s{s_i}-{j}", kind, long=j < 2))  # two long ones, for the faults
            for j, (field, extra) in enumerate(rnd.sample(POISON_HTTP, 2)):
                seg.insert(
                    rnd.randrange(len(seg) + 1), (f"s{s_i}-bad{j}", "poison", "x", 4, 0, (field, extra))
                )
            name = rnd.choice(sorted(HAND_WRITTEN))
            seg.insert(rnd.randrange(len(seg) + 1), (f"s{s_i}-hand", "hand", "", 0, 0, name))
            segments.append(seg)
            plan += seg
        # requests the faults add when they need one running on a given engine, or a burst
        fillers = [request(f"f{i}", "complete", long=True) for i in range(6)]
        plan += fillers
        refs = {}
        llm = LLM(tiny_runner, tiny_tokenizer, enable_prefix_caching=False)
        for rid, kind, prompt, max_tokens, *_ in plan:
            if kind == "complete":
                (refs[rid],) = llm.generate(
                    [tiny_tokenizer.encode(prompt)],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                )

        spec = dict(delay=0.005, max_num_seqs=SEATS, max_attempts=ATTEMPTS)
        a = await engines.start("A", **spec)
        b = await engines.start("B", **spec)
        # (blind: the faults need requests running on P, which placement would keep on A and
        # B, whose caches hold the shared prefix; tests/integration/test_placement.py has it)
        api_cfg = ApiConfig(model_dir=str(tiny_model_dir), placement="blind")
        for _ in range(2):
            apis.append(await start_api(factory, keys, api_cfg, tokenizer=tiny_tokenizer))
        await wait_for(lambda: _heartbeat(bus, "P"), 120, "engine P up")

        log: dict = {}
        hand: dict[str, tuple] = {}  # rid -> (name, entry id, time written)
        windows: dict[str, tuple[float, float]] = {}
        sem = asyncio.Semaphore(CONCURRENCY)
        tasks: list[asyncio.Task] = []
        counter = [0]

        async def one(rid, kind, prompt, max_tokens, cut, extra):
            i = counter[0] = counter[0] + 1
            # (a burst is sent all at once: more than the engines' seats must be waiting)
            async with sem if kind != "burst" else contextlib.nullcontext():
                if kind == "hand":
                    data, _ = HAND_WRITTEN[extra]
                    fields = ["type", "request"] + (["request_id", rid, "data", data] if data else [])
                    while True:  # (an operator retries what Redis refuses for now, as fd does)
                        t = time.monotonic()
                        try:
                            eid = await bus.redis.execute_command("XADD", keys.requests, "*", *fields)
                            break
                        except RedisError as e:
                            assert is_outage(e), e
                            await asyncio.sleep(0.1)
                    hand[rid] = (extra, eid, t)
                    return
                body = {
                    "model": apis[0].cfg.model_name,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                if kind == "poison":
                    body.update(extra[1])
                await _client(
                    apis[i % 2].url,
                    rid,
                    body,
                    kind if kind != "burst" else "complete",
                    apis[(i + 1) % 2].url,
                    cut,
                    log,
                )

        def launch(p):
            tasks.append(asyncio.create_task(asyncio.wait_for(one(*p), 120), name=p[0]))

        async def unfinished_on(engine_id: str, streaming: bool = False) -> list[str]:
            out = []
            for rid, rec in list(log.items()):
                if rec["t1"] is None and owner_engine(await bus.owner(rid)) == engine_id:
                    evs = [e for _, e in await bus.read_req(rid)]
                    if "final" not in types(evs) and (tokens_of(evs) or not streaming):
                        out.append(rid)
            return out

        async def running_on(engine_id: str) -> None:
            # a request streaming tokens on that engine; a long filler more every second none is
            deadline = time.monotonic() + 60
            next_filler = time.monotonic() + 1.0
            while not await unfinished_on(engine_id, streaming=True):
                assert time.monotonic() < deadline, f"nothing ran on {engine_id}"
                if fillers and time.monotonic() > next_filler:
                    launch(fillers.pop())
                    next_filler = time.monotonic() + 1.0
                await asyncio.sleep(0.05)

        alive = {"A": a, "B": b}
        refusing: list[int] = []  # (non-empty while the OOM fault holds)
        ended_before_flush: dict[str, list] = {}

        async def story_of(rid: str) -> list:
            return [e for _, e in await bus.read_req(rid)] or ended_before_flush.get(rid, [])

        summary = {"stall_503": 0, "p_paused_s": 0.0}

        async def fault(name: str) -> None:
            t0 = time.monotonic()
            if name == "kill-connections":
                # every Redis connection but the test's own, a few times over
                for _ in range(3):
                    await bus.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                    await asyncio.sleep(0.05)
            elif name == "kill-engine":
                await running_on("A")
                await kill(alive.pop("A"))
            elif name == "pause-engine":
                await running_on("P")
                os.kill(proc.pid, signal.SIGSTOP)
                paused.append(proc.pid)
                # until nothing unfinished is P's: its heartbeat expired, a peer took them over
                await wait_for(
                    lambda: _none_left(unfinished_on("P"), bus, "P"), 60, "P's requests taken over"
                )
                os.kill(proc.pid, signal.SIGCONT)
                paused.clear()
                summary["p_paused_s"] = time.monotonic() - t0
            elif name == "abort-all":
                # more long requests than every live engine's seats: some run, some wait
                burst = [request(f"b{i}", "burst") for i in range(SEATS * (len(alive) + 1) + 3)]
                plan.extend(burst)
                for p in burst:
                    launch(p)
                await wait_for(
                    lambda: _running_and_queued(bus, [p[0] for p in burst]),
                    60,
                    "burst requests running and queued",
                )
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                    async with s.post(f"{apis[0].url}/v1/abort_requests", json={"abort_all": True}) as r:
                        assert r.status == 200, await r.text()
            elif name == "stall-redis":
                os.kill(redis.proc.pid, signal.SIGSTOP)
                paused.append(redis.proc.pid)
                await asyncio.sleep(STALL_S)  # (the clients' requests go on meanwhile)
                os.kill(redis.proc.pid, signal.SIGCONT)
                paused.clear()
            elif name == "oom-redis":
                # noeviction with less room than is used: every write refused with OOM
                await running_on("B")
                await bus.redis.config_set("maxmemory", 1)
                refusing.append(1)
                await asyncio.sleep(STALL_S)
                await bus.redis.config_set("maxmemory", 0)
                refusing.clear()
            elif name == "flush-redis":
                # a restart without persistence, a lost volume: every story, owner key, queued
                # entry and heartbeat gone at once, while requests stream
                await running_on("B")
                # (the stories that ended so far, kept to be checked as if it had not happened)
                for rid in [*log, *hand]:
                    evs = [e for _, e in await bus.read_req(rid)]
                    if "final" in types(evs):
                        ended_before_flush[rid] = evs
                await bus.redis.flushall()
            windows[name] = (t0, time.monotonic())

        # A hang (a fault that never returns: nothing else bounds it) prints every task's
        # awaits and the clients still waiting, and fails the test.
        watchdog = dump_tasks_after(
            150,
            "chaos with outside faults",
            lambda: (
                "clients waiting: %r" % {rid: rec["kind"] for rid, rec in log.items() if rec["t1"] is None}
            ),
        )
        t_start = time.monotonic()
        for s_i, seg in enumerate(segments):
            for p in seg:
                launch(p)
            if s_i < len(faults):
                # the fault comes once a seeded number of this segment's requests has begun
                k = rnd.randint(1, len(seg) // 2)
                await wait_for(
                    lambda seg=seg, k=k: sum(p[0] in log or p[0] in hand for p in seg) >= k,
                    60,
                    f"{k} requests of segment {s_i} begun",
                )
                await fault(faults[s_i])
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # no client hangs: each is bounded, and none ran into its bound; a hung one's story says why
        hung = {t.get_name(): r for t, r in zip(tasks, results) if isinstance(r, BaseException)}
        assert not hung, {
            rid: (
                repr(r),
                log.get(rid),
                await bus.owner(rid),
                [(eid, e.TYPE) for eid, e in await bus.read_req(rid)],
                {n: (round(w0 - t_start, 2), round(w1 - t_start, 2)) for n, (w0, w1) in windows.items()},
            )
            for rid, r in hung.items()
        } | {"pending": await bus.redis.xpending_range(keys.requests, "engines", "-", "+", 100)}
        elapsed = time.monotonic() - t_start

        # ---- every request's story
        def overlaps(rid: str, *fault_names: str) -> bool:
            for fault_name in fault_names:
                if fault_name not in windows:
                    continue
                rec = log.get(rid) or {"t0": hand[rid][2], "t1": None}
                w0, w1 = windows[fault_name]
                if rec["t0"] <= w1 and (rec["t1"] is None or rec["t1"] >= w0):
                    return True
            return False

        def before_flush(rid: str) -> bool:
            t0 = log[rid]["t0"] if rid in log else hand[rid][2]
            return "flush-redis" in windows and t0 <= windows["flush-redis"][1]

        sent = [p for p in plan if p[0] in log or p[0] in hand]
        stories = {}
        counts = dict(finals=0, aborts=0, errors=0, http_400=0, http_503=0, dead=0, lost=0, flushed=0)
        late_aborts = 0
        for rid, kind, _prompt, max_tokens, _, extra in sent:
            rec = log.get(rid)
            key_exists = await bus.redis.exists(keys.req(rid)) or rid in ended_before_flush
            if kind == "poison":
                assert not key_exists, rid  # nothing was submitted
                if rec["status"] == 503:  # (the API answers 503 before it parses while Redis fails)
                    assert overlaps(rid, *REFUSING), (rid, rec)
                    counts["http_503"] += 1
                    continue
                assert rec["status"] == 400 and rec["body"]["error"]["param"] == extra[0], (rid, rec)
                counts["http_400"] += 1
                continue
            if kind == "hand" and HAND_WRITTEN[hand[rid][0]][1] is None:
                assert not key_exists, rid  # a dead letter has no story
                continue
            if not key_exists and before_flush(rid):
                # its story went with the emptying: a client still streaming was told so
                counts["flushed"] += 1
                if rec is not None and rec["status"] == 200 and kind != "disconnect":
                    assert rec["done"], (rid, rec)
                    codes = [e.get("code") for e in rec["errors"]]
                    assert codes == ["story_lost"] or (not codes and rec["finish_reason"]), (rid, rec)
                    counts["lost"] += codes == ["story_lost"]
                continue
            if rec is not None and rec["status"] == 503:
                # refused while Redis stalled; what the API had sent may still have got through
                assert overlaps(rid, *REFUSING), (rid, rec)
                counts["http_503"] += 1
                if not key_exists:
                    continue
            evs = await story_of(rid)
            if "final" not in types(evs):
                await wait_for(lambda rid=rid: _has_final(bus, rid), 30, f"final of {rid}")
                evs = await story_of(rid)
            t = types(evs)
            assert t.count("final") == 1 and t[-1] == "final", (rid, kind, t)
            stories[rid] = evs
            final = evs[-1]
            counts["finals"] += 1
            counts["aborts"] += final.finish_reason == "abort"
            counts["errors"] += final.finish_reason == "error"
            assert final.usage["completion_tokens"] == len(tokens_of(evs)), (rid, final.usage)
            if final.finish_reason == "abort":
                assert "abort_requested" in t and t[-3:] == ["drained", "blocks_released", "final"], (rid, t)
            if kind == "hand":
                name, field = hand[rid][0], HAND_WRITTEN[hand[rid][0]][1]
                if final.finish_reason == "abort":  # it waited on P:requests when all was aborted
                    assert overlaps(rid, "abort-all"), rid
                    continue
                assert t == ["claimed", "final"] and final.finish_reason == "error", (rid, t, final)
                assert field in final.error and str(VOCAB) in final.error, final.error
                continue
            if rec["status"] != 200:
                continue  # a 503's story: only the invariants above
            if kind in ("disconnect", "abort") and final.finish_reason != "abort":
                # P steps at the model's own speed (no test delay): its 200 tokens can all be
                # out before the hang-up's or the call's abort reaches it. Then it ran to its
                # end, and the abort was published all the same (unless Redis was stalled).
                assert final.finish_reason == "length" and len(tokens_of(evs)) == max_tokens, (rid, t)
                assert rid in await _aborted(bus) or overlaps(rid, *REFUSING), (rid, kind, t)
                late_aborts += 1
                if kind == "disconnect":
                    continue
            if kind == "disconnect":
                assert final.finish_reason == "abort", (rid, final)
                continue
            if rid in ended_before_flush and [e.get("code") for e in rec["errors"]] == ["story_lost"]:
                # it had ended, but its reader had not read the end yet when it went: the client
                # was told so (what it had is a prefix of the story)
                assert rec["done"] and text_of(evs).startswith(rec["text"]), (rid, rec)
                assert overlaps(rid, "flush-redis"), (rid, rec)
                counts["lost"] += 1
                continue
            assert rec["done"] and not rec["errors"], (rid, rec)
            assert rec["finish_reason"] == final.finish_reason, (rid, rec, final)
            assert rec["text"] == text_of(evs), rid
            if kind == "burst":
                assert final.finish_reason == "abort", (rid, t)
                continue
            if kind == "abort" or final.finish_reason == "abort":
                assert final.finish_reason in ("abort", "length"), rid
                assert kind == "abort" or overlaps(rid, "abort-all"), (rid, kind, t)
                continue
            ref = refs[rid]
            assert tokens_of(evs) == ref.token_ids, (rid, t)  # no duplicate, none lost
            assert rec["text"] == ref.text, rid
            assert final.finish_reason == "length", (rid, final)

        # dead letters: exactly the hand-written entries that do not decode, nothing else
        dead = {f[b"entry_id"]: f for _, f in await bus.redis.xrange(keys.dead)}
        want = {
            eid if isinstance(eid, bytes) else str(eid).encode(): name
            for rid, (name, eid, _) in hand.items()
            if HAND_WRITTEN[name][1] is None and not before_flush(rid)  # (those went with it)
        }
        assert set(dead) == set(want), ({k: v.get(b"reason") for k, v in dead.items()}, want)
        assert all(dead[e][b"stream"] == keys.requests.encode() for e in want)
        counts["dead"] = len(dead)

        # ---- the engines: alive but A, every block back, nothing pending, nothing written late
        assert proc.poll() is None, reap(proc, 1)[1][-3000:]
        assert not b.task.done(), b.task
        await all_blocks_free(b.node, timeout=20)
        hb = await wait_for(lambda: _idle_beat(bus, "P"), 30, "P idle with every block free")
        assert (await bus.redis.xpending(keys.requests, "engines"))["pending"] == 0
        await asyncio.sleep(1.0)  # (P's late step results, if any, would land by now)
        assert {rid: await story_of(rid) for rid in stories} == stories
        assert set(windows) == set(FAULTS)
        burst_queued = sum("claimed" not in types(evs) for rid, evs in stories.items() if rid.startswith("b"))
        print(
            f"\nchaos with outside faults (seed {SEED}, faults {faults}): {len(sent)} requests "
            f"({len(log)} over HTTP, {len(hand)} by hand), {counts['finals']} finals, "
            f"{counts['aborts']} aborts ({burst_queued} of the burst never claimed), "
            f"{counts['errors']} error finals, {counts['http_503']} 503s, {counts['http_400']} 400s, "
            f"{counts['dead']} dead letters, {late_aborts} aborts after the end, {counts['flushed']} stories "
            f"emptied ({counts['lost']} clients told story_lost), 0 leaked blocks, 0 engine deaths; P paused "
            f"{summary['p_paused_s']:.1f} s, fenced {hb.get('fenced')}; B took over {b.node.taken_over}, "
            f"{b.node.redis_errors} Redis errors retried; {elapsed:.1f} s"
        )
    finally:
        if watchdog is not None:
            watchdog.cancel()
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        if refusing:
            await bus.redis.config_set("maxmemory", 0)
        for api in apis:
            await api.stop()
        await engines.stop_all()
        proc.terminate()
        rc, out = reap(proc, 30)
        if sys.exc_info()[0] is not None:  # the test failed: what P said belongs in the report
            print(f"\n=== engine P's output (exit {rc}):\n{out[-12000:]}")
        await bus.redis.aclose()
        redis.stop()
    assert rc == 0, out[-3000:]  # P drained and exited on SIGTERM: it never died of input


async def _aborted(bus) -> set[str]:
    """The request ids every ``abort`` on ``P:control`` names."""
    _, evs = await bus.read_control(b"0", None, count=100_000)
    return {rid for _, ev in evs if isinstance(ev, Abort) for rid in ev.request_ids}


async def _none_left(pending, bus, engine_id: str) -> bool:
    return not await pending and not await bus.redis.exists(bus.keys.engine(engine_id))


async def _running_and_queued(bus, rids: list[str]) -> bool:
    running = queued = False
    for rid in rids:
        t = types([e for _, e in await bus.read_req(rid)])
        running |= "tokens" in t and "final" not in t
        queued |= "accepted" in t and "claimed" not in t
    return running and queued


async def _idle_beat(bus, engine_id: str) -> dict[str, str] | None:
    hb = await _heartbeat(bus, engine_id)
    if (
        hb
        and hb.get("running") == "0"
        and hb.get("waiting") == "0"
        and hb.get("blocks_free") == hb.get("blocks_total")
    ):
        return hb
    return None


# ----------------------------------------------------------------------------- Redis's own faults

REDIS_FAULTS = ["oom", "flush", "failover"]


async def test_chaos_of_redis_itself(tmp_path, keys, tiny_model_dir, tiny_runner, tiny_tokenizer):
    """Issue 43's faults on a Redis Sentinel deployment (a primary, a replica, a sentinel;
    tests/kit/sentinel.py), each during one segment of streamed requests, in a seeded order:
    the primary refusing writes (OOM) for 2 s, the primary emptied (FLUSHALL) and an
    operator's failover to the replica (the old primary stays up, taking writes, until the
    sentinel demotes it). Two engines and two API nodes on the sentinel URL. Every client
    stream ends, either exactly the greedy reference or with one error event after a prefix of
    it (nothing repeated, nothing skipped); every story left has at most one final, last; no
    engine dies, and each gives every block back."""
    from redis.asyncio import Redis as AsyncRedis

    from fd.control.bus import Bus
    from tests.kit.sentinel import SentinelSet

    rnd = random.Random(SEED)
    sentinels = SentinelSet(str(tmp_path)).start()
    factory = lambda: connect(sentinels.url, REDIS_TIMEOUT)  # noqa: E731
    bus = Bus(connect(sentinels.url), keys)
    engines = Engines(factory, keys, tiny_model_dir, tiny_runner, tiny_tokenizer)
    apis = []
    try:
        faults = rnd.sample(REDIS_FAULTS, len(REDIS_FAULTS))
        per = max(6, N // 8)
        segments = [
            [(f"r{s_i}-{j}", f"{SHARED}{s_i} {j} and then", rnd.randint(20, 120)) for j in range(per)]
            for s_i in range(len(faults) + 1)
        ]
        llm = LLM(tiny_runner, tiny_tokenizer, enable_prefix_caching=False)
        refs = {}
        for rid, prompt, max_tokens in [p for seg in segments for p in seg]:
            (refs[rid],) = llm.generate(
                [tiny_tokenizer.encode(prompt)],
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        alive = [await engines.start(e, delay=0.02, max_num_seqs=SEATS) for e in ("A", "B")]
        for _ in range(2):
            apis.append(
                await start_api(
                    factory, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
                )
            )
        log: dict = {}
        windows: dict[str, tuple[float, float]] = {}
        tasks: list[asyncio.Task] = []

        async def client(i: int, rid: str, prompt: str, max_tokens: int) -> None:
            body = {
                "model": apis[0].cfg.model_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            await _client(apis[i % 2].url, rid, body, "complete", apis[(i + 1) % 2].url, 0, log)

        def primary() -> AsyncRedis:
            return AsyncRedis(port=sentinels.primary_port(), socket_timeout=5)

        async def fault(name: str) -> None:
            t0 = time.monotonic()
            if name == "oom":
                p = primary()
                await p.config_set("maxmemory", 1)
                await asyncio.sleep(STALL_S)
                await p.config_set("maxmemory", 0)
                await p.aclose()
            elif name == "flush":
                p = primary()
                await p.flushall()
                await p.aclose()
            else:
                sentinels.failover()
                await asyncio.to_thread(sentinels.wait_promoted)
                # (clients follow the new primary within a second or two of the switch: till
                # then, what they write to the old one, still up, is lost with it)
                windows[name] = (t0, time.monotonic() + 3.0)
                return
            windows[name] = (t0, time.monotonic())

        watchdog = dump_tasks_after(
            150,
            "chaos of Redis itself",
            lambda: "clients waiting: %r" % [rid for rid, rec in log.items() if rec["t1"] is None],
        )
        t_start = time.monotonic()
        n = 0
        try:
            for s_i, seg in enumerate(segments):
                for rid, prompt, max_tokens in seg:
                    tasks.append(
                        asyncio.create_task(
                            asyncio.wait_for(client(n, rid, prompt, max_tokens), 120), name=rid
                        )
                    )
                    n += 1
                if s_i < len(faults):
                    await wait_for(
                        lambda seg=seg: (
                            sum(
                                r in log and (log[r]["text"] != "" or log[r]["t1"] is not None)
                                for r, _, _ in seg
                            )
                            >= len(seg) // 2
                        ),
                        60,
                        f"half of segment {s_i} streaming (or ended)",
                    )
                    await fault(faults[s_i])
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            watchdog.cancel()
        hung = {t.get_name(): r for t, r in zip(tasks, results) if isinstance(r, BaseException)}
        if hung:  # where each hung request stands: its story, its owner, each engine's view
            where = {}
            for rid in hung:
                evs = await bus.read_req(rid)
                where[rid] = {
                    "story": [
                        (
                            eid,
                            e.TYPE,
                            getattr(e, "engine", None) or getattr(e, "source", None),
                            len(getattr(e, "token_ids", ())),
                        )
                        for eid, e in evs
                    ],
                    "owner": await bus.redis.get(keys.owner(rid)),
                    "known_by": [eng.node.id for eng in alive if eng.node.sched.knows(rid)],
                    "at": round(log[rid]["t0"] - t_start, 2) if rid in log else None,
                }
            where["faults"] = {
                n: (round(w0 - t_start, 2), round(w1 - t_start, 2)) for n, (w0, w1) in windows.items()
            }
            where["heartbeats"] = {e: await _heartbeat(bus, e) for e in ("A", "B")}
            print(f"\n=== hung clients: {where}")
            assert not hung, ({rid: (repr(r), log.get(rid)) for rid, r in hung.items()}, where)
        elapsed = time.monotonic() - t_start

        def overlaps(rid: str, *names: str) -> bool:
            rec = log[rid]
            rec["faults"] = {
                n: (round(w0 - t_start, 2), round(w1 - t_start, 2)) for n, (w0, w1) in windows.items()
            }
            rec["at"] = (round(rec["t0"] - t_start, 2), round(rec["t1"] - t_start, 2))
            return any(
                name in windows and rec["t0"] <= windows[name][1] and rec["t1"] >= windows[name][0]
                for name in names
            )

        counts = dict(exact=0, errors=0, lost=0, http_503=0)
        for rid, rec in log.items():
            if rec["status"] == 503:
                assert overlaps(rid, "oom", "failover"), (rid, rec)
                counts["http_503"] += 1
                continue
            assert rec["status"] == 200 and rec["done"], (rid, rec)  # ended, with [DONE]
            ref = refs[rid]
            if not rec["errors"]:
                assert rec["text"] == ref.text and rec["finish_reason"] == "length", (rid, rec)
                counts["exact"] += 1
                continue
            # one error, after a prefix of the reference: nothing repeated, nothing skipped
            assert len(rec["errors"]) == 1, (rid, rec)
            assert ref.text.startswith(rec["text"].rstrip("\ufffd")), (rid, rec["text"], ref.text)
            code = rec["errors"][0].get("code")
            if code == "story_lost":
                assert overlaps(rid, "flush", "failover"), (rid, rec)
                counts["lost"] += 1
            else:
                assert overlaps(rid, "failover", "oom"), (rid, rec)
                counts["errors"] += 1
        for rid in log:
            t = types([e for _, e in await bus.read_req(rid)])
            assert t.count("final") <= 1 and (not t.count("final") or t[-1] == "final"), (rid, t)
        for eng in alive:
            assert not eng.task.done(), eng.task
            await all_blocks_free(eng.node, timeout=30)
        print(
            f"\nchaos of Redis itself (seed {SEED}, faults {faults}): {len(log)} streamed requests over "
            f"2 API nodes and 2 engines on a Sentinel deployment; {counts['exact']} exact, "
            f"{counts['errors']} ended with an engine error, {counts['lost']} with story_lost, "
            f"{counts['http_503']} 503s; 0 hung, 0 after a final, 0 duplicated, 0 engine deaths, "
            f"0 leaked blocks; {sum(e.node.redis_errors for e in alive)} Redis errors ridden out; "
            f"{elapsed:.1f} s"
        )
    finally:
        for api in apis:
            await api.stop()
        await engines.stop_all()
        await bus.redis.aclose()
        sentinels.stop()
