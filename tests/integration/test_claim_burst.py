"""A burst of requests in ``fd serve``: what the engine claims.

The engine there claims when its API says it submitted (``on_local_arrival``) and otherwise
only every CLAIM_POLL_S. A claim is capped (``max_num_waiting``); what it left behind must be
claimed at the next chance, not after the poll (a wave of 32 was prefilled as 16, then the
other 15 a poll later)."""

from __future__ import annotations

import asyncio

from fd.control.bus import Bus
from fd.engine.node.node import EngineNode
from fd.engine.node.node_config import EngineConfig, SchedulerSettings
from tests.kit.engine import submit_together


async def _node(embedded_redis, keys, tiny_runner, tiny_tokenizer) -> EngineNode:
    node = EngineNode(
        Bus(embedded_redis.client(), keys),
        Bus(embedded_redis.client(), keys),
        tiny_runner,
        tiny_tokenizer,
        EngineConfig(
            model_dir="", engine_id="burst", scheduler=SchedulerSettings(max_num_seqs=64, max_num_waiting=16)
        ),
    )
    await node.prepare()
    return node


async def test_a_capped_claim_leaves_the_rest_for_the_next_chance_not_the_poll(
    embedded_redis, keys, tiny_runner, tiny_tokenizer
):
    node = await _node(embedded_redis, keys, tiny_runner, tiny_tokenizer)
    try:
        await submit_together(node.bus, [(f"b{i}", [3, 4, 5], {"max_tokens": 2}) for i in range(20)])
        node.on_local_arrival()  # what fd serve's API says after submitting
        assert await node.admission.claim(block=False) == 16  # the cap
        await node.publisher.flush()  # (their `claimed`: then a step may run them)
        node.core.start(asyncio.get_running_loop())
        assert node.core.step(ahead=1).decided
        assert len(node.core.flying[0][0].seqs) == 16  # the step that starts them
        # at once (well inside CLAIM_POLL_S): the four it could not take
        assert await node.admission.claim(block=False) == 4
        await node.publisher.flush()
        node.core.step(ahead=0)  # (their arrival applied; no step decided)
        assert node.sched.num_waiting == 4 and node.sched.num_running == 16
        # and nothing more announced or queued: the next chance does not read again
        assert await node.admission.claim(block=False) == 0 and not node.admission.arrived
    finally:
        node.driver.close(asyncio.get_running_loop())
        await node.bus.redis.aclose()
        await node.control_bus.redis.aclose()
