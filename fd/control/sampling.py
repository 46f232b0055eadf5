"""What a client asks of sampling (:class:`SamplingParams`), and its strict check.

A request's sampling parameters travel inside the ``data`` JSON of its ``request`` event
(fd/control/request_data.py), which a person or another program may have typed: every value is
checked here, and a wrong one is a :class:`~fd.control.bad_event.BadEvent` (a dead letter), never
an exception inside an engine step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fd.control.bad_event import BadEvent

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
    # Structured output: the canonical JSON text of a fd.control.guided spec ("" for none); the
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
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
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
            from fd.control.guided import GuidedError, parse

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
