"""The ``data`` of a ``request`` event: everything an engine needs to run the request.

It rides as one JSON field of the event (fd/control/events.py), read strictly: anything that
is not what an engine can run is a :class:`~fd.control.bad_event.BadEvent`, so a dead letter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fd.control.bad_event import BadEvent
from fd.control.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestData:
    """The ``data`` JSON of a ``request`` event: everything an engine needs to run it."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    arrival_ts: int = 0
    model: str = ""
    api: str = ""  # the API replica that accepted it; informational
    background: bool = False
    #: A choice of a response of n > 1 (``<parent>.<k>``): the engine renews the response's
    #: own story and mark with the choice's, at its final, so they live as long as the choices
    #: even when no handler is left to do it (a ``background`` response whose client went).
    #: Only written when set; an engine of an earlier release ignores it.
    parent: str = ""
    #: vLLM's priority (lower runs first), for an engine with --scheduling-policy priority; the
    #: rest take requests in arrival order. Only written when not 0.
    priority: int = 0

    def to_json(self) -> dict[str, Any]:
        d = {
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "arrival_ts": self.arrival_ts,
            "model": self.model,
            "api": self.api,
            "background": self.background,
        }
        if self.parent:
            d["parent"] = self.parent
        if self.priority:
            d["priority"] = self.priority
        return d

    @classmethod
    def from_json(cls, d: Any) -> RequestData:
        if not isinstance(d, dict):
            raise BadEvent("must be a JSON object", "data")
        ids = d.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise BadEvent("prompt_token_ids must be a non-empty list of token ids", "data")
        sampling = d.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise BadEvent("sampling must be a JSON object", "data")
        try:
            sp = SamplingParams.from_dict(sampling)
        except TypeError as e:
            raise BadEvent(f"bad sampling parameters: {e}", "data") from None
        arrival = d.get("arrival_ts") or 0
        if not isinstance(arrival, int) or isinstance(arrival, bool):
            raise BadEvent("arrival_ts must be an integer (ms)", "data")
        priority = d.get("priority") or 0
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise BadEvent("priority must be an integer", "data")
        return cls(
            prompt_token_ids=tuple(ids),
            sampling=sp,
            arrival_ts=arrival,
            model=str(d.get("model") or ""),
            api=str(d.get("api") or ""),
            background=bool(d.get("background", False)),
            parent=str(d.get("parent") or ""),
            priority=priority,
        )
