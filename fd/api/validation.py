"""Request validation, without I/O: a request body's JSON, its fields' types and ranges, and
what the served model allows (:class:`Limits`).

Every rejection is decided here or in the parses built on these checks before anything
reaches Redis (a rejected request leaves no trace on ``P:requests``). The helpers take the
body as a plain mapping and raise the error a client should see, so each endpoint's parse
(:mod:`fd.api.protocol`, :mod:`fd.api.responses`, :mod:`fd.api.embeddings`) reads as the
list of its fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from fd.api.errors import bad_request, not_found, too_large
from fd.control.sampling import MAX_LOGPROBS

MAX_BODY_BYTES = 4 << 20  # a request body's size, unless the server says otherwise
DEFAULT_MAX_TOKENS = 16  # completions' max_tokens when a request gives none (OpenAI's)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What the served model allows; the validation context (the API's config makes it:
    :meth:`fd.api.config.ApiConfig.limits`). Built by keyword: its fields are many and mostly of
    one type, where a position would let two swap unseen."""

    model_name: str
    max_model_len: int
    max_body_bytes: int = MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # completions; chat: the rest of the context
    vocab_size: int | None = None
    tool_parser: str | None = None  # --tool-call-parser (with --enable-auto-tool-choice)
    # The model's generation_config.json (--generation-config): sampling defaults for requests
    # that leave them out, and max_new_tokens as a cap on every request's output (as vLLM).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    reasoning_parser: str | None = None  # --reasoning-parser (fd.api.reasoning)
    # --served-model-name's other names: a request may use any, the answer says model_name
    model_aliases: tuple[str, ...] = ()
    # vLLM's server-wide defaults: --enable-force-include-usage (every stream ends with its
    # usage chunk) and --return-tokens-as-token-ids (unless a request says otherwise)
    force_include_usage: bool = False
    tokens_as_ids: bool = False
    priority_scheduling: bool = False  # --scheduling-policy priority: `priority` is taken
    lora_names: tuple[str, ...] = ()  # vLLM's --lora-modules: a request's `model` may name one


#: OpenAI's fields that ask for nothing a server does (bookkeeping on OpenAI's side): taken
#: without a word, where other fields the parse never looked at are said to be ignored.
QUIET_FIELDS = frozenset({"user", "store", "metadata", "service_tier"})


class Body(dict):
    """A request's JSON object that remembers which fields its parse looked at: the others
    were ignored, which the API says in its log as vLLM does (a misspelt or unsupported
    field otherwise changes nothing, silently)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: set[str] = set(QUIET_FIELDS)

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def replaced(self, changes: dict[str, Any]) -> Body:
        """A copy with ``changes``, whose reads count as this one's."""
        out = Body({**self, **changes})
        out.seen = self.seen
        return out

    def ignored(self) -> list[str]:
        return sorted(k for k in self if k not in self.seen)


def parse_body(raw: bytes, limits: Limits) -> Body:
    """The JSON object of a request body, or the error a client should see."""
    if len(raw) > limits.max_body_bytes:
        raise too_large(limits.max_body_bytes)
    if not raw.strip():
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return Body(body)


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def opt(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    """``body[name]`` when present and not null, after a type check; else ``default``."""
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad_request(f"'{name}' must be {what}.", name, "invalid_type")
    return v


def check_model(body: dict, limits: Limits) -> str:
    model = body.get("model")
    if model is None:
        return limits.model_name  # like vLLM: the one served model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model", "invalid_type")
    if model in limits.lora_names:
        return model  # a LoRA adapter (as vLLM: the answer names it)
    if model != limits.model_name and model not in limits.model_aliases:
        raise not_found(f"The model '{model}' does not exist.", "model", "model_not_found")
    return limits.model_name  # (as vLLM: an answer names the first of the served names)


def reject_unsupported(body: dict, names: dict[str, Any]) -> None:
    for name, ok in names.items():
        v = body.get(name)
        if v is not None and v is not False and v != ok:
            raise bad_request(f"'{name}' is not supported by this server.", name, "unsupported")


def stream_opts(body: dict, limits: Limits | None = None) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage``, and vLLM's
    ``stream_options.continuous_usage_stats`` (usage on every chunk; with include_usage only,
    as in vLLM)."""
    stream = opt(body, "stream", is_bool, "a boolean", False)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options", "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
        iu = opts.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad_request(
                "'stream_options.include_usage' must be a boolean.",
                "stream_options.include_usage",
                "invalid_type",
            )
        include_usage = bool(iu)
        cu = opts.get("continuous_usage_stats")
        if cu is not None and not isinstance(cu, bool):
            raise bad_request(
                "'stream_options.continuous_usage_stats' must be a boolean.",
                "stream_options.continuous_usage_stats",
                "invalid_type",
            )
        continuous = include_usage and bool(cu)
    if stream and limits is not None and limits.force_include_usage:
        include_usage = True
    return stream, include_usage, continuous


def top_logprobs(n: int, param: str) -> int:
    if not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"'{param}' must be between 0 and {MAX_LOGPROBS}.", param, "invalid_value")
    return n


def prompt_scores(body: dict, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: each prompt token's log-probability and rank, with this many
    alternatives; as in vLLM, not on a stream."""
    k = opt(body, "prompt_logprobs", is_int, "an integer", None)
    if k is None:
        return None
    if stream:
        raise bad_request(
            "'prompt_logprobs' is not available when 'stream' is true.", "prompt_logprobs", "invalid_value"
        )
    return top_logprobs(k, "prompt_logprobs")


def truncation_of(body: dict, limits: Limits) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep only a prompt's last k tokens (-1: as many as
    the context holds). None: leave prompts whole."""
    k = opt(body, "truncate_prompt_tokens", is_int, "an integer", None)
    if k is None:
        return None
    if k == -1:
        return limits.max_model_len
    if k < 1:
        raise bad_request(
            "'truncate_prompt_tokens' must be -1 or at least 1.", "truncate_prompt_tokens", "invalid_value"
        )
    if k > limits.max_model_len:
        raise bad_request(
            f"'truncate_prompt_tokens' ({k}) is more than the model's context "
            f"({limits.max_model_len} tokens).",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    return k


def priority_of(body: dict, limits: Limits) -> int:
    """vLLM's ``priority``: taken on a server with ``--scheduling-policy priority``, refused
    (other than 0) elsewhere, as vLLM refuses it."""
    p = opt(body, "priority", is_int, "an integer", 0)
    if p and not limits.priority_scheduling:
        raise bad_request(
            "'priority' needs a server started with --scheduling-policy priority.", "priority", "unsupported"
        )
    if not -(2**31) <= p < 2**31:
        raise bad_request("'priority' must be a 32-bit integer.", "priority", "invalid_value")
    return p


def tokens_as_ids_of(body: dict, limits: Limits) -> bool:
    return opt(body, "return_tokens_as_token_ids", is_bool, "a boolean", limits.tokens_as_ids)


def lora_of(body: dict, limits: Limits) -> str:
    """The LoRA adapter a request's ``model`` names (vLLM's --lora-modules), "" for the base."""
    model = body.get("model")
    return model if isinstance(model, str) and model in limits.lora_names else ""


def background_of(body: dict) -> bool:
    return opt(body, "background", is_bool, "a boolean", False)


def check_ids(ids: list, limits: Limits, param: str) -> tuple[int, ...]:
    vocab = limits.vocab_size
    for t in ids:
        if not is_int(t) or t < 0 or (vocab is not None and t >= vocab):
            raise bad_request(
                f"'{param}' contains an invalid token id {t!r}"
                + (f" (vocabulary size {vocab})." if vocab else "."),
                param,
                "invalid_value",
            )
    return tuple(ids)
