"""The scheduler driven by a deterministic fake model (tests/unit/test_scheduler.py and the
tests of async scheduling and step faults): a runner that keeps its KV, so a wrong block table
changes the tokens."""

from __future__ import annotations

from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.config import SchedulerConfig
from fd.engine.core.outputs import RunnerOutput
from fd.engine.core.scheduler import Scheduler
from fd.engine.core.sequence import PLACEHOLDER

EOS = 2


def model(ctx):
    """A deterministic fake LM: the next token depends on the whole context (never 0..2)."""
    return (sum((i + 1) * t for i, t in enumerate(ctx)) + 7 * len(ctx)) % 97 + 3


def reference(prompt, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(model(toks))
    return toks[len(prompt) :]


class FakeRunner:
    """Writes each fed token into its KV slot and samples from what the KV holds, so a block
    table that points at the wrong (or someone else's) blocks changes the tokens."""

    def __init__(self, sched):
        self.bs = sched.config.block_size
        self.kv = [[None] * self.bs for _ in range(sched.num_total_blocks)]
        self.outputs = []
        self.last = {}  # the previous step's samples: what a placeholder (async) stands for

    def run(self, out, override=None, stopped=None):
        self.outputs.append(out)
        sampled = {}
        for s in out.seqs:
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_table) * self.bs >= end
            for i, t in enumerate(s.token_ids):
                if t == PLACEHOLDER:
                    t = self.last[s.request_id]
                p = s.start_pos + i
                self.kv[s.block_table[p // self.bs]][p % self.bs] = t
            if s.sample:
                ctx = [self.kv[s.block_table[p // self.bs]][p % self.bs] for p in range(end)]
                sampled[s.request_id] = model(ctx)
        sampled.update({k: v for k, v in (override or {}).items() if k in sampled})
        self.last = sampled
        return RunnerOutput(step=out.step, sampled=sampled, stopped=dict(stopped or {}))

    def seen(self, rid):
        return any(s.request_id == rid for out in self.outputs for s in out.seqs)


def make(**kw):
    cfg = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        eos_token_ids=(EOS,),
    )
    cfg.update(kw)
    sched = Scheduler(SchedulerConfig(**cfg))
    return sched, FakeRunner(sched)


def req(n, max_tokens=4, start=10, **sp):
    return RequestData(
        prompt_token_ids=tuple(range(start, start + n)), sampling=SamplingParams(max_tokens=max_tokens, **sp)
    )
