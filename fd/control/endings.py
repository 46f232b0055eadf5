"""Every way a request's story ends, built in one place: a finish (``blocks_released`` then
``final``), an abort (``abort_requested`` → ``drained`` → ``blocks_released`` → ``final``,
DESIGN.md §4), the tombstone's story of a request no engine ran, an error, and a timeout.

The same endings are written by several parties — the scheduler, an engine that takes over a
request whose abort is half told, an engine or the API that wins a tombstone's story
(fd/control/ownership.py, fd/control/bus.py), ``fd replay``'s checker reading them back — and each
must write them alike: the stages in the protocol's order, one ``final``, the usage shaped as
OpenAI's. Pure values only: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection

from fd.control.events import AbortRequested, BlocksReleased, Drained, Event, Final, JsonObject

#: The events of an ending by their type, as stories and journal digests name them.
ABORT_REQUESTED = AbortRequested.TYPE
DRAINED = Drained.TYPE
BLOCKS_RELEASED = BlocksReleased.TYPE
FINAL = Final.TYPE  # what ends a story: nothing follows it
#: The abort's stages before its ``final``, in the protocol's order.
ABORT_STAGES = (ABORT_REQUESTED, DRAINED, BLOCKS_RELEASED)


def usage(prompt_tokens: int, completion_tokens: int) -> JsonObject:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def final(
    request_id: str,
    reason: str,
    used: JsonObject,
    stop: str | int | None = None,
    error: str | None = None,
    step: int = 0,
) -> Final:
    """A request's one ``final``; ``stop``: the stop string, or the stop token (an int) that
    ended it; ``error``: why it failed (``finish_reason`` "error")."""
    if isinstance(stop, int):  # (stop_reason is a string on the wire: the token rides apart too)
        return Final(
            request_id=request_id,
            finish_reason=reason,
            usage=used,
            stop_reason=str(stop),
            stop_token=stop,
            step=step,
        )
    return Final(
        request_id=request_id, finish_reason=reason, usage=used, stop_reason=stop, error=error, step=step
    )


def error_final(request_id: str, used: JsonObject, error: str, step: int = 0) -> Final:
    """A request that ends with an error before (or instead of) running."""
    return Final(request_id=request_id, finish_reason="error", usage=used, error=error, step=step)


def release(
    request_id: str,
    count: int,
    step: int,
    reason: str,
    used: JsonObject,
    stop: str | int | None = None,
    error: str | None = None,
) -> list[Event]:
    """The end of a request that held blocks: they go back, it says so, then its ``final``."""
    return [
        BlocksReleased(request_id=request_id, count=count, step=step),
        final(request_id, reason, used, stop, error),
    ]


def abort_requested(request_id: str, source: str, step: int) -> AbortRequested:
    """Stage 1: the request is no longer scheduled."""
    return AbortRequested(request_id=request_id, source=source, step=step)


def drained(request_id: str, step: int, discarded_tokens: int = 0) -> Drained:
    """Stage 2: no step in flight can still write its blocks."""
    return Drained(request_id=request_id, step=step, discarded_tokens=discarded_tokens)


def abort_story(
    request_id: str,
    source: str,
    used: JsonObject,
    step: int = 0,
    engine: str = "",
    noted: Collection[str] = (),
    error: str | None = None,
) -> list[Event]:
    """The whole abort story of a request that holds no blocks here: each stage not already
    on its stream (``noted``: their types, the stages a previous owner wrote), then its
    ``final`` (``finish_reason=error`` saying ``error`` where the abort was a failure)."""
    evs: list[Event] = []
    if ABORT_REQUESTED not in noted:
        evs.append(AbortRequested(request_id=request_id, source=source, step=step, engine=engine))
    if DRAINED not in noted:
        evs.append(Drained(request_id=request_id, step=step, engine=engine))
    if BLOCKS_RELEASED not in noted:
        evs.append(BlocksReleased(request_id=request_id, count=0, step=step, engine=engine))
    reason = "abort" if error is None else "error"
    evs.append(
        Final(request_id=request_id, finish_reason=reason, usage=used, step=step, engine=engine, error=error)
    )
    return evs


def tombstone_story(request_id: str, source: str, engine: str = "") -> list[Event]:
    """The abort story of a request no engine ever ran: nothing to drain, no blocks."""
    return abort_story(request_id, source, usage(0, 0), engine=engine)


def timeout_error(timeout_s: float) -> str:
    """Why the watchdog ended a request (``source=timeout``): its ``final`` is an error, not
    an abort."""
    return f"no progress for {timeout_s:g} s (request timeout)"
