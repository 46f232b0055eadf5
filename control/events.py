"""The event catalogue: every event fd writes or reads, and its flat-field encoding.

An event on a stream is a flat map of string fields, so that an operator can type one with
``redis-cli XADD``. Each event type here is a frozen dataclass; its fields encode as:

- ``str`` as is; ``int``/``float`` as decimal text; ``bool`` as ``1``/``0``;
- ``tuple[int, ...]`` / ``tuple[str, ...]`` as comma-separated text (``1,2,3``);
- ``dict`` / :class:`RequestData` as one JSON field (orjson).

Every event also carries ``type``, ``v`` (schema version) and ``ts`` (ms since the epoch).
Events a person types may omit ``v`` and ``ts``: ``v`` defaults to the current version and
``ts`` to the millisecond part of the stream entry id. Anything that does not decode raises
:class:`BadEvent` naming the field, and the reader dead-letters it (see ``control.bus``).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence, Union

import orjson

from control.keys import ENGINE_ID_RE, valid_request_id

SCHEMA_VERSION = 1
MAX_FIELD_BYTES = 1 << 20  # one field; a 1 MiB prompt is already far past any context
MAX_IDS_PER_ABORT = 10_000

FINISH_REASONS = ("stop", "length", "abort", "error")


class BadEvent(ValueError):
    """An event that cannot be decoded. ``field`` names the culprit for the dead letter."""

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(reason if field is None else f"{field}: {reason}")
        self.reason = reason
        self.field = field


def now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- payload types


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_REPETITION_PENALTY = 100.0  # (vLLM sets none; 1-2 is the useful range)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the client asked of sampling; vLLM's names where vLLM has one."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # OpenAI's, on the tokens generated so far: minus frequency_penalty for each time a token
    # occurred, minus presence_penalty once if it did. vLLM's repetition_penalty, on tokens of
    # the prompt or the output: a positive logit divided by it, a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: (token id, bias) pairs, sorted, added to those tokens' logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: keep only tokens at least min_p times as likely as the likeliest (0: off);
    # neither EOS nor stop_token_ids can come before min_tokens tokens were generated.
    min_p: float = 0.0
    min_tokens: int = 0
    # Log-probabilities of each sampled token and of this many likeliest alternatives, from
    # the model's own distribution (before penalties and temperature, as vLLM's default):
    # None for none. Chat's logprobs + top_logprobs, completions' logprobs.
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each given the ones before it) and of this many
    # likeliest alternatives at each position: None for none. Completions' echo + logprobs.
    prompt_logprobs: int | None = None
    # Structured output: the canonical JSON text of a control.guided spec ("" for none); the
    # runner masks every token the spec's grammar does not allow next.
    guided: str = ""
    # vLLM's: leave special tokens' text (<|im_start|>, <s>) out of the output text (True, the
    # default) or keep it.
    skip_special_tokens: bool = True
    # vLLM's allowed_token_ids: only these may be sampled (empty: any).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words, as token id sequences (the API tokenizes the words): the last token of
    # one may not come where it would complete it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # An embeddings request (/v1/embeddings): besides its one token, the runner returns the
    # model's final hidden state at the prompt's last position (what vLLM's LAST pooling
    # takes), which the request's first tokens event carries as `embedding`.
    embed: bool = False
    # vLLM's LoRA: the adapter (a name of the engines' --lora-modules) the request runs with;
    # "" for the base model.
    lora: str = ""

    def ends_on(self, token: int, eos_token_ids: Sequence[int]) -> bool:
        """Whether sampling ``token`` ends the request (finish_reason "stop"): one of its
        ``stop_token_ids``, or an EOS of the model unless ``ignore_eos``. Such a token counts
        as output but its text is not shown (vLLM's rule), unless include_stop_str_in_output."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """The runner needs the request's tokens so far to sample it."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """The runner needs the request's output so far: for penalties, or to bring a guided
        request's grammar to where its output stands (after a preemption, on another engine)."""
        return self.penalized or bool(self.guided) or bool(self.bad_words_ids)

    @property
    def plain(self) -> bool:
        """Nothing but the logits decides a greedy pick (the runner's fast path)."""
        return not (
            self.penalized
            or self.logit_bias
            or self.min_tokens
            or self.guided
            or self.allowed_token_ids
            or self.bad_words_ids
        )

    def to_dict(self) -> dict[str, Any]:
        # (not dataclasses.asdict: its deep copy of nine plain values was ~10 µs of every
        # request's way in)
        d = {name: getattr(self, name) for name in _SAMPLING_NAMES}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        d["allowed_token_ids"] = list(self.allowed_token_ids)
        d["bad_words_ids"] = [list(w) for w in self.bad_words_ids]
        # Written only when asked for: an engine of a release before them refuses a request
        # with fields it does not know (a dead letter), and in a rolling upgrade it must still
        # take every request that does not use them.
        for name in _OPTIONAL_NAMES:
            if getattr(self, name) == _DEFAULTS[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Strict: a request event is typed by hand or by another program, and a wrong type
        here must become a dead letter, not an exception inside an engine step."""
        unknown = set(d) - _SAMPLING_FIELDS
        if unknown:
            raise BadEvent(f"unknown sampling parameter(s) {sorted(unknown)}", "data")
        kw = dict(d)

        def bad(name: str, what: str) -> BadEvent:
            return BadEvent(f"sampling.{name} must be {what}, got {kw[name]!r:.40}", "data")

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

        if "max_tokens" in kw and not (is_int(kw["max_tokens"]) and kw["max_tokens"] >= 1):
            raise bad("max_tokens", "an integer >= 1")
        if "temperature" in kw and not (is_num(kw["temperature"]) and kw["temperature"] >= 0):
            raise bad("temperature", "a number >= 0")
        if "top_p" in kw and not (is_num(kw["top_p"]) and 0 < kw["top_p"] <= 1):
            raise bad("top_p", "a number in (0, 1]")
        if "top_k" in kw and not (is_int(kw["top_k"]) and kw["top_k"] >= -1):
            raise bad("top_k", "an integer >= -1")
        if kw.get("seed") is not None and not (is_int(kw["seed"]) and 0 <= kw["seed"] < 2**63):
            raise bad("seed", "an integer in [0, 2**63)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "embed"):
            if name in kw and not isinstance(kw[name], bool):
                raise bad(name, "true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            if name in kw and not (is_num(kw[name]) and -2 <= kw[name] <= 2):
                raise bad(name, "a number in [-2, 2]")
        if "repetition_penalty" in kw and not (
            is_num(kw["repetition_penalty"]) and 0 < kw["repetition_penalty"] <= MAX_REPETITION_PENALTY
        ):
            raise bad("repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}]")
        if "min_p" in kw and not (is_num(kw["min_p"]) and 0 <= kw["min_p"] <= 1):
            raise bad("min_p", "a number in [0, 1]")
        if "min_tokens" in kw and not (is_int(kw["min_tokens"]) and kw["min_tokens"] >= 0):
            raise bad("min_tokens", "an integer >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if kw.get(name) is not None and not (is_int(kw[name]) and 0 <= kw[name] <= MAX_LOGPROBS):
                raise bad(name, f"an integer in [0, {MAX_LOGPROBS}]")
        if "logit_bias" in kw:
            pairs = kw["logit_bias"] or ()
            if not (
                isinstance(pairs, (list, tuple))
                and all(
                    isinstance(p, (list, tuple))
                    and len(p) == 2
                    and is_int(p[0])
                    and p[0] >= 0
                    and is_num(p[1])
                    and -100 <= p[1] <= 100
                    for p in pairs
                )
            ):
                raise bad("logit_bias", "a list of [token id, bias in [-100, 100]] pairs")
            kw["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in dict(pairs).items()))
        if "stop" in kw:
            stop = kw["stop"] or ()
            if isinstance(stop, str):
                stop = (stop,)
            if not (isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop)):
                raise bad("stop", "a list of non-empty strings")
            kw["stop"] = tuple(stop)
        if "lora" in kw and not (isinstance(kw["lora"], str) and len(kw["lora"]) <= 128):
            raise bad("lora", "an adapter name")
        if kw.get("guided"):
            from control.guided import GuidedError, parse

            if not isinstance(kw["guided"], str):
                raise bad("guided", "a guided-decoding spec as JSON text")
            try:
                parse(kw["guided"])
            except GuidedError as e:
                raise BadEvent(f"sampling.guided: {e}", "data") from None
        if "bad_words_ids" in kw:
            words = kw["bad_words_ids"] or ()
            if not (
                isinstance(words, (list, tuple))
                and all(
                    isinstance(w, (list, tuple)) and w and all(is_int(t) and t >= 0 for t in w) for w in words
                )
            ):
                raise bad("bad_words_ids", "a list of non-empty token id lists")
            kw["bad_words_ids"] = tuple(tuple(w) for w in words)
        for name in ("stop_token_ids", "allowed_token_ids"):
            if name in kw:
                ids = kw[name] or ()
                if not (isinstance(ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in ids)):
                    raise bad(name, "a list of token ids")
                kw[name] = tuple(ids)
        return cls(**kw)


_SAMPLING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
# fields added after the first release: on the wire only when set
_OPTIONAL_NAMES = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_p",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "guided",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words_ids",
    "embed",
    "lora",
)
_SAMPLING_FIELDS = frozenset(_SAMPLING_NAMES)


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
    def from_json(cls, d: Any) -> "RequestData":
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


# --------------------------------------------------------------------------- events

_REGISTRY: dict[str, type["Event"]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of all events. ``TYPE`` is the wire ``type``; ``ts`` is ms since the epoch."""

    TYPE: ClassVar[str] = ""
    v: int = SCHEMA_VERSION
    ts: int = 0

    def encode(self) -> dict[str, str]:
        """Flat string fields, as ``redis-cli XADD`` would have written them."""
        cls = type(self)
        names = _ENCODE_NAMES.get(cls)
        if names is None:  # (looked up once a class: an engine step encodes one per request)
            names = _ENCODE_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
        out = {"type": self.TYPE}
        for name in names:
            value = getattr(self, name)
            if value is None:
                continue
            t = type(value)
            out[name] = value if t is str else str(value) if t is int else _encode_value(value)
        if not self.ts:
            out["ts"] = str(now_ms())
        return out


_ENCODE_NAMES: dict[type, tuple[str, ...]] = {}


# control stream -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Event):
    """Abort one or more requests. Typed by hand as ``type abort request_id <id>``; on the wire
    a single id is written as ``request_id`` and several as ``request_ids=a,b,c``."""

    TYPE: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]
    source: str = "redis"
    reason: str | None = None
    abort_id: str | None = None

    def encode(self) -> dict[str, str]:
        out = Event.encode(self)
        if len(self.request_ids) == 1:
            del out["request_ids"]
            out["request_id"] = self.request_ids[0]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortAll(Event):
    TYPE: ClassVar[str] = "abort_all"
    engine: str | None = None
    source: str = "redis"
    reason: str | None = None
    abort_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Drain(Event):
    TYPE: ClassVar[str] = "drain"
    engine: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadLora(Event):
    """Every engine loads a LoRA adapter (vLLM's /v1/load_lora_adapter); ``P:loras`` holds the
    adapters loaded this way, for engines that start later. Each engine says what it has in
    its heartbeat (``loras``, ``lora_errors``)."""

    TYPE: ClassVar[str] = "load_lora"
    name: str
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UnloadLora(Event):
    """Every engine stops taking requests for the adapter, and forgets it once none runs."""

    TYPE: ClassVar[str] = "unload_lora"
    name: str


# requests stream --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(Event):
    TYPE: ClassVar[str] = "request"
    request_id: str
    data: RequestData
    # Set when a draining engine hands the request back: it may already have tokens on its
    # stream, so the engine that claims it reads them and continues (see engine.failover).
    resume: bool | None = None


# per-request stream P:req:<id> -------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Accepted(Event):
    TYPE: ClassVar[str] = "accepted"
    request_id: str
    api: str = ""
    prompt_tokens: int = 0
    endpoint: str = ""  # "chat", "completion" or "responses": how any replica renders a replay
    model: str = ""
    created: int = 0  # seconds, OpenAI's `created`, so every replica renders the same chunks
    include_usage: bool = False  # stream_options.include_usage: a replay renders as the original
    # vLLM's stream_options.continuous_usage_stats; written only when set (readers of an
    # earlier release skip a field they do not know)
    continuous_usage: bool | None = None
    # A response of n > 1 choices: its own story holds this `accepted` with `choices=n` and
    # nothing else; each choice is a request `<id>.<k>` whose `accepted` names `parent` and
    # `index` (written only when set, like continuous_usage).
    choices: int | None = None
    n: int | None = None  # (the response's) choices of each prompt: `choices` / number of prompts
    parent: str | None = None
    index: int | None = None
    # Completions' echo: the prompt's text, shown before the completion; `echo_only` when the
    # client asked max_tokens=0 (the engine generates one token, which is not shown).
    echo: str | None = None
    echo_only: bool | None = None
    # Chat with tools, on a server started with a tool-call parser (fd.api.tool_calls): the
    # parser's name; every replica then renders the model's calls as `tool_calls`.
    tool_parser: str | None = None
    # Chat on a server with a reasoning parser (fd.api.reasoning): its name; every replica then
    # renders the model's thinking as `reasoning_content`.
    reasoning_parser: str | None = None
    # vLLM's include_reasoning false (written only then): the thinking is read and left out.
    include_reasoning: bool | None = None
    # vLLM's return_tokens_as_token_ids (written only when set): log-probabilities name their
    # tokens as "token_id:<id>".
    tokens_as_ids: bool | None = None
    # vLLM's prompt_logprobs=k (written only when asked): the response carries the prompt's
    # log-probabilities, ranks and k alternatives, as vLLM's `prompt_logprobs` field.
    prompt_logprobs: int | None = None
    # vLLM's return_token_ids (written only when asked): the prompt's token ids, which the
    # answer shows beside the output's.
    prompt_ids: tuple[int, ...] | None = None
    # The tenant that made it (fd.api.tenancy): a one-way tag of its API key, never the key;
    # written only for a request made with a tenant's key. Any replica serves the request's
    # stream, response and input items only to that key (or the admin key).
    tenant: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Claimed(Event):
    TYPE: ClassVar[str] = "claimed"
    request_id: str
    engine: str
    attempt: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens(Event):
    """Tokens of one engine step for one request (coalesced), with their text delta."""

    TYPE: ClassVar[str] = "tokens"
    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    step: int = 0
    # Only when the request asked (SamplingParams.logprobs): per token of token_ids, in order,
    # {"lp": [its log-probability, ...], "top": [[[token id, log-probability], ...], ...]}
    # (logprobs_field / logprobs_entries).
    logprobs: dict | None = None
    # Only on the first tokens event of a request that asked (SamplingParams.prompt_logprobs):
    # {"ids": the prompt, "lp": [...], "top": [...]}, lp and top for its tokens 1.. (the first
    # has none), shaped as `logprobs` (prompt_logprobs_field / prompt_logprobs_entries).
    prompt_logprobs: dict | None = None
    # Only on the first tokens event of an embeddings request (SamplingParams.embed): the
    # final hidden state at the prompt's last position, float32 little-endian, base64
    # (embedding_field / embedding_vector).
    embedding: str | None = None


def embedding_field(vector: bytes) -> str:
    """A tokens event's ``embedding``: the runner's float32 bytes, as base64 text."""
    return base64.b64encode(vector).decode("ascii")


def embedding_vector(field: Any) -> Any:
    """:func:`embedding_field` read back, a float32 numpy array; None when it is not that
    shape (a hand-typed event)."""
    import numpy as np

    try:
        raw = base64.b64decode(field, validate=True)
    except (TypeError, ValueError):
        return None
    if not raw or len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<f4")


def prompt_logprobs_field(prompt: Sequence[int], entries: Sequence[tuple]) -> dict:
    """Entries of (log-probability, alternatives[, rank]): the rank (1: the likeliest token of
    its position) rides as ``rank`` when every entry has one."""
    out = {"ids": list(prompt), **logprobs_field([e[:2] for e in entries])}
    if entries and all(len(e) > 2 for e in entries):
        out["rank"] = [int(e[2]) for e in entries]
    return out


def prompt_logprob_ranks(field: Any, n: int) -> list[int] | None:
    """:func:`prompt_logprobs_field`'s ranks read back (``n`` of them), or None."""
    try:
        ranks = [int(r) for r in field["rank"]]
    except (TypeError, KeyError, ValueError):
        return None
    return ranks if len(ranks) == n else None


def prompt_logprobs_entries(field: Any) -> tuple[list[int], list[tuple[float, list]]] | None:
    """:func:`prompt_logprobs_field` read back: the prompt's ids and an entry for each but the
    first; None when it is not that shape."""
    try:
        ids = [int(t) for t in field["ids"]]
    except (TypeError, KeyError, ValueError):
        return None
    entries = logprobs_entries(field, len(ids) - 1)
    return None if entries is None else (ids, entries)


def logprobs_field(entries: Sequence[tuple[float, Sequence[tuple[int, float]]]]) -> dict:
    """A tokens event's ``logprobs``: per token, its log-probability and the likeliest
    alternatives as (token id, log-probability), likeliest first."""
    return {"lp": [lp for lp, _ in entries], "top": [[list(pair) for pair in top] for _, top in entries]}


def logprobs_entries(field: Any, n_tokens: int) -> list[tuple[float, list]] | None:
    """:func:`logprobs_field` read back, one entry per token; None when it is not that shape
    (a hand-typed event: its tokens are shown without log-probabilities)."""
    try:
        lps, tops = field["lp"], field["top"]
        if len(lps) != n_tokens or len(tops) != n_tokens:
            return None
        return [(float(lp), [(int(t), float(v)) for t, v in top]) for lp, top in zip(lps, tops)]
    except (TypeError, KeyError, ValueError):
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequested(Event):
    """Stage 1 of an abort: the engine stopped scheduling the request."""

    TYPE: ClassVar[str] = "abort_requested"
    request_id: str
    source: str = "redis"
    engine: str = ""
    step: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained(Event):
    """Stage 2: no step in flight can still write the request's KV blocks."""

    TYPE: ClassVar[str] = "drained"
    request_id: str
    engine: str = ""
    step: int = 0
    discarded_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BlocksReleased(Event):
    """Stage 3: the request's KV blocks are back in the pool."""

    TYPE: ClassVar[str] = "blocks_released"
    request_id: str
    count: int
    engine: str = ""
    step: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Preempted(Event):
    """The engine took the request's blocks back to make room; it will recompute them."""

    TYPE: ClassVar[str] = "preempted"
    request_id: str
    count: int = 0
    engine: str = ""
    step: int = 0
    # Set when a draining engine handed the request back for another engine to continue: a
    # hand-back, unlike a crash, does not count as a failed attempt.
    handback: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Final(Event):
    """The one last event of a request. ``usage`` is OpenAI's usage object."""

    TYPE: ClassVar[str] = "final"
    request_id: str
    finish_reason: str
    usage: dict = field(default_factory=dict)
    engine: str = ""
    step: int = 0
    error: str | None = None
    stop_reason: str | None = None  # the stop string or token that ended it, like vLLM
    # The stop_token_ids token that ended it (then also stop_reason, as text), written only
    # then: what vLLM's answer gives as an integer stop_reason.
    stop_token: int | None = None


def tombstone_story(request_id: str, source: str, engine: str = "") -> list[Event]:
    """The whole abort story of a request no engine ever ran: nothing to drain, no blocks."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return [
        AbortRequested(request_id=request_id, source=source, engine=engine),
        Drained(request_id=request_id, engine=engine),
        BlocksReleased(request_id=request_id, count=0, engine=engine),
        Final(request_id=request_id, finish_reason="abort", usage=usage, engine=engine),
    ]


REQ_STREAM_TYPES = (Accepted, Claimed, Tokens, Preempted, AbortRequested, Drained, BlocksReleased, Final)
CONTROL_TYPES = (Abort, AbortAll, Drain, LoadLora, UnloadLora)

for _cls in (*CONTROL_TYPES, Request, *REQ_STREAM_TYPES):
    _REGISTRY[_cls.TYPE] = _cls

AnyEvent = Union[
    Abort,
    AbortAll,
    Drain,
    LoadLora,
    UnloadLora,
    Request,
    Accepted,
    Claimed,
    Tokens,
    Preempted,
    AbortRequested,
    Drained,
    BlocksReleased,
    Final,
]


# --------------------------------------------------------------------------- codec


def _encode_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, RequestData):
        return orjson.dumps(value.to_json()).decode()
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    raise TypeError(f"cannot encode {type(value).__name__}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls, globalns=globals())
        _HINTS[cls] = hints
    return hints


_HINTS: dict[type, dict[str, Any]] = {}
_PLANS: dict[type, list[tuple[str, Any, bool]]] = {}
#: field names as redis-py returns them (bytes), decoded once
_FIELD_NAMES: dict[Any, str] = {}


def _plan(cls: type) -> list[tuple[str, Any, bool]]:
    """Per event class, once: each field's name, its type with Optional unwrapped, and whether
    it is required. Readers decode every event on every stream, so this stays off the hot path."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _field_types(cls)
        plan = []
        for fl in dataclasses.fields(cls):
            tp = hints[fl.name]
            if typing.get_origin(tp) in (Union, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            required = fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING
            plan.append((fl.name, tp, required))
        _PLANS[cls] = plan
    return plan


def _decode_value(name: str, raw: str, tp: Any) -> Any:
    if tp is int:  # the common case first: ids, steps, counts, timestamps
        try:
            return int(raw)
        except ValueError:
            raise BadEvent(f"expected an integer, got {raw[:40]!r}", name) from None
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode_value(name, raw, args[0])
    if tp is str:
        return raw
    if tp is bool:
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no", ""):
            return False
        raise BadEvent(f"expected a boolean, got {raw!r}", name)
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise BadEvent(f"expected an integer, got {raw[:40]!r}", name) from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise BadEvent(f"expected a number, got {raw[:40]!r}", name) from None
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        parts = [p.strip() for p in raw.split(",") if p.strip()] if raw else []
        if item_tp is int:
            try:
                return tuple(int(p) for p in parts)
            except ValueError:
                raise BadEvent(f"expected comma-separated integers, got {raw[:40]!r}", name) from None
        return tuple(parts)
    if tp is dict or origin is dict or tp is RequestData:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadEvent("not valid JSON", name) from None
        if tp is RequestData:
            return RequestData.from_json(obj)
        if not isinstance(obj, dict):
            raise BadEvent("must be a JSON object", name)
        return obj
    raise TypeError(f"no decoder for {tp}")  # a bug in this module, not bad input


def _text(x: Any, name: str) -> str:
    if type(x) is bytes:  # what redis-py hands back
        try:
            s = x.decode()
        except UnicodeDecodeError:
            raise BadEvent("not valid UTF-8", name) from None
    elif isinstance(x, str):
        s = x
    else:
        try:
            s = bytes(x).decode("utf-8")
        except UnicodeDecodeError:
            raise BadEvent("not valid UTF-8", name) from None
    if len(s) > MAX_FIELD_BYTES:
        raise BadEvent(f"field longer than {MAX_FIELD_BYTES} bytes", name)
    return s


def ts_of_entry_id(entry_id: str | bytes | None) -> int:
    if entry_id is None:
        return 0
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    try:
        return int(entry_id.split("-", 1)[0])
    except ValueError:
        return 0


def decode(fields: Mapping[Any, Any], entry_id: str | bytes | None = None) -> AnyEvent:
    """Decode a stream entry (keys/values as bytes or str) into its event.

    Raises :class:`BadEvent` for anything a reader must dead-letter.
    """
    f: dict[str, str] = {}
    for k, v in fields.items():
        key = _FIELD_NAMES.get(k) or _text(k, "<field name>")
        f[key] = _text(v, key)
    type_ = f.get("type")
    if not type_:
        raise BadEvent("missing", "type")
    cls = _REGISTRY.get(type_)
    if cls is None:
        raise BadEvent(f"unknown event type {type_[:40]!r}", "type")
    if cls is Abort and "request_ids" not in f:
        if "request_id" not in f:
            raise BadEvent("missing (or request_ids)", "request_id")
        f["request_ids"] = f.pop("request_id")
    kw: dict[str, Any] = {}
    for name, tp, required in _plan(cls):
        raw = f.get(name)
        if raw is None:
            if required:
                raise BadEvent("missing", name)
            continue
        kw[name] = raw if tp is str else _decode_value(name, raw, tp)
    if not kw.get("ts"):
        kw["ts"] = ts_of_entry_id(entry_id)
    if kw.get("v", SCHEMA_VERSION) > SCHEMA_VERSION:
        raise BadEvent(f"schema version {kw['v']} is newer than this node's {SCHEMA_VERSION}", "v")
    ev = cls(**kw)
    _validate(ev)
    return ev  # type: ignore[return-value]


def _validate(ev: Event) -> None:
    rid = getattr(ev, "request_id", None)
    if rid is not None and not valid_request_id(rid):
        raise BadEvent(f"invalid request id {rid[:40]!r} (letters, digits, '_.:@-', 1-128)", "request_id")
    if isinstance(ev, Abort):
        if not ev.request_ids:
            raise BadEvent("no request ids", "request_ids")
        if len(ev.request_ids) > MAX_IDS_PER_ABORT:
            raise BadEvent(f"more than {MAX_IDS_PER_ABORT} ids in one abort", "request_ids")
        for r in ev.request_ids:
            if not valid_request_id(r):
                raise BadEvent(f"invalid request id {r[:40]!r}", "request_ids")
    for name in ("engine",):
        e = getattr(ev, name, None)
        if e and not ENGINE_ID_RE.fullmatch(e):
            raise BadEvent(f"invalid engine id {e[:40]!r}", name)
    if isinstance(ev, (LoadLora, UnloadLora)) and not valid_request_id(ev.name):
        raise BadEvent(f"invalid adapter name {ev.name[:40]!r} (letters, digits, '_.:@-', 1-128)", "name")
    if isinstance(ev, LoadLora) and not ev.path:
        raise BadEvent("empty", "path")
    if isinstance(ev, Final) and ev.finish_reason not in FINISH_REASONS:
        raise BadEvent(f"must be one of {FINISH_REASONS}", "finish_reason")


def encode(ev: Event) -> dict[str, str]:
    return ev.encode()


# engine journal P:journal:<engine> ---------------------------------------------------
# Written by engine.journal, read by ``fd replay``: what the pure scheduler consumed, and a
# digest of what it decided, so a run can be re-executed and checked off the cluster.


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalStart(Event):
    """Opens a journal segment: the scheduler config a replay builds its fresh scheduler from.
    An engine restarted under the same id writes another one; replay starts over there."""

    TYPE: ClassVar[str] = "journal_start"
    engine: str = ""
    config: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalStep(Event):
    """The scheduler calls of one engine step, in order (``data["calls"]``). ``seq`` counts
    entries from 0 after the JournalStart, so a trimmed or gappy journal is detected."""

    TYPE: ClassVar[str] = "step"
    engine: str = ""
    step: int = 0
    seq: int = 0
    data: dict = field(default_factory=dict)


JOURNAL_TYPES = (JournalStart, JournalStep)

for _cls in JOURNAL_TYPES:
    _REGISTRY[_cls.TYPE] = _cls

for _cls in _REGISTRY.values():
    for _f in ("type", *(f.name for f in dataclasses.fields(_cls)), "request_id"):
        _FIELD_NAMES[_f.encode()] = _f
        _FIELD_NAMES[_f] = _f
