"""--worker-cpus: where the model worker runs and where the engine's process stays."""

from __future__ import annotations

import os

import pytest

from fd.engine.runner.affinity import SHARED_WORKER_NICE, CpuPlan, parse_cpus, plan
from fd.engine.runner.worker import ProcessRunner


def test_auto_offers_two_cpus_to_settle_and_keeps_one_of_more():
    both = frozenset({0, 1})
    offered = plan("auto", {0, 1})
    assert offered == CpuPlan(both, both, SHARED_WORKER_NICE, alone=1)
    # the worker kept both: niced, the process on both too; or it took CPU 1 alone
    assert offered.settled(both) == CpuPlan(both, both, SHARED_WORKER_NICE)
    assert offered.settled(frozenset({1})) == CpuPlan(frozenset({1}), frozenset({0}))
    assert plan("auto", {2, 5, 7}) == CpuPlan(frozenset({5, 7}), frozenset({2}))
    assert plan("auto", {3}) is None  # one CPU: nothing to split
    assert plan("none", {0, 1, 2}) is None


def test_a_list_gives_the_worker_those_cpus():
    assert plan("2-3", {0, 1, 2, 3}) == CpuPlan(frozenset({2, 3}), frozenset({0, 1}))
    assert plan("0,3", {0, 1, 2, 3}) == CpuPlan(frozenset({0, 3}), frozenset({1, 2}))
    # all of them to the worker: the process keeps them too (nothing else to give it), and
    # the worker yields to it
    assert plan("0-1", {0, 1}) == CpuPlan(frozenset({0, 1}), frozenset({0, 1}), SHARED_WORKER_NICE)
    assert parse_cpus(" 1, 4-6 ") == {1, 4, 5, 6}


def test_a_worker_offered_two_cpus_takes_one_alone_when_its_gemms_gain_nothing(tiny_model_dir):
    """The tiny model's GEMMs fit in the caches: eager or packed on one MKL thread, unless two
    are 10% faster; a worker that keeps one thread takes its ``alone`` CPU, at its own priority,
    and one that keeps more stays on all it was offered, niced."""
    cpus = frozenset(os.sched_getaffinity(0))
    alone = max(cpus)
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16, cpus=cpus, nice=4, alone=alone)
    try:
        pid = runner._proc.pid
        nice = os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)
        assert runner.cpus == frozenset(os.sched_getaffinity(pid))
        assert (runner.cpus, nice) in (({alone}, 0), (cpus, 4))
        for tid in os.listdir(f"/proc/{pid}/task"):  # every thread of the worker, MKL's too
            assert os.sched_getaffinity(int(tid)) == runner.cpus
        runner.warmup()
    finally:
        runner.close()


@pytest.mark.parametrize("spec", ["x", "3-1", "-1", "", "1-a"])
def test_a_bad_list_says_what_a_list_looks_like(spec):
    with pytest.raises(ValueError, match="not a CPU list"):
        plan(spec, {0, 1, 2, 3})


def test_cpus_this_process_may_not_use_are_refused():
    with pytest.raises(ValueError, match=r"CPUs \[9\] are not among this process's CPUs \[0, 1\]"):
        plan("9", {0, 1})


def test_the_worker_process_runs_on_the_cpus_it_was_given(tiny_model_dir):
    cpu = max(os.sched_getaffinity(0))
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16, cpus=frozenset({cpu}), nice=3)
    try:
        assert os.sched_getaffinity(runner._proc.pid) == {cpu}
        assert os.getpriority(os.PRIO_PROCESS, runner._proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 3
    finally:
        runner.close()


def test_a_worker_that_may_not_be_pinned_still_runs(tiny_model_dir, capfd):
    """A container can refuse sched_setaffinity: the worker says so and runs where it is."""
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16, cpus=frozenset({4096}))
    try:
        assert os.sched_getaffinity(runner._proc.pid) == os.sched_getaffinity(0)
        runner.warmup()  # and it works
    finally:
        runner.close()
    assert "could not pin to CPUs [4096]" in capfd.readouterr().err
