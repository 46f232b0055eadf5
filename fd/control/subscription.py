"""A subscription: one reader's view of one request's stream (``P:req:<id>``), fed by the
stream multiplexer (fd/control/mux.py's :class:`~fd.control.mux.StreamMux`) and read by a
handler; and how a subscription ends when it cannot reach ``final`` (the multiplexer stopped,
the story was lost or rewound).
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from fd.control.entry_ids import entry_id_key
from fd.control.events import Event, Final, Tokens

if TYPE_CHECKING:
    from fd.control.mux import StreamMux


class MuxStopped(RuntimeError):
    """The multiplexer stopped before this subscription saw its ``final``."""


class StoryLost(RuntimeError):
    """The request's story disappeared from Redis before its ``final``: the server was
    emptied or flushed, a failover lost it, or it expired. Nothing will ever be written to it
    again (an engine writes only while its owner key holds, and that went with it)."""

    def __init__(self, request_id: str):
        super().__init__(
            f"The stream of request {request_id} disappeared from the control plane (Redis was "
            "emptied, flushed or failed over, or the stream expired) before the request "
            "finished; its output is lost. Send the request again."
        )
        self.request_id = request_id


class StoryRewound(StoryLost):
    """The request's story lost an end this reader was sent (a failover), and what follows
    does not repeat it: what the client has can no longer be continued exactly."""

    def __init__(self, request_id: str):
        RuntimeError.__init__(
            self,
            f"The stream of request {request_id} was rewound by the control plane (Redis failed "
            "over and lost its end) and continued differently from what was sent; its output "
            "cannot be continued exactly. Send the request again.",
        )
        self.request_id = request_id


class _End(enum.Enum):
    """What ends a subscription's queue: its ``final`` was queued, or it was closed."""

    END = enum.auto()


_END = _End.END
#: What a subscription's queue holds: entries, then its end (or what stopped it).
_Item: TypeAlias = tuple[bytes, Event] | BaseException | _End
_NOTHING = entry_id_key(b"0-0")  # a subscription's ``_last`` before it has seen an entry


class Subscription:
    """One reader's view of one request's stream: ``(entry_id, event)`` in order, ending after
    ``final``. Iterate it with ``async for``; :meth:`close` to stop early.

    A consumer that writes what it gets somewhere (the API's SSE streams) can instead take
    everything delivered so far at once: ``await sub.ready(timeout)``, then
    :meth:`take_ready`, so one wake-up that brought several entries costs one write, and
    waiting costs no task per entry."""

    def __init__(self, mux: StreamMux, request_id: str, key: bytes, after: bytes):
        self.request_id = request_id
        self.key = key
        self.last_id = after
        self._last = entry_id_key(after)
        self._mux = mux
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[bool] | None = None
        self._quiet_until: float | None = None  # ready(timeout): when the wait gives up (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._ended = False  # nothing more will be queued
        self._closed = False  # the consumer saw the end
        #: the story is known to exist (or to have existed): its absence means it is lost. A
        #: subscription made after an entry is armed; one made before its request is
        #: submitted is armed by the submitter (:meth:`story_started`) or by its first entry.
        self.armed = self._last > _NOTHING
        #: the output token ids delivered, in order (None: made mid-story, whose output before
        #: ``after`` this reader does not know, and does not check)
        self._ids: list[int] | None = None if self.armed else []
        #: called whenever something is delivered: one consumer waiting on many subscriptions
        #: (a response of n choices) waits on one event instead of a task per subscription
        self.on_put: Callable[[], None] | None = None

    def story_started(self) -> None:
        """The request's story was written: from now on its absence is a loss."""
        self.armed = True

    @property
    def done(self) -> bool:
        """The consumer has seen the end (after ``final``, a stop, or :meth:`close`)."""
        return self._closed

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> tuple[bytes, Event]:
        if self._closed:
            raise StopAsyncIteration
        while not self._items:
            await self.ready()
        item = self._items.popleft()
        if item is _END:
            self._finish()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        return item

    async def ready(self, timeout: float | None = None) -> bool:
        """Wait until something is delivered (True; also at the end) or ``timeout`` seconds
        pass without anything (False)."""
        if self._items or self._closed:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiter = fut
        if timeout is None:
            self._quiet_until = None
        else:
            # One timer per quiet spell, not one per entry: it re-arms itself while entries
            # keep coming, and fires only once nothing came for ``timeout`` seconds.
            self._quiet_until = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._quiet_until, self._quiet)
        try:
            return await fut
        finally:
            self._waiter = None

    def _quiet(self) -> None:
        self._timer = None
        fut = self._waiter
        if fut is None or fut.done() or self._closed or self._quiet_until is None:
            return
        loop = fut.get_loop()
        if loop.time() >= self._quiet_until:
            fut.set_result(False)
        else:
            self._timer = loop.call_at(self._quiet_until, self._quiet)

    def take_ready(self) -> list[tuple[bytes, Event]]:
        """Every ``(entry_id, event)`` delivered and not yet taken, without waiting. Empty
        once the consumer has seen the end (check :attr:`done`); raises what stopped the
        mux once everything before it was taken."""
        out: list[tuple[bytes, Event]] = []
        items = self._items
        while items:
            item = items[0]
            if item is _END or isinstance(item, BaseException):
                if out:
                    break
                items.popleft()
                self._finish()
                if item is _END:
                    break
                raise item
            items.popleft()
            out.append(item)
        return out

    def _finish(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def close(self) -> None:
        if not self._ended:
            self._mux._unsubscribe(self)
            self._end(_END)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- called by the mux
    def _put(self, item: _Item) -> None:
        self._items.append(item)
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(True)
        if self.on_put is not None:
            self.on_put()

    def _offer(self, entry_id: bytes, idk: tuple[int, int], ev: Event) -> None:
        if self._ended or idk <= self._last:
            return
        self._last = idk
        self.last_id = entry_id
        if type(ev) is Tokens and ev.pos is not None and self._ids is not None:
            if ev.pos != len(self._ids) and not self._follows(ev, self._ids):
                return
            self._ids += ev.token_ids
        self._put((entry_id, ev))
        if isinstance(ev, Final):
            self._end(_END)

    def _follows(self, ev: Tokens, sent: list[int]) -> bool:
        """``ev`` is not where this reader's output stands: a failover shortened the story
        after the reader had read more of it, and the engine that went on from what was left
        (a takeover, or its own after a final that was lost) writes those positions again.
        Tokens it repeats as they were sent are skipped (False); anything else (a sampled
        continuation that differs, one event that repeats and goes on, tokens missing) ends
        the subscription with :class:`StoryRewound` (False), since the client's text can no
        longer go on exactly."""
        pos, ids = ev.pos, ev.token_ids
        if (
            pos is not None
            and pos < len(sent)
            and pos + len(ids) <= len(sent)
            and all(sent[pos + i] == t for i, t in enumerate(ids))
        ):
            return False
        self._end(StoryRewound(self.request_id))
        return False

    def _end(self, item: _End | BaseException) -> None:
        if not self._ended:
            self._ended = True
            self._put(item)
