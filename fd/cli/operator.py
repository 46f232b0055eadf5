"""The operator's commands against a running control plane: ``fd abort``, ``fd status`` and
``fd trace``. They import ``control`` only, so none of them loads PaddlePaddle."""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Any

import orjson

from fd.cli.local_serve import LocalServe
from fd.control.keys import GROUP_ENGINES, Keys


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
    _print_json_or(args, obj, "\n".join(lines))
    return 0


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
