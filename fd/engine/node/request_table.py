"""What the engine node knows of each request it runs: one :class:`Live` record a request,
from the moment it is started (fd.engine.node.admission) to its ``final``, in one
:class:`RequestTable`. Forgetting a request is one call, so no piece of its state can outlive
the rest by being missed.

Two things outlive a request's record on purpose, and the table keeps them beside it:

- its owner token (``tokens``): the fence (fd/control/fence.py) checks the final itself, and the
  abort story of a request this engine never ran is written under a token too. A token goes
  once the flush that carries the request's final is done (:meth:`RequestTable.release`).
- an abort that arrived while the request was not this engine's (``dismiss``): if this engine
  later takes it over, the abort still wins.

No I/O and no clock of its own: the node passes the times in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, Iterator, ValuesView
from dataclasses import dataclass

from fd.control.events import Request
from fd.engine.core.detokenizer import IncrementalDetokenizer
from fd.engine.core.outputs import PromptLogprob

#: At most this many dismissed aborts are remembered (each for at most the tombstone TTL).
MAX_DISMISSED = 100_000


@dataclass(slots=True)
class Live:
    """One request this engine has started and not yet ended."""

    entry: bytes  # its P:requests entry, acknowledged with its final
    request: Request  # what was claimed: a drain hands it back as it came
    renewed: float  # when its owner key's and story's TTLs were last renewed (monotonic)
    detok: IncrementalDetokenizer | None = None  # None once flushed (or never made)
    # Scoring its prompt (SamplingParams.prompt_logprobs), new here: position -> entry, as the
    # prefill chunks bring them, for the request's first tokens event; None when not asked
    # or already published.
    prompt_lp: dict[int, PromptLogprob] | None = None
    progress: float | None = None  # last token (or the start), monotonic; None: not watched
    abort_noted_at: float | None = None  # its abort_requested, for the release-time metric
    # This engine no longer speaks for it (handed back, or ownership lost): the scheduler
    # still winds it down, but none of its events is published.
    silent: bool = False
    timed_out: bool = False  # aborted by the watchdog already (logged and counted once)
    emitted: int = 0  # output tokens on its story (a takeover's: those before it too)


class RequestTable:
    """The live requests by id, and the owner tokens and remembered aborts beside them."""

    def __init__(self) -> None:
        self._live: dict[str, Live] = {}
        # The owner token (fd.control.keys.owner_token) each request's events are fenced with:
        # this engine's grant of it, or ABORT_WRITTEN for an abort story it won the writing of.
        self.tokens: dict[str, str] = {}
        self._lost: set[str] = set()  # dropped by the fence (counted once), until their token goes
        self.admitting: set[str] = set()  # owner key being taken, story being read
        # Started, but their `claimed` is not on their stream yet. No step runs a request
        # before it is: an engine that dies in that step (a poison request) has then counted
        # as an attempt, so failover gives the request up after max_attempts (fd.engine.node.failover).
        self.unannounced: set[str] = set()
        self._dismissed: OrderedDict[str, tuple[str, float]] = OrderedDict()

    # ------------------------------------------------------------------ live requests

    def add(self, rid: str, entry: bytes, request: Request, token: str, now: float) -> Live:
        live = self._live[rid] = Live(entry=entry, request=request, renewed=now)
        self.tokens[rid] = token
        return live

    def get(self, rid: str) -> Live | None:
        return self._live.get(rid)

    def forget(self, rid: str) -> Live | None:
        """The request ended (its final is queued): its record, gone from the table."""
        return self._live.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def items(self) -> ItemsView[str, Live]:
        return self._live.items()

    def values(self) -> ValuesView[Live]:
        return self._live.values()

    def silent(self, rid: str) -> bool:
        live = self._live.get(rid)
        return live is not None and live.silent

    def using_lora(self, name: str) -> bool:
        """Some request running here uses LoRA adapter ``name`` (it cannot be forgotten yet)."""
        return any(live.request.data.sampling.lora == name for live in self._live.values())

    def holds(self, rid: str) -> bool:
        """Started here, or being owned: a second claim or a failover scan leaves it alone."""
        return rid in self._live or rid in self.admitting

    # ------------------------------------------------------------------ tokens

    def lose(self, rid: str) -> bool:
        """The fence refused the request's events: True the first time (a flush made before
        it was dropped is refused too, and counts once)."""
        if rid in self._lost:
            return False
        self._lost.add(rid)
        return True

    def release(self, rids: list[str]) -> None:
        """Their finals are out (or refused): nothing more is written, so their tokens go,
        unless the request was started again here meanwhile."""
        for rid in rids:
            if not self.holds(rid):
                self.tokens.pop(rid, None)
                self._lost.discard(rid)

    # ------------------------------------------------------------------ dismissed aborts

    def dismiss(self, rid: str, source: str, now: float, ttl_s: float) -> None:
        """Remember an abort of a request another engine owns (or a dead one did), for as
        long as its tombstone would last."""
        dismissed = self._dismissed
        dismissed[rid] = (source, now)
        dismissed.move_to_end(rid)
        while dismissed:
            first, (_, t) = next(iter(dismissed.items()))
            if now - t <= ttl_s and len(dismissed) <= MAX_DISMISSED:
                break
            del dismissed[first]

    def take_dismissed(self, rid: str) -> str | None:
        """The source of an abort remembered for this request, now that it starts here."""
        got = self._dismissed.pop(rid, None)
        return None if got is None else got[0]
