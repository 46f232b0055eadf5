"""Offline, in-process generation: the scheduler and the runner with no Redis and no HTTP.

It is the reference the served path is compared against (greedy output through the API must
equal this) and the in-process baseline of ``bench/api.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fd.control.events import Event, Final, Request, Tokens
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig, default
from fd.engine.core.detokenizer import IncrementalDetokenizer
from fd.engine.core.outputs import RunnerOutput, SchedulerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.node.engine_core import EngineCore
from fd.engine.node.node_config import SchedulerSettings
from fd.engine.node.request_table import RequestTable
from fd.engine.node.step_driver import StepFailed
from fd.engine.runner.runners import Skipped


@dataclass
class Generation:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # wall time (perf_counter) of each Tokens event, for latency baselines
    token_times: list[float] = field(default_factory=list)
    # an embeddings request's (SamplingParams.embed): the runner's float32 bytes
    embedding: bytes | None = None


class InlineDriver:
    """The engine core's driver for a runner in this thread: it keeps the steps handed to it
    and runs the oldest when asked (:meth:`run_oldest`), so with async scheduling the next
    step is decided before the last one's result is folded in, as in the engine node."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._queued: deque[SchedulerOutput] = deque()
        self._reply: Callable[[RunnerOutput | Skipped | StepFailed], None] = lambda _: None

    def start(self, loop: object, reply: Callable[[RunnerOutput | Skipped | StepFailed], None]) -> None:
        self._reply = reply

    def submit(self, out: SchedulerOutput) -> None:
        self._queued.append(out)

    def drop(self, step: int, request_ids: list[str]) -> None:
        pass  # (nothing aborts an offline generation)

    def run_oldest(self) -> bool:
        if not self._queued:
            return False
        self._reply(self.runner.execute(self._queued.popleft()))
        return True


class LLM:
    def __init__(
        self,
        runner,
        tokenizer,
        *,
        block_size: int = default("block_size"),
        max_num_seqs: int = default("max_num_seqs"),
        max_num_batched_tokens: int = default("max_num_batched_tokens"),
        async_scheduling: bool = False,
        enable_prefix_caching: bool = SchedulerSettings.enable_prefix_caching,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = SchedulerConfig(
            num_blocks=runner.num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=runner.max_model_len,
            eos_token_ids=tuple(runner.eos_token_ids),
            max_steps_in_flight=2 if async_scheduling else 1,
            enable_prefix_caching=enable_prefix_caching,
        )

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        clock: Callable[[], float] | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> list[Generation]:
        """Run ``prompts`` to completion; ``on_event`` sees every event the scheduler emits."""
        clock = clock or time.perf_counter
        sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        gens: dict[str, Generation] = {}
        requests = RequestTable()

        def emit(
            evs: list[Event],
            texts: dict[str, str] | None = None,
            logprobs: object = None,
            embeddings: dict[str, bytes] | None = None,
        ) -> None:
            for ev in evs:
                rid = ev.request_id  # type: ignore[attr-defined]
                g = gens[rid]
                if isinstance(ev, Tokens):
                    ev = replace(ev, text=(texts or {}).get(rid, ""))
                    g.token_ids.extend(ev.token_ids)
                    g.text += ev.text
                    g.token_times.append(clock())
                    if embeddings and rid in embeddings:
                        g.embedding = embeddings[rid]
                elif isinstance(ev, Final):
                    live = requests.get(rid)
                    if live is not None and live.detok is not None:
                        g.text += live.detok.flush()
                    g.finish_reason = ev.finish_reason
                    requests.forget(rid)
                if on_event is not None:
                    on_event(ev)

        sched = Scheduler(self.cfg)
        driver = InlineDriver(self.runner)
        core = EngineCore(sched, driver, requests, emit, lambda source: None, lambda: None, asyncio.Event())
        core.start(None)
        for i, (ids, sp) in enumerate(zip(prompts, sps, strict=False)):
            rid = f"r{i}"
            gens[rid] = Generation(rid)
            data = RequestData(prompt_token_ids=tuple(ids), sampling=sp)
            live = requests.add(rid, b"", Request(request_id=rid, data=data), "", 0.0)
            live.detok = IncrementalDetokenizer.for_request(self.tokenizer, sp, self.cfg.eos_token_ids)
            core.arrive(rid, data)
        # The engine's own step (EngineCore.step), its runner's steps run here, in order, once
        # as many are decided as may be in flight: with async scheduling step N+1 is decided
        # (on placeholders) before step N's results are folded in. No faster here, but the same
        # calls the engine node makes with a step in flight.
        idle = 0
        while core.has_work() or core.flying:
            stepped = core.step(self.cfg.max_steps_in_flight)
            if stepped.decided and len(core.flying) < self.cfg.max_steps_in_flight:
                continue  # decide one more ahead
            if driver.run_oldest() or stepped.decided:
                idle = 0
            else:
                idle += 1  # (a step that only ended requests, e.g. one that outgrew the pool)
                if idle > 1:
                    raise RuntimeError("scheduler has work but scheduled nothing")
        self.last_free_blocks = sched.num_free_blocks
        self.last_cache_hits = sched.num_cache_hits  # prompt tokens the prefix cache spared
        return [gens[f"r{i}"] for i in range(len(prompts))]

    def embed(self, prompts: list[list[int]]) -> list[bytes]:
        """Each prompt's final hidden state at its last position (float32 bytes, not
        normalized): what ``/v1/embeddings`` returns, before its normalization."""
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=True)
        return [g.embedding for g in self.generate(prompts, sp)]
