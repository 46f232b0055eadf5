"""The generating requests of the OpenAI protocol, without I/O: a chat's or a completion's
body in, a :class:`GenerationRequest` out (fd/api/rendering.py makes the responses), and
vLLM's ``/tokenize`` and ``/detokenize``.

Keeping this pure means every rejection is decided before anything reaches Redis (a rejected
request leaves no trace on ``P:requests``), and every response shape is testable without a
server. The only collaborator is the tokenizer, used as a pure function (text -> ids). The
parts each parse is made of live by idea: field checks and :class:`~fd.api.validation.Limits`
in :mod:`fd.api.validation`, sampling parameters in :mod:`fd.api.sampling`, messages, tools
and the chat template in :mod:`fd.api.chat_template`, and ``n`` in :mod:`fd.api.choices`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fd.api.chat_template import (
    chat_ids,
    chat_rendering,
    guide_answer,
    parse_messages,
    parse_tools,
    template_kwargs,
)
from fd.api.choices import MAX_BATCH, choice_count, choice_sampling
from fd.api.errors import bad_request
from fd.api.sampling import sampling_of, with_bad_words
from fd.api.validation import (
    Body,
    Limits,
    background_of,
    check_ids,
    check_model,
    is_bool,
    is_int,
    opt,
    priority_of,
    prompt_scores,
    reject_unsupported,
    stream_opts,
    tokens_as_ids_of,
    top_logprobs,
    truncation_of,
)
from fd.control.sampling import SamplingParams
from fd.control.tokenizer import TokenizerLike


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
    tool_parser: str | None = None  # chat with tools: how its calls are read (see parse_tools)
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


def parse_chat(body: dict, limits: Limits, tokenizer: TokenizerLike) -> GenerationRequest:
    model = check_model(body, limits)
    priority = priority_of(body, limits)
    tools, parser = parse_tools(body, limits)
    parallel = opt(body, "parallel_tool_calls", is_bool, "a boolean", True)
    want = opt(body, "logprobs", is_bool, "a boolean", False)
    top = opt(body, "top_logprobs", is_int, "an integer", None)
    if top and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", "top_logprobs", "invalid_value")
    logprobs = top_logprobs(top or 0, "top_logprobs") if want else None
    messages = parse_messages(body)
    stream, include_usage, continuous = stream_opts(body, limits)
    background = background_of(body)
    ids = chat_ids(messages, tokenizer, chat_rendering(body, messages), tools, template_kwargs(body))
    keep = truncation_of(body, limits)
    if keep:
        ids = ids[-keep:]
    if not ids:
        raise bad_request("The prompt is empty.", "messages", "invalid_value")
    sampling = with_bad_words(body, sampling_of(body, len(ids), limits, None, logprobs), tokenizer)
    scored = prompt_scores(body, stream)
    if scored is not None:
        sampling = dataclasses.replace(sampling, prompt_logprobs=scored)
    sampling, reasoning = guide_answer(
        sampling, limits.reasoning_parser, parser, tools, parallel, ids, tokenizer
    )
    return GenerationRequest(
        "chat",
        model,
        ids,
        sampling,
        stream,
        include_usage,
        background,
        continuous,
        choice_count(body),
        tool_parser=parser,
        reasoning_parser=reasoning,
        include_reasoning=opt(body, "include_reasoning", is_bool, "a boolean", True),
        tokens_as_ids=tokens_as_ids_of(body, limits),
        prompt_logprobs=scored,
        return_token_ids=opt(body, "return_token_ids", is_bool, "a boolean", False),
        priority=priority,
    )


def parse_tokenize(body: dict, limits: Limits, tokenizer: TokenizerLike) -> tuple[int, ...]:
    """vLLM's ``POST /tokenize``: a completion's ``prompt`` or a chat's ``messages``, as the
    generating endpoints would tokenize them (``add_special_tokens`` / ``add_generation_prompt``
    to say otherwise)."""
    check_model(body, limits)
    if body.get("messages") is not None:
        tools, _ = parse_tools({**body, "tool_choice": "none"}, limits)
        messages = parse_messages(body)
        return chat_ids(messages, tokenizer, chat_rendering(body, messages), tools, template_kwargs(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request(
            "Give 'prompt' (a string) or 'messages'.",
            "prompt",
            "missing_required_parameter" if prompt is None else "invalid_type",
        )
    special = opt(body, "add_special_tokens", is_bool, "a boolean", True)
    return tuple(tokenizer.encode(prompt, add_special_tokens=special))


def parse_detokenize(body: dict, limits: Limits) -> tuple[int, ...]:
    """vLLM's ``POST /detokenize``: ``tokens``, ids of this model's vocabulary."""
    check_model(body, limits)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required.", "tokens", "missing_required_parameter")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids.", "tokens", "invalid_type")
    return check_ids(tokens, limits, "tokens")


def parse_completion(body: dict, limits: Limits, tokenizer: TokenizerLike) -> GenerationRequest:
    model = check_model(body, limits)
    reject_unsupported(body, {"suffix": None})
    priority = priority_of(body, limits)
    top = opt(body, "logprobs", is_int, "an integer", None)
    logprobs = None if top is None else top_logprobs(top, "logprobs")
    echo = opt(body, "echo", is_bool, "a boolean", False)
    # max_tokens=0 with echo (scoring a text, as evaluation harnesses do): the engine generates
    # one token, which the response leaves out
    zero = [k for k in ("max_completion_tokens", "max_tokens") if is_int(body.get(k)) and body[k] == 0]
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
    elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        batch = [prompt]
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of either.", "prompt", "invalid_type"
        )
    keep = truncation_of(body, limits)
    whole = tuple(_prompt_ids(p, limits, tokenizer) for p in batch)
    prompts = tuple(ids[-keep:] for ids in whole) if keep else whole
    n = choice_count(body)
    if len(prompts) * n > MAX_BATCH:
        raise bad_request(
            f"At most {MAX_BATCH} choices a request (prompts times n).", "prompt", "invalid_value"
        )
    stream, include_usage, continuous = stream_opts(body, limits)
    background = background_of(body)
    sampling = with_bad_words(
        body,
        sampling_of(body, max(map(len, prompts)), limits, limits.default_max_tokens, logprobs),
        tokenizer,
    )
    scored = prompt_scores(body, stream)
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
            p if isinstance(p, str) and len(ids) == len(w) else tokenizer.decode(list(ids))
            for p, w, ids in zip(batch, whole, prompts, strict=True)
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
        tokens_as_ids=tokens_as_ids_of(body, limits),
        prompt_logprobs=scored,
        return_token_ids=opt(body, "return_token_ids", is_bool, "a boolean", False),
        priority=priority,
    )


def _prompt_ids(prompt: Any, limits: Limits, tokenizer: TokenizerLike) -> tuple[int, ...]:
    if isinstance(prompt, str):
        ids = tuple(tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = check_ids(prompt, limits, "prompt")
    elif isinstance(prompt, list) and prompt:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of either.", "prompt", "invalid_type"
        )
    else:
        ids = ()
    if not ids:
        raise bad_request("The prompt is empty.", "prompt", "invalid_value")
    return ids
