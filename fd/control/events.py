"""The event catalogue: every event fd writes or reads, and its flat-field encoding.

An event on a stream is a flat map of string fields, so that an operator can type one with
``redis-cli XADD``. Each event type here is a frozen dataclass; its fields encode as:

- ``str`` as is; ``int``/``float`` as decimal text; ``bool`` as ``1``/``0``;
- ``tuple[int, ...]`` / ``tuple[str, ...]`` as comma-separated text (``1,2,3``);
- ``dict`` / :class:`~fd.control.request_data.RequestData` as one JSON field (orjson).

Every event also carries ``type``, ``v`` (schema version) and ``ts`` (ms since the epoch).
Events a person types may omit ``v`` and ``ts``: ``v`` defaults to the current version and
``ts`` to the millisecond part of the stream entry id. Anything that does not decode raises
:class:`~fd.control.bad_event.BadEvent` naming the field, and the reader dead-letters it
(fd/control/dead_letters.py). What rides inside the events lives beside them: a request's
``data`` (fd/control/request_data.py, fd/control/sampling.py) and a tokens event's log-probabilities
and embedding (fd/control/token_payloads.py).
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, Union

import orjson

from fd.control.bad_event import BadEvent
from fd.control.entry_ids import ts_of_entry_id
from fd.control.keys import ENGINE_ID_RE, valid_request_id
from fd.control.request_data import RequestData

SCHEMA_VERSION = 1
MAX_FIELD_BYTES = 1 << 20  # one field; a 1 MiB prompt is already far past any context
MAX_IDS_PER_ABORT = 10_000

FINISH_REASONS = ("stop", "length", "abort", "error")

#: A JSON object, decoded: its values are unchecked until read. Events carry some as one field
#: each (``usage``, ``logprobs``, a journal's ``config``).
JsonObject: TypeAlias = dict[str, Any]


def now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- events

_REGISTRY: dict[str, type[AnyEvent]] = {}


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
    # stream, so the engine that claims it reads them and continues (see fd.engine.node.failover).
    resume: bool | None = None
    # Set when an engine takes the request from a lane (fd/control/lanes.py) onto P:requests:
    # its lane entry's id, when it was accepted (an abort_all counts it from then).
    queued: str | None = None


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
    # client asked max_tokens=0 (the engine generates one token, which is not shown). On a
    # Responses API request: JSON of the request fields its Response echoes (fd.api.responses).
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
    #: the request's output tokens before these (their place in its output, a takeover's
    #: included; None from an engine of an earlier release): a reader checks it follows what it
    #: was sent (a failover can shorten a story a reader had read more of; fd/control/mux.py)
    pos: int | None = None
    # Only when the request asked (SamplingParams.logprobs): per token of token_ids, in order,
    # {"lp": [its log-probability, ...], "top": [[[token id, log-probability], ...], ...]}
    # (fd.control.token_payloads.logprobs_field / logprobs_entries).
    logprobs: JsonObject | None = None
    # Only on the first tokens event of a request that asked (SamplingParams.prompt_logprobs):
    # {"ids": the prompt, "lp": [...], "top": [...]}, lp and top for its tokens 1.. (the first
    # has none), shaped as `logprobs` (fd.control.token_payloads.prompt_logprobs_field / prompt_logprobs_entries).
    prompt_logprobs: JsonObject | None = None
    # Only on the first tokens event of an embeddings request (SamplingParams.embed): the
    # final hidden state at the prompt's last position, float32 little-endian, base64
    # (fd.control.token_payloads.embedding_field / embedding_vector).
    embedding: str | None = None


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
    usage: JsonObject = field(default_factory=dict)
    engine: str = ""
    step: int = 0
    error: str | None = None
    stop_reason: str | None = None  # the stop string or token that ended it, like vLLM
    # The stop_token_ids token that ended it (then also stop_reason, as text), written only
    # then: what vLLM's answer gives as an integer stop_reason.
    stop_token: int | None = None


# lifecycle stream P:lifecycle -------------------------------------------------------
# For what watches fd from outside (a router, an autoscaler, a dashboard; DESIGN.md §2): each
# request's milestones and each engine's load as they happen, on one capped stream, readable
# with ``redis-cli XREAD``. No prompt, no text, no key: ids, engines, counts and reasons.


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestAccepted(Event):
    """An API replica accepted the request (its story started)."""

    TYPE: ClassVar[str] = "request_accepted"
    request_id: str
    api: str = ""
    endpoint: str = ""
    prompt_tokens: int = 0
    # the engine placement chose (its lane, fd/control/lanes.py); absent: P:requests, any engine
    lane: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestClaimed(Event):
    """An engine owns the request and starts it (a takeover or a hand-back's: again)."""

    TYPE: ClassVar[str] = "request_claimed"
    request_id: str
    engine: str = ""
    attempt: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstToken(Event):
    """The request's first output token is on its story."""

    TYPE: ClassVar[str] = "first_token"
    request_id: str
    engine: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    """The request's ``final``: why it ended, and its token counts."""

    TYPE: ClassVar[str] = "request_finished"
    request_id: str
    engine: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad(Event):
    """An engine's load, written at each step it decides while it has work (and once when it
    runs out): what a router weighs, fresher than a heartbeat."""

    TYPE: ClassVar[str] = "engine_load"
    engine: str = ""
    step: int = 0
    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    prefix_blocks: int = 0  # KV blocks the prefix cache holds that a new request could share


LifecycleEvent: TypeAlias = RequestAccepted | RequestClaimed | FirstToken | RequestFinished | EngineLoad
LIFECYCLE_TYPES: tuple[type[LifecycleEvent], ...] = (
    RequestAccepted,
    RequestClaimed,
    FirstToken,
    RequestFinished,
    EngineLoad,
)

#: What ``P:control`` carries.
ControlEvent: TypeAlias = Abort | AbortAll | Drain | LoadLora | UnloadLora

REQ_STREAM_TYPES = (Accepted, Claimed, Tokens, Preempted, AbortRequested, Drained, BlocksReleased, Final)
CONTROL_TYPES: tuple[type[ControlEvent], ...] = (Abort, AbortAll, Drain, LoadLora, UnloadLora)

_cls: type[AnyEvent]
for _cls in (*CONTROL_TYPES, Request, *REQ_STREAM_TYPES, *LIFECYCLE_TYPES):
    _REGISTRY[_cls.TYPE] = _cls

#: Every event :func:`decode` gives (the engine journal's too, defined further down).
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
    RequestAccepted,
    RequestClaimed,
    FirstToken,
    RequestFinished,
    EngineLoad,
    "JournalStart",
    "JournalStep",
]


# --------------------------------------------------------------------------- codec


def json_fields(ev: Event) -> dict[str, Any]:
    """The event's fields as :meth:`Event.encode` writes them, each number a JSON number: what
    ``XREAD`` shows, typed (``GET /v1/lifecycle``'s data, ``fd status --watch --json``)."""
    out: dict[str, Any] = {}
    for name, text in ev.encode().items():
        value = getattr(ev, name, None) if name != "type" else None
        if type(value) is bool:
            out[name] = value
        elif type(value) is int:
            out[name] = int(text)  # (the text, not the value: an unset ts is encoded as now)
        elif type(value) is float:
            out[name] = float(text)
        else:
            out[name] = text
    return out


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


#: A stream entry's fields as a client hands them back (bytes from redis-py; str from a test or
#: a hand-typed entry): unchecked until :func:`decode` reads them.
RawFields: TypeAlias = Mapping[Any, Any]


def decode(fields: RawFields, entry_id: str | bytes | None = None) -> AnyEvent:
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
    return ev


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
# Written by fd.engine.journal.journal, read by ``fd replay``: what the pure scheduler consumed, and a
# digest of what it decided, so a run can be re-executed and checked off the cluster.


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalStart(Event):
    """Opens a journal segment: the scheduler config a replay builds its fresh scheduler from.
    An engine restarted under the same id writes another one; replay starts over there."""

    TYPE: ClassVar[str] = "journal_start"
    engine: str = ""
    config: JsonObject = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalStep(Event):
    """The scheduler calls of one engine step, in order (``data["calls"]``). ``seq`` counts
    entries from 0 after the JournalStart, so a trimmed or gappy journal is detected."""

    TYPE: ClassVar[str] = "step"
    engine: str = ""
    step: int = 0
    seq: int = 0
    data: JsonObject = field(default_factory=dict)


JOURNAL_TYPES = (JournalStart, JournalStep)

for _cls in JOURNAL_TYPES:
    _REGISTRY[_cls.TYPE] = _cls

for _cls in _REGISTRY.values():
    for _f in ("type", *(f.name for f in dataclasses.fields(_cls)), "request_id"):
        _FIELD_NAMES[_f.encode()] = _f
        _FIELD_NAMES[_f] = _f
