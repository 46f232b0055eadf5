"""The scheduler's state as a JSON-able value (:meth:`Scheduler.snapshot
<fd.engine.core.scheduler.Scheduler.snapshot>`), for debugging and ``fd replay --at STEP``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fd.engine.core.block_manager import BlockManager
from fd.engine.core.outputs import SchedulerOutput
from fd.engine.core.sequence import Sequence


def snapshot(
    step: int,
    blocks: BlockManager,
    in_flight: Iterable[SchedulerOutput],
    in_flight_ids: Iterable[str],
    running: Iterable[Sequence],
    waiting: Iterable[Sequence],
    seqs: Iterable[Sequence],
) -> dict[str, Any]:
    """``in_flight``: the steps in flight, oldest first; ``in_flight_ids``: the requests they
    hold; ``seqs``: every unfinished request, in arrival order."""
    return {
        "step": step,
        "num_total_blocks": blocks.num_total,
        "num_free_blocks": blocks.num_free,
        "in_flight": list(in_flight_ids),
        "steps_in_flight": [o.step for o in in_flight],
        "running": [s.request_id for s in running],
        "waiting": [s.request_id for s in waiting],
        "requests": [
            {
                "request_id": s.request_id,
                "status": s.status.value,
                "arrival": s.arrival,
                "num_prompt_tokens": s.num_prompt_tokens,
                "num_output_tokens": s.num_output_tokens,
                "num_computed_tokens": s.num_computed_tokens,
                "num_in_flight": s.num_in_flight,
                "num_pending": s.num_pending,
                "finishing": None if s.finishing is None else s.finishing[0],
                "num_preemptions": s.num_preemptions,
                "aborting": s.aborting,
                "block_table": list(blocks.table(s.request_id)),
            }
            for s in seqs
        ],
    }
