"""The error of a stream entry that cannot be decoded into its event.

Whatever raises it (the field codec, a payload's strict parser) names the field at fault, and
the reader that caught it copies the entry to ``P:dead`` with that reason
(fd/control/dead_letters.py) instead of letting it reach an engine step or a handler.
"""

from __future__ import annotations


class BadEvent(ValueError):
    """An event that cannot be decoded. ``field`` names the culprit for the dead letter."""

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(reason if field is None else f"{field}: {reason}")
        self.reason = reason
        self.field = field
