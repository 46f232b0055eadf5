"""Guided decoding (structured outputs): what a request's ``sampling.guided`` may say, and the
grammar it becomes.

The spec is one small JSON object on the request event, so an operator can write one by hand
and any engine can compile it: ``{"json": <JSON Schema>}``, ``{"json_object": true}`` (any
JSON object), ``{"regex": "<pattern>"}``, ``{"choice": ["yes", "no"]}`` or ``{"grammar":
"<Lark>"}`` — OpenAI's ``response_format`` and vLLM's ``guided_*`` parameters map onto it. It
travels as canonical JSON text (``SamplingParams.guided``), so sampling parameters stay
hashable and two equal specs compare equal.

Compiling and the token masks are llguidance's (the Rust library vLLM and SGLang use for the
same): a grammar is checked here, where the API validates a request before anything reaches
Redis, and each engine's model runner keeps one matcher per guided request
(:mod:`fd.engine.runner.guided`). JSON is compiled without free whitespace (``", "`` and ``": "``):
small models otherwise fill the allowed whitespace instead of the object.

A spec may also say ``"after": <token id>``: the grammar holds only from the token after the
first time the output has that one (a reasoning model's ``</think>``: it thinks freely, then
answers in the grammar), as vLLM does with a reasoning parser.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # (a name of llguidance's stub only: the package does not export it at run time)
    from llguidance._lib import JsonCompileOptions

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_BYTES = 64 << 10


class GuidedError(ValueError):
    """A spec that is malformed or whose grammar does not compile."""


def canonical(spec: dict[str, Any]) -> str:
    """The spec as the text ``SamplingParams.guided`` holds (checked: :func:`parse`)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    parse(text)
    return text


def parse(text: str) -> tuple[str, Any]:
    """``(kind, value)`` of a spec's text; raises :class:`GuidedError` for a malformed one."""
    return _parse(text)[:2]


def after_token(text: str) -> int | None:
    """The token after whose first appearance in the output the grammar holds (None: from
    the first token)."""
    return _parse(text)[2]


def starting_after(text: str, token_id: int) -> str:
    """The spec ``text`` holding only after ``token_id`` (see the module's docstring)."""
    return canonical({**json.loads(text), "after": token_id})


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> tuple[str, Any, int | None]:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise GuidedError(f"at most {MAX_SPEC_BYTES} bytes")
    try:
        spec = json.loads(text)
    except ValueError:
        raise GuidedError("not JSON") from None
    after = spec.pop("after", None) if isinstance(spec, dict) else None
    if after is not None and not (isinstance(after, int) and not isinstance(after, bool) and after >= 0):
        raise GuidedError("'after' must be a token id")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise GuidedError(f"one of {', '.join(KINDS)}, as an object with that one key")
    kind, value = next(iter(spec.items()))
    ok = {
        "json": isinstance(value, (dict, bool)),
        "json_object": value is True,
        "regex": isinstance(value, str) and value != "",
        "grammar": isinstance(value, str) and value.strip() != "",
        "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value),
    }[kind]
    if not ok:
        what = {
            "json": "a JSON Schema (an object)",
            "json_object": "true",
            "regex": "a non-empty pattern",
            "grammar": "a Lark grammar",
            "choice": "a non-empty list of non-empty strings",
        }[kind]
        raise GuidedError(f"'{kind}' must be {what}")
    return kind, value, after


def grammar(text: str) -> str:
    """The llguidance grammar of a spec's text (not yet checked against a vocabulary)."""
    import llguidance

    kind, value = parse(text)
    compact: JsonCompileOptions = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=compact)
        except (ValueError, TypeError) as e:
            raise GuidedError(f"bad JSON Schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        )
    return llguidance.LLMatcher.grammar_from_lark(value)


def check(text: str) -> None:
    """Raise :class:`GuidedError` unless the spec is well formed and its grammar compiles.
    Remembered for the last few hundred specs: clients send the same schema again and again,
    and compiling one (~2 ms for 30 fields) holds the API's event loop."""
    error = _check(text)
    if error is not None:
        raise GuidedError(error)


@functools.lru_cache(maxsize=256)
def _check(text: str) -> str | None:
    import llguidance

    try:
        g = grammar(text)
    except GuidedError as e:
        return str(e)
    error = llguidance.LLMatcher.validate_grammar(g)
    if error and not error.startswith("WARNING"):
        return error.strip().splitlines()[0][:300]
    return None
