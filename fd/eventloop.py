"""The event loop of ``fd serve``: API and engine on one loop, the engine first when the model
would otherwise wait for it, and hang-ups first always.

asyncio runs what is ready in arrival order, a turn at a time. When a burst of requests comes
in, one turn parses and submits a few dozen of them (~0.3 ms each here), and each time the
engine's step loop wakes (a step's result is in, new requests can be claimed) it waits for the
rest of that turn, usually two or three turns. With 32 requests sent at once the first step's
result waited 8 ms, until the whole burst was in, while the model worker sat idle; at 32
steady streams the worker idled between steps for the same reason.

Putting the engine first always was tried and is wrong the other way: it then makes tokens as
fast as the model allows, the API falls behind showing them (at 128 streams a client saw a
token 24-57 steps after it was made), and a hang-up is noticed as late (abort p50 6 -> 64 ms).
So the engine says when it is urgent: :meth:`EngineFirstLoop.prioritize` takes a task and a
predicate (``fd serve``'s engine: "the model has nothing left to run, and either requests
wait to be claimed or the clients have been shown the last step"), and the task's wake-ups
jump the line only while it holds; :meth:`hurry` moves a wake-up that was queued before it
held. Other callbacks that always go first, each a few lines of work:

- a reader added with :meth:`add_urgent_reader` (the model worker's pipe: a step's result)
  and callbacks handed in from other threads (``call_soon_threadsafe``: an in-process
  runner's step thread, the embedded server's TCP door);
- I/O events: what a socket brought goes ahead of queued work, in the order it came (behind
  an urgent engine's wake-up only). A socket's callback is a read and a parse, and it is how
  a hang-up is seen: a closed connection's EOF waited behind a turn's queued stream writes
  (TARGETS release p99 at 32 streams 16.5–26.6 ms, with this 13.1–14.9);
- ingress, in a lane of its own: a new request goes through ~5 callbacks before its handler
  has submitted it (asyncio's setting up of an accepted connection: a task, then the
  protocol's ``connection_made`` and the reader's adding, queued by the transport; aiohttp's
  per-connection task woken by the parsed request; the request's own task, whose first step
  parses and submits). In arrival order each waited behind the work queued before it, at 32
  streams a turn of token writes: a request sent as another ended reached its handler ~10 ms
  later, and round 1 of `bench/api.py` lost most of its TTFT there. They run in the order
  they came, in slices of ``LANE_S`` with a look at the sockets between two, ahead of queued
  work and behind an urgent engine. While a look must wait (the last one's callbacks, a
  burst's reads, are still queued), the model worker's pipe alone is looked at between two
  slices: its reply waited for the whole burst while the worker idled;
- a request's first answer, in the same lane ahead of the ingress queued there: a streaming
  handler is :meth:`answering` until it has written its first token, and its wake-ups till
  then run there. Behind a burst's ingress the first tokens waited for all of it (in round 0 of
  ``bench/api.py`` the first request's token was made at 10 ms and shown at 21 ms), behind a
  turn of the other streams' writes a few ms more;
- a transport's ``_call_connection_lost`` (asyncio's way of saying a connection is gone) and
  a task woken by a cancelled wait (aiohttp cancels the handler whose client hung up), or
  cancelled while its step was already queued (a token had woken it): a hang-up reaches the
  engine's abort without queueing behind the streams it competes with.

:meth:`io_turn` is for the engine between two steps when the next result is already in: one
look at the sockets, their callbacks, then the engine again, ahead of the last step's queued
token writes (at 128 streams the engine otherwise went through two steps' publishes, ~4 ms,
without a look, and a hang-up waited); and between chunks of one long publish to the embedded
server, which runs on this loop without a pause (~115 events, 1.8 ms at 128 streams).

Relies on ``BaseEventLoop._ready`` (the deque of ready handles; unchanged since Python 3.4),
``_process_events`` and ``_add_callback`` (where a selector loop queues I/O events'
callbacks), ``_make_socket_transport`` and ``_accept_connection2`` (an accepted connection's
set-up), the name asyncio's selector transports give their connection-lost callback and
their ``_protocol``, and aiohttp's ``RequestHandler._task_handler``, ``start`` and
``_handle_request`` (tests/test_eventloop.py checks each). Any other loop works too, in plain
arrival order (the engine checks for ``prioritize``); ``fd serve --fifo-loop`` uses one.
"""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import collections
import itertools
import select
import time
from typing import Callable

from aiohttp import web_protocol

#: Tasks whose every step is ingress: asyncio's setting up of an accepted connection, and
#: aiohttp's loop of a connection that waits for its next request and starts its handler.
_INGRESS_CODE = frozenset({
    asyncio.selector_events.BaseSelectorEventLoop._accept_connection2.__code__,
    web_protocol.RequestHandler.start.__code__,
})
#: aiohttp's task of one request: its first step runs the handler up to its first wait, which
#: in fd's handlers is after the request was parsed and submitted.
_HANDLER_CODE = web_protocol.RequestHandler._handle_request.__code__


def _always() -> bool:
    return True


def _nothing() -> None:
    pass


def _done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _cancelled_task(handle: asyncio.Handle) -> bool:
    task = getattr(handle._callback, "__self__", None)
    return isinstance(task, asyncio.Task) and not handle._cancelled and task.cancelling() > 0


class EngineFirstLoop(asyncio.SelectorEventLoop):
    #: A turn with more than this many callbacks ready looks at the sockets again (a select
    #: that does not wait) after each this many: at 128 streams a turn of stream writes is
    #: ~5 ms, and a hang-up that came during it was seen only after it.
    POLL_EVERY = 16
    #: The ingress lane runs in slices of about this long, with a look at the sockets between
    #: two (a handler's first step is ~0.2 ms here; a whole burst's ingress ~7 ms).
    LANE_S = 0.0005

    def __init__(self) -> None:
        super().__init__()
        self._first: dict[asyncio.Task, Callable[[], bool]] = {}
        self._queued: dict[asyncio.Task, asyncio.Handle] = {}  # a wake-up that waits its turn
        self._first_readers: set[asyncio.Handle] = set()
        self._urgent_fds: dict[int, asyncio.Handle] = {}  # fd -> its reader's handle
        self._urgent_poll = select.poll() if hasattr(select, "poll") else None
        self._io: list[asyncio.Handle] | None = None  # this turn's I/O callbacks, as they come
        self._poll = asyncio.Handle(self._poll_now, (), self, None)
        self._poll_queued = False
        self._lane: collections.deque[asyncio.Handle] = collections.deque()  # ingress
        self._lane_handle = asyncio.Handle(self._run_lane, (), self, None)
        self._lane_queued = False
        self._lane_mark = asyncio.Handle(_nothing, (), self, None)
        self._answering: set[asyncio.Task] = set()  # their wake-ups go in the lane (answering)
        #: first answers (:meth:`answering`), ahead of the lane's ingress
        self._lane_first: collections.deque[asyncio.Handle] = collections.deque()
        self._making_transport = False  # callbacks a new transport queues are ingress
        self._last_io: asyncio.Handle | None = None  # the last I/O callback queued by a look
        self._turn_io: dict[int, asyncio.Handle] = {}  # queued by io_turn's look
        self._task_first = False  # create_urgent_task: the new task's first step goes first
        self.mid_turn_polls = 0  # (tests and benchmarks: how often a turn looked again)

    def create_urgent_task(self, coro) -> asyncio.Task:
        """A task whose every step runs ahead of what is ready, its first one included (an
        abort heard in this process: its first stage is written before the turn goes on)."""
        self._task_first = True
        try:
            task = self.create_task(coro)
        finally:
            self._task_first = False
        self.prioritize(task, _always)
        return task

    def prioritize(self, task: asyncio.Task, when: Callable[[], bool]) -> None:
        """Until ``task`` ends, its steps run ahead of everything else that is ready whenever
        ``when()`` is true as they are scheduled."""
        self._first[task] = when
        task.add_done_callback(self._forget)

    def hurry(self, task: asyncio.Task) -> None:
        """Move ``task``'s queued wake-up, if it has one, to the front of the line."""
        handle = self._queued.pop(task, None)
        if handle is None or handle.cancelled():
            return
        try:
            self._ready.remove(handle)
        except ValueError:
            return  # it has run
        self._ready.appendleft(handle)

    def answering(self, task: asyncio.Task) -> None:
        """Until :meth:`answered`, ``task``'s wake-ups run in the ingress lane, ahead of the
        ingress queued there: a streaming handler waiting for its request's first token. That
        token ends the request's way in (its TTFT) and costs one write; behind the rest of a
        burst's ingress it waited ~10 ms, behind a turn of other streams' token writes a few."""
        if task not in self._answering:
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    def answered(self, task: asyncio.Task) -> None:
        self._answering.discard(task)

    def add_urgent_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """:meth:`add_reader`, whose callback runs ahead of what is ready when ``fd`` becomes
        readable (``fd serve``: the model worker's pipe, a step's result)."""
        self.add_reader(fd, callback)
        handle = self._selector.get_key(fd).data[0]
        self._first_readers.add(handle)
        if self._urgent_poll is not None:
            self._urgent_fds[fd] = handle
            self._urgent_poll.register(fd, select.POLLIN)

    def remove_reader(self, fd) -> bool:
        try:
            handle = self._selector.get_key(fd).data[0]
        except (KeyError, ValueError):
            handle = None
        self._first_readers.discard(handle)
        if self._urgent_fds.pop(fd, None) is not None:
            self._urgent_poll.unregister(fd)
        return super().remove_reader(fd)

    def _process_events(self, event_list) -> None:
        self._io = []
        try:
            super()._process_events(event_list)  # (its callbacks come to _add_callback)
        finally:
            io, self._io = self._io, None
        # ahead of queued work, in the order they came; the model's reply ahead of all
        if len(io) > 1 and self._first_readers:
            io.sort(key=lambda h: h not in self._first_readers)
        ready = self._ready
        self._put_first(reversed(io))
        if io:
            self._last_io = io[-1]
        # Look again after the next POLL_EVERY callbacks of a long turn. Only after all of
        # this poll's I/O callbacks: a socket whose callback is still queued would be reported
        # again, and a duplicate write-ready callback is an error in asyncio's transports.
        # One such look at a time is queued (each queues the next): never more of them.
        at = len(io) + self.POLL_EVERY
        if len(ready) > at and not self._poll_queued:
            self._poll_queued = True
            ready.insert(at, self._poll)

    def io_turn(self) -> asyncio.Future:
        """For a long-running task between two pieces of work (the engine between two steps,
        whose publish can take milliseconds at 128 streams): look at the sockets now, and
        return a future that is done once their callbacks have run, ahead of everything else
        that is ready. When callbacks of the last look are still queued (a step's result can
        wake the engine ahead of them), the future waits for those instead: looking again would
        report their sockets twice."""
        fut = self.create_future()
        done = asyncio.Handle(_done, (fut,), self, None)
        ready = self._ready
        at, looked = self._past_last_look()
        if looked:
            self._turn_io = {id(h): h for h in itertools.islice(ready, at)}  # (_add_callback)
        ready.insert(at, done)
        return fut

    def _past_last_look(self) -> tuple[int, bool]:
        """Where the callbacks of the last look at the sockets end in what is ready, and
        whether it looked: when none of them is still queued, it looks now (their callbacks
        go first) and says where those end. Never a second look while the last one's
        callbacks wait: their sockets would be reported twice (a second write-ready callback
        is an error in asyncio's transports)."""
        ready, last = self._ready, self._last_io
        if last is not None:
            try:
                return ready.index(last) + 1, False
            except ValueError:
                pass
        self._process_events(self._selector.select(0))
        return (0 if self._last_io is last else ready.index(self._last_io) + 1), True

    def _poll_now(self) -> None:
        self._poll_queued = False
        self.mid_turn_polls += 1
        self._process_events(self._selector.select(0))

    def _look_urgent(self) -> None:
        """The urgent readers' fds alone (a step's result), when a full look must wait: a
        burst's ingress runs its lane slices while the last look's callbacks are still queued
        (32 requests' reads, ~7 ms), and the model's reply, in after 3 of them, waited for
        all the rest while the worker idled with 17 requests submitted. Its callback runs
        here; the main selector may report the fd again, and a second read of a drained pipe
        finds nothing (``take_ready`` does not wait)."""
        if not self._urgent_fds:
            return
        for fd, _ in self._urgent_poll.poll(0):
            handle = self._urgent_fds.get(fd)
            if handle is not None and not handle._cancelled:
                handle._run()

    def _add_callback(self, handle: asyncio.Handle) -> None:
        if self._io is not None and not handle._cancelled:  # an I/O event's callback
            if self._turn_io and id(handle) in self._turn_io:
                # Queued by an io_turn's look in the middle of a turn, the callback may not
                # have run when the next turn looks: the same socket must not be queued twice
                # (a second write-ready callback is an error in asyncio's transports).
                if handle in self._ready:
                    return
                del self._turn_io[id(handle)]
            self._io.append(handle)
        else:  # (a signal's)
            super()._add_callback(handle)

    def _forget(self, task: asyncio.Task) -> None:
        self._first.pop(task, None)
        self._queued.pop(task, None)

    def _front(self, callback, args, context) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.appendleft(handle)
        return handle

    def call_soon(self, callback, *args, context=None):
        if self._task_first:  # the first step of a task made by create_urgent_task
            self._task_first = False
            return self._front(callback, args, context)
        # A task's step and its wake-up by a future are both bound to the task.
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task) and not self.is_closed():
            when = self._first.get(task)
            if when is not None:
                if when():
                    return self._front(callback, args, context)
                handle = super().call_soon(callback, *args, context=context)
                self._queued[task] = handle
                return handle
            code = getattr(task.get_coro(), "cr_code", None)
            if code in _INGRESS_CODE or (code is _HANDLER_CODE and not args):  # (no args: not
                return self._to_lane(callback, args, context)  # a wake-up, a first step)
            if args and isinstance(args[0], asyncio.Future) and args[0].cancelled():
                # A task woken by a cancelled wait: a handler whose client hung up (aiohttp
                # cancels it), which is an abort to hear at once.
                return self._front(callback, args, context)
            if task in self._answering:  # (a first token to write: ahead of the lane's ingress)
                return self._to_lane(callback, args, context, first=True)
        elif self._making_transport:
            return self._to_lane(callback, args, context)
        elif getattr(callback, "__name__", None) == "_call_connection_lost" and not self.is_closed():
            # A connection is gone (asyncio's transports say so through this callback): aiohttp
            # then cancels its handler, whose client hung up.
            return self._front(self._lost, (callback, args), context)
        return super().call_soon(callback, *args, context=context)

    def _make_socket_transport(self, *args, **kwargs):
        # (an accepted connection's: the protocol's connection_made, the reader's adding and
        # the waiter's result are queued by the transport's constructor)
        self._making_transport = True
        try:
            return super()._make_socket_transport(*args, **kwargs)
        finally:
            self._making_transport = False

    def _put_first(self, handles) -> None:
        """``handles`` (an iterable, put in reverse) at the front of what is ready, behind
        the wake-ups of prioritized tasks at its head: an urgent engine has the model idle."""
        ready, first = self._ready, self._first
        k = 0
        if first:
            for h in ready:
                task = getattr(h._callback, "__self__", None)
                if not isinstance(task, asyncio.Task) or task not in first:
                    break
                k += 1
        if k:
            ready.rotate(-k)
            ready.extendleft(handles)
            ready.rotate(k)
        else:
            ready.extendleft(handles)

    def _to_lane(self, callback, args, context, first: bool = False) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        (self._lane_first if first else self._lane).append(handle)
        if not self._lane_queued:
            self._lane_queued = True
            self._put_first((self._lane_handle,))
        return handle

    def _run_lane(self) -> None:
        """A slice of the ingress lane: first answers first, then ingress in the order it
        came; the rest after a look at the sockets (a step's result, a hang-up) and behind
        whatever was put first while the slice ran (an urgent engine's wake-up)."""
        lane, first, ready, mark = self._lane, self._lane_first, self._ready, self._lane_mark
        ready.appendleft(mark)  # (what goes first while the slice runs lands ahead of it)
        end = time.perf_counter() + self.LANE_S
        try:
            while first or lane:
                handle = first.popleft() if first else lane.popleft()
                if not handle._cancelled:
                    handle._run()
                if time.perf_counter() >= end:
                    break
        finally:
            self._look_urgent()  # (its wake-ups land ahead of the mark)
            at = ready.index(mark)
            del ready[at]
            if not lane and not first:
                self._lane_queued = False
            else:
                ready.insert(max(at, self._past_last_look()[0]), self._lane_handle)

    def _lost(self, callback, args) -> None:
        """A connection's end, then the step of any task it cancelled that was already
        queued (woken by a token, say) goes first too: cancelling a task whose step is queued
        only marks it, and at 128 streams its turn came up to 10 ms later, behind a step's
        worth of token deliveries. The walk through what is ready is taken only when the
        connection had a request in progress (aiohttp's ``_task_handler`` of the transport's
        protocol, still running), not for each connection that closes after its response."""
        protocol = getattr(getattr(callback, "__self__", None), "_protocol", None)
        busy = getattr(protocol, "_task_handler", None)
        callback(*args)
        if busy is None or busy.done():
            return
        ready = self._ready
        first = [h for h in ready if _cancelled_task(h)]
        if first:
            for h in first:
                ready.remove(h)
            ready.extendleft(reversed(first))

    def call_soon_threadsafe(self, callback, *args, context=None):
        if self.is_closed():
            return super().call_soon_threadsafe(callback, *args, context=context)
        handle = self._front(callback, args, context)  # (deque.appendleft is atomic)
        self._write_to_self()
        return handle
