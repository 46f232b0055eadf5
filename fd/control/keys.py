"""Every Redis key fd uses, in one place.

Keys that belong to one request carry the id in a hash tag (``{id}``) so that a request's
stream and its owner key land in the same Redis Cluster slot: the claim-vs-abort arbitration
and the final-event EXPIRE can then be pipelined together.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

#: Request ids become parts of key names, so they are restricted to a charset that cannot
#: open a hash tag or a glob and to a length that keeps keys small.
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

GROUP_ENGINES = "engines"

#: The value of ``P:owner:{id}`` when an abort won the race for a request no engine had claimed
#: (or that had not even been sent yet): a tombstone, ``aborted:<source>``. No engine will
#: prefill it. Whoever next finds it with the request's stream in place (the abort itself, the
#: API submitting the request, an engine claiming it) flips it to :data:`ABORT_WRITTEN` with a
#: compare-and-set and writes the abort story: exactly one party does.
ABORTED_OWNER = "aborted"
ABORT_WRITTEN = "aborted-final"


def tombstone(source: str) -> str:
    return f"{ABORTED_OWNER}:{source}"


def is_tombstone(owner: str | None) -> bool:
    return owner is not None and (
        owner in (ABORTED_OWNER, ABORT_WRITTEN) or owner.startswith(ABORTED_OWNER + ":")
    )


def pending_tombstone_source(owner: str | None) -> str | None:
    """The abort's source if ``owner`` is a tombstone whose story is not written yet."""
    if owner == ABORTED_OWNER:
        return "redis"
    if owner is not None and owner.startswith(ABORTED_OWNER + ":"):
        return owner[len(ABORTED_OWNER) + 1 :] or "redis"
    return None


#: An engine's value of ``P:owner:{id}``: its *owner token* ``<engine>#<attempt>``, the grant
#: of ownership it fences its writes with (fd/control/fence.py). ``#`` is in no engine id, so the
#: engine is everything before it.
TOKEN_SEP = "#"


def owner_token(engine_id: str, attempt: int) -> str:
    return f"{engine_id}{TOKEN_SEP}{attempt}"


def owner_engine(owner: str | None) -> str | None:
    """The engine an owner key's value names (a token, or the bare id an engine of an earlier
    release wrote); None for no value."""
    return None if owner is None else owner.partition(TOKEN_SEP)[0]


def owner_attempt(owner: str | None) -> int | None:
    """The attempt of an owner token; None for anything else (no value, a bare engine id, a
    tombstone)."""
    if owner is None or TOKEN_SEP not in owner:
        return None
    try:
        return int(owner.rpartition(TOKEN_SEP)[2])
    except ValueError:
        return None


#: The value of ``P:owner:{id}`` for a response of n > 1 choices (``choices=<n>``): nobody
#: runs the id itself, its choices ``<id>.<k>`` run as requests of their own. An abort of the
#: id meets it instead of winning a tombstone, and aborts the choices.
CHOICES_OWNER = "choices"
MAX_CHOICES_OWNED = 1024  # a hand-written mark above this is not one (the API makes at most 256)


def choices_owner(n: int) -> str:
    return f"{CHOICES_OWNER}={n}"  # ('=' is in no engine id: no engine can be mistaken for it)


def owner_choices(owner: str | None) -> int | None:
    """n, if ``owner`` marks a response of n choices."""
    if owner is None or not owner.startswith(CHOICES_OWNER + "="):
        return None
    try:
        n = int(owner[len(CHOICES_OWNER) + 1 :])
    except ValueError:
        return None
    return n if 0 < n <= MAX_CHOICES_OWNED else None


def choice_ids(request_id: str, n: int) -> tuple[str, ...]:
    """The requests a response of ``n`` choices runs as: choice ``k`` is ``<id>.<k>``, so
    whoever holds the response id can name them all (an engine aborting it, a replica
    replaying it)."""
    return tuple(f"{request_id}.{k}" for k in range(n))


def valid_request_id(request_id: str) -> bool:
    return bool(REQUEST_ID_RE.fullmatch(request_id))


_REQUEST_IDS_RE = re.compile(r"(?:[A-Za-z0-9_.:@-]{1,128}\n)*")


def _all_str(items: Sequence[object]) -> TypeGuard[Sequence[str]]:
    return all(type(r) is str for r in items)


def all_valid_request_ids(request_ids: Sequence[object]) -> bool:
    """True when every item is a valid request id: one regex pass over them all (a 1,000-id
    abort would otherwise run 1,000), for the common case; False says only "look closer"."""
    if not request_ids or not _all_str(request_ids):
        return False
    joined = "\n".join(request_ids)
    if joined.count("\n") != len(request_ids) - 1:  # an id with a newline in it: not valid
        return False
    return _REQUEST_IDS_RE.fullmatch(joined + "\n") is not None


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "fd"

    def __post_init__(self) -> None:
        if not PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"invalid key prefix {self.prefix!r}: use letters, digits, '_.:-'")

    @property
    def requests(self) -> str:
        """Stream of new requests; consumed by engines through group ``engines``."""
        return f"{self.prefix}:requests"

    @property
    def control(self) -> str:
        """Broadcast stream: abort, abort_all, drain. Every engine reads it with its own cursor."""
        return f"{self.prefix}:control"

    @property
    def dead(self) -> str:
        """Dead letters: events that could not be decoded, with the reason."""
        return f"{self.prefix}:dead"

    def req(self, request_id: str) -> str:
        """A request's whole story, in order: accepted ... final."""
        return f"{self.prefix}:req:{{{request_id}}}"

    def owner(self, request_id: str) -> str:
        """Which engine owns a request, or the abort tombstone; SET NX decides the race."""
        return f"{self.prefix}:owner:{{{request_id}}}"

    def conversation(self, request_id: str) -> str:
        """A Responses API request's conversation (the input items it was given, after those of
        the response it continued), JSON: what ``previous_response_id`` goes on from. Kept as
        long as the story."""
        return f"{self.prefix}:conv:{{{request_id}}}"

    @property
    def lifecycle(self) -> str:
        """Capped stream of request milestones and engine loads (events.LIFECYCLE_TYPES), for
        routers, autoscalers and dashboards: ``redis-cli XREAD BLOCK 0 STREAMS fd:lifecycle $``."""
        return f"{self.prefix}:lifecycle"

    def journal(self, engine_id: str) -> str:
        return f"{self.prefix}:journal:{engine_id}"

    @property
    def loras(self) -> str:
        """Hash: LoRA adapters loaded at run time (name -> path), for engines that start later."""
        return f"{self.prefix}:loras"

    def engine(self, engine_id: str) -> str:
        """Heartbeat hash of one engine, with an EXPIRE a few heartbeats long."""
        return f"{self.prefix}:engine:{engine_id}"

    def health(self, api_id: str) -> str:
        """String, EXPIRE: an API replica's ``/health`` write probe (a Redis that refuses
        writes answers reads and pings)."""
        return f"{self.prefix}:health:{api_id}"

    def lane(self, engine_id: str) -> str:
        """Stream of requests placed for one engine (fd/control/lanes.py), waiting for it to
        take them or for another to steal them. Hash-tagged with ``P:requests``'s name, so a
        lane, the registry and ``P:requests`` share a Redis Cluster slot and one script moves
        a request from a lane onto ``P:requests``."""
        if "{" in engine_id or "}" in engine_id:
            raise ValueError(f"invalid engine id {engine_id!r}: no braces")
        return f"{self.prefix}:lane:{engine_id}:{{{self.requests}}}"

    @property
    def lanes(self) -> str:
        """Set of the engines that have a lane (placement's registry; the slot of ``P:requests``)."""
        return f"{self.prefix}:lanes:{{{self.requests}}}"

    def card(self, engine_id: str) -> str:
        """Hash, EXPIRE: an engine's placement card, what the API places by (its load and the
        blocks its prefix cache holds)."""
        return f"{self.prefix}:card:{engine_id}"

    def engine_pattern(self) -> str:
        return f"{self.prefix}:engine:*"

    def wake(self, reader_id: str) -> str:
        """Per-reader doorbell stream: XADDed when a reader gains a key to watch, so a blocked
        multiplexed XREAD wakes up at once instead of after its BLOCK timeout (we never cancel
        a blocking read; see DESIGN.md §6)."""
        return f"{self.prefix}:wake:{reader_id}"

    def wake_in_slot(self, reader_id: str, tag: str) -> str:
        """A doorbell for a Redis Cluster reader: hash-tagged with ``tag`` (a request id whose
        stream the reader watches) so one XREAD can name it together with that slot's streams."""
        return f"{self.prefix}:wake:{{{tag}}}:{reader_id}"
