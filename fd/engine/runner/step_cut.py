"""An abort that lands while a step runs: the step stops writing the request's KV blocks at
its next layer, and says so, instead of writing them to the end.

The abort protocol releases a request's blocks only once no step in flight can write them
(DESIGN.md §4). A client hangs up just after a token, which is when the step after it has
begun; waiting for that step's end made a release cost a whole step (90-200 ms on a real model
on a CPU), which a step queued behind it (``drop``) does not. So the worker's inbox thread
tells the running step too (:meth:`StepCut.ask`); the step's own thread takes the request ids
before its next layer writes KV (:meth:`StepCut.take`), sends that layer and every later one's
KV rows of those requests to the trash slot, and then reports them as
:class:`~fd.engine.runner.runners.Skipped` for the running step: from that point no step writes their
blocks, and the scheduler drains and releases them as it does for a queued step that left them
out. Their rows still run to the end of the step (taking them out of a batch mid-step would
cost more than the rows); their tokens are dropped, as every aborted request's are.

The thread that writes the KV is the one that decides the cut, so "no later write" holds by
program order. On a GPU the writes of the rest of the step are queued on the same stream as
every later step's, so blocks handed to another request are written by it only afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fd.engine.core.outputs import SchedulerOutput
from fd.engine.runner.runners import Skipped


class StepCut:
    """The running step's requests that an abort asked it to stop writing.

    ``begin`` and ``ask`` are called under the lock that orders the worker's queue, so an
    abort finds a step either still queued or begun here, never between the two."""

    def __init__(self, send: Callable[[Skipped], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._step: int | None = None
        self._holds: frozenset[str] = frozenset()  # the running step's requests
        self._asked: set[str] = set()  # asked to stop, not yet taken by the step
        self.stopped: set[str] = set()  # the step writes no more of their KV

    def begin(self, out: SchedulerOutput) -> None:
        with self._lock:
            self._step = out.step
            self._holds = frozenset(s.request_id for s in out.seqs)
            self._asked = set()
            self.stopped = set()

    def end(self) -> None:
        with self._lock:
            self._step = None
            self._holds = frozenset()
            self._asked = set()

    def ask(self, step: int, request_ids: frozenset[str]) -> None:
        """An abort of ``request_ids``, sent after step ``step`` was (the inbox thread)."""
        with self._lock:
            if self._step is not None and self._step <= step:
                self._asked |= (request_ids & self._holds) - self.stopped

    def take(self) -> frozenset[str]:
        """The requests to stop writing from the next layer on (the step's thread, before each
        layer: an empty set costs a truth test)."""
        if not self._asked:
            return frozenset()
        with self._lock:
            taken, self._asked = frozenset(self._asked), set()
            self.stopped |= taken
            return taken

    def stopped_writing(self, request_ids: frozenset[str]) -> None:
        """Said once the step's later layers write none of ``request_ids``' KV."""
        if self._step is not None:
            self._send(Skipped(self._step, sorted(request_ids)))
