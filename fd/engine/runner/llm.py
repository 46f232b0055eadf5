"""Offline, in-process generation: the scheduler and the runner with no Redis and no HTTP.

It is the reference the served path is compared against (greedy output through the API must
equal this) and the in-process baseline of ``bench/api.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fd.control.events import Final, Tokens
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig, default
from fd.engine.core.detokenizer import IncrementalDetokenizer
from fd.engine.core.scheduler import Scheduler
from fd.engine.node.node_config import SchedulerSettings


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
        clock=None,
        on_event=None,
    ) -> list[Generation]:
        """Run ``prompts`` to completion; ``on_event`` sees every event the scheduler emits."""
        import time

        clock = clock or time.perf_counter

        def fold(gens, detoks, ev, clock):
            if on_event is not None:
                on_event(ev)
            self._fold(gens, detoks, ev, clock)

        sched = Scheduler(self.cfg)
        sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        gens: dict[str, Generation] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for i, (ids, sp) in enumerate(zip(prompts, sps, strict=False)):
            rid = f"r{i}"
            gens[rid] = Generation(rid)
            detoks[rid] = IncrementalDetokenizer.for_request(self.tokenizer, sp, self.cfg.eos_token_ids)
            for ev in sched.add(rid, RequestData(prompt_token_ids=tuple(ids), sampling=sp)):
                fold(gens, detoks, ev, clock)
        # Async scheduling in one thread: step N+1 is decided (and run: the runner takes steps
        # in order) before step N's results are folded in. No faster here, but the same
        # calls, placeholders included, as the engine node makes with a step in flight.
        flying: list = []
        while sched.has_work() or flying:
            out = sched.schedule()
            held = out.events
            for ev in held:
                fold(gens, detoks, ev, clock)
            if not out.empty:
                flying.append((out, self.runner.execute(out)))
            elif not flying:
                if not held:
                    raise RuntimeError("scheduler has work but scheduled nothing")
                continue
            if len(flying) < self.cfg.max_steps_in_flight and not out.empty:
                continue
            out, res = flying.pop(0)
            for rid, vec in res.embeddings.items():
                gens[rid].embedding = vec
            stopped = {}
            deltas = {}
            for rid, tok in res.sampled.items():
                if sched.discards(rid):
                    continue  # aborted or finished while this step ran: its token is dropped
                delta, stop = detoks[rid].push((tok,))
                deltas[rid] = delta
                if stop is not None:
                    stopped[rid] = stop
            if stopped:
                res = replace(res, stopped={**res.stopped, **stopped})
            for ev in sched.update(out, res):
                if isinstance(ev, Tokens):
                    ev = replace(ev, text=deltas.get(ev.request_id, ""))
                fold(gens, detoks, ev, clock)
        self.last_free_blocks = sched.num_free_blocks
        self.last_cache_hits = sched.num_cache_hits  # prompt tokens the prefix cache spared
        return [gens[f"r{i}"] for i in range(len(prompts))]

    def embed(self, prompts: list[list[int]]) -> list[bytes]:
        """Each prompt's final hidden state at its last position (float32 bytes, not
        normalized): what ``/v1/embeddings`` returns, before its normalization."""
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, embed=True)
        return [g.embedding for g in self.generate(prompts, sp)]

    @staticmethod
    def _fold(gens, detoks, ev, clock) -> None:
        g = gens[ev.request_id]
        if isinstance(ev, Tokens):
            g.token_ids.extend(ev.token_ids)
            g.text += ev.text
            g.token_times.append(clock())
        elif isinstance(ev, Final):
            g.text += detoks[ev.request_id].flush()
            g.finish_reason = ev.finish_reason
