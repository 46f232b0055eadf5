"""Made-up requests and stories for the bus tests, and what they compare events with."""

from __future__ import annotations

from fd.control import events as E
from fd.control.bus import Bus
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams

DATA = RequestData(prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4))


def request(rid: str) -> E.Request:
    return E.Request(request_id=rid, data=DATA)


def story(rid: str, n_tokens: int = 3) -> list[E.Event]:
    evs: list[E.Event] = [E.Accepted(request_id=rid, prompt_tokens=3), E.Claimed(request_id=rid, engine="e1")]
    evs += [E.Tokens(request_id=rid, token_ids=(i,), text=f"t{i}", step=i) for i in range(n_tokens)]
    evs.append(E.Final(request_id=rid, finish_reason="length", usage={"completion_tokens": n_tokens}))
    return evs


async def dead(bus: Bus) -> list[dict[bytes, bytes]]:
    return [f for _id, f in await bus.redis.xrange(bus.keys.dead)]


def same(a: E.Event, b: E.Event) -> bool:
    """Equal up to ``ts``, which encode() stamps when the event had none."""
    return type(a) is type(b) and {**a.encode(), "ts": ""} == {**b.encode(), "ts": ""}
