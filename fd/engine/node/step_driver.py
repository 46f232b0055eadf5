"""How the engine node's steps reach its runner and their results come back, for the runner's
kind (fd/engine/runner/runners.py), chosen once when the driver is made.

- A pipelined runner (the model worker process) takes each step down its pipe the moment it
  is decided, so it starts as soon as the one before it ends, and its replies are read by the
  node's own event loop when the pipe is readable (``add_reader``): no thread to wake and hand
  the GIL back and forth with (that hand-off cost up to ~2 ms a step on a busy box, between the
  worker's end of a step and the loop). An abort reaches it at once (:meth:`StepDriver.drop`).
- An in-process runner computes each step on the step thread, one at a time, and one that
  raises fails each of its requests, not the engine.

Either way each reply (a step's result, a ``Skipped`` note, or a failure) goes to ``reply``
(fd/engine/node/engine_core.py's inbox) in the order the runner sent it; the engine's loop
applies it at its next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.runner.runners import InProcessRunner, LoraDone, PipelinedRunner, Runner, Skipped

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


@dataclass(frozen=True, slots=True)
class StepFailed:
    """A step whose result never comes: the worker died, or its pipe broke."""

    error: BaseException


class StepDriver:
    def __init__(
        self,
        runner: Runner,
        engine_id: str,
        pool: ThreadPoolExecutor,
        lora_done: Callable[[str, str | None], None],
    ) -> None:
        self.runner = runner
        self.engine_id = engine_id
        self.lora_done = lora_done  # a pipelined runner's answer to a LoRA load
        # The step thread: an in-process runner's steps, and its LoRA loads between them.
        self.pool = pool
        #: the runner's word on a step, in order (EngineCore.reply, given at start)
        self.reply: Callable[[RunnerOutput | Skipped | StepFailed], None] = lambda _: None
        self._reader_fd: int | None = None  # a pipelined runner's pipe, read by the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0  # a pipelined runner's steps whose results are not in

    def start(
        self, loop: asyncio.AbstractEventLoop, reply: Callable[[RunnerOutput | Skipped | StepFailed], None]
    ) -> None:
        self._loop = loop
        self.reply = reply
        runner = self.runner
        if runner.pipelined:
            self._reader_fd = runner.fileno()
            loop.add_reader(self._reader_fd, self._on_replies)

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stop_reading(loop)
        self.pool.shutdown(wait=True)

    def _stop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._reader_fd is not None:
            loop.remove_reader(self._reader_fd)
            self._reader_fd = None

    def submit(self, out: SchedulerOutput) -> None:
        """Start a step; its result comes back, in order, through ``reply``."""
        runner = self.runner
        if runner.pipelined:
            self._due += 1
            try:
                runner.submit(out)
            except OSError as e:  # the worker is gone
                self._fail(e)
            return
        loop = self._loop
        assert loop is not None, "StepDriver.start first"
        work = self.pool.submit(self._execute, runner, out)

        def done(work: Future[RunnerOutput]) -> None:  # on the step thread
            e = None if work.cancelled() else work.exception()
            reply = StepFailed(e) if e is not None else None if work.cancelled() else work.result()
            if reply is None:
                return
            try:
                loop.call_soon_threadsafe(self.reply, reply)
            except RuntimeError:
                pass  # the loop is closed: the engine stopped

        work.add_done_callback(done)

    def drop(self, step: int, request_ids: list[str]) -> None:
        """Aborting requests that steps up to ``step`` hold: a pipelined runner leaves them out
        of the steps it has not started and says so (``Skipped``). An in-process runner has
        no step queued behind the running one to leave them out of."""
        runner = self.runner
        if runner.pipelined:
            try:
                runner.drop(step, request_ids)
            except OSError:
                pass  # the worker is gone: its step results say so

    def _execute(self, runner: InProcessRunner, out: SchedulerOutput) -> RunnerOutput:
        """An in-process runner's step (on the step thread). One that raises fails each of its
        requests, not the engine: this runner could not tell whose share broke it (the model
        runner can, and fails only that one: ``ModelRunner.execute``)."""
        try:
            return runner.execute(out)
        except Exception as e:  # noqa: BLE001 - said on each request's stream, in its final
            log.exception("step %d failed", out.step, extra={"engine": self.engine_id})
            return RunnerOutput.failure(out, f"the model step failed: {type(e).__name__}: {e}")

    def _fail(self, e: BaseException) -> None:
        """Every step still due fails (once): the engine's loop raises it."""
        if self._due:
            self._due = 0
            self.reply(StepFailed(e))
        if self._loop is not None:
            self._stop_reading(self._loop)  # (a dead pipe stays readable)

    def _on_replies(self) -> None:
        """The worker's pipe is readable: pass on what came, in order — a ``Skipped`` note
        (an aborting request left out of a queued step) before that step's result."""
        runner = cast(PipelinedRunner, self.runner)  # (only a pipelined runner's pipe is read)
        try:
            replies = runner.take_ready()
        except Exception as e:  # a failed step or a dead worker: every waiting step fails
            self._fail(e)
            return
        for reply in replies:
            if isinstance(reply, RunnerOutput):
                if not self._due:
                    log.error("a step result nobody waits for (step %s)", reply.step)
                    continue
                self._due -= 1
                self.reply(reply)
            elif isinstance(reply, LoraDone):
                self.lora_done(reply.name, reply.error)
            elif isinstance(reply, Skipped):
                self.reply(reply)
