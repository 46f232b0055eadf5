"""An abort that lands while a step runs (fd/engine/runner/step_cut.py): the step writes none of the
request's KV from its next layer on, says so for that step, gives it no token, and the other
requests of the batch get the tokens they get without the cut."""

from __future__ import annotations

import numpy as np

from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.runner.step_cut import StepCut
from tests.kit.model import cut_at_the_second_layer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BS = 16


def _step(step: int) -> SchedulerOutput:
    # "a" and "b": 20-token prompts in blocks of their own (two each), the whole prompt a chunk
    a = ScheduledSeq("a", tuple(range(5, 25)), 0, (300, 301), True, GREEDY, 0)
    b = ScheduledSeq("b", tuple(range(40, 60)), 0, (310, 311), True, GREEDY, 0)
    return SchedulerOutput(step=step, seqs=(a, b), num_batched_tokens=40)


def _kv_of(runner, blocks: tuple[int, ...], n: int) -> list[np.ndarray]:
    """Each layer's K of the first ``n`` slots of ``blocks``, every KV head."""
    m = runner.model
    slots = np.asarray([blocks[p // BS] * BS + p % BS for p in range(n)])
    return [
        np.stack([k.numpy()[h * m.num_slots + slots] for h in range(m.cfg.num_key_value_heads)])
        for k in m.k_slots
    ]


def _clear(runner, blocks: tuple[int, ...]) -> None:
    m = runner.model
    for k, v in zip(m.k_blocks, m.v_blocks):
        for blk in blocks:
            k[:, blk] = 0.0
            v[:, blk] = 0.0


def test_a_request_cut_at_the_second_layer_keeps_only_the_first_layers_kv(tiny_runner):
    runner = tiny_runner
    assert len(runner.model.k_slots) >= 2
    alone = runner.execute(_step(1))  # b's token without any cut
    _clear(runner, (300, 301, 310, 311))
    sent: list = []
    cut = StepCut(sent.append)
    out = _step(2)
    cut.begin(out)
    cut_at_the_second_layer(cut, out.step, frozenset({"a", "nobody"}))
    res = runner.execute(out, cut)
    cut.end()
    assert [tuple(s) for s in sent] == [(2, ["a"])]  # said once, for this step, of "a" only
    assert set(res.sampled) == {"b"} and res.sampled["b"] == alone.sampled["b"]
    ka, kb = _kv_of(runner, (300, 301), 20), _kv_of(runner, (310, 311), 20)
    assert np.abs(ka[0]).min() > 0  # the first layer wrote a's keys before the cut
    assert all(not k.any() for k in ka[1:])  # no later layer did
    assert all(np.abs(k).min() > 0 for k in kb)  # b's, every layer


def test_an_abort_before_the_first_layer_writes_nothing_and_one_after_the_step_is_ignored(tiny_runner):
    runner = tiny_runner
    _clear(runner, (300, 301, 310, 311))
    sent: list = []
    cut = StepCut(sent.append)
    out = _step(3)
    cut.begin(out)
    cut.ask(out.step - 1, frozenset({"a"}))  # an abort sent before this step was: not its own
    cut.ask(out.step, frozenset({"b"}))
    res = runner.execute(out, cut)
    cut.end()
    assert [tuple(s) for s in sent] == [(3, ["b"])] and set(res.sampled) == {"a"}
    assert all(not k.any() for k in _kv_of(runner, (310, 311), 20))
    cut.ask(out.step, frozenset({"a"}))  # the step is over: nothing to stop, nothing said
    assert cut.take() == frozenset() and len(sent) == 1
