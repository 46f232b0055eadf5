"""How the engine node's steps reach its runner and their results come back, for the runner's
kind (fd/engine/runner/runners.py), chosen once when the driver is made.

- A pipelined runner (the model worker process) takes each step down its pipe the moment it
  is decided, so it starts as soon as the one before it ends, and its replies are read by the
  node's own event loop when the pipe is readable (``add_reader``): no thread to wake and hand
  the GIL back and forth with (that hand-off cost up to ~2 ms a step on a busy box, between the
  worker's end of a step and the loop). An abort reaches it at once (:meth:`StepDriver.drop`).
- An in-process runner computes each step on the step thread, one at a time, and one that
  raises fails each of its requests, not the engine.

Either way each step's result resolves a future, in the order the steps were submitted;
``finished`` hears of it the moment it is in, so the scheduler can release what only finished
steps held, and then ``result_in`` folds it back and hands the runner its next step, in the
same callback: the step loop's task, woken by the future, runs a loop turn later, and under
load a turn is every stream's token writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.runner.runners import InProcessRunner, LoraDone, PipelinedRunner, Runner, Skipped

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class StepDriver:
    def __init__(
        self,
        runner: Runner,
        engine_id: str,
        finished: Callable[[int, tuple[int, int] | None], None],
        skipped: Callable[[int, list[str]], None],
        lora_done: Callable[[str, str | None], None],
        result_in: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.engine_id = engine_id
        self.finished = finished  # a step's result is in: (step, when it ran)
        self.skipped = skipped  # a queued step started without these aborting requests
        self.lora_done = lora_done  # a pipelined runner's answer to a LoRA load
        self.result_in = result_in  # the oldest step's future is resolved: fold it in now
        # The step thread: an in-process runner's steps, and its LoRA loads between them.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"step-{engine_id}")
        self._reader_fd: int | None = None  # a pipelined runner's pipe, read by the loop
        self._replies_due: deque[asyncio.Future] = deque()  # its steps, oldest first

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
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

    def submit(self, loop: asyncio.AbstractEventLoop, out: SchedulerOutput) -> asyncio.Future:
        """Start a step; its result comes back in order, as the future's."""
        runner = self.runner
        fut = loop.create_future()
        if runner.pipelined:
            runner.submit(out)
            self._replies_due.append(fut)
            return fut
        work = self.pool.submit(self._execute, runner, out)

        def done(_work) -> None:  # on the step thread
            try:
                loop.call_soon_threadsafe(self._step_done, fut, work)
            except RuntimeError:
                pass  # the loop is closed: the engine stopped

        work.add_done_callback(done)
        return fut

    def drop(self, step: int, request_ids: list[str]) -> None:
        """Aborting requests that steps up to ``step`` hold: a pipelined runner leaves them out
        of the steps it has not started and says so (``skipped``). An in-process runner has
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

    def _step_done(self, fut: asyncio.Future, work: Future) -> None:
        if fut.cancelled():
            return
        if work.cancelled():
            fut.cancel()
            return
        e = work.exception()
        if e is not None:
            fut.set_exception(e)
        else:
            result = work.result()
            fut.set_result(result)
            self.finished(result.step, result.ran)
            self.result_in()

    def _on_replies(self) -> None:
        """The worker's pipe is readable: fold in what came, in order — a ``Skipped`` note
        (an aborting request left out of a queued step) before that step's result."""
        runner: PipelinedRunner = self.runner  # type: ignore[assignment]  (only it is read)
        due = self._replies_due
        try:
            replies = runner.take_ready()
        except Exception as e:  # a failed step or a dead worker: every waiting step fails
            while due:
                fut = due.popleft()
                if not fut.done():
                    fut.set_exception(e)
            self._stop_reading(asyncio.get_running_loop())  # (a dead pipe stays readable)
            return
        for reply in replies:
            if isinstance(reply, RunnerOutput):
                if not due:
                    log.error("a step result nobody waits for (step %s)", reply.step)
                    continue
                fut = due.popleft()
                if not fut.done():
                    fut.set_result(reply)
                    self.finished(reply.step, reply.ran)
                    self.result_in()
            elif isinstance(reply, LoraDone):
                self.lora_done(reply.name, reply.error)
            elif isinstance(reply, Skipped):
                self.skipped(reply.step, reply.request_ids)
