"""The engine core (fd/engine/node/engine_core.py): the one owner of the scheduler. What comes
in (runner replies, arrivals, aborts) waits in its inboxes and is applied at one point of a
step, in one order; then the next step is decided and handed to the runner. No Redis: a driver
that records what it is handed, and the fake runner of tests/kit/scheduler.py."""

from __future__ import annotations

import asyncio
from typing import Any

from fd.control.events import AbortRequested, BlocksReleased, Event, Final, Tokens
from fd.engine.core.outputs import SchedulerOutput
from fd.engine.node.engine_core import EngineCore
from fd.engine.node.request_table import RequestTable
from fd.engine.node.step_driver import StepFailed
from fd.engine.runner.runners import Skipped
from tests.kit.scheduler import make, req


class Driver:
    """What the core hands the runner: steps, and requests to leave out of queued ones."""

    def start(self, loop: object, reply: object) -> None:
        pass

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []
        self.drops: list[tuple[int, list[str]]] = []

    def submit(self, out: SchedulerOutput) -> None:
        self.steps.append(out)

    def drop(self, step: int, rids: list[str]) -> None:
        self.drops.append((step, rids))


def core(depth: int = 2) -> tuple[EngineCore, Driver, Any, list[Event], list[str]]:
    sched, runner = make(max_steps_in_flight=depth)
    driver = Driver()
    events: list[Event] = []
    counted: list[str] = []
    c = EngineCore(
        sched,
        driver,
        RequestTable(),
        lambda evs, *rest: events.extend(evs),
        counted.append,
        lambda: None,
        asyncio.Event(),
    )
    return c, driver, runner, events, counted


def kinds(evs: list[Event], rid: str) -> list[str]:
    return [type(e).__name__ for e in evs if e.request_id == rid]  # type: ignore[attr-defined]


def test_an_arrival_joins_the_scheduler_at_the_next_step_and_is_known_before():
    c, driver, _, _, _ = core()
    c.arrive("a", req(4))
    assert c.knows("a") and not c.sched.knows("a") and c.has_work()
    assert c.can_admit() == c.sched.can_admit() - 1  # (an arrival takes its room already)
    assert c.step(ahead=2).decided
    assert c.sched.knows("a") and [ss.request_id for ss in driver.steps[0].seqs] == ["a"]


def test_an_arrival_whose_claimed_is_not_out_waits_and_so_does_its_abort():
    c, driver, _, events, _ = core()
    c.requests.unannounced.add("a")  # its `claimed` not published yet
    c.arrive("a", req(4))
    c.abort("a", "http")
    assert not c.step(ahead=2).decided and not driver.steps  # no step runs it before that
    assert c.knows("a") and c.aborts_pending
    c.requests.unannounced.clear()  # (the publisher's flush)
    c.step(ahead=2)
    assert kinds(events, "a") == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert not driver.steps  # aborted before any step ran it


def test_an_abort_of_a_request_in_flight_is_dropped_in_the_runner_and_released_after_its_step():
    c, driver, runner, events, counted = core()
    c.arrive("a", req(4, max_tokens=50))
    c.step(ahead=2)  # the prefill: running
    c.step(ahead=2)  # the first decode, queued behind it
    assert len(c.flying) == 2
    c.abort("a", "disconnect")
    assert not any(isinstance(e, AbortRequested) for e in events)  # (applied at the step)
    c.step(ahead=2)
    assert kinds(events, "a") == ["AbortRequested"]
    assert driver.drops == [(c.sched.step, ["a"])] and counted == ["disconnect"]
    # The runner left it out of the queued step: its blocks come back after the running one.
    first, second = driver.steps
    c.reply(Skipped(second.step, ("a",)))
    c.reply(runner.run(first))
    c.step(ahead=2)
    assert kinds(events, "a") == ["AbortRequested", "Drained", "BlocksReleased", "Final"]
    assert c.sched.num_free_blocks == c.sched.num_total_blocks


def test_replies_are_folded_in_order_and_the_next_step_is_decided_in_the_same_step():
    c, driver, runner, events, _ = core()
    c.arrive("a", req(4, max_tokens=3))
    c.step(ahead=2)
    c.step(ahead=2)
    for _ in range(10):
        if not c.flying:
            break
        c.reply(runner.run(driver.steps[c.steps]))
        c.step(ahead=2)
    toks = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert len(toks) == 3 and isinstance(events[-1], Final) and events[-1].finish_reason == "length"
    assert c.steps == len(driver.steps) and not c.flying
    assert any(isinstance(e, BlocksReleased) for e in events)


def test_a_failed_step_is_raised_at_the_next_step():
    c, _, _, _, _ = core()
    c.arrive("a", req(4))
    c.step(ahead=2)
    c.reply(StepFailed(BrokenPipeError("the worker died")))
    try:
        c.step(ahead=2)
    except BrokenPipeError:
        pass
    else:
        raise AssertionError("a dead worker must end the engine's loop")


def test_a_drain_hands_back_only_with_no_step_in_flight_and_says_what_each_released():
    c, driver, runner, events, _ = core()
    c.arrive("a", req(4, max_tokens=50))
    c.step(ahead=1)
    asked: list[int] = []

    def due() -> list[str]:
        asked.append(1)
        return ["a"]

    c.step(ahead=1, drain=due)
    assert not asked  # a step in flight: not now
    c.reply(runner.run(driver.steps[0]))
    stepped = c.step(ahead=0, drain=due)
    assert asked and stepped.handed_back == {"a": 1} and not c.sched.knows("a")
    assert c.sched.num_free_blocks == c.sched.num_total_blocks
