"""OpenAI-shaped errors.

Every failure a client can see is an :class:`ApiError`, so that the body always has OpenAI's
``{"error": {"message", "type", "param", "code"}}`` shape whatever raised it: the official
clients map that shape to their exception types, and anything else surfaces as a parse error.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answer: HTTP ``status`` plus the four OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(
    max_model_len: int, prompt_tokens: int, completion_tokens: int | None, param: str
) -> ApiError:
    """OpenAI's (and vLLM's) words for a request that does not fit the context: clients match
    them (LiteLLM's ContextWindowExceededError looks for "This model's maximum context length
    is"; some read the counts back to shrink ``max_tokens``). ``completion_tokens`` None: the
    request asked no output length, so only the prompt is counted, as OpenAI words it then."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if completion_tokens is None:
        message = (
            f"{head}your messages resulted in {prompt_tokens} tokens. "
            "Please reduce the length of the messages."
        )
    else:
        message = (
            f"{head}you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in "
            f"the messages, {completion_tokens} in the completion). Please reduce the length of "
            "the messages or completion."
        )
    return bad_request(message, param, "context_length_exceeded")


def unauthorized(message: str = "Invalid or missing API key.") -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def conflict(message: str, param: str | None = None) -> ApiError:
    return ApiError(409, message, "invalid_request_error", param, "duplicate_request_id")


def id_taken(shown: str) -> ApiError:
    """The 409 for a client's ``X-Request-Id`` that a request already has."""
    return conflict(f"A request with id '{shown}' already exists.", "X-Request-Id")


def too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"Request body is larger than {limit} bytes.", "invalid_request_error", None, "request_too_large"
    )


def server_error(message: str) -> ApiError:
    return ApiError(500, message, "server_error", None, None)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "service_unavailable")


def story_lost(message: str) -> ApiError:
    """A request whose story disappeared from Redis before its final (fd.control.mux.StoryLost):
    a 503, which clients retry, since nothing of it can be recovered."""
    return ApiError(503, message, "service_unavailable", None, "story_lost")
