"""The API node: OpenAI-compatible HTTP in front of the event log (DESIGN.md §5)."""

from fd.api.config import ApiConfig
from fd.api.errors import ApiError
from fd.api.server import make_app

__all__ = ["ApiConfig", "ApiError", "make_app"]
