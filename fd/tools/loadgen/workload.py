"""What ``fd bench`` sends (fd/tools/loadgen/main.py runs it): its configuration, the planned requests
(prompts, lengths, which of them are cancelled and how) and their arrival times, all pure
functions of the config and seed, so two runs (or two servers) get the same workload."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

CANCEL_KINDS = ("disconnect", "abort")

# Common short English words: most byte-level BPE vocabularies hold " word" as one token, so a
# prompt of N words is close to N tokens (the report gives the server's own count from usage).
WORDS = tuple(
    """
the of and to in is was for on that with as by at from it his an be are this which or had
not but were her they one all there their has been have more its who when would also will
two other some time into out first only new can after about most over then these many such
than may them any even like much where back well what some through long down good year day
make way each work city world life house part both three people under state over few water
light small place great old land high name music game river song night group book story
system power line between still round home road while never point early field open study
team order number side sound right left hand head king war film sea south north east west
""".split()  # noqa: SIM905 (a word list reads best as text)
)


@dataclass
class BenchConfig:
    base_urls: list[str]
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # default: the first id of GET /v1/models
    num_prompts: int = 100
    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    input_len: int = 32  # words
    output_len: int = 128  # max_tokens, with ignore_eos
    range_ratio: float = 0.0  # lengths uniform in [L*(1-r), L*(1+r)]
    num_warmups: int = 0
    seed: int = 0
    temperature: float = 0.0
    disconnect_ratio: float = 0.0
    abort_ratio: float = 0.0
    cancel_after_tokens: int = 10
    cancel_after_ms: float | None = None  # when set, cancels fire on time, not token count
    api_key: str | None = None
    admin_key: str | None = None  # for /v1/abort_requests; default: api_key
    redis_url: str | None = None
    prefix: str = "fd"
    metrics_poll_ms: float = 5.0
    request_id_prefix: str | None = None
    progress: bool = True
    timeout_s: float = 600.0

    def check(self) -> None:
        if not self.base_urls:
            raise ValueError("at least one --base-url is required")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("--endpoint must be completions or chat")
        for name in ("disconnect_ratio", "abort_ratio", "range_ratio"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
        if self.disconnect_ratio + self.abort_ratio > 1.0 + 1e-9:
            raise ValueError("--disconnect-ratio + --abort-ratio must be <= 1")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")


@dataclass
class Planned:
    index: int
    request_id: str
    prompt: str
    max_tokens: int
    cancel: str | None  # None | "disconnect" | "abort"
    base_url: str


def _length(rng: random.Random, n: int, ratio: float) -> int:
    lo, hi = max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio)))
    return rng.randint(lo, hi)


def plan_requests(cfg: BenchConfig, run_id: str) -> list[Planned]:
    """The prompts, lengths and cancel assignments: a pure function of the config and seed, so
    two runs (or two servers) get the same workload. Exactly round(ratio * n) requests of each
    cancel kind, spread at random over the run."""
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts
    kinds: list[str | None] = ["disconnect"] * round(cfg.disconnect_ratio * n) + ["abort"] * round(
        cfg.abort_ratio * n
    )
    kinds = (kinds + [None] * n)[:n]
    rng.shuffle(kinds)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(_length(rng, cfg.input_len, cfg.range_ratio))]
        out.append(
            Planned(
                i,
                f"{run_id}-{i}",
                " ".join(words).capitalize(),
                _length(rng, cfg.output_len, cfg.range_ratio),
                kinds[i],
                cfg.base_urls[i % len(cfg.base_urls)],
            )
        )
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process of ``rate`` requests/s."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
