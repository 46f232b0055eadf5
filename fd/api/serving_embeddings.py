"""The embedding routes (vLLM's ``OpenAIServingEmbedding`` and ``ServingScores``): OpenAI's
``/v1/embeddings``, and vLLM's ``/score`` and ``/rerank`` over an embedding model. Request
shapes and answers live in :mod:`fd.api.embeddings`; this runs each text as a request on
the engines and gathers the vectors.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web

from fd.api import bodies
from fd.api.cancellation import watch_of
from fd.api.context import CALLER, RID, ApiContext, json_response, new_abort_id
from fd.api.embeddings import finish as embedding_finish
from fd.api.embeddings import (
    pair_scores,
    parse_embeddings,
    parse_rerank,
    parse_score,
    rerank_response,
    score_response,
)
from fd.api.embeddings import response as embedding_response
from fd.api.errors import ApiError, id_taken, unavailable
from fd.api.streaming import Timing, merged
from fd.control.events import Accepted, Final, Request, Tokens
from fd.control.request_data import RequestData
from fd.control.token_payloads import embedding_vector


class ServingEmbeddings:
    """Embeddings, scores and reranks, over one replica's context."""

    def __init__(self, ctx: ApiContext):
        self.ctx = ctx

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's embeddings (fd.api.embeddings)."""
        rid, created, req, vectors = await self._embed(request, parse_embeddings)
        return json_response(
            embedding_response(rid, created, req, [embedding_finish(v, req) for v in vectors]),
            headers={"X-Request-Id": rid},
        )

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's ``/score`` over an embedding model: cosine similarities (fd.api.embeddings)."""
        rid, created, req, vectors = await self._embed(request, parse_score, "score")
        return json_response(
            score_response(rid, created, req, pair_scores(vectors, req)), headers={"X-Request-Id": rid}
        )

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's ``/rerank`` (Jina's and Cohere's API) over an embedding model."""
        rid, _, req, vectors = await self._embed(request, parse_rerank, "rerank")
        return json_response(
            rerank_response(rid, req, pair_scores(vectors, req)), headers={"X-Request-Id": rid}
        )

    async def _embed(self, request: web.Request, parse, prefix: str = "embd") -> tuple[str, int, Any, list]:
        """The vectors of a request's texts: each a request on the engines, ``<id>.<k>`` when
        there are several (as a completions batch's prompts), whose first tokens event carries
        its vector. A hang-up aborts them; so does an abort of the id."""
        ctx = self.ctx
        await ctx.check_redis()
        arrival = time.monotonic()
        rid, explicit = ctx.request_id(request, prefix)
        shown = request[RID]
        body = await ctx.body(request)
        await ctx.know_adapters(body)
        parsed = parse(body, ctx.limits, ctx.tokenizer)
        req = getattr(parsed, "embed", parsed)  # (a score's: the texts it embeds)
        ctx.say_ignored(body.ignored(), rid)
        many = len(req.inputs) > 1
        if many:
            ids = await ctx.choice_ids(rid, explicit, len(req.inputs), shown)
        else:
            ids = (rid,)
            if explicit:
                await ctx.id_free(rid, shown)
        watch = watch_of(request)
        now = time.time()
        created = int(now)
        common = dict(
            api=ctx.cfg.api_id,
            endpoint="embeddings",
            model=req.model,
            created=created,
            tenant=request[CALLER].tag,
        )
        requests = [
            (
                Request(
                    request_id=c,
                    data=RequestData(
                        prompt_token_ids=ids_,
                        sampling=req.sampling,
                        arrival_ts=int(now * 1000),
                        model=req.model,
                        api=ctx.cfg.api_id,
                        parent=rid if many else "",
                        priority=req.priority,
                    ),
                ),
                Accepted(
                    request_id=c,
                    prompt_tokens=len(ids_),
                    **common,
                    **(dict(parent=rid, index=k) if many else {}),
                ),
            )
            for k, (c, ids_) in enumerate(zip(ids, req.inputs, strict=False))
        ]
        subs = [await ctx.mux.subscribe(c, b"0") for c in ids]  # before submit: nothing missed
        timing: list[Timing] = []
        try:
            watch.request_id = rid  # from here on a disconnect aborts them
            if many:
                watch.abort_ids = ids
                parent = Accepted(
                    request_id=rid, choices=len(ids), n=1, prompt_tokens=sum(map(len, req.inputs)), **common
                )
                if not await ctx.bus.submit_choices(parent, requests):
                    raise id_taken(shown)
            else:
                await ctx.bus.submit(*requests[0])
            for sub in subs:
                sub.story_started()
            timing = [Timing(ctx.metrics, arrival, len(x)) for x in req.inputs]
            vectors = await self._collect(ids, subs, timing)
            watch.finished = True
            return shown, created, parsed, vectors
        finally:
            for t in timing:
                t.close()
            for sub in subs:
                await sub.close()

    async def _collect(self, ids: tuple[str, ...], subs: list, timing: list[Timing]) -> list:
        """Each input's vector, from its first tokens event, once every input has ended. An
        input that failed or was aborted fails the whole answer (and stops the others)."""
        vectors: list = [None] * len(ids)
        finals: list[Final | None] = [None] * len(ids)
        async with contextlib.aclosing(merged(subs)) as batches:
            async for batch in batches:
                for k, _eid, ev in batch or ():
                    if isinstance(ev, Tokens):
                        timing[k].tokens(len(ev.token_ids))
                        if ev.embedding is not None and vectors[k] is None:
                            vectors[k] = embedding_vector(ev.embedding)
                    elif isinstance(ev, Final):
                        timing[k].final(ev)
                        finals[k] = ev
                        if ev.finish_reason in ("error", "abort"):
                            rest = tuple(c for c, f in zip(ids, finals, strict=True) if f is None)
                            if rest:
                                await self.ctx.publish_abort(rest, new_abort_id())
                            if ev.finish_reason == "error":
                                raise bodies.final_error(ev)
                            raise ApiError(
                                503,
                                f"Input {k} was aborted before its embedding was made.",
                                "server_error",
                                None,
                                "request_aborted",
                            )
                if all(f is not None for f in finals):
                    missing = [k for k, v in enumerate(vectors) if v is None]
                    if missing:
                        raise ApiError(
                            500,
                            f"The engine returned no embedding for input {missing[0]} (an "
                            "engine that cannot make embeddings?).",
                            "server_error",
                            None,
                            "engine_error",
                        )
                    return vectors
        raise unavailable("The request's stream ended without a final event.")
