"""The operator's commands against a running control plane: ``fd abort``, ``fd status`` and
``fd trace``. They import ``control`` only, so none of them loads PaddlePaddle."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import sys
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from fd.cli.local_serve import LocalServe
from fd.control.events import LifecycleEvent, json_fields
from fd.control.keys import GROUP_ENGINES, Keys

if TYPE_CHECKING:
    from fd.control.bus import Bus

#: BLOCK of ``fd status --watch``'s reads (within the socket timeout, which is at least 2 s)
WATCH_BLOCK_MS = 1000


def _lora_status(heartbeat: dict) -> str:
    from fd.control.bus import Bus

    ready, errors = Bus.lora_state(heartbeat)
    return (f", LoRA adapters {','.join(sorted(ready))}" if ready else "") + (
        f", LoRA loads failed {errors}" if errors else ""
    )


def _print_json_or(args: argparse.Namespace, obj: Any, text: str) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)


def need_url(args: argparse.Namespace) -> str:
    """``--redis-url`` (or ``FD_REDIS_URL``), else a local ``fd serve``'s (fd.cli.local_serve)."""
    url = args.redis_url or LocalServe(args.prefix).redis_url()
    if not url:
        raise SystemExit(
            "error: --redis-url (or FD_REDIS_URL) is required for this command: no fd serve with "
            f"key prefix {args.prefix!r} is running on this machine"
        )
    return url


async def cmd_abort(args: argparse.Namespace) -> int:
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.events import Abort, AbortAll
    from fd.control.keys import valid_request_id

    bus = Bus(connect(need_url(args), args.redis_timeout), Keys(args.prefix))
    abort_id = f"abort-{secrets.token_hex(6)}"
    if args.all:
        ev = AbortAll(source="cli", abort_id=abort_id, engine=args.engine)
        ids: list[str] = []
    else:
        if not args.ids:
            raise SystemExit("error: give request ids or --all")
        bad = [i for i in args.ids if not valid_request_id(i)]
        if bad:
            raise SystemExit(f"error: invalid request id(s): {', '.join(bad)}")
        ids = list(args.ids)
        ev = Abort(request_ids=tuple(ids), source="cli", abort_id=abort_id)
    entry = await bus.publish(bus.keys.control, ev)
    await bus.redis.aclose()
    _print_json_or(
        args,
        {"abort_id": abort_id, "entry_id": entry.decode(), "accepted": ids, "abort_all": bool(args.all)},
        f"abort {abort_id} published ({'all' if args.all else ', '.join(ids)})",
    )
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    from fd.control.bus import Bus
    from fd.control.connect import connect

    bus = Bus(connect(need_url(args), args.redis_timeout), Keys(args.prefix))
    engines = await bus.engines()
    r = bus.redis
    lens = {}
    for name in (bus.keys.requests, bus.keys.control, bus.keys.dead):
        lens[name] = await r.xlen(name)
    pending = 0
    try:
        info = await r.xpending(bus.keys.requests, GROUP_ENGINES)
        pending = int(info["pending"])
    except Exception:
        pass
    if not args.watch:
        await r.aclose()
    obj = {"engines": engines, "streams": lens, "requests_pending": pending}
    lines = [f"engines alive: {len(engines)}"]
    for eid, h in sorted(engines.items()):
        lines.append(
            f"  {eid}: blocks {h.get('blocks_free')}/{h.get('blocks_total')} free, "
            f"running {h.get('running')}, waiting {h.get('waiting')}, step {h.get('step')}" + _lora_status(h)
        )
    lines += [f"{k}: {v} entries" for k, v in lens.items()]
    lines.append(f"requests claimed but not finished: {pending}")
    if args.watch and args.json:  # one JSON object a line, the status's first
        sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    else:
        _print_json_or(args, obj, "\n".join(lines))
    if args.watch:
        sys.stdout.flush()
        try:
            await until_interrupted(watch_lifecycle(bus, args.json, sys.stdout))
        finally:
            await r.aclose()
    return 0


def _clock(ts_ms: int) -> str:
    """An event's ``ts`` as local wall-clock time, to the millisecond."""
    return time.strftime("%H:%M:%S", time.localtime(ts_ms // 1000)) + f".{ts_ms % 1000:03d}"


def lifecycle_line(ev: LifecycleEvent) -> str:
    """One ``P:lifecycle`` event as ``fd status --watch`` prints it."""
    from fd.control.events import EngineLoad, FirstToken, RequestAccepted, RequestClaimed, RequestFinished

    head = f"{_clock(ev.ts)} {ev.TYPE}"
    if isinstance(ev, EngineLoad):
        return (
            f"{head} {ev.engine or '?'} step {ev.step} running {ev.running} waiting {ev.waiting} "
            f"blocks {ev.blocks_free}/{ev.blocks_total} prefix {ev.prefix_blocks}"
        )
    if isinstance(ev, RequestAccepted):
        return f"{head} {ev.request_id} via {ev.api or '?'} ({ev.endpoint or '?'}, {ev.prompt_tokens} prompt tokens)"
    if isinstance(ev, RequestClaimed):
        attempt = f" (attempt {ev.attempt})" if ev.attempt is not None else ""
        return f"{head} {ev.request_id} by {ev.engine or '?'}{attempt}"
    if isinstance(ev, FirstToken):
        return f"{head} {ev.request_id} on {ev.engine or '?'}"
    if isinstance(ev, RequestFinished):
        return (
            f"{head} {ev.request_id} on {ev.engine or '?'}: {ev.finish_reason or '?'}, "
            f"{ev.prompt_tokens}+{ev.completion_tokens} tokens"
        )
    # (a type this release does not format: its fields as they are)
    return head + "".join(f" {k}={v}" for k, v in ev.encode().items() if k not in ("type", "v", "ts"))


async def watch_lifecycle(bus: Bus, as_json: bool, out: TextIO) -> None:
    """``P:lifecycle`` from now on, one line an event (``as_json``: the entry id and the event's
    fields as one JSON object), until cancelled. It says on stderr once it is reading, so that
    what is written after that line is seen."""
    to_json = json_fields if as_json else None  # (the SSE route's JSON, field for field)
    cursor, batch = await bus.read_lifecycle("$", None)  # ("$" resolved now, not at the first event)
    print(f"watching {bus.keys.lifecycle} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    while True:
        for eid, ev in batch:
            if to_json is not None:
                out.write(orjson.dumps({"id": eid.decode(), **to_json(ev)}).decode() + "\n")
            else:
                out.write(lifecycle_line(ev) + "\n")
        if batch:
            out.flush()
        cursor, batch = await bus.read_lifecycle(cursor, WATCH_BLOCK_MS)


async def until_interrupted(work: Awaitable[None]) -> None:
    """``work`` until it ends, or until Ctrl-C (SIGINT) or SIGTERM, which end it quietly: a
    watch that is stopped has done what it was for. (asyncio.Runner's own Ctrl-C would end the
    command as interrupted, exit 130.) Its error, if it fails, is raised."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    caught = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # (not the main thread)
            loop.add_signal_handler(sig, stop.set)
            caught.append(sig)
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in caught:
            loop.remove_signal_handler(sig)
        # (a blocking read cancelled here closes its connection: the process is leaving)
        for t in (task, stopped):
            t.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    if task.done() and not task.cancelled():
        task.result()


async def cmd_trace(args: argparse.Namespace) -> int:
    from fd.control.bus import Bus
    from fd.control.connect import connect
    from fd.control.events import Accepted, Tokens
    from fd.control.keys import choice_ids

    bus = Bus(connect(need_url(args), args.redis_timeout), Keys(args.prefix))
    try:
        entries = await bus.read_req(args.request_id)
        if not entries:
            print(f"no events for request {args.request_id}", file=sys.stderr)
            return 1
        # a response of n choices: its story is one `accepted`; each choice's follows it
        stories = [(args.request_id, entries)]
        first = entries[0][1]
        if isinstance(first, Accepted) and first.choices and first.choices > 1:
            for rid in choice_ids(args.request_id, first.choices):
                stories.append((rid, await bus.read_req(rid)))
    finally:
        await bus.redis.aclose()
    t0 = entries[0][1].ts
    rows, lines = [], []
    for rid, story in stories:
        if rid != args.request_id:
            lines.append(f"-- {rid}")
        ntok = 0
        for eid, ev in story:
            if isinstance(ev, Tokens):
                ntok += len(ev.token_ids)
            d = {k: v for k, v in ev.encode().items() if k not in ("v", "ts", "request_id")}
            r = {"request_id": rid, "id": eid.decode(), "ms": ev.ts - t0, "tokens_so_far": ntok, **d}
            rows.append(r)
            lines.append(
                f"{r['ms']:>7} ms  {r['type']:<16} tokens={r['tokens_so_far']:<5} "
                + " ".join(
                    f"{k}={v}"
                    for k, v in r.items()
                    if k not in ("request_id", "id", "ms", "type", "tokens_so_far")
                )
            )
    _print_json_or(args, rows, "\n".join(lines))
    return 0
