"""``fd status --watch`` as an operator runs it: a real process following a real redis-server's
``P:lifecycle`` until Ctrl-C, which ends it with exit status 0."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import pytest

from fd.cli.operator import lifecycle_line
from fd.control.events import (
    EngineLoad,
    FirstToken,
    RequestAccepted,
    RequestClaimed,
    RequestFinished,
    json_fields,
)

TS = 1_700_000_000_123
EVENTS = [
    RequestAccepted(request_id="r-1", api="a1", endpoint="completion", prompt_tokens=5, ts=TS),
    RequestClaimed(request_id="r-1", engine="e1", attempt=1, ts=TS + 1),
    EngineLoad(
        engine="e1", step=3, running=1, waiting=0, blocks_free=30, blocks_total=32, prefix_blocks=2, ts=TS + 2
    ),
    FirstToken(request_id="r-1", engine="e1", ts=TS + 3),
    RequestFinished(
        request_id="r-1", engine="e1", finish_reason="stop", prompt_tokens=5, completion_tokens=7, ts=TS + 4
    ),
]
START_S = 120.0  # a fresh interpreter importing fd, on two CPUs shared with others


async def readline(stream: asyncio.StreamReader, timeout: float = 30.0) -> str:
    async with asyncio.timeout(timeout):
        line = await stream.readline()
    assert line, "the command's output ended"
    return line.decode().rstrip("\n")


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_fd_status_watch_prints_each_event_until_ctrl_c(real_bus, redis_server, keys, as_json):
    await real_bus.publish(keys.lifecycle, EngineLoad(engine="before", ts=TS))  # (not shown)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "fd", "status", "--watch", "--redis-url", redis_server.url, "--prefix", keys.prefix),
        *(["--json"] if as_json else []),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # it says on stderr once it reads: what is published from then on is shown
        assert (await readline(proc.stderr, START_S)).startswith(f"watching {keys.lifecycle}")
        ids = [(await real_bus.publish(keys.lifecycle, ev)).decode() for ev in EVENTS]
        status = [await readline(proc.stdout)]
        if as_json:
            assert set(json.loads(status[0])) == {"engines", "streams", "requests_pending"}
        else:
            while status[-1] != "requests claimed but not finished: 0":
                status.append(await readline(proc.stdout))
            assert status[0] == "engines alive: 0"
        lines = [await readline(proc.stdout) for _ in EVENTS]
        if as_json:
            got = [json.loads(line) for line in lines]
            assert got == [{"id": i, **json_fields(ev)} for i, ev in zip(ids, EVENTS, strict=True)]
            assert got[2]["blocks_free"] == 30  # (a number, not its text)
        else:
            assert lines == [lifecycle_line(ev) for ev in EVENTS]
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert out == b"" and b"Traceback" not in err, (out, err)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
