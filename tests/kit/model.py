"""The tiny model's directory for a module, random prompts, a driver of the paged runner
that batches requests the way the scheduler does (tests/unit/test_model.py and
test_cpu_attention.py hold the model to full recompute with it), and an abort that lands
between a step's layers."""

from __future__ import annotations

import numpy as np
import pytest

from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.model.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny"))


def greedy_reference(model, prompt, steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` by the model's full recompute (no cache)."""
    ids, out = list(prompt), []
    for _ in range(steps):
        t = int(np.argmax(model.reference_logits(ids)[-1]))
        out.append(t)
        ids.append(t)
    return out


def random_prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 512, size=n).tolist()


class Blocks:
    """A tiny block allocator: blocks handed out in a shuffled order, so tables are scattered
    and reused blocks still hold other requests' stale K/V."""

    def __init__(self, n, seed):
        self.free = np.random.default_rng(seed).permutation(n).tolist()

    def table(self, old: tuple[int, ...], length: int) -> tuple[int, ...]:
        need = -(-length // BLOCK) - len(old)
        return old + tuple(self.free.pop() for _ in range(max(0, need)))

    def release(self, table):
        self.free.extend(table)


def run_batched(runner, prompts: dict[str, list[int]], steps: int, chunk: dict[str, int], blocks: Blocks):
    """Drive requests to ``steps`` generated tokens each, all in one batch per step: prompts
    prefilled in chunks (mixed with other requests' decodes), then decoded together.
    Returns the greedy tokens and the logits each was chosen from."""
    done = {r: 0 for r in prompts}  # prompt tokens prefilled
    gen: dict[str, list[int]] = {r: [] for r in prompts}
    logits: dict[str, list[np.ndarray]] = {r: [] for r in prompts}
    tables = {r: () for r in prompts}
    step = 0
    while any(len(g) < steps for g in gen.values()):
        seqs = []
        for r, p in prompts.items():
            if len(gen[r]) >= steps:
                continue
            if done[r] < len(p):
                toks = tuple(p[done[r] : done[r] + chunk.get(r, len(p))])
                start = done[r]
                done[r] += len(toks)
                sample = done[r] == len(p)
            else:
                toks, start, sample = (gen[r][-1],), len(p) + len(gen[r]) - 1, True
            tables[r] = blocks.table(tables[r], start + len(toks))
            seqs.append(ScheduledSeq(r, toks, start, tables[r], sample, GREEDY, len(gen[r])))
        out = SchedulerOutput(step=step, seqs=tuple(seqs))
        rows = runner.logits(out)
        sampled = [s for s in seqs if s.sample]
        for s, row in zip(sampled, rows, strict=False):
            gen[s.request_id].append(int(np.argmax(row)))
            logits[s.request_id].append(row)
        step += 1
    for t in tables.values():
        blocks.release(t)
    return gen, logits


def cut_at_the_second_layer(cut, step: int, request_ids: frozenset[str]) -> None:
    """An abort of ``request_ids`` that lands in ``cut`` (fd/engine/runner/step_cut.py) while
    step ``step``'s first layer runs: the model asks before each layer's KV writes."""
    take, calls = cut.take, []

    def take_at_second_layer():
        calls.append(1)
        if len(calls) == 2:
            cut.ask(step, request_ids)
        return take()

    cut.take = take_at_second_layer
