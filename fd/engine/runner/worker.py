"""The model in its own process: a runner that forwards each step to a worker over a pipe.

In one Python process the model step (hundreds of short paddle calls) and the event loop
(Redis I/O, HTTP streaming) take turns on one GIL, and each slows the other: at 32 streams
the forward ran about 4x slower beside ``fd serve``'s loop than alone (bench/api.py). In a
worker process the forward has a core and a GIL of its own, and the node's step thread just
waits on the pipe (which releases the GIL). A step's input and output are small values
(:class:`SchedulerOutput`, :class:`RunnerOutput`), so the pipe costs tens of microseconds.
What crosses it, both ways, is typed in fd/engine/runner/worker_messages.py.

The worker exits when the pipe closes, so it never outlives its engine, even one killed with
SIGKILL.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.runner.runners import LoraDone, PipelinedRunner, Reply, Skipped
from fd.engine.runner.step_cut import StepCut
from fd.engine.runner.worker_messages import (
    Drop,
    Failed,
    LoadLora,
    Ready,
    Step,
    StepDecoder,
    StepDone,
    StepEncoder,
    UnloadLora,
    Warmed,
    Warmup,
)

if TYPE_CHECKING:  # (imported in the worker only: the engine's process never loads Paddle)
    from fd.engine.runner.model_runner import ModelRunner

log = logging.getLogger("fd.worker")


class WorkerError(RuntimeError):
    """The worker failed to start, died, or failed outside a step (a warmup); the message
    carries its traceback. A step that fails is a result (``RunnerOutput.failed``), not this."""


#: What the worker's loop takes from its inbox, in the order sent: a step (decoded), a
#: warm-up, a LoRA load or unload; None once the pipe has closed.
_Queued = SchedulerOutput | Warmup | LoadLora | UnloadLora | None


class _Inbox:
    """The worker's end of the pipe, read by a thread of its own while a step runs.

    An abort's ``drop`` takes its requests out of the steps queued here at once and says so
    (``skipped``) at once, and asks the running step to stop writing their KV at its next
    layer (:attr:`cut`, fd/engine/runner/step_cut.py), which says so when it has: their blocks go back
    within a layer, not when the running step ends, nor when the step queued behind it starts
    (a whole step later, which is where a client that hangs up just after a token, as clients
    do, found itself). Steps, warm-ups and LoRA loads are taken in the order sent; replies from
    both threads go through :meth:`send`, one at a time.
    """

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: deque[_Queued] = deque()  # received, not yet started
        self._ready = threading.Condition()
        self._send = threading.Lock()
        self._steps = StepDecoder()  # (decoded as they arrive: the parameter table stays in order)
        self.cut = StepCut(self.send)  # the running step's aborts
        threading.Thread(target=self._read, name="fd-worker-inbox", daemon=True).start()

    def get(self) -> _Queued:
        """The next message to act on (blocks); None once the pipe has closed."""
        with self._ready:
            while not self._queue:
                self._ready.wait()
            msg = self._queue.popleft()
            if isinstance(msg, SchedulerOutput):  # (under the lock: a drop finds it here or there)
                self.cut.begin(msg)
            return msg

    def send(self, reply: Any) -> None:
        with self._send:
            try:
                self._conn.send(reply)
            except (BrokenPipeError, OSError):
                pass  # the engine is gone: the reader sees the pipe close and stops the worker

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = None
            queued: _Queued
            match msg:
                case Drop(step, request_ids):  # (at once, not in turn: see the class)
                    self._drop(step, frozenset(request_ids))
                    continue
                case Step():
                    queued = self._steps.decode(msg)
                case Warmup() | LoadLora() | UnloadLora() | None:
                    queued = msg
                case _:  # (nothing ProcessRunner sends: the engine raises WorkerError on it)
                    self.send(Failed(f"the model worker got an unknown message: {msg!r}"))
                    continue
            with self._ready:
                self._queue.append(queued)
                self._ready.notify()
            if queued is None:
                return

    def _drop(self, step: int, rids: frozenset[str]) -> None:
        """Take ``rids`` out of every queued step up to ``step`` (every step that holds them
        was sent before the drop, so one not queued has started or is done)."""
        with self._ready:
            self.cut.ask(step, rids)
            for i, out in enumerate(self._queue):
                if not isinstance(out, SchedulerOutput) or out.step > step:
                    continue
                left = [s.request_id for s in out.seqs if s.request_id in rids]
                if left:
                    self._queue[i] = replace(out, seqs=tuple(s for s in out.seqs if s.request_id not in rids))
                    # (said under the lock: the step cannot start, and report, before its skip)
                    self.send(Skipped(out.step, left))


def _worker_main(
    conn,
    model_dir: str,
    kwargs: dict[str, Any],
    cpus: frozenset[int] | None = None,
    nice: int = 0,
    alone: int | None = None,
    log_settings: tuple[str, str] | None = None,
) -> None:
    # Ctrl-C reaches the whole process group; the worker stops when its engine closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_settings is not None:
        # Logged as its engine logs, set up before Paddle is imported (whose import installs a
        # handler of its own on a root logger that has none); in JSON mode descriptors 1 and 2
        # go through pipes, so what Paddle writes from C++ is a JSON line too.
        from fd.control.logs import setup_logging

        level, fmt = log_settings
        setup_logging(level, fmt, capture_fds=fmt == "json")
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # before paddle starts any thread (fd/engine/runner/affinity.py)
        except OSError as e:  # (a container that forbids it: run where the kernel puts us)
            log.warning("fd model worker: could not pin to CPUs %s: %s", sorted(cpus), e)
    if nice and alone is None:
        try:
            os.nice(
                nice
            )  # (fd/engine/runner/affinity.py: the engine's process preempts a worker it shares CPUs with)
        except OSError as e:
            log.warning("fd model worker: could not lower its priority by %d: %s", nice, e)
    try:
        from fd.engine.runner.process import tune

        tune()  # (before Paddle loads)
        from fd.engine.runner.model_runner import ModelRunner

        runner = ModelRunner(model_dir, **kwargs)
        if alone is not None:  # settle (fd/engine/runner/affinity.py): one CPU alone, or all of them niced
            from fd.engine.runner import affinity

            if runner.model.gemm_threads <= 1:
                affinity.pin_this_process(frozenset({alone}))
            elif nice:
                affinity.nice_this_process(nice)
        # paddle installs a SIGTERM handler that prints a C++ "FatalError" banner; a worker
        # terminated by its parent (multiprocessing's exit clean-up) should just go.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # What the load made (Paddle's modules, the model: most of the heap) lives as long as
        # the worker: out of the collector's sight, so that a full collection, which Python
        # starts in the middle of whatever step allocates past its threshold, walks only what
        # steps left behind (with the load in it, 50-65 ms: a step of the tiny model is 3-10).
        gc.collect()
        gc.freeze()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(Failed(f"{type(e).__name__}: {e}"))
        return
    conn.send(
        Ready(
            num_blocks=runner.num_blocks,
            eos_token_ids=tuple(runner.eos_token_ids),
            max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size,
            lora_names=runner.lora_names,
            cpus=sorted(os.sched_getaffinity(0)),
        )
    )
    inbox = _Inbox(conn)

    while True:
        msg = inbox.get()
        if msg is None:
            return
        send = inbox.send
        try:
            if isinstance(msg, Warmup):
                runner.warmup()
                gc.collect()
                gc.freeze()  # (what the warm-up left for good: as the load's, above)
                send(Warmed())
                continue
            if isinstance(msg, (LoadLora, UnloadLora)):
                # (between steps, in the order sent: a step sent before an unload still has it)
                send(_lora(runner, msg))
                continue
            t, wall = time.perf_counter(), time.time()
            try:
                out = runner.execute(msg, inbox.cut)
            except Exception as e:  # noqa: BLE001 - its requests fail; the worker goes on
                log.exception("the model step failed")
                out = RunnerOutput.failure(msg, f"the model step failed: {type(e).__name__}: {e}")
            finally:
                inbox.cut.end()
            dt = time.perf_counter() - t
            ran = (int(wall * 1000), int((wall + dt) * 1000))
            send(
                StepDone(
                    out.step,
                    out.sampled,
                    out.stopped,
                    ran,
                    out.logprobs,
                    out.prompt_logprobs,
                    out.embeddings,
                    out.failed,
                    dt,
                )
            )
        except Exception:  # noqa: BLE001
            send(Failed(traceback.format_exc()))


def _lora(runner: ModelRunner, msg: LoadLora | UnloadLora) -> LoraDone:
    """Load or unload an adapter; the LoraDone that says how it went (the worker goes on)."""
    try:
        match msg:
            case LoadLora(name, path):
                runner.load_lora(name, path)
            case UnloadLora(name):
                runner.unload_lora(name)
        return LoraDone(msg.name, None)
    except Exception as e:  # noqa: BLE001 - said to the engine, which goes on
        return LoraDone(msg.name, f"{type(e).__name__}: {e}")


class ProcessRunner(PipelinedRunner):
    """A :class:`~fd.engine.runner.runners.PipelinedRunner`: a :class:`ModelRunner` in a worker process,
    fed through a pipe. Also usable step by step (:meth:`execute`, blocking)."""

    def __init__(
        self,
        model_dir: str,
        *,
        cpus: frozenset[int] | None = None,
        nice: int = 0,
        alone: int | None = None,
        **kwargs: Any,
    ):
        """``cpus``, ``nice``, ``alone``: the worker's placement (fd/engine/runner/affinity.py's
        :class:`CpuPlan`); :attr:`cpus` says where it settled."""
        from fd.control.logs import settings as log_settings

        ctx = mp.get_context("spawn")  # paddle and threads do not survive a fork
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_worker_main,
            args=(child, str(model_dir), kwargs, cpus, nice, alone, log_settings()),
            name="fd-model-worker",
            daemon=True,
        )
        self._proc.start()
        child.close()
        try:
            ready = self._conn.recv()
        except EOFError:
            raise WorkerError(f"the model worker exited with code {self._proc.exitcode}") from None
        if not isinstance(ready, Ready):
            self._proc.join(timeout=5)
            raise WorkerError(ready.error if isinstance(ready, Failed) else repr(ready))
        self.num_blocks: int = ready.num_blocks
        self.eos_token_ids: tuple[int, ...] = ready.eos_token_ids
        self.max_model_len: int = ready.max_model_len
        self.vocab_size: int = ready.vocab_size
        self.lora_names: tuple[str, ...] = ready.lora_names  # (at start; the engine keeps the rest)
        self.cpus: frozenset[int] = frozenset(ready.cpus)  # where the worker runs, once settled
        # Called with (name, error or None) when the worker is done loading or unloading an
        # adapter asked for while steps ran, for a caller that collects step by step
        # (:meth:`collect`); the engine's loop reads it among the replies instead.
        self.on_lora: Callable[[str, str | None], None] | None = None
        # Seconds the worker spent inside execute (the model step itself, without the pipe):
        # what bench/engine.py compares the engine loop's wall time with.
        self.busy_seconds = 0.0
        self._steps = StepEncoder()
        # Called (from the thread collecting results) with (step, request ids) when the worker
        # starts a step without requests it was told to drop (:meth:`drop`), for a caller that
        # collects step by step.
        self.on_skipped: Callable[[int, list[str]], None] | None = None

    def submit(self, out: SchedulerOutput) -> None:
        """Queue a step on the pipe without waiting for it: the worker starts it the moment it
        is done with the one before, with no hand-off through this process's GIL. Results
        come back in submission order, one :meth:`collect` each."""
        self._conn.send(self._steps.encode(out))

    def drop(self, step: int, request_ids: list[str]) -> None:
        """Leave these (aborting) requests out of any submitted step up to ``step`` that has
        not started yet. A step that leaves some out says so before it starts
        (:class:`Skipped`), so their blocks can go back without waiting for it."""
        self._conn.send(Drop(step, tuple(request_ids)))

    def load_lora(self, name: str, path: str, wait: bool = False) -> str | None:
        """Load an adapter in the worker, between two steps. ``wait`` (no step in flight: at
        start) returns its error or None; otherwise the answer comes as a :class:`LoraDone`
        reply, after the steps sent before."""
        self._conn.send(LoadLora(name, path))
        return self._lora_reply(name) if wait else None

    def unload_lora(self, name: str) -> None:
        self._conn.send(UnloadLora(name))

    def _lora_reply(self, name: str) -> str | None:
        while True:
            reply = self._recv()
            if isinstance(reply, LoraDone) and reply.name == name:
                return reply.error
            if isinstance(reply, Failed):
                raise WorkerError(reply.error)

    def collect(self) -> RunnerOutput:
        """The result of the oldest submitted step (blocks; run it off the event loop)."""
        done = self._next_done()
        if not isinstance(done, StepDone):
            raise WorkerError(f"a step's result expected, not {done!r}")
        return done.output()

    def _next_done(self) -> StepDone | Warmed:
        """The next step result or warm-up, telling ``on_lora`` and ``on_skipped`` of the
        notes before it."""
        while True:
            reply = self._recv()
            if isinstance(reply, LoraDone):
                if self.on_lora is not None:
                    self.on_lora(reply.name, reply.error)
            elif isinstance(reply, Skipped):
                if self.on_skipped is not None:
                    self.on_skipped(reply.step, reply.request_ids)
            elif isinstance(reply, Failed):
                raise WorkerError(reply.error)
            elif isinstance(reply, StepDone):
                self.busy_seconds += reply.busy_s
                return reply
            elif isinstance(reply, Warmed):
                return reply

    def fileno(self) -> int:
        """The pipe's end in this process: readable when a reply has come (for an event loop
        that reads replies itself, :meth:`take_ready`)."""
        return self._conn.fileno()

    def take_ready(self) -> list[Reply]:
        """Every reply that has come, without waiting: step results (in submission order),
        :class:`Skipped` notes (each before its step's result) and :class:`LoraDone`s. A step
        that failed is a result too, its requests in ``failed``. Raises WorkerError for a dead
        worker."""
        out: list[Reply] = []
        conn = self._conn
        while conn.poll():
            reply = self._recv()
            if isinstance(reply, StepDone):
                self.busy_seconds += reply.busy_s
                out.append(reply.output())
            elif isinstance(reply, Failed):
                raise WorkerError(reply.error)
            elif isinstance(reply, (Skipped, LoraDone)):
                out.append(reply)
        return out

    def _recv(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # (a killed worker's pipe may say "reset by peer")
            raise self._died() from None

    def _died(self) -> WorkerError:
        self._proc.join(timeout=1.0)  # (reaped, so its exit code is known)
        return WorkerError(f"the model worker died (exit code {self._proc.exitcode})")

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.submit(out)
        return self.collect()

    def warmup(self) -> None:
        self._conn.send(Warmup())
        self._next_done()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
