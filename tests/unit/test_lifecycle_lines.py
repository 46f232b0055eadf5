"""``fd status --watch``'s line for each lifecycle event: what an operator reads."""

from __future__ import annotations

import datetime

from fd.cli.operator import lifecycle_line
from fd.control.events import EngineLoad, FirstToken, RequestAccepted, RequestClaimed, RequestFinished

TS = 1_700_000_001_234


def clock(ts_ms: int) -> str:
    """The local wall-clock time of ``ts_ms``, to the millisecond."""
    return datetime.datetime.fromtimestamp(ts_ms / 1000).strftime("%H:%M:%S.%f")[:-3]


def test_each_lifecycle_event_is_one_readable_line():
    at = clock(TS)
    assert lifecycle_line(
        EngineLoad(
            engine="e1",
            step=812,
            running=8,
            waiting=2,
            blocks_free=100,
            blocks_total=512,
            prefix_blocks=40,
            ts=TS,
        )
    ) == (f"{at} engine_load e1 step 812 running 8 waiting 2 blocks 100/512 prefix 40")
    assert (
        lifecycle_line(
            RequestAccepted(request_id="r-123", api="a1", endpoint="chat", prompt_tokens=64, ts=TS)
        )
        == f"{at} request_accepted r-123 via a1 (chat, 64 prompt tokens)"
    )
    assert (
        lifecycle_line(RequestClaimed(request_id="r-123", engine="e1", attempt=1, ts=TS))
        == f"{at} request_claimed r-123 by e1 (attempt 1)"
    )
    assert (
        lifecycle_line(FirstToken(request_id="r-123", engine="e1", ts=TS)) == f"{at} first_token r-123 on e1"
    )
    assert (
        lifecycle_line(
            RequestFinished(
                request_id="r-123",
                engine="e1",
                finish_reason="length",
                prompt_tokens=64,
                completion_tokens=128,
                ts=TS,
            )
        )
        == f"{at} request_finished r-123 on e1: length, 64+128 tokens"
    )


def test_what_an_event_leaves_unset_reads_as_unknown_not_as_a_blank():
    # (an event typed by hand with redis-cli may name no engine, and a claim no attempt)
    assert lifecycle_line(RequestClaimed(request_id="r-1", ts=TS)) == f"{clock(TS)} request_claimed r-1 by ?"
    assert lifecycle_line(FirstToken(request_id="r-1", ts=TS)).endswith("first_token r-1 on ?")


def test_the_clock_keeps_the_milliseconds_of_a_second_boundary():
    assert lifecycle_line(FirstToken(request_id="r", engine="e", ts=1_700_000_002_000)).startswith(
        clock(1_700_000_002_000)
    )
    assert clock(1_700_000_002_000).endswith(".000")
