"""Loading and forgetting LoRA adapters in the engine's runner, as :class:`fd.engine.core.adapters.
Adapters` decides (that class keeps the bookkeeping and does no I/O; this one does the I/O).

A worker-process runner takes a load or an unload down its pipe, behind the steps already
sent, and answers a load among its step replies; an in-process runner does it on the step
thread, so it never runs during a step. Either way the outcome comes back to :meth:`done` on
the event loop, which tells ``Adapters`` and has the heartbeat written at once: an API node
waits on the heartbeat before it answers ``/v1/load_lora_adapter``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from fd.engine.core.adapters import Adapters
from fd.engine.runner.runners import NO_LORA, Runner

# (its lines are the engine node's: operators filter on that name)
log = logging.getLogger("fd.engine.node.node")


class LoraLoader:
    def __init__(
        self,
        runner: Runner,
        pool: ThreadPoolExecutor,
        adapters: Adapters,
        engine_id: str,
        changed: Callable[[], None],
    ) -> None:
        self.runner = runner
        self.pool = pool  # the step thread: no load runs during a step
        self.adapters = adapters
        self.engine_id = engine_id
        self.changed = changed  # an adapter became ready or failed: write the heartbeat now

    async def load_registered(self, registered: Mapping[str, str]) -> None:
        """At start: the adapters loaded at run time before this engine came (``P:loras``)."""
        for name, path in registered.items():
            if not self.adapters.want_load(name):
                continue
            runner = self.runner
            if runner.pipelined:  # a worker process, no step in flight yet
                error = runner.load_lora(name, path, wait=True)
            elif runner.loads_lora:
                try:
                    await asyncio.wrap_future(self.pool.submit(runner.load_lora, name, path))
                    error = None
                except Exception as e:  # noqa: BLE001 - said in the heartbeat
                    error = f"{type(e).__name__}: {e}"
            else:
                error = NO_LORA
            self.done(name, error)

    def load(self, name: str, path: str) -> None:
        """Load an adapter in the runner, between steps; the outcome comes to :meth:`done`."""
        runner = self.runner
        if runner.pipelined:  # the worker process: down the pipe, after the steps sent
            runner.load_lora(name, path)
        elif runner.loads_lora:
            self._on_step_thread(name, runner.load_lora, name, path)
        else:
            self.done(name, NO_LORA)

    def forget(self, name: str) -> None:
        """Forget an adapter in the runner, between steps."""
        runner = self.runner
        if runner.pipelined:
            runner.unload_lora(name)
        elif runner.loads_lora:
            self._on_step_thread(name, runner.unload_lora, name)

    def _on_step_thread(self, name: str, work: Callable[..., None], *args: str) -> None:
        """``work(*args)`` on the step thread, between steps; its outcome to :meth:`done`."""
        loop = asyncio.get_running_loop()

        def done(w: Future[None]) -> None:  # on the step thread
            e = w.exception()
            try:
                loop.call_soon_threadsafe(self.done, name, None if e is None else f"{type(e).__name__}: {e}")
            except RuntimeError:
                pass  # the loop is closed: the engine stopped

        self.pool.submit(work, *args).add_done_callback(done)

    def done(self, name: str, error: str | None) -> None:
        """The runner's answer to a load of ``name``: ``error``, or None if it loaded."""
        outcome = self.adapters.loaded(name, error)
        if outcome is None:
            return
        if outcome == "unload":  # (taken back while it was loading)
            self.forget(name)
            return
        if error is None:
            log.info("LoRA adapter %r loaded", name, extra={"engine": self.engine_id})
        else:
            log.warning(
                "LoRA adapter %r could not be loaded: %s", name, error, extra={"engine": self.engine_id}
            )
        self.changed()
