"""What the engine node asks of the runner that computes its steps, in the two kinds there are.

A runner says which kind it is (``pipelined``), and the node chooses how to drive it once, at
start, by that, never by feeling for methods:

- :class:`InProcessRunner` computes a step when called: the model runner on the node's step
  thread (``--executor paddle-thread``), the timed runner, and tests' stand-ins. The node calls
  ``execute`` on its step thread, one step at a time, and a LoRA load there too, between steps.
- :class:`PipelinedRunner` is fed steps down a pipe and answers on it: the model worker process
  (fd/engine/runner/worker.py, ``--executor paddle``). The node sends a step the moment it is decided
  (``submit``), so the worker starts it as soon as the one before ends, and its loop reads the
  answers when the pipe is readable (``add_reader`` on ``fileno``, then ``take_ready``). An
  abort reaches the worker at once (``drop``), and the worker says which queued steps it
  started without the request, and when the running one stopped writing its KV
  (:class:`Skipped`), so its blocks go back within a layer, not a step or two later.

A pipelined runner's answers are typed records (:data:`Reply`): a step's
:class:`~fd.engine.core.outputs.RunnerOutput`, a :class:`Skipped` note, or a :class:`LoraDone`.

Both kinds name the model's limits the scheduler is configured from. ``vocab_size`` is 0 for a
runner that does not know it (the engine then leaves token ids unchecked at admission), and
``lora_names`` are the adapters it has at start.
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple, Protocol

from fd.engine.core.outputs import RunnerOutput, SchedulerOutput

#: What a runner that cannot load LoRA adapters answers a load with.
NO_LORA = "this engine's executor cannot load LoRA adapters"


class Skipped(NamedTuple):
    """In-flight ``step`` writes none of these aborting requests' KV (``drop``): the worker
    started it without them, or, running, it stopped writing theirs (fd/engine/runner/step_cut.py)."""

    step: int
    request_ids: list[str]


class LoraDone(NamedTuple):
    """The worker is done loading (or unloading) adapter ``name``: ``error``, or None."""

    name: str
    error: str | None


#: One answer read from a pipelined runner, in the order it was sent.
Reply = RunnerOutput | Skipped | LoraDone


class InProcessRunner(Protocol):
    """Computes a step when called, on the node's step thread."""

    pipelined: ClassVar[Literal[False]] = False
    #: True when it implements :meth:`load_lora` and :meth:`unload_lora`.
    loads_lora: ClassVar[bool] = False
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int = 0
    lora_names: tuple[str, ...] = ()

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    def load_lora(self, name: str, path: str) -> None:
        raise NotImplementedError(NO_LORA)

    def unload_lora(self, name: str) -> None:
        raise NotImplementedError(NO_LORA)

    def close(self) -> None:
        """Let go of what the runner holds beyond its objects (nothing, for most)."""


class PipelinedRunner(Protocol):
    """Fed steps down a pipe; its answers are read by the node's event loop."""

    pipelined: ClassVar[Literal[True]] = True
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    lora_names: tuple[str, ...]

    def submit(self, out: SchedulerOutput) -> None:
        """Queue a step; its result comes back, in submission order, among the replies."""
        ...

    def drop(self, step: int, request_ids: list[str]) -> None:
        """Leave these aborting requests out of any queued step up to ``step`` not started."""
        ...

    def fileno(self) -> int:
        """Readable when a reply has come."""
        ...

    def take_ready(self) -> list[Reply]:
        """Every reply that has come, without waiting; raises once the runner is dead."""
        ...

    def load_lora(self, name: str, path: str, wait: bool = False) -> str | None:
        """Load an adapter after the steps sent; ``wait`` (nothing in flight) returns its
        error or None, else the answer comes as a :class:`LoraDone` reply."""
        ...

    def unload_lora(self, name: str) -> None: ...

    def close(self) -> None:
        """Stop the process that computes the steps."""
        ...


Runner = InProcessRunner | PipelinedRunner
