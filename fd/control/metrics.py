"""Every Prometheus metric fd exports (DESIGN.md §5), defined once.

Each :class:`Metrics` owns its registry rather than using prometheus_client's global one, so
tests and several apps in one process do not collide on metric names. In ``fd serve`` the
engine and the API share one instance: the engine sets the KV and queue gauges itself (and
says so with :attr:`Metrics.engine_in_process`); in a split deployment the API fills them from
the engines' heartbeat hashes at scrape time (:meth:`Metrics.set_engine_gauges_from`). Beside
fd's ``fd_*`` names, :attr:`Metrics.vllm` exports vLLM's ``vllm:*`` ones from the same
measurements (fd/control/vllm_metrics.py; docs/metrics.md lists both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Self, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fd.control.vllm_metrics import VllmMetrics

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Fine at the low end: a token on a small model takes well under 10 ms, an abort on an idle
# engine releases its blocks in about a millisecond.
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_E2E_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _Family:
    """One metric in a registry of its own, with its exposition text kept until it changes.

    Rendering walks every sample of every metric, ~1 ms for fd's; :class:`_Tracked` counts
    each change in :attr:`version`, so a render reuses the text of each metric that kept
    still and re-renders the one that moved."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.version = 0
        self._rendered = -1
        self._text = b""

    def text(self) -> bytes:
        version = self.version  # (read first: a change made during the render renders again)
        if version != self._rendered:
            self._text = generate_latest(self.registry)
            self._rendered = version
        return self._text


M = TypeVar("M", Counter, Gauge, Histogram)


class _Tracked(Generic[M]):
    """A prometheus_client metric (or one labelled child of it) whose every change is counted
    in its family's version. Only the updates fd makes are here: a counter's inc, a gauge's
    set, a histogram's observe, and labels."""

    __slots__ = ("_metric", "_family")

    def __init__(self, metric: M, family: _Family):
        self._metric: M = metric
        self._family = family

    def labels(self, *values: str, **labels: str) -> Self:
        return type(self)(self._metric.labels(*values, **labels), self._family)


class _Counter(_Tracked[Counter]):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        self._metric.inc(amount)
        self._family.version += 1


class _Gauge(_Tracked[Gauge]):
    __slots__ = ("_last",)

    def __init__(self, metric: Gauge, family: _Family):
        super().__init__(metric, family)
        self._last: float | None = None

    def set(self, value: float) -> None:
        if value != self._last:  # (the engine sets its gauges every step, mostly unchanged)
            self._metric.set(value)
            self._last = value
            self._family.version += 1


class _Histogram(_Tracked[Histogram]):
    __slots__ = ()

    def observe(self, amount: float) -> None:
        self._metric.observe(amount)
        self._family.version += 1


def _family(families: list[_Family]) -> _Family:
    family = _Family()
    families.append(family)
    return family


def _counter(
    families: list[_Family], name: str, documentation: str, labelnames: Sequence[str] = ()
) -> _Counter:
    family = _family(families)
    return _Counter(Counter(name, documentation, labelnames, registry=family.registry), family)


def _gauge(families: list[_Family], name: str, documentation: str) -> _Gauge:
    family = _family(families)
    return _Gauge(Gauge(name, documentation, registry=family.registry), family)


def _histogram(
    families: list[_Family], name: str, documentation: str, buckets: Sequence[float]
) -> _Histogram:
    family = _family(families)
    return _Histogram(Histogram(name, documentation, buckets=buckets, registry=family.registry), family)


#: heartbeat hash field -> gauge attribute
HEARTBEAT_GAUGES = {
    "blocks_total": "kv_blocks_total",
    "blocks_free": "kv_blocks_free",
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "cache_queries": "prefix_cache_queries",
    "cache_hits": "prefix_cache_hits",
}


class Metrics:
    def __init__(self) -> None:
        self._families: list[_Family] = []
        r = self._families  # (each metric in a registry of its own: see _Family)
        self.requests_total = _counter(
            r,
            "fd_requests_total",
            "Finished requests, by finish reason (aborts included).",
            ["finish_reason"],
        )
        self.abort_requests_total = _counter(
            r,
            "fd_abort_requests_total",
            "Request aborts published, by source.",
            ["source"],
        )
        self.abort_release_seconds = _histogram(
            r,
            "fd_abort_release_seconds",
            "Abort noted by the engine -> the request's KV blocks released.",
            _LATENCY_BUCKETS,
        )
        self.kv_blocks_total = _gauge(r, "fd_kv_blocks_total", "KV cache blocks, all engines.")
        self.kv_blocks_free = _gauge(r, "fd_kv_blocks_free", "Free KV cache blocks, all engines.")
        self.num_requests_running = _gauge(r, "fd_num_requests_running", "Requests scheduled on engines.")
        self.num_requests_waiting = _gauge(
            r, "fd_num_requests_waiting", "Requests claimed by engines and waiting to run."
        )
        self.time_to_first_token_seconds = _histogram(
            r,
            "fd_time_to_first_token_seconds",
            "Arrival at the API -> first token seen by the API.",
            _LATENCY_BUCKETS,
        )
        self.inter_token_latency_seconds = _histogram(
            r,
            "fd_inter_token_latency_seconds",
            "Time between successive output tokens, per token.",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency_seconds = _histogram(
            r,
            "fd_e2e_request_latency_seconds",
            "Arrival at the API -> final event.",
            _E2E_BUCKETS,
        )
        # vLLM's prefix_cache_queries / _hits; gauges, as sums over the live engines' counts
        # since each started (an engine that stops takes its share with it)
        self.prefix_cache_queries = _gauge(
            r,
            "fd_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache "
            "(at each start or restart of a request), live engines since they started.",
        )
        self.prefix_cache_hits = _gauge(
            r,
            "fd_prefix_cache_hits_tokens",
            "Of those, tokens found cached (not computed).",
        )
        self.dead_letters_total = _counter(
            r, "fd_dead_letters_total", "Events that did not decode and went to P:dead."
        )
        self.placements_total = _counter(
            r,
            "fd_placements_total",
            "Requests placed by this API: on an engine holding part of the prompt (hit), on "
            "one holding none (miss), or on P:requests for any engine (none).",
            ["result"],
        )
        self.placement_seconds = _histogram(
            r, "fd_placement_seconds", "Time to choose a request's engine (placement).", _LATENCY_BUCKETS
        )
        # vLLM's names for the same measurements (fd/control/vllm_metrics.py), after fd's own
        self.vllm = VllmMetrics()
        #: Set by an engine that shares this object and keeps the engine gauges current itself.
        self.engine_in_process = False

    def note_placement(self, result: str, seconds: float) -> None:
        """One request placed (fd/api/placement.py): ``hit``, ``miss`` or ``none``."""
        self.placements_total.labels(result=result).inc()
        self.placement_seconds.observe(seconds)

    def set_engine_gauges(
        self,
        *,
        blocks_total: int,
        blocks_free: int,
        running: int,
        waiting: int,
        cache_queries: int = 0,
        cache_hits: int = 0,
    ) -> None:
        self.kv_blocks_total.set(blocks_total)
        self.kv_blocks_free.set(blocks_free)
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.prefix_cache_queries.set(cache_queries)
        self.prefix_cache_hits.set(cache_hits)
        self.vllm.set_engines(
            {
                "blocks_total": blocks_total,
                "blocks_free": blocks_free,
                "running": running,
                "waiting": waiting,
                "cache_queries": cache_queries,
                "cache_hits": cache_hits,
            }
        )

    def set_engine_gauges_from(self, engines: Mapping[str, Mapping[str, str]]) -> None:
        """Sum the gauges over the live engines' heartbeat hashes (missing/garbled fields: 0)."""
        sums = dict.fromkeys(HEARTBEAT_GAUGES, 0.0)
        for fields in engines.values():
            for name in HEARTBEAT_GAUGES:
                try:  # noqa: SIM105 (per field per engine per scrape: suppress() costs more)
                    sums[name] += float(fields.get(name, 0) or 0)
                except (TypeError, ValueError):
                    pass
        for name, attr in HEARTBEAT_GAUGES.items():
            getattr(self, attr).set(sums[name])
        self.vllm.set_engines(sums)

    def render(self) -> bytes:
        """The exposition text; a metric that did not change since the last render is not
        rendered again (a poller reading every few ms costs a join, not prometheus_client's
        walk over every bucket of every histogram)."""
        return b"".join(family.text() for family in self._families) + self.vllm.text()
