"""Helpers for tests that run real engine nodes: a gated runner that holds a step in flight
until the test lets it finish, and readers of a request's story on its stream."""

from __future__ import annotations

import asyncio
import threading
import time

from fd.control.bus import Bus
from fd.control.events import Accepted, Final, Request, Tokens
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.runner.runners import InProcessRunner


class GatedRunner(InProcessRunner):
    """Wraps a real runner. While the gate is closed, ``execute`` blocks inside the step, so a
    test can land an abort while a step is genuinely in flight. Records every batch it ran."""

    def __init__(self, inner):
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.eos_token_ids = inner.eos_token_ids
        self.max_model_len = inner.max_model_len
        self.batches: list[SchedulerOutput] = []
        self._gate = threading.Event()
        self._gate.set()
        self.held: SchedulerOutput | None = None  # the step blocked at the gate right now
        self.steps_done = 0

    def close(self) -> None:
        self._gate.clear()

    def open(self) -> None:
        self._gate.set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.batches.append(out)
        if not self._gate.is_set():
            self.held = out
        self._gate.wait(timeout=30)
        self.held = None
        res = self.inner.execute(out)
        self.steps_done += 1
        return res

    async def wait_entered(self, pred=lambda out: True, timeout: float = 10.0) -> SchedulerOutput:
        """Wait until a step matching ``pred`` is in flight (blocked at the gate)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = self.held
            if held is not None and pred(held):
                return held
            await asyncio.sleep(0.002)
        raise AssertionError("no matching step entered in time")

    def scheduled_ids(self) -> set[str]:
        return {s.request_id for out in self.batches for s in out.seqs}


def _pair(rid: str, prompt: list[int], **sampling) -> tuple[Request, Accepted]:
    sp = SamplingParams(**{"temperature": 0.0, **sampling})
    return (
        Request(request_id=rid, data=RequestData(prompt_token_ids=tuple(prompt), sampling=sp)),
        Accepted(request_id=rid, prompt_tokens=len(prompt), endpoint="completion"),
    )


async def submit(bus: Bus, rid: str, prompt: list[int], **sampling) -> None:
    await bus.submit(*_pair(rid, prompt, **sampling))


async def submit_together(bus: Bus, reqs: list[tuple[str, list[int], dict]]) -> None:
    """Several requests in one round trip, so one engine claim sees them all at once."""
    items = []
    for rid, prompt, sampling in reqs:
        req, acc = _pair(rid, prompt, **sampling)
        items += [(bus.keys.req(rid), acc), (bus.keys.requests, req)]
    await bus.publish_many(items)


async def story(bus: Bus, rid: str, timeout: float = 15.0, until=Final) -> list:
    """The request's events once one of type ``until`` is on its stream."""
    deadline = time.monotonic() + timeout
    while True:
        evs = [ev for _, ev in await bus.read_req(rid)]
        if any(isinstance(e, until) for e in evs):
            return evs
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid}: no {until.__name__} in time; story so far: {[e.TYPE for e in evs]}")
        await asyncio.sleep(0.005)


def types(evs) -> list[str]:
    return [e.TYPE for e in evs]


def tokens_of(evs) -> list[int]:
    return [t for e in evs if isinstance(e, Tokens) for t in e.token_ids]


def text_of(evs) -> str:
    return "".join(e.text for e in evs if isinstance(e, Tokens))


def prefix_logits(runner, tokens: list[int]):
    """The model's logits after ``tokens`` (float64): one prefill in scratch blocks from 0 up,
    for a reference computed from the model itself (the runner must be idle)."""
    from fd.engine.core.outputs import ScheduledSeq

    table = tuple(range(-(-len(tokens) // runner.block_size)))
    seq = ScheduledSeq("ref", tuple(tokens), 0, table, True, SamplingParams(temperature=0.0), 0)
    return runner.logits(SchedulerOutput(step=-1, seqs=(seq,)))[0].astype("float64")
