"""A response of ``n`` choices: how many a request asks (``n``, ``best_of``), each choice's
sampling, and, since each choice runs as a request of its own on the engines (``choice_ids``),
the joining of their renderers into the one response a client sees."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from fd.api.bodies import usage_chunk
from fd.api.errors import bad_request
from fd.api.rendering import make_renderer
from fd.api.validation import is_int, opt
from fd.control.endings import usage
from fd.control.events import Final
from fd.control.keys import choice_ids
from fd.control.sampling import SamplingParams

MAX_CHOICES = 16  # n: each choice is a request of its own on the engines
MAX_BATCH = 256  # prompts x n, of one completions request


def choice_sampling(sp: SamplingParams, k: int) -> SamplingParams:
    """Choice ``k``'s sampling: with a seed, ``seed + k`` (as vLLM), so the choices differ and
    each is reproducible on its own."""
    if sp.seed is None or k == 0:
        return sp
    return dataclasses.replace(sp, seed=(sp.seed + k) % 2**63)


def choice_count(body: dict) -> int:
    """``n``, with ``best_of`` equal to it or absent (a best_of that ranks more candidates
    than it returns is not supported)."""
    n = opt(body, "n", is_int, "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must be between 1 and {MAX_CHOICES}.", "n", "invalid_value")
    best_of = opt(body, "best_of", is_int, "an integer", n)
    if best_of != n:
        raise bad_request("Only best_of equal to n is supported.", "best_of", "unsupported")
    return n


def choices_cursor(entry_ids: list[bytes]) -> bytes:
    """The SSE ``id:`` of a response of n choices: each choice's last entry id, in order."""
    return b",".join(entry_ids)


class Choices:
    """A response of ``n`` choices, each a request of its own (``choice_ids``): one
    :class:`~fd.api.rendering.Renderer` a choice, their chunks under the response's id, one usage for all (the
    prompt counted once, as OpenAI and vLLM do), and the final chunks once every choice has
    ended. Like the renderer it needs nothing but the ``accepted`` events' fields, so any
    replica renders the same bytes."""

    def __init__(
        self,
        request_id: str,
        n: int,
        endpoint: str,
        model: str,
        created: int,
        prompt_tokens: int,
        include_usage: bool = False,
        token_bytes: Callable[[int], bytes] | None = None,
        continuous_usage: bool = False,
        per_prompt: int | None = None,
        request_ids: tuple[str, ...] | None = None,
    ):
        self.rid = request_id
        # the choices' ids in the event log (a tenant's own id is namespaced there, its answer
        # shows the id it gave: fd.api.tenancy)
        self.request_ids = request_ids or choice_ids(request_id, n)
        # choices of each prompt (a story written before `n` was: all of one prompt)
        whole = isinstance(per_prompt, int) and not isinstance(per_prompt, bool)
        self.per_prompt = per_prompt if whole and 0 < per_prompt <= n else n
        self.endpoint, self.model, self.created = endpoint, model, created
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.parts = [
            make_renderer(
                request_id, endpoint, model, created, prompt_tokens, include_usage, token_bytes, False, k
            )
            for k in range(n)
        ]
        for r in self.parts:
            r.usage_chunk = False
        self.finals: list[Final | None] = [None] * n

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finals)

    def _usage(self) -> dict[str, Any]:
        # what the engines counted for the choices that ended, this replica's count for the rest
        ended = [
            None if f is None else r.final_usage(f) for f, r in zip(self.finals, self.parts, strict=True)
        ]
        c = sum(
            r.completion_tokens if u is None else u["completion_tokens"]
            for u, r in zip(ended, self.parts, strict=True)
        )
        out: dict[str, Any] = usage(self.prompt_tokens, c)
        # Each prompt counted once, so its cached tokens are those of one choice, its first:
        # its siblings may reuse what it computed, which the prompt did not get for free.
        cached = sum(
            u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            for u in ended[:: self.per_prompt]
            if u is not None
        )
        if cached:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def _stamp(self, chunks: list[dict]) -> list[dict]:
        if self.continuous_usage:
            for c in chunks:
                if "error" not in c:
                    c["usage"] = self._usage()
        return chunks

    def choice(self, k: int) -> _Choice:
        """Choice ``k`` with a renderer's streaming methods (the SSE writer's)."""
        return _Choice(self, k)

    def start_chunks(self, k: int, accepted: Any = None) -> list[dict]:
        return self._stamp(self.parts[k].start_chunks(accepted))

    def token_json(
        self,
        k: int,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> bytes | None:
        if not self.continuous_usage:
            return self.parts[k].token_json(text, n_tokens, token_ids, logprobs, prompt_logprobs)
        chunks = self._stamp(self.parts[k].token_chunks(text, n_tokens, token_ids, logprobs, prompt_logprobs))
        return orjson.dumps(chunks[0]) if chunks else None

    def token_chunks(self, k: int, *args) -> list[dict]:
        return self._stamp(self.parts[k].token_chunks(*args))

    def add_tokens(
        self,
        k: int,
        text: str,
        n_tokens: int,
        token_ids: tuple[int, ...] = (),
        logprobs: Any = None,
        prompt_logprobs: Any = None,
    ) -> None:
        self.parts[k].add_tokens(text, n_tokens, token_ids, logprobs, prompt_logprobs)

    def final_chunks(self, k: int, final: Final) -> list[dict]:
        """Choice ``k``'s last chunk, and once it is the last choice to end, the usage chunk.
        An error ends the whole response (the caller aborts the other choices)."""
        self.finals[k] = final
        out = self._stamp(self.parts[k].final_chunks(final))
        if final.finish_reason != "error" and self.done and self.include_usage:
            out.append(usage_chunk(self.endpoint, self.rid, self.created, self.model, self._usage()))
        return out

    def response(self) -> dict:
        """The whole body once every choice ended; raises the first choice's error, if any."""
        bodies = [r.response(f) for r, f in zip(self.parts, self.finals, strict=True)]
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        for k, c in enumerate(body["choices"]):
            c["index"] = k
        body["usage"] = self._usage()
        return body


@dataclass(frozen=True, slots=True)
class _Choice:
    choices: Choices
    k: int

    def start_chunks(self, accepted: Any = None) -> list[dict]:
        return self.choices.start_chunks(self.k, accepted)

    @property
    def structured(self) -> bool:
        return self.choices.parts[self.k].structured

    def token_json(self, *args) -> bytes | None:
        return self.choices.token_json(self.k, *args)

    def token_chunks(self, *args) -> list[dict]:
        return self.choices.token_chunks(self.k, *args)

    def final_chunks(self, final: Final) -> list[dict]:
        return self.choices.final_chunks(self.k, final)
