"""What LoRA adapters an engine serves, as the control stream changes them (``load_lora``,
``unload_lora``): the bookkeeping, with no I/O; the engine node does the loading (in its model
worker) and says the outcome in its heartbeat (``loras``, ``lora_errors``), which is what an
API node waits on before it answers ``/v1/load_lora_adapter``.

An adapter given at start (``--lora-modules``) stays for the engine's life. One loaded at run
time can be unloaded: from then on no request may start with it, and the worker forgets it
once the last request running with it has ended (a step in flight may still use it).
"""

from __future__ import annotations

from fd.control.bus import Bus


class Adapters:
    def __init__(self, static: tuple[str, ...] = ()) -> None:
        self.static = frozenset(static)
        self.ready: set[str] = set(static)  # requests may start with these
        self.pending: set[str] = set()  # being loaded
        self.errors: dict[str, str] = {}  # failed loads, until unloaded
        self.unloading: set[str] = set()  # unloaded, still in use by running requests
        self.cancelled: set[str] = set()  # unloaded while being loaded: forgotten once loaded

    def want_load(self, name: str) -> bool:
        """A ``load_lora``: True when the worker should load it (not had, not on its way)."""
        if name in self.cancelled:  # (its last load, taken back, is still on its way)
            self.errors[name] = "it is still being unloaded here: load it again in a moment"
            return False
        if name in self.ready or name in self.pending:
            return False
        self.errors.pop(name, None)
        self.unloading.discard(name)  # (loaded again before the old copy went: a fresh load)
        self.pending.add(name)
        return True

    def loaded(self, name: str, error: str | None) -> str | None:
        """The worker's answer to a load: "ready", "failed", "unload" (it was unloaded while
        loading: the worker should forget it now), or None if no load was asked (an unload's
        answer)."""
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if name in self.cancelled:
            self.cancelled.discard(name)
            return "unload" if error is None else "failed"
        if error is None:
            self.ready.add(name)
            return "ready"
        self.errors[name] = error
        return "failed"

    def unload(self, name: str, in_use: bool) -> bool:
        """An ``unload_lora``: True when the worker should forget it now (nothing runs with
        it); else it is forgotten once :meth:`done_with` says the last user ended."""
        self.errors.pop(name, None)
        if name in self.pending and name not in self.static:
            self.cancelled.add(name)
            return False
        if name in self.static or name not in self.ready:
            return False
        self.ready.discard(name)
        if in_use:
            self.unloading.add(name)
            return False
        return True

    def done_with(self, name: str, in_use: bool) -> bool:
        """A request with this adapter ended: True when the worker should forget it now."""
        if name in self.unloading and not in_use:
            self.unloading.discard(name)
            return True
        return False

    def status(self) -> dict[str, str]:
        """The heartbeat's fields: the adapters ready, and the loads that failed (JSON)."""
        return Bus.lora_fields(self.ready, self.errors)
