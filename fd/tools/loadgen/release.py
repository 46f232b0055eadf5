"""How long a server took from a cancel to releasing the request, read where it is exact:
from the request's own events on an fd server (:class:`EventReader`), else from the
``/metrics`` gauges of any server (:class:`GaugePoller`)."""

from __future__ import annotations

import asyncio
import time

from fd.tools.gauge_sampler import GaugeSampler
from fd.tools.loadgen.client import Outcome


class EventReader:
    """Reads a cancelled request's own stream (``P:req:{id}``) until its ``final``."""

    def __init__(self, redis_url: str, prefix: str):
        from fd.control.connect import connect
        from fd.control.keys import Keys

        self.redis = connect(redis_url)
        self.keys = Keys(prefix)

    async def fill(self, o: Outcome, timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
        key = self.keys.req(o.request_id)
        ts: dict[str, int] = {}
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                entries = await self.redis.xrange(key)
            except Exception as e:  # noqa: BLE001 - a bench reports, it does not crash mid-run
                o.error = o.error or f"redis: {type(e).__name__}: {e}"
                return
            for _eid, f in entries:
                typ = f.get(b"type", b"").decode()
                if typ not in ts and b"ts" in f:
                    ts[typ] = int(f[b"ts"])
                if typ == "abort_requested" and o.abort_source is None:
                    o.abort_source = f.get(b"source", b"").decode() or None
                if typ == "final":
                    o.server_finish_reason = f.get(b"finish_reason", b"").decode() or None
            if "final" in ts:
                break
            await asyncio.sleep(poll_s)
        if o.cancel_wall_ms is not None and "abort_requested" in ts:
            o.noted_ms = ts["abort_requested"] - o.cancel_wall_ms
            if "blocks_released" in ts:
                o.release_ms = ts["blocks_released"] - o.cancel_wall_ms

    async def close(self) -> None:
        await self.redis.aclose()


class GaugePoller:
    """Samples running + waiting requests from ``/metrics`` every ``poll_ms``, in a process of
    its own (:mod:`fd.tools.gauge_sampler`: in the client's loop a sample waited on the client's own
    work, and a release looked as late as that). Any server's gauges: the names' suffixes."""

    NAMES = ("num_requests_running", "num_requests_waiting")  # (fd_..., vllm:...)

    def __init__(self, base: str, key: str | None, poll_ms: float):
        self.poll_s = poll_ms / 1000
        self._sampler = GaugeSampler(base, self.NAMES, self.poll_s, suffix=True, key=key)
        self.samples: list[tuple[float, float]] = []
        self.errors = 0

    async def start(self) -> None:
        await asyncio.to_thread(self._sampler.start)

    async def stop(self) -> None:
        self.samples = await asyncio.to_thread(self._sampler.stop)
        self.errors = self._sampler.errors

    def fill(self, o: Outcome) -> None:
        """Release = the first sample after the cancel whose value is below the last sample
        taken before it."""
        if o.t_cancel is None or not self.samples:
            return
        before = [v for t, v in self.samples if t <= o.t_cancel]
        if not before:
            return
        v0 = before[-1]
        for t, v in self.samples:
            if t > o.t_cancel and v < v0:
                o.release_ms = (t - o.t_cancel) * 1000.0
                return
