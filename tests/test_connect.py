"""control.connect's client on a real redis-server: what its socket timeout does to a cancel."""

from __future__ import annotations

import asyncio

from control.connect import connect


async def test_a_cancel_is_never_lost_whenever_it_comes_during_a_command(redis_server, keys):
    # A cancel at each turn of the event loop in turn, from before the command is written to
    # after its reply: once cancel() says it took, the task ends cancelled. (redis-py writes
    # under asyncio.wait_for when a socket timeout is set, and Python 3.11's wait_for returns
    # the result of a write that ended just before the cancel came: the cancel was lost.)
    client = connect(redis_server.url)
    try:
        await client.ping()  # (connected: every turn below is the command's own)
        ran_to_the_end = False
        for turns in range(10_000):
            task = asyncio.create_task(client.set(f"{keys.prefix}:c", str(turns)))
            for _ in range(turns):
                await asyncio.sleep(0)
            took = task.cancel()
            result = await asyncio.gather(task, return_exceptions=True)
            if took:
                assert task.cancelled(), (turns, result)
            else:
                ran_to_the_end = True  # (done before the cancel: nothing to lose)
                break
        assert ran_to_the_end  # every turn of a whole command was tried
    finally:
        await client.aclose()
