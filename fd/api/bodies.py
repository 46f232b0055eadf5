"""OpenAI's response shapes: the JSON bodies and SSE chunks of chat and text completions, and
the usage and error a final becomes. Pure values; fd/api/rendering.py's renderers fill them
from a request's events.
"""

from __future__ import annotations

from typing import Any

from fd.api.errors import ApiError
from fd.api.validation import is_int
from fd.control.endings import usage
from fd.control.events import Final


def final_usage(final: Final, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The engine's usage when it sent one, else what this replica counted; with OpenAI's
    ``prompt_tokens_details.cached_tokens`` when the prefix cache spared some of the prompt."""
    u = final.usage or {}
    p = u.get("prompt_tokens", prompt_tokens)
    c = u.get("completion_tokens", completion_tokens)
    if not (is_int(p) and is_int(c)):
        return usage(prompt_tokens, completion_tokens)
    out: dict[str, Any] = usage(p, c)
    cached = u.get("cached_tokens")
    if is_int(cached) and 0 < cached <= p:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def chat_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
        "usage": usage_,
    }


def text_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    d = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        d["usage"] = None  # OpenAI: null on every chunk but the last when usage is requested
    return d


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    d = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        d["usage"] = None
    return d


def usage_chunk(endpoint: str, rid: str, created: int, model: str, usage_: dict) -> dict[str, Any]:
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def stop_reason(final: Final) -> str | int | None:
    """vLLM's ``stop_reason``: the stop token as an integer, else the stop string."""
    return final.stop_token if final.stop_token is not None else final.stop_reason


def final_error(final: Final) -> ApiError:
    return ApiError(
        500, final.error or "The engine failed while generating.", "server_error", None, "engine_error"
    )
