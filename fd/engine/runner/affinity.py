"""Which CPUs the model worker runs on, and which the engine's own process keeps
(``--worker-cpus``).

The worker computes steps back to back while the engine's process (in ``fd serve`` also the
API) wakes for every request, token and hang-up. Left to the kernel on a two-core machine the
two kept landing on the same core while the other idled: a pipe write wakes its reader
*synchronously*, Linux's hint that the writer is about to sleep, which places the reader on
the writer's core; but neither sleeps (the worker goes on with the step queued behind the
one it answered, the loop with HTTP), and the woken side waited up to 4 ms for its turn
(a step's result written, the loop running 4 ms later). Apart, each wakes on its own core,
which ``bench/api.py`` shows as more tokens/s and a lower TTFT at every level; an eventfd
doorbell (no synchronous hint) instead sends the woken side to the idle core, whose wake-up
costs more on these VMs (bench/README.md has the figures of both).

``auto`` on two CPUs offers the worker both and settles when the model has loaded: a decode
step's GEMMs stream every weight from memory, and where two cores stream them at least 10%
faster than one at any of the step sizes the model times at load
(fd/engine/model/packed_gemm.py) the worker keeps
both, at a lower priority (nice +10) so that the engine's process, which wakes for every
request, token and hang-up, preempts it at once instead of waiting for its time slice beside
two busy MKL threads (a real model's throughput nearly doubles at one stream: bench/README.md,
"two worker CPUs"); otherwise (a model small enough for the caches, such as the
tiny test model) it takes the last CPU alone and the engine's process the other, as above. On
three or more CPUs the worker gets all but the first, which the engine's process keeps (as vLLM
keeps a CPU for its API server; not measured here, where every machine has two). A list (``3``,
``2-3``, ``0,4-5``) gives the worker those (at nice +10 where they include every CPU the process
keeps); ``none`` (the default of ``fd engine``) leaves placement to the kernel: several engines
on one machine need a list each, since ``auto`` would give every worker the same CPUs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("fd.engine")


#: The model worker's niceness where it shares its CPUs with the engine's process.
SHARED_WORKER_NICE = 10


@dataclass(frozen=True)
class CpuPlan:
    worker: frozenset[int]  # the model worker process's CPUs
    rest: frozenset[int]  # everything else in the engine's process
    worker_nice: int = 0  # added to the worker's niceness where it keeps ``worker``
    # The one CPU the worker takes alone (at its own priority, the engine's process leaving
    # it) if its model's GEMMs are no faster on all of ``worker``; None: it keeps them.
    alone: int | None = None

    def settled(self, worker_cpus: frozenset[int]) -> CpuPlan:
        """The plan once the worker has said where it stays (``alone`` or all it was given)."""
        if self.alone is not None and worker_cpus == {self.alone}:
            return CpuPlan(worker_cpus, self.rest - worker_cpus or self.rest)
        return CpuPlan(self.worker, self.rest, self.worker_nice)


def parse_cpus(spec: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r} (e.g. 3, 2-3, 0,4-5)") from None
        if a < 0 or b < a:
            raise ValueError(f"not a CPU list: {spec!r} (e.g. 3, 2-3, 0,4-5)")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"not a CPU list: {spec!r} (e.g. 3, 2-3, 0,4-5)")
    return cpus


def plan(spec: str, allowed: set[int] | None = None) -> CpuPlan | None:
    """The placement ``--worker-cpus spec`` asks for, among the CPUs this process may use;
    None: leave it to the kernel."""
    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    spec = spec.strip().lower()
    if spec == "none":
        return None
    if spec == "auto":
        if len(allowed) < 2:
            return None
        if len(allowed) == 2:
            both = frozenset(allowed)
            return CpuPlan(both, both, SHARED_WORKER_NICE, alone=max(allowed))
        worker = allowed - {min(allowed)}
    else:
        worker = parse_cpus(spec)
        if not worker <= allowed:
            raise ValueError(
                f"--worker-cpus {spec}: CPUs {sorted(worker - allowed)} are not "
                f"among this process's CPUs {sorted(allowed)}"
            )
    rest = allowed - worker or allowed  # (the worker given them all: the process keeps them too)
    return CpuPlan(frozenset(worker), frozenset(rest), SHARED_WORKER_NICE if worker & rest else 0)


def apply_rest(cpu_plan: CpuPlan) -> None:
    """This process (the engine's, its worker started) onto the plan's other CPUs, said once."""
    pin_this_process(cpu_plan.rest)
    log.info(
        "model worker on CPUs %s%s, this process on CPUs %s",
        _cpu_list(cpu_plan.worker),
        f" at nice +{cpu_plan.worker_nice}" if cpu_plan.worker_nice else "",
        _cpu_list(cpu_plan.rest),
        extra={
            "worker_cpus": sorted(cpu_plan.worker),
            "worker_nice": cpu_plan.worker_nice,
            "cpus": sorted(cpu_plan.rest),
        },
    )


def _cpu_list(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))


def nice_this_process(increment: int) -> None:
    """Every thread of this process ``increment`` nicer (Linux keeps a niceness per thread:
    ``os.nice`` changes only the caller's)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            t = int(tid)
            os.setpriority(os.PRIO_PROCESS, t, os.getpriority(os.PRIO_PROCESS, t) + increment)
        except (ProcessLookupError, PermissionError, OSError) as e:
            log.warning("could not lower thread %s's priority by %d: %s", tid, increment, e)


def pin_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto ``cpus`` (``sched_setaffinity`` moves one thread;
    threads started from now on inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError, OSError) as e:
            log.warning("could not pin thread %s to CPUs %s: %s", tid, sorted(cpus), e)
