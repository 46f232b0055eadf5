"""A request body's sampling parameters (fd.control.sampling's :class:`SamplingParams`), without
I/O: the output's length against the context, temperature and the other knobs with the model's
own defaults (``generation_config.json``), stop sequences, token restrictions, and structured
outputs, each checked here so that a bad value is a 400 and never a failed request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from fd.api.errors import ApiError, bad_request, context_length_exceeded
from fd.api.validation import Limits, check_ids, is_bool, is_int, is_num, lora_of, opt
from fd.control.guided import GuidedError, canonical, check
from fd.control.sampling import MAX_REPETITION_PENALTY, SamplingParams
from fd.control.tokenizer import TokenizerLike


def sampling_of(
    body: dict, prompt_len: int, limits: Limits, default_max: int | None, logprobs: int | None = None
) -> SamplingParams:

    room = limits.max_model_len - prompt_len
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = opt(body, name, is_int, "an integer", None)
        if v is not None:
            if v < 1:
                raise bad_request(f"'{name}' must be at least 1.", name, "invalid_value")
            max_tokens = v
            break
    if room < 1 or (max_tokens is not None and max_tokens > room):
        # (named as OpenAI names it: the messages, or completions' prompt, even when it is the
        # asked length that does not fit)
        raise context_length_exceeded(
            limits.max_model_len, prompt_len, max_tokens, "messages" if default_max is None else "prompt"
        )
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if limits.max_output_tokens is not None:  # (the model's max_new_tokens: a server-wide cap)
        max_tokens = min(max_tokens, limits.max_output_tokens)

    defaults = limits.sampling_defaults
    temperature = float(opt(body, "temperature", is_num, "a number", defaults.get("temperature", 1.0)))
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("'temperature' must be between 0 and 2.", "temperature", "invalid_value")
    top_p = float(opt(body, "top_p", is_num, "a number", defaults.get("top_p", 1.0)))
    if not 0.0 < top_p <= 1.0:
        raise bad_request("'top_p' must be in (0, 1].", "top_p", "invalid_value")
    top_k = opt(body, "top_k", is_int, "an integer", defaults.get("top_k", 0))
    if top_k < -1:
        raise bad_request("'top_k' must be -1, 0 (off) or a positive integer.", "top_k", "invalid_value")
    seed = opt(body, "seed", is_int, "an integer", None)
    if seed is not None and not 0 <= seed < 2**63:  # what an engine accepts (fd.control.events)
        raise bad_request("'seed' must be an integer in [0, 2**63).", "seed", "invalid_value")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = opt(body, name, is_num, "a number", 0.0)
        if not -2.0 <= v <= 2.0:
            raise bad_request(f"'{name}' must be between -2 and 2.", name, "invalid_value")
        penalties[name] = float(v)
    rp = opt(body, "repetition_penalty", is_num, "a number", defaults.get("repetition_penalty", 1.0))
    if not 0 < rp <= MAX_REPETITION_PENALTY:
        raise bad_request(
            f"'repetition_penalty' must be greater than 0 and at most {MAX_REPETITION_PENALTY:g} (1 is off).",
            "repetition_penalty",
            "invalid_value",
        )
    penalties["repetition_penalty"] = float(rp)
    min_p = opt(body, "min_p", is_num, "a number", defaults.get("min_p", 0.0))
    if not 0.0 <= min_p <= 1.0:
        raise bad_request("'min_p' must be between 0 and 1.", "min_p", "invalid_value")
    min_tokens = opt(body, "min_tokens", is_int, "an integer", 0)
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
    stop_token_ids = check_ids(
        opt(
            body,
            "stop_token_ids",
            lambda v: isinstance(v, list) and all(is_int(t) and t >= 0 for t in v),
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
        allowed = tuple(sorted(set(check_ids(allowed, limits, "allowed_token_ids"))))
    ignore_eos = opt(body, "ignore_eos", is_bool, "a boolean", False)
    include_stop = opt(body, "include_stop_str_in_output", is_bool, "a boolean", False)
    skip_special = opt(body, "skip_special_tokens", is_bool, "a boolean", True)
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
            sampling_of({key: gen[key]}, 1, probe, None)
        except ApiError as e:
            ignored.append(f"{key}: {e.message}")
            continue
        defaults[key] = gen[key]
    cap = gen.get("max_new_tokens")
    if cap is not None and not (is_int(cap) and cap >= 1):
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
    by compiling its grammar here (fd.control.guided), so a bad one is a 400, not a failed request."""
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
    raw = opt(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id: bias", {})
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
        if not is_num(bias) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias' values must be numbers between -100 and 100, got {bias!r:.20}.",
                "logit_bias",
                "invalid_value",
            )
        out.append((token, float(bias)))
    return tuple(sorted(out))


MAX_BAD_WORDS = 64


def with_bad_words(body: dict, sampling: SamplingParams, tokenizer: TokenizerLike) -> SamplingParams:
    """vLLM's ``bad_words``: each word as its tokens, alone and after a space (as it is
    written at the start of a text and within one), for the engine to keep from completing."""
    words = opt(
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
