"""The model in its own process: a runner that forwards each step to a worker over a pipe.

In one Python process the model step (hundreds of short paddle calls) and the event loop
(Redis I/O, HTTP streaming) take turns on one GIL, and each slows the other: at 32 streams
the forward ran about 4x slower beside ``fd serve``'s loop than alone (bench/api.py). In a
worker process the forward has a core and a GIL of its own, and the node's step thread just
waits on the pipe (which releases the GIL). A step's input and output are small values
(:class:`SchedulerOutput`, :class:`RunnerOutput`), so the pipe costs tens of microseconds.

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
from typing import Any, NamedTuple

from fd.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from fd.engine.runner.runners import LoraDone, PipelinedRunner, Reply, Skipped
from fd.engine.runner.step_cut import StepCut

log = logging.getLogger("fd.worker")


class WorkerError(RuntimeError):
    """The worker failed to start, died, or failed outside a step (a warmup); the message
    carries its traceback. A step that fails is a result (``RunnerOutput.failed``), not this."""


class Ready(NamedTuple):
    """The worker's first reply: the model is loaded, and these are its limits."""

    num_blocks: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    lora_names: tuple[str, ...]
    cpus: list[int]


class StepDone(NamedTuple):
    """A step's result as it crosses the pipe: a plain tuple of :class:`RunnerOutput`'s
    fields (a dataclass would pickle through copyreg), and the seconds the step took."""

    step: int
    sampled: dict[str, int]
    stopped: dict[str, str]
    ran: tuple[int, int] | None
    logprobs: dict
    prompt_logprobs: dict
    embeddings: dict[str, bytes]
    failed: dict[str, str]
    busy_s: float

    def output(self) -> RunnerOutput:
        return RunnerOutput(
            step=self.step,
            sampled=self.sampled,
            stopped=self.stopped,
            ran=self.ran,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            embeddings=self.embeddings,
            failed=self.failed,
        )


class Warmed(NamedTuple):
    """The warm-up is done."""


class Failed(NamedTuple):
    """The worker failed outside a step (to start, or a warm-up): its traceback."""

    error: str


class _StepEncoder:
    """The pipe's form of a step: plain tuples, which pickle in C, instead of dataclasses,
    which pickle through copyreg (7% of ``fd serve``'s loop at 8 streams went to pickling
    steps); and each request's SamplingParams sent once, then named by a number. Bounded: past
    ``MAX_PARAMS`` the worker is told to forget them all and they are sent again."""

    MAX_PARAMS = 4096

    def __init__(self) -> None:
        self._keys: dict[int, tuple[int, Any]] = {}  # id(params) -> (number, params: kept alive)
        self._next = 0

    def encode(self, out: SchedulerOutput) -> tuple:
        keys = self._keys
        reset = len(keys) > self.MAX_PARAMS
        if reset:
            keys.clear()
            self._next = 0
        new = []
        seqs = []
        for ss in out.seqs:
            sp = ss.sampling
            known = keys.get(id(sp))
            if known is None or known[1] is not sp:
                known = keys[id(sp)] = (self._next, sp)
                self._next += 1
                new.append((known[0], sp))
            seqs.append(
                (
                    ss.request_id,
                    ss.token_ids,
                    ss.start_pos,
                    ss.block_table,
                    ss.sample,
                    known[0],
                    ss.num_generated,
                    ss.history,
                    ss.num_prompt_tokens,
                    ss.prompt_len,
                    ss.prompt_next,
                )
            )
        return ("step", out.step, out.num_batched_tokens, reset, new, seqs)


class _StepDecoder:
    def __init__(self) -> None:
        self._params: dict[int, Any] = {}

    def decode(self, msg: tuple) -> SchedulerOutput:
        _, step, num_batched, reset, new, seqs = msg
        params = self._params
        if reset:
            params.clear()
        for key, sp in new:
            params[key] = sp
        return SchedulerOutput(
            step=step,
            num_batched_tokens=num_batched,
            seqs=tuple(
                ScheduledSeq(
                    rid,
                    toks,
                    start,
                    table,
                    sample,
                    params[key],
                    gen,
                    history,
                    num_prompt,
                    prompt_len,
                    prompt_next,
                )
                for rid, toks, start, table, sample, key, gen, history, num_prompt, prompt_len, prompt_next in seqs
            ),
        )


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
        self._queue: deque = deque()  # received, not yet started; None: the pipe closed
        self._ready = threading.Condition()
        self._send = threading.Lock()
        self._steps = _StepDecoder()  # (decoded as they arrive: the parameter table stays in order)
        self.cut = StepCut(self.send)  # the running step's aborts
        threading.Thread(target=self._read, name="fd-worker-inbox", daemon=True).start()

    def get(self) -> Any:
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
            if isinstance(msg, tuple) and msg and msg[0] == "drop":
                self._drop(msg[1], frozenset(msg[2]))
                continue
            if isinstance(msg, tuple) and msg and msg[0] == "step":
                msg = self._steps.decode(msg)
            with self._ready:
                self._queue.append(msg)
                self._ready.notify()
            if msg is None:
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
            if msg == "warmup":
                runner.warmup()
                gc.collect()
                gc.freeze()  # (what the warm-up left for good: as the load's, above)
                send(Warmed())
                continue
            if isinstance(msg, tuple) and msg[0] in ("lora_load", "lora_unload"):
                # (between steps, in the order sent: a step sent before an unload still has it)
                try:
                    if msg[0] == "lora_load":
                        runner.load_lora(msg[1], msg[2])
                    else:
                        runner.unload_lora(msg[1])
                    send(LoraDone(msg[1], None))
                except Exception as e:  # noqa: BLE001 - said to the engine, which goes on
                    send(LoraDone(msg[1], f"{type(e).__name__}: {e}"))
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
        self._steps = _StepEncoder()
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
        self._conn.send(("drop", step, tuple(request_ids)))

    def load_lora(self, name: str, path: str, wait: bool = False) -> str | None:
        """Load an adapter in the worker, between two steps. ``wait`` (no step in flight: at
        start) returns its error or None; otherwise the answer comes as a :class:`LoraDone`
        reply, after the steps sent before."""
        self._conn.send(("lora_load", name, path))
        return self._lora_reply(name) if wait else None

    def unload_lora(self, name: str) -> None:
        self._conn.send(("lora_unload", name))

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
        self._conn.send("warmup")
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
