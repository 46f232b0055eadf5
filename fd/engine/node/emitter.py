"""How the engine node's events reach the outbox: each stamped with its time and its engine,
the scheduler's ``Tokens`` given their text, and each ending (``abort_requested``,
``blocks_released``, ``final``) settling what the node kept for the request.

Every event the node publishes on a request's story goes through :meth:`Emitter.emit`, from
the engine core's step (the scheduler's events) and from admission and aborts (a claim, the
story of a request no engine ran) alike, so the bookkeeping that rides on an event happens
exactly once, wherever the event was made:

- a request's held-back text (a possible stop-string prefix, an incomplete UTF-8 character)
  goes out before the end of its story, so nothing but the protocol's own events follows
  ``abort_requested``;
- a ``final`` forgets the request's record, queues its ack and its parent's TTLs with it, and
  lets a LoRA adapter that waits to be unloaded go once no request uses it;
- a silent request's events (handed back, or its ownership lost) are bookkept, never
  published: its new owner writes its story.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fd.control.events import (
    AbortRequested,
    BlocksReleased,
    Claimed,
    Drained,
    Event,
    Final,
    FirstToken,
    Preempted,
    RequestClaimed,
    RequestFinished,
    Tokens,
)
from fd.control.keys import Keys
from fd.control.token_payloads import embedding_field, logprobs_field, prompt_logprobs_field
from fd.engine.core.adapters import Adapters
from fd.engine.core.protocol import SchedulerLike
from fd.engine.node.publisher import Publisher
from fd.engine.node.request_table import Live, RequestTable
from fd.engine.runner.lora_runtime import LoraLoader

#: The story events an engine writes under its own name (``engine=<id>``); the scheduler makes
#: them without one, and ``Tokens`` carry none.
ENGINE_NAMED = (Claimed, Preempted, AbortRequested, Drained, BlocksReleased, Final)


def take_prompt_logprobs(live: Live) -> dict | None:
    """The prompt's log-probabilities for the request's first tokens event, once every
    prompt position was scored (its last prefill chunk samples that first token)."""
    got = live.prompt_lp
    if got is None:
        return None
    prompt = live.request.data.prompt_token_ids
    if len(got) < len(prompt) - 1:
        return None
    live.prompt_lp = None
    return prompt_logprobs_field(prompt, [got[p] for p in range(1, len(prompt))])


class Emitter:
    def __init__(
        self,
        engine_id: str,
        keys: Keys,
        publisher: Publisher,
        requests: RequestTable,
        sched: SchedulerLike,
        adapters: Adapters,
        lora: LoraLoader,
        metrics: Any = None,
        released: Callable[[], None] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.keys = keys
        self.publisher = publisher
        self.requests = requests
        self.sched = sched  # (the step a tail of text is stamped with)
        self.adapters = adapters
        self.lora = lora
        self.metrics = metrics
        # Blocks came back: the engine's gauges (running, waiting, free blocks) are read now, on
        # every path that releases (a step's result, a queued step that left a request out, an
        # abort of a request no step held), not at the next step's fold-in, a step later.
        self.released = released

    def emit(
        self,
        evs: list[Event],
        texts: dict[str, str] | None = None,
        logprobs: dict[str, tuple[float, tuple]] | None = None,
        embeddings: dict[str, bytes] | None = None,
    ) -> None:
        """Stamp and queue events for the next flush; ``texts``: the step's text deltas, by
        request, for its ``Tokens`` (which the scheduler makes without text), and
        ``logprobs`` and ``embeddings`` the runner's, for those that asked."""
        now = time.time()
        ts = int(now * 1000)
        released = False
        # abort_requested of requests with no record here (a tombstone's story, written
        # whole in one call): their blocks_released follows in the same call.
        noted: dict[str, float] = {}
        put = self.publisher.put
        requests = self.requests
        story = self.keys.req
        for ev in evs:
            rid = ev.request_id  # type: ignore[attr-defined]
            live = requests.get(rid)
            silent = live is not None and live.silent
            if type(ev) is Tokens:  # the common case: one per request per step
                if not silent:
                    self._put_tokens(ev, live, ts, texts, logprobs, embeddings)
                continue
            if (
                live is not None
                and live.detok is not None
                and isinstance(ev, (AbortRequested, BlocksReleased, Final))
            ):
                # The request emits no more tokens: text held back goes out now, before the
                # end of its story.
                tail = live.detok.flush()
                live.detok = None
                if tail and not silent:
                    put(
                        story(rid),
                        Tokens(
                            request_id=rid,
                            token_ids=(),
                            text=tail,
                            ts=ts,
                            step=self.sched.step,
                            pos=live.emitted,
                        ),
                    )
            if isinstance(ev, AbortRequested):
                if live is not None:
                    live.abort_noted_at = now
                else:
                    noted[rid] = now
            elif isinstance(ev, BlocksReleased):
                released = True
                if live is not None:
                    t, live.abort_noted_at = live.abort_noted_at, None
                else:
                    t = noted.pop(rid, None)
                if t is not None and self.metrics is not None and not silent:
                    self.metrics.abort_release_seconds.observe(now - t)
            elif isinstance(ev, Final):
                self._ended(rid, live)
                if silent:
                    continue  # its new owner acks it and writes its final
                if live is not None:
                    req = live.request
                    if req.data.parent:  # see RequestData.parent
                        self.publisher.expire(rid, story(req.data.parent))
                        self.publisher.expire(rid, self.keys.owner(req.data.parent))
                    # (its own story's and owner key's TTL: renewed by the fence with the final)
                    self.publisher.ack(rid, live.entry)
            if silent:
                continue
            if isinstance(ev, ENGINE_NAMED) and not ev.engine:
                ev = replace(ev, ts=ts, engine=self.engine_id)
            else:
                ev = replace(ev, ts=ts)
            put(story(rid), ev)
            if isinstance(ev, (Claimed, Final)):
                self._note(ev)
        if released and self.released is not None:
            self.released()

    def _put_tokens(
        self,
        ev: Tokens,
        live: Live | None,
        ts: int,
        texts: dict[str, str] | None,
        logprobs: dict[str, tuple[float, tuple]] | None,
        embeddings: dict[str, bytes] | None,
    ) -> None:
        rid = ev.request_id
        text = texts.pop(rid, ev.text) if texts else ev.text
        lp = logprobs.get(rid) if logprobs else None
        plp = (
            take_prompt_logprobs(live)
            if live is not None and live.prompt_lp is not None and ev.token_ids
            else None
        )
        emb = embeddings.get(rid) if embeddings else None
        pos = None
        if live is not None:
            pos = live.emitted
            if not pos and ev.token_ids:
                self.publisher.put(
                    self.keys.lifecycle, FirstToken(request_id=rid, engine=self.engine_id, ts=ts)
                )
            live.emitted += len(ev.token_ids)
        self.publisher.put(
            self.keys.req(rid),
            Tokens(
                request_id=rid,
                token_ids=ev.token_ids,
                text=text,
                step=ev.step,
                ts=ts,
                logprobs=None if lp is None else logprobs_field([lp]),
                prompt_logprobs=plp,
                embedding=None if emb is None else embedding_field(emb),
                pos=pos,
            ),
        )

    def _note(self, ev: Claimed | Final) -> None:
        """A request's milestone on ``P:lifecycle``, in the same batch as its story's event."""
        if isinstance(ev, Claimed):
            note: Event = RequestClaimed(
                request_id=ev.request_id, engine=ev.engine, attempt=ev.attempt, ts=ev.ts
            )
        else:
            usage = ev.usage
            note = RequestFinished(
                request_id=ev.request_id,
                engine=ev.engine,
                finish_reason=ev.finish_reason,
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                ts=ev.ts,
            )
        self.publisher.put(self.keys.lifecycle, note)

    def _ended(self, rid: str, live: Live | None) -> None:
        """A final: the request's record goes, its token once the final is out, and an adapter
        being unloaded goes once its last request has ended."""
        self.publisher.ended(rid)
        self.requests.forget(rid)
        name = None if live is None else live.request.data.sampling.lora
        if name and self.adapters.unloading and self.adapters.done_with(name, self.requests.using_lora(name)):
            self.lora.forget(name)
