"""vLLM's metrics (``vllm:*``) beside fd's, so that vLLM's Grafana dashboard, a KEDA or HPA rule
on ``vllm:num_requests_waiting`` and tokens/s over ``vllm:generation_tokens_total`` work on fd
unchanged (docs/metrics.md lists each metric and how it is computed here).

Names, types, label names and bucket bounds are those vLLM 0.32 exports (its
``PrometheusStatLogger``), plus the older names that published dashboards still query
(``gpu_cache_usage_perc``, ``time_per_output_token_seconds``, ...) and the production-stack
router's ``vllm:num_incoming_requests_total`` that its prometheus-adapter rules read. Every series
carries ``model_name`` (the served model name) and ``engine="0"``: fd's engines are summed into
the one engine a vLLM server would show, so a dashboard filtering on ``model_name`` sees all of
them, as it sees fd's own ``fd_*`` sums.

The values live here, not in prometheus_client metrics: the label values are only known once the
API is configured (:meth:`VllmMetrics.configure`), which in ``fd serve`` is after the engine has
started setting its gauges, so the labels are written at render time. Each metric keeps its
text until it changes, as fd's do (fd.control.metrics._Family): a token moves a few of them, and a
poller reading ``/metrics`` every few ms (fd.tools.gauge_sampler) re-renders only those.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from prometheus_client import utils

# prometheus_client leaves it unannotated: a float in, its exposition text out
floatToGoString: Callable[[float], str] = utils.floatToGoString

#: vLLM's label names; fd's engines are summed into engine "0"
LABELS = ("model_name", "engine")
ENGINE = "0"

#: vLLM's FinishReason values, all shown from the start (at 0) as vLLM does
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM 0.32's default bucket families (vllm/v1/metrics/buckets.py), as data.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Mapping[str, str]) -> str:
    """``{a="x",b="y"}`` in name order, as prometheus_client writes them."""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(pairs.items())) + "}"


class _Metric:
    """One metric family, with its exposition text kept until it (or the labels) change."""

    kind = ""

    def __init__(self, name: str, help: str):
        self.name = name
        self.help = help.replace("\\", "\\\\").replace("\n", "\\n")
        self.version = 0
        self._key: tuple[int, int] = (-1, -1)
        self._text = ""

    def text(self, labels: Mapping[str, str], epoch: int) -> str:
        key = (self.version, epoch)
        if key != self._key:
            name = f"{self.name}_total" if self.kind == "counter" else self.name
            head = f"# HELP {name} {self.help}\n# TYPE {name} {self.kind}\n"
            self._text = head + "".join(self._samples(labels))
            self._key = key
        return self._text

    def _samples(self, labels: Mapping[str, str]) -> list[str]:
        raise NotImplementedError


class _Values(_Metric):
    """A counter or gauge: one value per value of its extra label (none: one value). With
    ``own_labels`` the series carry only that label, not model_name/engine."""

    def __init__(self, name: str, help: str, kind: str, extra: str = "", own_labels: bool = False):
        super().__init__(name, help)
        self.kind = kind
        self.extra = extra
        self.own_labels = own_labels
        self.values: dict[str, float] = {}

    def set(self, value: float, key: str = "") -> None:
        if self.values.get(key) != value:
            self.values[key] = value
            self.version += 1

    def inc(self, amount: float = 1, key: str = "") -> None:
        self.values[key] = self.values.get(key, 0.0) + amount
        self.version += 1

    def _samples(self, labels: Mapping[str, str]) -> list[str]:
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        out = []
        for key, value in self.values.items():
            pairs = {} if self.own_labels else dict(labels)
            if self.extra:
                pairs[self.extra] = key
            out.append(f"{name}{_labels(pairs)} {floatToGoString(value)}\n")
        return out


class _Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, bounds: tuple[float, ...]):
        super().__init__(name, help)
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # (the last: above every bound, +Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # le is inclusive: a value equal to a bound falls in that bound's bucket
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.version += 1

    def _samples(self, labels: Mapping[str, str]) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            le = _labels({**labels, "le": floatToGoString(bound)})
            out.append(f"{self.name}_bucket{le} {floatToGoString(total)}\n")
        plain = _labels(labels)
        out.append(f"{self.name}_count{plain} {floatToGoString(total)}\n")
        out.append(f"{self.name}_sum{plain} {floatToGoString(self.sum)}\n")
        return out


# name -> (help, buckets): the histograms whose buckets do not depend on the model
_FIXED_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": (
        "Histogram of time to first token in seconds (arrival at the API -> first token).",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    "vllm:inter_token_latency_seconds": (
        "Histogram of inter-token latency in seconds.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    # vLLM's name for inter-token latency up to 0.10, still queried by older dashboards
    "vllm:time_per_output_token_seconds": (
        "Deprecated alias of vllm:inter_token_latency_seconds.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    "vllm:request_time_per_output_token_seconds": (
        "Histogram of each request's mean time per output token after the first.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    "vllm:e2e_request_latency_seconds": (
        "Histogram of e2e request latency in seconds (arrival at the API -> final).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "vllm:request_queue_time_seconds": (
        "Histogram of time a request waited for an engine (arrival -> claimed).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "vllm:request_inference_time_seconds": (
        "Histogram of time a request ran on its engine (claimed -> last token).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "vllm:request_prefill_time_seconds": (
        "Histogram of time in prefill (claimed -> first token).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "vllm:request_decode_time_seconds": (
        "Histogram of time in decode (first -> last token).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "vllm:request_params_n": ("Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    "vllm:request_num_preemptions": (
        "Histogram of the number of times a request was preempted.",
        REQUEST_NUM_PREEMPTIONS_BUCKETS,
    ),
}

# name -> help: the histograms of token counts, bucketed up to the context length
_TOKEN_HISTOGRAMS: dict[str, str] = {
    "vllm:request_prompt_tokens": "Histogram of each request's prompt tokens.",
    "vllm:request_generation_tokens": "Histogram of each request's output tokens.",
    "vllm:request_max_num_generation_tokens": "Histogram of the longest output of each request (each choice).",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
}

_DEFAULT_MAX_MODEL_LEN = 8192  # (until configure(): an API always configures before serving)


class VllmMetrics:
    """The ``vllm:*`` series of one :class:`fd.control.metrics.Metrics`; :meth:`text` is their
    exposition, which Metrics.render appends to fd's."""

    def __init__(self) -> None:
        self.model_name = ""
        self._epoch = 0  # (the labels' version: a change re-renders every metric)
        self._key: tuple[int, ...] = ()
        self._bytes = b""
        v = _Values
        self._running = v(
            "vllm:num_requests_running", "Number of requests in model execution batches.", "gauge"
        )
        self._waiting = v(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed: claimed by engines and waiting to run, "
            "or not yet claimed from this API.",
            "gauge",
        )
        self._kv_usage = v("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge")
        # the names before vLLM 0.10 that older dashboards query; fd has no CPU swap space
        self._gpu_usage = v(
            "vllm:gpu_cache_usage_perc", "Deprecated alias of vllm:kv_cache_usage_perc.", "gauge"
        )
        cpu = v("vllm:cpu_cache_usage_perc", "CPU KV-cache usage (fd swaps nothing: 0).", "gauge")
        swapped = v("vllm:num_requests_swapped", "Requests swapped to CPU (fd swaps nothing: 0).", "gauge")
        # counters as sums over the live engines' counts since each started: an engine that
        # stops takes its share with it, which rate() reads as a counter reset
        self._queries = v(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            "counter",
        )
        self._hits = v(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "counter"
        )
        self._gpu_queries = v(
            "vllm:gpu_prefix_cache_queries", "Deprecated alias of vllm:prefix_cache_queries.", "counter"
        )
        self._gpu_hits = v(
            "vllm:gpu_prefix_cache_hits", "Deprecated alias of vllm:prefix_cache_hits.", "counter"
        )
        self._counters = {
            "vllm:prompt_tokens": v("vllm:prompt_tokens", "Number of prefill tokens processed.", "counter"),
            "vllm:generation_tokens": v(
                "vllm:generation_tokens", "Number of generation tokens processed.", "counter"
            ),
            "vllm:num_preemptions": v(
                "vllm:num_preemptions", "Cumulative number of preemptions from the engines.", "counter"
            ),
        }
        self._success = v(
            "vllm:request_success",
            "Count of finished requests, by finish reason.",
            "counter",
            extra="finished_reason",
        )
        self._incoming = v(
            "vllm:num_incoming_requests",
            "Total valid incoming requests (the production-stack router's), by requested model.",
            "counter",
            extra="model",
            own_labels=True,
        )
        for g in (self._running, self._waiting, self._kv_usage, self._gpu_usage, cpu, swapped):
            g.set(0.0)
        for c in (self._queries, self._hits, self._gpu_queries, self._gpu_hits, *self._counters.values()):
            c.set(0.0)
        for reason in FINISHED_REASONS:
            self._success.set(0.0, reason)
        self._histograms: dict[str, _Histogram] = {
            name: _Histogram(name, help, buckets) for name, (help, buckets) in _FIXED_HISTOGRAMS.items()
        }
        self._token_histograms(_DEFAULT_MAX_MODEL_LEN)
        self._metrics: list[_Metric] = [
            self._running,
            self._waiting,
            self._kv_usage,
            self._gpu_usage,
            cpu,
            swapped,
            self._queries,
            self._hits,
            self._gpu_queries,
            self._gpu_hits,
            *self._counters.values(),
            self._success,
            self._incoming,
        ]
        self._engine_waiting = 0.0
        # this API's requests that no engine has claimed yet: engines claim only what they can
        # start now, so a backlog waits in P:requests, where the engines' `waiting` misses it
        self.unclaimed = 0

    def _token_histograms(self, max_model_len: int) -> None:
        buckets = request_tokens_buckets(max(1, max_model_len))
        for name, help in _TOKEN_HISTOGRAMS.items():
            self._histograms[name] = _Histogram(name, help, buckets)

    def configure(self, model_name: str, max_model_len: int) -> None:
        """The served model's name (every series' ``model_name``) and its context length (the
        token histograms' top bucket), as the API knows them."""
        if max_model_len != _DEFAULT_MAX_MODEL_LEN and not any(
            any(self._histograms[name].counts) for name in _TOKEN_HISTOGRAMS
        ):
            self._token_histograms(max_model_len)
        self.model_name = model_name
        self._epoch += 1

    # ------------------------------------------------------------------ updates

    def set_engines(self, sums: Mapping[str, float]) -> None:
        """The engine gauges, summed over the engines (heartbeat field -> value)."""
        total, free = sums.get("blocks_total", 0.0), sums.get("blocks_free", 0.0)
        usage = (total - free) / total if total > 0 else 0.0
        self._running.set(sums.get("running", 0.0))
        self._engine_waiting = sums.get("waiting", 0.0)
        self.waiting_changed()
        self._kv_usage.set(usage)
        self._gpu_usage.set(usage)
        queries, hits = sums.get("cache_queries", 0.0), sums.get("cache_hits", 0.0)
        self._queries.set(queries)
        self._gpu_queries.set(queries)
        self._hits.set(hits)
        self._gpu_hits.set(hits)

    def waiting_changed(self) -> None:
        self._waiting.set(self._engine_waiting + self.unclaimed)

    def incoming(self, model: str) -> None:
        """A valid generating request arrived (the production-stack router's count, by the
        model the client named)."""
        self._incoming.inc(1, model)

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.inc(count, reason)

    def count(self, name: str, amount: float) -> None:
        self._counters[name].inc(amount)

    def observe(self, name: str, value: float) -> None:
        self._histograms[name].observe(value)

    def request(self, arrival: float, prompt_tokens: int, max_tokens: int | None, n: int) -> VllmRequest:
        return VllmRequest(self, arrival, prompt_tokens, max_tokens, n)

    # ------------------------------------------------------------------ exposition

    def text(self) -> bytes:
        """The exposition text; only the metrics that changed since the last call render anew."""
        metrics = (*self._metrics, *self._histograms.values())
        key = (self._epoch, *(m.version for m in metrics))
        if key != self._key:
            labels = {"model_name": self.model_name, "engine": ENGINE}
            self._bytes = "".join(m.text(labels, self._epoch) for m in metrics).encode()
            self._key = key
        return self._bytes


class VllmRequest:
    """One live request's vLLM phases, from the events the API relays to its client: queue
    (arrival -> an engine claimed it), prefill (claimed -> first token), decode (first -> last
    token), inference (claimed -> last token), with its tokens and preemptions."""

    __slots__ = (
        "m",
        "arrival",
        "prompt_tokens",
        "max_tokens",
        "n",
        "claimed_at",
        "first",
        "last",
        "generated",
        "preemptions",
        "_queued",
    )

    def __init__(self, m: VllmMetrics, arrival: float, prompt_tokens: int, max_tokens: int | None, n: int):
        self.m = m
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n = n
        self.claimed_at: float | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.generated = 0
        self.preemptions = 0
        self._queued = True  # (counted in m.unclaimed until claimed, ended or dropped)
        m.unclaimed += 1
        m.waiting_changed()

    def _dequeue(self) -> None:
        if self._queued:
            self._queued = False
            self.m.unclaimed -= 1
            self.m.waiting_changed()

    def close(self) -> None:
        """Its handler is done: a request that ends without its final (its client hung up, a
        background response answered at once) no longer waits here."""
        self._dequeue()

    def claimed(self, now: float) -> None:
        if self.claimed_at is None:  # (a takeover claims again: the request waited once)
            self.claimed_at = now
        self._dequeue()

    def preempted(self) -> None:
        self.preemptions += 1
        self.m.count("vllm:num_preemptions", 1)

    def tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        m = self.m
        self.generated += n
        m.count("vllm:generation_tokens", n)
        if self.first is None or self.last is None:  # (the two are set together)
            self._dequeue()  # (a route that does not relay `claimed`: running by now)
            self.first = now
            m.observe("vllm:time_to_first_token_seconds", now - self.arrival)
            m.count("vllm:prompt_tokens", self.prompt_tokens)  # (prefilled once it yields a token)
        else:
            per = (now - self.last) / n  # (a coalesced event: its tokens share the gap)
            for _ in range(n):
                m.observe("vllm:inter_token_latency_seconds", per)
                m.observe("vllm:time_per_output_token_seconds", per)
        self.last = now

    def final(self, now: float, finish_reason: str, usage: Mapping[str, object]) -> None:
        self._dequeue()
        m = self.m
        m.finished(finish_reason)
        m.observe("vllm:e2e_request_latency_seconds", now - self.arrival)
        claimed = self.claimed_at if self.claimed_at is not None else self.arrival
        first = self.first if self.first is not None else now
        last = self.last if self.last is not None else now
        m.observe("vllm:request_queue_time_seconds", max(0.0, claimed - self.arrival))
        m.observe("vllm:request_prefill_time_seconds", max(0.0, first - claimed))
        m.observe("vllm:request_decode_time_seconds", max(0.0, last - first))
        m.observe("vllm:request_inference_time_seconds", max(0.0, last - claimed))
        tpot = (last - first) / (self.generated - 1) if self.generated > 1 else 0.0
        m.observe("vllm:request_time_per_output_token_seconds", tpot)
        prompt = usage.get("prompt_tokens", self.prompt_tokens) if isinstance(usage, Mapping) else None
        m.observe("vllm:request_prompt_tokens", prompt if isinstance(prompt, int) else self.prompt_tokens)
        m.observe("vllm:request_generation_tokens", self.generated)
        # vLLM's is the longest output of the request's n choices; each of fd's choices is a
        # request of its own, so here it is each choice's
        m.observe("vllm:request_max_num_generation_tokens", self.generated)
        if self.max_tokens:
            m.observe("vllm:request_params_max_tokens", self.max_tokens)
        if self.n > 0:  # (0: another choice of the same response already counts its n)
            m.observe("vllm:request_params_n", self.n)
        m.observe("vllm:request_num_preemptions", self.preemptions)
