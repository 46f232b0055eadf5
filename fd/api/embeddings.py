"""OpenAI's embeddings API (``POST /v1/embeddings``), as vLLM serves it for a decoder model:
an input's embedding is the model's final hidden state at the input's last token (vLLM's LAST
pooling), L2-normalized unless the request says ``normalize: false``.

Each input runs on the engines as a request of its own, asking for one token it never shows
(``SamplingParams.embed``); the runner hands back the hidden state with it, and the request's
first ``tokens`` event carries it. Not a side path, because an input takes an engine slot and
KV blocks like any prompt: it is claimed, batched, aborted and released the same way (a client
that hangs up stops its inputs), and its story is in the event log like every other request's.

This module is the sans-IO part: the body's parse, and the answer's body from the vectors.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd.api.chat_template import chat_ids, chat_rendering, parse_messages, template_kwargs
from fd.api.errors import bad_request
from fd.api.validation import (
    Limits,
    check_ids,
    check_model,
    is_bool,
    is_int,
    lora_of,
    opt,
    priority_of,
    truncation_of,
)
from fd.control.sampling import SamplingParams
from fd.control.tokenizer import TokenizerLike

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
ENCODINGS = ("float", "base64")
#: What each input asks of the engine: its prompt and the one token that comes with the
#: hidden state (never shown; ignore_eos, so it is always a token and always comes).
SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=True)


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None  # a matryoshka model's vectors cut to their first d values
    normalize: bool = True
    priority: int = 0
    lora: str = ""  # a LoRA adapter the request's model names

    @property
    def sampling(self) -> SamplingParams:
        return dataclasses.replace(SAMPLING, lora=self.lora) if self.lora else SAMPLING


def parse_embeddings(body: dict, limits: Limits, tokenizer: TokenizerLike) -> EmbeddingRequest:
    model = check_model(body, limits)
    raw = body.get("input")
    if body.get("messages") is not None:  # vLLM's chat embeddings: the conversation, templated
        if raw is not None:
            raise bad_request("Give 'input' or 'messages', not both.", "messages", "invalid_value")
        messages = parse_messages(body)
        raw = list(
            chat_ids(
                messages,
                tokenizer,
                chat_rendering(body, messages, generation_prompt=False),
                None,
                template_kwargs(body),
            )
        )
        if not raw:
            raise bad_request("The conversation renders to no tokens.", "messages", "invalid_value")
    if raw is None:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(is_int(t) for t in raw)):
        batch = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        batch = raw
    else:
        raise bad_request(
            "'input' must be a string, a list of token ids, or a non-empty list of either.",
            "input",
            "invalid_type",
        )
    inputs = _inputs(body, batch, "input", limits, tokenizer)
    fmt = opt(body, "encoding_format", lambda v: v in ENCODINGS, "'float' or 'base64'", "float")
    dims = _dimensions(body, tokenizer)
    return EmbeddingRequest(
        model,
        inputs,
        fmt,
        dims,
        opt(body, "normalize", is_bool, "a boolean", True),
        priority_of(body, limits),
        lora_of(body, limits),
    )


def _inputs(
    body: dict, batch: list, param: str, limits: Limits, tokenizer: TokenizerLike
) -> tuple[tuple[int, ...], ...]:
    """Each text (or token id list) of ``batch`` as the prompt its engine request embeds."""
    if len(batch) > MAX_INPUTS:
        raise bad_request(f"At most {MAX_INPUTS} inputs a request.", param, "invalid_value")
    special = opt(body, "add_special_tokens", is_bool, "a boolean", True)
    keep = truncation_of(body, limits)
    inputs = []
    for k, x in enumerate(batch):
        if isinstance(x, str):
            ids = tuple(tokenizer.encode(x, add_special_tokens=special)) if x else ()
        elif isinstance(x, list) and x and all(is_int(t) for t in x):
            ids = check_ids(x, limits, param)
        else:
            raise bad_request(
                "Each input must be a non-empty string or a non-empty list of token ids.",
                param,
                "invalid_value",
            )
        if not ids:
            raise bad_request(f"Input {k} is empty.", param, "invalid_value")
        if keep:
            ids = ids[-keep:]
        if len(ids) >= limits.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens; "
                f"input {k} has {len(ids)} (at most {limits.max_model_len - 1}). Shorten it, "
                "or set 'truncate_prompt_tokens'.",
                param,
                "context_length_exceeded",
            )
        inputs.append(ids)
    return tuple(inputs)


def _dimensions(body: dict, tokenizer: TokenizerLike) -> int | None:
    """OpenAI's ``dimensions``, for a model trained for it (vLLM's rule and messages): any
    other model's leading values are not an embedding of their own."""
    d = opt(body, "dimensions", is_int, "an integer", None)
    if d is None:
        return None
    if d < 1:
        raise bad_request("'dimensions' must be greater than 0.", "dimensions", "invalid_value")
    m = tokenizer.matryoshka
    if not m:
        raise bad_request(
            "The model does not support matryoshka representation: changing the output "
            "dimensions would give poor embeddings.",
            "dimensions",
            "unsupported",
        )
    if isinstance(m, tuple) and d not in m:
        raise bad_request(
            f"The model supports only {list(m)} as 'dimensions', not {d}.", "dimensions", "invalid_value"
        )
    return d


def finish(vector: np.ndarray, req: EmbeddingRequest) -> np.ndarray:
    """The hidden state an engine returned, as the request asked for it: cut to its
    ``dimensions``, then normalized (both as vLLM: the cut first), in float32."""
    v = vector[: req.dimensions] if req.dimensions else vector
    if req.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32)


def response(rid: str, created: int, req: EmbeddingRequest, vectors: list[np.ndarray]) -> dict[str, Any]:
    """OpenAI's answer: a list of ``embedding`` objects, in the inputs' order. ``base64`` is
    the float32 values' little-endian bytes (what the ``openai`` client asks for by default
    and decodes itself)."""
    if req.encoding_format == "base64":
        values: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        values = [v.tolist() for v in vectors]
    n = sum(map(len, req.inputs))
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": req.model,
        "data": [{"object": "embedding", "index": k, "embedding": e} for k, e in enumerate(values)],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


# ------------------------------------------------------------------ scores and reranking


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """vLLM's score and rerank over an embedding model: each pair's score is the cosine
    similarity of its two texts' embeddings. Each distinct text is embedded once."""

    embed: EmbeddingRequest  # the distinct texts, in first-seen order
    pairs: tuple[tuple[int, int], ...]  # (first, second) as indexes of embed.inputs, in answer order
    documents: tuple[str, ...] = ()  # rerank: the documents, returned with their scores
    top_n: int | None = None  # rerank: only the best this many


def _texts(body: dict, name: str, one: bool = False) -> list[str]:
    v = body.get(name)
    if v is None:
        raise bad_request(f"'{name}' is required.", name, "missing_required_parameter")
    if isinstance(v, str) and v:
        return [v]
    if not one and isinstance(v, list) and v and all(isinstance(x, str) and x for x in v):
        return v
    what = "a non-empty string" if one else "a non-empty string or a non-empty list of them"
    raise bad_request(f"'{name}' must be {what}.", name, "invalid_type")


def _score_request(
    body: dict,
    limits: Limits,
    tokenizer: TokenizerLike,
    firsts: list[str],
    seconds: list[str],
    param: str,
    **extra: Any,
) -> ScoreRequest:
    texts = list(dict.fromkeys(firsts + seconds))
    at = {t: i for i, t in enumerate(texts)}
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise bad_request(
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one "
            "'text_1', or as many as 'text_2'.",
            "text_1",
            "invalid_value",
        )
    embed = EmbeddingRequest(
        check_model(body, limits),
        _inputs(body, texts, param, limits, tokenizer),
        priority=priority_of(body, limits),
        lora=lora_of(body, limits),
    )
    return ScoreRequest(embed, tuple((at[a], at[b]) for a, b in zip(firsts, seconds, strict=True)), **extra)


def parse_score(body: dict, limits: Limits, tokenizer: TokenizerLike) -> ScoreRequest:
    """vLLM's ``/score``: ``text_1`` against each of ``text_2`` (one or as many as it)."""
    return _score_request(body, limits, tokenizer, _texts(body, "text_1"), _texts(body, "text_2"), "text_2")


def parse_rerank(body: dict, limits: Limits, tokenizer: TokenizerLike) -> ScoreRequest:
    """vLLM's ``/rerank`` (Jina's and Cohere's shape): ``documents`` by relevance to
    ``query``, the best ``top_n`` (all by default)."""
    query = _texts(body, "query", one=True)
    docs = _texts(body, "documents")
    top = opt(body, "top_n", is_int, "an integer", None)
    if top is not None and top < 0:
        raise bad_request("'top_n' must be at least 0 (0: every document).", "top_n", "invalid_value")
    return _score_request(
        body, limits, tokenizer, query, docs, "documents", documents=tuple(docs), top_n=top or None
    )


def pair_scores(vectors: list[np.ndarray], req: ScoreRequest) -> list[float]:
    """Each pair's cosine similarity (in float64: a text and itself score 1, not 1 + 1e-7)."""
    wide = [v.astype(np.float64) for v in vectors]
    unit = [v / max(float(np.linalg.norm(v)), 1e-12) for v in wide]
    return [float(np.dot(unit[a], unit[b])) for a, b in req.pairs]


def score_response(rid: str, created: int, req: ScoreRequest, scores: list[float]) -> dict[str, Any]:
    n = sum(map(len, req.embed.inputs))
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": req.embed.model,
        "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


def rerank_response(rid: str, req: ScoreRequest, scores: list[float]) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda k: -scores[k])[: req.top_n]
    return {
        "id": rid,
        "model": req.embed.model,
        "usage": {"total_tokens": sum(map(len, req.embed.inputs))},
        "results": [
            {"index": k, "document": {"text": req.documents[k]}, "relevance_score": scores[k]} for k in order
        ],
    }
