"""The OpenAI protocol's requests, without I/O: request bodies in, validated values out
(fd/api/rendering.py makes the responses).

Keeping this pure means every rejection is decided before anything reaches Redis (a rejected
request leaves no trace on ``P:requests``), and every response shape is testable without a
server. The only collaborator is the tokenizer, used as a pure function (text -> ids).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from control.guided import GuidedError, canonical, check, starting_after
from control.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, SamplingParams
from fd.api.errors import ApiError, bad_request, not_found, too_large
from fd.api.reasoning import END as REASONING_END
from fd.api.reasoning import START as REASONING_START
from fd.api.tool_calls import (
    forced_spec,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128
FINISH_REASONS = ("stop", "length", "abort", "error")


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows; the validation context."""

    model_name: str
    max_model_len: int
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 16  # completions; chat defaults to the rest of the context
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


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated generating request, ready to become a ``request`` event."""

    endpoint: str  # "chat" | "completion"
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    background: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    n: int = 1  # choices: n > 1 runs as n requests, ``<id>.<index>`` (see :func:`choice_ids`)
    prompts: tuple[tuple[int, ...], ...] = ()  # a completions batch (more than one prompt)
    # completions' echo: each prompt's text, shown before its completion; echo_only when the
    # client asked max_tokens=0 (the engine is asked for one token, which is not shown)
    echo_texts: tuple[str, ...] = ()
    echo_only: bool = False
    tool_parser: str | None = None  # chat with tools: how its calls are read (see _tools)
    reasoning_parser: str | None = None  # chat on a server with --reasoning-parser, unguided
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the answer
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>" in logprobs
    prompt_logprobs: int | None = None  # vLLM's: the response's `prompt_logprobs`, k alternatives
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    priority: int = 0  # vLLM's (with --scheduling-policy priority): lower starts first

    def rendering(self) -> dict[str, Any]:
        """The ``accepted`` event's fields that say how every replica renders the output."""
        return {
            "tool_parser": self.tool_parser,
            "reasoning_parser": self.reasoning_parser,
            "include_reasoning": None if self.include_reasoning or not self.reasoning_parser else False,
            "tokens_as_ids": self.tokens_as_ids or None,
            "prompt_logprobs": self.prompt_logprobs,
        }

    def prompt_ids_field(self, prompt: tuple[int, ...]) -> dict[str, Any]:
        """The ``accepted`` event's ``prompt_ids``: the prompt, when the answer shows it."""
        return {"prompt_ids": prompt} if self.return_token_ids else {}

    def choices(self) -> list[tuple[tuple[int, ...], SamplingParams]]:
        """Each choice's prompt and sampling, in OpenAI's order: prompt ``i``'s ``j``-th choice
        is choice ``i * n + j``."""
        return [
            (p, choice_sampling(self.sampling, j))
            for p in self.prompts or (self.prompt_token_ids,)
            for j in range(self.n)
        ]


MAX_CHOICES = 16  # n: each choice is a request of its own on the engines
MAX_BATCH = 256  # prompts x n, of one completions request


def choice_sampling(sp: SamplingParams, k: int) -> SamplingParams:
    """Choice ``k``'s sampling: with a seed, ``seed + k`` (as vLLM), so the choices differ and
    each is reproducible on its own."""
    if sp.seed is None or k == 0:
        return sp
    return dataclasses.replace(sp, seed=(sp.seed + k) % 2**63)


# ------------------------------------------------------------------------- body parsing


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

    def replaced(self, changes: dict[str, Any]) -> "Body":
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


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _opt(body: dict, name: str, check, what: str, default: Any = None) -> Any:
    """``body[name]`` when present and not null, after a type check; else ``default``."""
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad_request(f"'{name}' must be {what}.", name, "invalid_type")
    return v


def _check_model(body: dict, limits: Limits) -> str:
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


def _reject_unsupported(body: dict, names: dict[str, Any]) -> None:
    for name, ok in names.items():
        v = body.get(name)
        if v is not None and v is not False and v != ok:
            raise bad_request(f"'{name}' is not supported by this server.", name, "unsupported")


def _choices(body: dict) -> int:
    """``n``, with ``best_of`` equal to it or absent (a best_of that ranks more candidates
    than it returns is not supported)."""
    n = _opt(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must be between 1 and {MAX_CHOICES}.", "n", "invalid_value")
    best_of = _opt(body, "best_of", _is_int, "an integer", n)
    if best_of != n:
        raise bad_request("Only best_of equal to n is supported.", "best_of", "unsupported")
    return n


def _stream_opts(body: dict, limits: Limits | None = None) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage``, and vLLM's
    ``stream_options.continuous_usage_stats`` (usage on every chunk; with include_usage only,
    as in vLLM)."""
    stream = _opt(body, "stream", _is_bool, "a boolean", False)
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


def _top_logprobs(n: int, param: str) -> int:
    if not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"'{param}' must be between 0 and {MAX_LOGPROBS}.", param, "invalid_value")
    return n


def _sampling(
    body: dict, prompt_len: int, limits: Limits, default_max: int | None, logprobs: int | None = None
) -> SamplingParams:

    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"The prompt is {prompt_len} tokens long; this model's context is {limits.max_model_len} "
            f"tokens, which leaves no room to generate.",
            "messages" if default_max is None else "prompt",
            "context_length_exceeded",
        )
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = _opt(body, name, _is_int, "an integer", None)
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be at least 1.", name, "invalid_value")
            if v > room:
                raise bad_request(
                    f"'{name}' is {v}, but the prompt is {prompt_len} tokens and this model's context "
                    f"is {limits.max_model_len} tokens: at most {room} can be generated.",
                    name,
                    "context_length_exceeded",
                )
            max_tokens = v
            break
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if limits.max_output_tokens is not None:  # (the model's max_new_tokens: a server-wide cap)
        max_tokens = min(max_tokens, limits.max_output_tokens)

    defaults = limits.sampling_defaults
    temperature = float(_opt(body, "temperature", _is_num, "a number", defaults.get("temperature", 1.0)))
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("'temperature' must be between 0 and 2.", "temperature", "invalid_value")
    top_p = float(_opt(body, "top_p", _is_num, "a number", defaults.get("top_p", 1.0)))
    if not 0.0 < top_p <= 1.0:
        raise bad_request("'top_p' must be in (0, 1].", "top_p", "invalid_value")
    top_k = _opt(body, "top_k", _is_int, "an integer", defaults.get("top_k", 0))
    if top_k < -1:
        raise bad_request("'top_k' must be -1, 0 (off) or a positive integer.", "top_k", "invalid_value")
    seed = _opt(body, "seed", _is_int, "an integer", None)
    if seed is not None and not 0 <= seed < 2**63:  # what an engine accepts (control.events)
        raise bad_request("'seed' must be an integer in [0, 2**63).", "seed", "invalid_value")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _opt(body, name, _is_num, "a number", 0.0)
        if not -2.0 <= v <= 2.0:
            raise bad_request(f"'{name}' must be between -2 and 2.", name, "invalid_value")
        penalties[name] = float(v)
    rp = _opt(body, "repetition_penalty", _is_num, "a number", defaults.get("repetition_penalty", 1.0))
    if not 0 < rp <= MAX_REPETITION_PENALTY:
        raise bad_request(
            f"'repetition_penalty' must be greater than 0 and at most {MAX_REPETITION_PENALTY:g} (1 is off).",
            "repetition_penalty",
            "invalid_value",
        )
    penalties["repetition_penalty"] = float(rp)
    min_p = _opt(body, "min_p", _is_num, "a number", defaults.get("min_p", 0.0))
    if not 0.0 <= min_p <= 1.0:
        raise bad_request("'min_p' must be between 0 and 1.", "min_p", "invalid_value")
    min_tokens = _opt(body, "min_tokens", _is_int, "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise bad_request(
            f"'min_tokens' must be between 0 and max_tokens ({max_tokens}).", "min_tokens", "invalid_value"
        )
    logit_bias = _logit_bias(body, limits)

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise bad_request("'stop' must be a string or a list of strings.", "stop", "invalid_type")
    stop_token_ids = _check_ids(
        _opt(
            body,
            "stop_token_ids",
            lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
            "a list of token ids",
            [],
        ),
        limits,
        "stop_token_ids",
    )
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            raise bad_request(
                "'allowed_token_ids' must be a non-empty list of token ids.",
                "allowed_token_ids",
                "invalid_type",
            )
        allowed = tuple(sorted(set(_check_ids(allowed, limits, "allowed_token_ids"))))
    ignore_eos = _opt(body, "ignore_eos", _is_bool, "a boolean", False)
    include_stop = _opt(body, "include_stop_str_in_output", _is_bool, "a boolean", False)
    skip_special = _opt(body, "skip_special_tokens", _is_bool, "a boolean", True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop,
        logit_bias=logit_bias,
        min_p=float(min_p),
        min_tokens=min_tokens,
        logprobs=logprobs,
        guided=_guided(body),
        skip_special_tokens=skip_special,
        allowed_token_ids=allowed or (),
        lora=lora_of(body, limits),
        **penalties,
    )


def lora_of(body: dict, limits: Limits) -> str:
    """The LoRA adapter a request's ``model`` names (vLLM's --lora-modules), "" for the base."""
    model = body.get("model")
    return model if isinstance(model, str) and model in limits.lora_names else ""


#: What a model's generation_config.json may set for requests that do not (the keys vLLM reads).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(gen: dict[str, Any]) -> tuple[dict[str, Any], int | None, list[str]]:
    """A model's ``generation_config.json``, as vLLM's ``--generation-config auto`` reads it:
    the sampling defaults it recommends, its ``max_new_tokens`` (a cap on every request's
    output), and what was left out, with why. A value a request could not have (a
    temperature of 7) is left out, not fatal: the file is the model maker's, not the
    operator's. ``top_k`` 50 is transformers' own default, which vLLM does not take as the
    model's; ``do_sample`` is not read (vLLM ignores it too)."""
    defaults: dict[str, Any] = {}
    ignored: list[str] = []
    probe = Limits(model_name="", max_model_len=2)
    for key in GENERATION_KEYS:
        if key not in gen or gen[key] is None or (key == "top_k" and gen[key] == 50):
            continue
        try:
            _sampling({key: gen[key]}, 1, probe, None)
        except ApiError as e:
            ignored.append(f"{key}: {e.message}")
            continue
        defaults[key] = gen[key]
    cap = gen.get("max_new_tokens")
    if cap is not None and not (_is_int(cap) and cap >= 1):
        ignored.append(f"max_new_tokens: {cap!r} is not a positive integer")
        cap = None
    return defaults, cap, ignored


_GUIDED_PARAMS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _guided(body: dict) -> str:
    """A structured output, however it was asked: OpenAI's ``response_format`` (``json_object``,
    ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``, or vLLM's newer ``structured_outputs`` object. At most one; checked
    by compiling its grammar here (control.guided), so a bad one is a 400, not a failed request."""
    asked: list[tuple[str, dict]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_request(
                "'response_format' must be an object with a 'type'.", "response_format", "invalid_type"
            )
        if rf["type"] == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "'response_format.json_schema.schema' must be a JSON Schema object.",
                    "response_format",
                    "invalid_value",
                )
            asked.append(("response_format", {"json": schema}))
        elif rf["type"] != "text":
            raise bad_request(
                f"'response_format' type {rf['type']!r} is not one of text, json_object, json_schema.",
                "response_format",
                "invalid_value",
            )
    for name, kind in _GUIDED_PARAMS.items():
        v = body.get(name)
        if v is not None:
            if kind == "json" and isinstance(v, str):
                try:
                    v = orjson.loads(v)
                except orjson.JSONDecodeError:
                    raise bad_request(f"'{name}' is not JSON.", name, "invalid_value") from None
            asked.append((name, {kind: v}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'structured_outputs' must be an object.", "structured_outputs", "invalid_type")
        for kind in ("json", "regex", "choice", "grammar"):
            if so.get(kind) is not None:
                asked.append(("structured_outputs", {kind: so[kind]}))
        if so.get("json_object"):
            asked.append(("structured_outputs", {"json_object": True}))
    if not asked:
        return ""
    if len(asked) > 1:
        raise bad_request(
            f"Ask for one structured output, not {len(asked)} ("
            + ", ".join(sorted({n for n, _ in asked}))
            + ").",
            asked[1][0],
            "invalid_value",
        )
    name, spec = asked[0]
    try:
        text = canonical(spec)
        check(text)
    except GuidedError as e:
        raise bad_request(f"'{name}': {e}", name, "invalid_value") from None
    return text


def _logit_bias(body: dict, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``, bias in [-100, 100]; as sorted (id, bias) pairs."""
    raw = _opt(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id: bias", {})
    out = []
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or (limits.vocab_size is not None and token >= limits.vocab_size):
            raise bad_request(
                f"'logit_bias' has an invalid token id {key!r}"
                + (f" (vocabulary size {limits.vocab_size})." if limits.vocab_size else "."),
                "logit_bias",
                "invalid_value",
            )
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias' values must be numbers between -100 and 100, got {bias!r:.20}.",
                "logit_bias",
                "invalid_value",
            )
        out.append((token, float(bias)))
    return tuple(sorted(out))


def _background(body: dict) -> bool:
    return _opt(body, "background", _is_bool, "a boolean", False)


def _check_ids(ids: list, limits: Limits, param: str) -> tuple[int, ...]:
    vocab = limits.vocab_size
    for t in ids:
        if not _is_int(t) or t < 0 or (vocab is not None and t >= vocab):
            raise bad_request(
                f"'{param}' contains an invalid token id {t!r}"
                + (f" (vocabulary size {vocab})." if vocab else "."),
                param,
                "invalid_value",
            )
    return tuple(ids)


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(
                    f"messages[{i}].content[{j}] must be an object with a 'type'.",
                    f"messages[{i}].content",
                    "invalid_type",
                )
            if part["type"] != "text":
                raise bad_request(
                    f"Content parts of type '{part['type']}' are not supported.",
                    f"messages[{i}].content",
                    "unsupported",
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content[{j}].text must be a string.",
                    f"messages[{i}].content",
                    "invalid_type",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(
        f"messages[{i}].content must be a string or a list of text parts.",
        f"messages[{i}].content",
        "invalid_type",
    )


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The chat messages as ``[{"role", "content"}]`` with text content, validated."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list.", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object.", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(
                f"messages[{i}].role is required and must be a string.", f"messages[{i}].role", "invalid_type"
            )
        if role not in ROLES:
            raise bad_request(
                f"messages[{i}].role '{role}' is not one of {', '.join(ROLES)}.",
                f"messages[{i}].role",
                "invalid_value",
            )
        calls = _message_tool_calls(m, i) if role == "assistant" else None
        if m.get("content") is None and not calls:
            raise bad_request(
                f"messages[{i}].content is required.", f"messages[{i}].content", "missing_required_parameter"
            )
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if m.get("content") is None else _message_text(m["content"], i),
        }
        if calls:
            msg["tool_calls"] = calls
        if role == "assistant" and m.get("reasoning_content") is not None:
            # an earlier answer's thinking, as this server returned it: for the chat template
            # (Qwen3's keeps the latest turn's), as vLLM passes it
            if not isinstance(m["reasoning_content"], str):
                raise bad_request(
                    f"messages[{i}].reasoning_content must be a string.",
                    f"messages[{i}].reasoning_content",
                    "invalid_type",
                )
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad_request(
                            f"messages[{i}].{key} must be a string.", f"messages[{i}].{key}", "invalid_type"
                        )
                    msg[key] = m[key]
        out.append(msg)
    return out


def _message_tool_calls(m: dict, i: int) -> list[dict] | None:
    """An assistant message's earlier ``tool_calls``, for the chat template, their arguments
    as objects (what HF templates expect; OpenAI sends them as JSON text), as vLLM does."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list.", where, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{where}[{j}] must be an object with a 'function' that has a 'name'.", where, "invalid_type"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = orjson.loads(args) if args.strip() else {}
            except orjson.JSONDecodeError:
                raise bad_request(
                    f"{where}[{j}].function.arguments is not JSON.", where, "invalid_value"
                ) from None
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def _tools(body: dict, limits: Limits) -> tuple[list[dict] | None, str | None]:
    """``tools`` for the chat template, and how the model's calls are read (the ``accepted``
    event's ``tool_parser``): the server's parser for ``auto`` (the default with tools; as in
    vLLM it needs a server started with one), ``required`` or ``named:<function>`` for a forced
    call (guided to the tools' schemas: :func:`fd.api.tool_calls.forced_spec`), nothing for
    ``none`` (the model is still shown the tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice", "invalid_value")
        return None, None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools.", "tools", "invalid_value")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{j}] must be {{"type": "function", "function": {{...}}}}.', "tools", "invalid_type"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{j}].function.name is required.", "tools", "missing_required_parameter")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(
                f"tools[{j}].function.parameters must be a JSON Schema object.", "tools", "invalid_type"
            )
    if not tools:
        return None, None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return tools, None
    if choice == "auto":
        if limits.tool_parser is None:
            raise bad_request(
                '"auto" tool choice needs a server started with '
                "--enable-auto-tool-choice and --tool-call-parser.",
                "tool_choice",
                "unsupported",
            )
        return tools, limits.tool_parser
    if choice == "required":
        return tools, "required"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                'A named tool_choice must be {"type": "function", "function": {"name": <one of the tools>}}.',
                "tool_choice",
                "invalid_value",
            )
        return tools, "named:" + name
    raise bad_request(
        '\'tool_choice\' must be "none", "auto", "required" or a named function.',
        "tool_choice",
        "invalid_value",
    )


def parse_chat(body: dict, limits: Limits, tokenizer: TokenizerLike) -> GenerationRequest:
    model = _check_model(body, limits)
    priority = _priority(body, limits)
    tools, parser = _tools(body, limits)
    parallel = _opt(body, "parallel_tool_calls", _is_bool, "a boolean", True)
    want = _opt(body, "logprobs", _is_bool, "a boolean", False)
    top = _opt(body, "top_logprobs", _is_int, "an integer", None)
    if top and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs", "invalid_value")
    logprobs = _top_logprobs(top or 0, "top_logprobs") if want else None
    messages = parse_messages(body)
    stream, include_usage, continuous = _stream_opts(body, limits)
    background = _background(body)
    ids = _chat_ids(messages, tokenizer, _chat_rendering(body, messages), tools, _template_kwargs(body))
    keep = _truncation(body, limits)
    if keep:
        ids = ids[-keep:]
    if not ids:
        raise bad_request("The prompt is empty.", "messages", "invalid_value")
    sampling = _with_bad_words(body, _sampling(body, len(ids), limits, None, logprobs), tokenizer)
    scored = _prompt_scores(body, stream)
    if scored is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=scored)
    reasoning = limits.reasoning_parser
    if reasoning and sampling.guided:
        # As vLLM: the model thinks freely, and its answer after </think> is the grammar's,
        # unless the prompt closed the thinking already (Qwen3's enable_thinking false). A
        # tokenizer without </think> as one token: the grammar from the first token, and
        # nothing to read as thinking.
        end = tokenizer.encode(REASONING_END)
        if len(end) != 1:
            reasoning = None
        elif not _thinking_closed(ids, tokenizer.encode(REASONING_START), end[0]):
            sampling = dataclasses.replace(sampling, guided=starting_after(sampling.guided, end[0]))
    if parser == "mistral":  # (its tags are special tokens: their text must reach the parser)
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    forced = forced_spec(parser, tools, parallel) if parser else None
    if forced is not None:  # tool_choice "required" or a named function: the output is the call
        reasoning = None  # (from its first token: no thinking)
        if sampling.guided:
            raise bad_request(
                "A forced tool_choice and a structured output cannot go together.",
                "tool_choice",
                "invalid_value",
            )
        try:
            guided = canonical(forced)
            check(guided)
        except GuidedError as e:
            raise bad_request(
                f"The tools' parameters do not compile: {e}", "tools", "invalid_value"
            ) from None
        sampling = dataclasses.replace(sampling, guided=guided)
    return GenerationRequest(
        "chat",
        model,
        ids,
        sampling,
        stream,
        include_usage,
        background,
        continuous,
        _choices(body),
        tool_parser=parser,
        reasoning_parser=reasoning,
        include_reasoning=_opt(body, "include_reasoning", _is_bool, "a boolean", True),
        tokens_as_ids=_tokens_as_ids(body, limits),
        prompt_logprobs=scored,
        return_token_ids=_opt(body, "return_token_ids", _is_bool, "a boolean", False),
        priority=priority,
    )


def _thinking_closed(ids: tuple[int, ...], start: list[int], end: int) -> bool:
    """The prompt ends its thinking itself: a </think> after the last <think> (if any)."""
    if end not in ids:
        return False
    last_end = len(ids) - 1 - ids[::-1].index(end)
    if len(start) != 1 or start[0] not in ids:
        return True
    return last_end > len(ids) - 1 - ids[::-1].index(start[0])


#: What a chat template is given by fd itself, which ``chat_template_kwargs`` may not replace.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _template_kwargs(body: dict) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template, such as Qwen3's
    ``enable_thinking``."""
    kw = _opt(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    taken = sorted(_TEMPLATE_OWN & kw.keys())
    if taken:
        raise bad_request(
            f"'chat_template_kwargs' may not set {', '.join(taken)}.", "chat_template_kwargs", "invalid_value"
        )
    return kw


@dataclass(frozen=True, slots=True)
class ChatRendering:
    """vLLM's chat extensions on how the messages become the prompt."""

    add_generation_prompt: bool = True  # the template's opening of the assistant's turn
    # the last message, the assistant's, is left open for the model to go on with (a prefill):
    # the prompt ends where its text ends, with no end-of-turn and no new turn
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own (a BOS) on top of the template's


def _chat_rendering(body: dict, messages: list[dict], generation_prompt: bool = True) -> ChatRendering:
    """``generation_prompt``: the default of ``add_generation_prompt`` (vLLM's chat embeddings
    leave the assistant's turn unopened)."""
    gen = _opt(body, "add_generation_prompt", _is_bool, "a boolean", generation_prompt)
    cont = _opt(body, "continue_final_message", _is_bool, "a boolean", False)
    special = _opt(body, "add_special_tokens", _is_bool, "a boolean", False)
    if cont and gen:
        raise bad_request(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
            "continue_final_message",
            "invalid_value",
        )
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request(
            "'continue_final_message' needs the last message to be the assistant's.",
            "continue_final_message",
            "invalid_value",
        )
    return ChatRendering(gen, cont, special)


def _chat_ids(
    messages: list[dict],
    tokenizer: TokenizerLike,
    how: ChatRendering,
    tools: list[dict] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[int, ...]:
    try:
        kw = {**(extra or {}), **({} if tools is None else {"tools": tools})}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=how.add_generation_prompt, **kw)
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise bad_request(f"The chat template rejected these messages: {e}", "messages") from None
    if how.continue_final_message:
        # as transformers does: the text ends with the last message's (its end-of-turn cut)
        final = messages[-1]["content"].strip()
        if not final:
            raise bad_request(
                "'continue_final_message' needs text in the last message.",
                "continue_final_message",
                "invalid_value",
            )
        at = text.rfind(final)
        if at < 0:
            raise bad_request(
                "The chat template does not show the last message's text as it is, "
                "so it cannot be continued.",
                "continue_final_message",
                "invalid_value",
            )
        text = text[: at + len(final)]
    return tuple(tokenizer.encode(text, add_special_tokens=how.add_special_tokens))


def parse_tokenize(body: dict, limits: Limits, tokenizer: TokenizerLike) -> tuple[int, ...]:
    """vLLM's ``POST /tokenize``: a completion's ``prompt`` or a chat's ``messages``, as the
    generating endpoints would tokenize them (``add_special_tokens`` / ``add_generation_prompt``
    to say otherwise)."""
    _check_model(body, limits)
    if body.get("messages") is not None:
        tools, _ = _tools({**body, "tool_choice": "none"}, limits)
        messages = parse_messages(body)
        return _chat_ids(messages, tokenizer, _chat_rendering(body, messages), tools, _template_kwargs(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request(
            "Give 'prompt' (a string) or 'messages'.",
            "prompt",
            "missing_required_parameter" if prompt is None else "invalid_type",
        )
    special = _opt(body, "add_special_tokens", _is_bool, "a boolean", True)
    return tuple(tokenizer.encode(prompt, add_special_tokens=special))


def parse_detokenize(body: dict, limits: Limits) -> tuple[int, ...]:
    """vLLM's ``POST /detokenize``: ``tokens``, ids of this model's vocabulary."""
    _check_model(body, limits)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required.", "tokens", "missing_required_parameter")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids.", "tokens", "invalid_type")
    return _check_ids(tokens, limits, "tokens")


def parse_completion(body: dict, limits: Limits, tokenizer: TokenizerLike) -> GenerationRequest:
    model = _check_model(body, limits)
    _reject_unsupported(body, {"suffix": None})
    priority = _priority(body, limits)
    top = _opt(body, "logprobs", _is_int, "an integer", None)
    logprobs = None if top is None else _top_logprobs(top, "logprobs")
    echo = _opt(body, "echo", _is_bool, "a boolean", False)
    # max_tokens=0 with echo (scoring a text, as evaluation harnesses do): the engine generates
    # one token, which the response leaves out
    zero = [k for k in ("max_completion_tokens", "max_tokens") if _is_int(body.get(k)) and body[k] == 0]
    echo_only = echo and bool(zero)
    if echo_only:
        body = (
            body.replaced({k: 1 for k in zero})
            if isinstance(body, Body)
            else {**body, **{k: 1 for k in zero}}
        )
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt  # OpenAI's batch: a list of strings or of token id lists
    elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        batch = [prompt]
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of either.", "prompt", "invalid_type"
        )
    keep = _truncation(body, limits)
    whole = tuple(_prompt_ids(p, limits, tokenizer) for p in batch)
    prompts = tuple(ids[-keep:] for ids in whole) if keep else whole
    n = _choices(body)
    if len(prompts) * n > MAX_BATCH:
        raise bad_request(
            f"At most {MAX_BATCH} choices a request (prompts times n).", "prompt", "invalid_value"
        )
    stream, include_usage, continuous = _stream_opts(body, limits)
    background = _background(body)
    sampling = _with_bad_words(
        body, _sampling(body, max(map(len, prompts)), limits, limits.default_max_tokens, logprobs), tokenizer
    )
    scored = _prompt_scores(body, stream)
    if scored is not None:
        if echo:
            raise bad_request(
                "'prompt_logprobs' cannot go with 'echo' (echo with 'logprobs' scores the prompt too).",
                "prompt_logprobs",
                "invalid_value",
            )
        sampling = dataclasses.replace(sampling, prompt_logprobs=scored)
    echo_texts: tuple[str, ...] = ()
    if echo:
        # (what the model was given: a truncated prompt's kept tokens)
        echo_texts = tuple(
            p if isinstance(p, str) and len(ids) == len(w) else _decode(ids, tokenizer)
            for p, w, ids in zip(batch, whole, prompts)
        )
        if logprobs is not None:  # the prompt's tokens are scored too
            sampling = dataclasses.replace(sampling, prompt_logprobs=logprobs)
    return GenerationRequest(
        "completion",
        model,
        prompts[0],
        sampling,
        stream,
        include_usage,
        background,
        continuous,
        n,
        prompts if len(prompts) > 1 else (),
        echo_texts,
        echo_only,
        tokens_as_ids=_tokens_as_ids(body, limits),
        prompt_logprobs=scored,
        return_token_ids=_opt(body, "return_token_ids", _is_bool, "a boolean", False),
        priority=priority,
    )


def _prompt_scores(body: dict, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: each prompt token's log-probability and rank, with this many
    alternatives; as in vLLM, not on a stream."""
    k = _opt(body, "prompt_logprobs", _is_int, "an integer", None)
    if k is None:
        return None
    if stream:
        raise bad_request(
            "'prompt_logprobs' is not available when 'stream' is true.", "prompt_logprobs", "invalid_value"
        )
    return _top_logprobs(k, "prompt_logprobs")


def _truncation(body: dict, limits: Limits) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep only a prompt's last k tokens (-1: as many as
    the context holds). None: leave prompts whole."""
    k = _opt(body, "truncate_prompt_tokens", _is_int, "an integer", None)
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


MAX_BAD_WORDS = 64


def _with_bad_words(body: dict, sampling: SamplingParams, tokenizer: TokenizerLike) -> SamplingParams:
    """vLLM's ``bad_words``: each word as its tokens, alone and after a space (as it is
    written at the start of a text and within one), for the engine to keep from completing."""
    words = _opt(
        body,
        "bad_words",
        lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v),
        "a list of strings",
        None,
    )
    if not words:
        return sampling
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"At most {MAX_BAD_WORDS} bad words.", "bad_words", "invalid_value")
    seqs: list[tuple[int, ...]] = []
    for w in words:
        for text in (w, " " + w):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False)) if w.strip() else ()
            if ids and ids not in seqs:
                seqs.append(ids)
    return dataclasses.replace(sampling, bad_words_ids=tuple(seqs)) if seqs else sampling


def _priority(body: dict, limits: Limits) -> int:
    """vLLM's ``priority``: taken on a server with ``--scheduling-policy priority``, refused
    (other than 0) elsewhere, as vLLM refuses it."""
    p = _opt(body, "priority", _is_int, "an integer", 0)
    if p and not limits.priority_scheduling:
        raise bad_request(
            "'priority' needs a server started with --scheduling-policy priority.", "priority", "unsupported"
        )
    if not -(2**31) <= p < 2**31:
        raise bad_request("'priority' must be a 32-bit integer.", "priority", "invalid_value")
    return p


def _tokens_as_ids(body: dict, limits: Limits) -> bool:
    return _opt(body, "return_tokens_as_token_ids", _is_bool, "a boolean", limits.tokens_as_ids)


def _decode(ids: tuple[int, ...], tokenizer: Any) -> str:
    decode = getattr(tokenizer, "decode", None)
    return decode(list(ids)) if decode is not None else ""


def _prompt_ids(prompt: Any, limits: Limits, tokenizer: TokenizerLike) -> tuple[int, ...]:
    if isinstance(prompt, str):
        ids = tuple(tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = _check_ids(prompt, limits, "prompt")
    elif isinstance(prompt, list) and prompt:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of either.", "prompt", "invalid_type"
        )
    else:
        ids = ()
    if not ids:
        raise bad_request("The prompt is empty.", "prompt", "invalid_value")
    return ids
