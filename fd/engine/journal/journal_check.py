"""``fd replay``'s journal-only check: invariants from the recorded digests alone.

It reads block tables, released counts and the free count after every call, and finds a leak
(a request that ended still holding blocks, a release that returned fewer blocks than the
request held, blocks in use that no request holds), double allocation, and requests with
other than one ``final``, even when the scheduler that wrote the journal is the broken one,
and without re-executing anything (fd/engine/journal/replay.py re-executes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fd.control.endings import ABORT_REQUESTED, BLOCKS_RELEASED, DRAINED, FINAL
from fd.control.events import Event
from fd.engine.core.config import SchedulerConfig
from fd.engine.journal.journal import config_from_json
from fd.engine.journal.journal_reader import segments


@dataclass
class RequestTrace:
    """One request's life as the journal tells it (steps, and entry timestamps in ms)."""

    request_id: str
    segment: int = 0
    prompt_tokens: int = 0
    added_step: int = 0
    added_ms: int = 0
    first_scheduled_step: int | None = None
    scheduled_steps: int = 0
    num_tokens: int = 0
    preempted_steps: list[int] = field(default_factory=list)
    abort_step: int | None = None
    abort_ms: int | None = None
    abort_source: str | None = None
    drained_step: int | None = None
    released_step: int | None = None
    released_ms: int | None = None
    released_count: int | None = None
    final_step: int | None = None
    final_ms: int | None = None
    finish_reason: str | None = None
    finals: int = 0


@dataclass
class Analysis:
    total_blocks: int = 0
    calls: int = 0
    steps: int = 0
    violations: list[str] = field(default_factory=list)
    requests: dict[str, RequestTrace] = field(default_factory=dict)
    # (step, blocks in use, entry ts ms) after every schedule() and update()
    usage: list[tuple[int, int, int]] = field(default_factory=list)
    peak_blocks_in_use: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    abort_release_steps: list[int] = field(default_factory=list)
    abort_release_ms: list[int] = field(default_factory=list)
    first_ms: int = 0
    last_ms: int = 0


_MAX_SAME = 5  # repeated violations of one kind are counted, not listed


class _Checker:
    """Folds one segment's digests into block holdings and request traces, checking as it goes."""

    def __init__(self, a: Analysis, seg: int, cfg: SchedulerConfig):
        self.a = a
        self.seg = seg
        self.total = cfg.num_blocks
        self.bs = cfg.block_size
        self.held: dict[str, list[int]] = {}  # rid -> its block table, per the digests
        # block -> the requests holding it: one, or several for a cached prefix block, which
        # they share read-only (each took it wholly before the positions it feeds)
        self.holders: dict[int, set[str]] = {}
        self.step = 0
        self.ts = 0
        self.kinds: Counter = Counter()

    def violate(self, kind: str, msg: str) -> None:
        self.kinds[kind] += 1
        if self.kinds[kind] <= _MAX_SAME:
            self.a.violations.append(msg)
        elif self.kinds[kind] == _MAX_SAME + 1:
            self.a.violations.append(f"... more '{kind}' violations (counted at the end)")

    def trace(self, rid: str) -> RequestTrace:
        t = self.a.requests.get(rid)
        if t is None:
            t = self.a.requests[rid] = RequestTrace(rid, self.seg, added_step=self.step, added_ms=self.ts)
        return t

    def call(self, c: dict[str, Any], ts: int) -> None:
        self.ts = c.get("t") or ts
        op = c.get("op")
        if op == "add" and "raised" not in c:
            old = self.a.requests.get(c["rid"])
            if old is not None and old.finals:  # an id reused after its final: a new life
                del self.a.requests[c["rid"]]
            t = self.trace(c["rid"])
            t.prompt_tokens = len(c["data"].get("prompt_token_ids", ()))
        if "raised" in c:
            pass
        else:
            self.events(c.get("ev") or [])
            if op == "schedule":
                self.batch(c["out"])
        free = c.get("free")
        in_use = len(self.holders)
        if in_use > self.total:
            self.violate("overcommit", f"step {self.step}: {in_use} blocks held, only {self.total} exist")
        if free is not None:
            used = self.total - free
            self.a.peak_blocks_in_use = max(self.a.peak_blocks_in_use, used, in_use)
            if used != in_use:
                self.violate(
                    "unaccounted",
                    (
                        f"step {self.step} ({op}): the scheduler has {used} blocks in use but the "
                        f"requests hold {in_use}: {used - in_use} block(s) leaked"
                        if used > in_use
                        else f"step {self.step} ({op}): the requests hold {in_use} blocks but the "
                        f"scheduler counts only {used} in use"
                    ),
                )
            if op in ("schedule", "update"):
                self.a.usage.append((self.step, used, ts))

    def events(self, evs: list[list]) -> None:
        for d in evs:
            kind, rid = d[0], d[1]
            t = self.trace(rid)
            if t.finals and kind != FINAL:
                self.violate("after_final", f"step {self.step}: {kind} for {rid} after its final")
            if kind == "tokens":
                t.num_tokens += len(d[2])
            elif kind == "preempted":
                n = self.drop(rid)
                t.preempted_steps.append(d[3])
                if d[2] != n:
                    self.violate(
                        "count", f"step {d[3]}: {rid} preempted with count={d[2]} but it held {n} blocks"
                    )
            elif kind == ABORT_REQUESTED:
                if t.abort_step is None:
                    t.abort_step, t.abort_ms, t.abort_source = d[3], self.ts, d[2]
            elif kind == DRAINED:
                t.drained_step = d[3]
            elif kind == BLOCKS_RELEASED:
                n = self.drop(rid)
                t.released_step, t.released_ms, t.released_count = d[3], self.ts, d[2]
                if d[2] != n:
                    self.violate(
                        "leak",
                        f"step {d[3]}: {rid} released {d[2]} of the {n} blocks "
                        "it held" + (" (leak)" if d[2] < n else ""),
                    )
                if t.abort_step is not None:
                    self.a.abort_release_steps.append(d[3] - t.abort_step)
                    self.a.abort_release_ms.append(self.ts - (t.abort_ms or self.ts))
            elif kind == FINAL:
                t.finals += 1
                t.final_step, t.final_ms, t.finish_reason = self.step, self.ts, d[2]
                self.a.finish_reasons[d[2]] = self.a.finish_reasons.get(d[2], 0) + 1
                if t.finals > 1:
                    self.violate("finals", f"step {self.step}: {rid} got final #{t.finals}")
                left = self.held.get(rid)
                if left:
                    self.violate(
                        "leak",
                        f"step {self.step}: {rid} finished ({d[2]}) still holding {len(left)} blocks (leak)",
                    )

    def drop(self, rid: str, keep: int = 0) -> int:
        """Forget ``rid``'s blocks past the first ``keep``; returns how many it held."""
        table = self.held.get(rid)
        if table is None:
            return 0
        n = len(table)
        for b in table[keep:]:
            hs = self.holders.get(b)
            if hs is not None:
                hs.discard(rid)
                if not hs:
                    del self.holders[b]
        if keep:
            del table[keep:]
        else:
            del self.held[rid]
        return n

    def batch(self, out: list) -> None:
        step, _, seqs = out
        self.step = step
        for rid, start, n, _sample, base, new in seqs:
            prev = self.held.get(rid)
            have = 0 if prev is None else len(prev)
            if base > have:
                self.violate("delta", f"step {step}: {rid} extends {base} blocks, holds {have}")
                base = have
            if base < have:  # a table that did not just grow: the old tail is gone
                self.drop(rid, base)
            table = self.held.setdefault(rid, [])
            for b in new:
                if not 0 <= b < self.total:
                    self.violate("range", f"step {step}: {rid} holds block {b}, outside the pool")
                hs = self.holders.setdefault(b, set())
                if hs and rid not in hs and (len(table) + 1) * self.bs > start:
                    # shared, yet not wholly before what this request computes
                    self.violate("double", f"step {step}: block {b} held by both {min(hs)} and {rid}")
                hs.add(rid)
                table.append(b)
            if len(table) * self.bs < start + n:
                self.violate(
                    "short",
                    f"step {step}: {rid} feeds positions up to {start + n} with only {len(table)} blocks",
                )
            for b in table[start // self.bs : (start + n - 1) // self.bs + 1] if n else ():
                if len(self.holders.get(b, ())) > 1:
                    self.violate(
                        "shared_write",
                        f"step {step}: {rid} writes block {b}, which "
                        f"{sorted(self.holders[b] - {rid})} also hold",
                    )
            t = self.trace(rid)
            t.scheduled_steps += 1
            if t.first_scheduled_step is None:
                t.first_scheduled_step = step

    def finish(self) -> None:
        for t in self.a.requests.values():
            if t.segment != self.seg:
                continue
            if t.released_step is not None and t.finals == 0:
                self.violate("finals", f"{t.request_id} released its blocks but never got a final")
        for kind, n in self.kinds.items():
            if n > _MAX_SAME:
                self.a.violations.append(f"{n} '{kind}' violations in all")


def check_journal(entries: list[Event]) -> Analysis:
    """Invariants from the recorded digests alone (no re-execution)."""
    a = Analysis()
    segs, orphans = segments(entries)
    if orphans:
        a.violations.append(
            f"journal truncated: {orphans} step entries before any journal_start "
            "(MAXLEN trimmed its beginning); they cannot be checked"
        )
    for i, (start, steps) in enumerate(segs):
        cfg = config_from_json(start.config)
        a.total_blocks = cfg.num_blocks
        ck = _Checker(a, i, cfg)
        a.first_ms = a.first_ms or start.ts
        for n, st in enumerate(steps):
            if st.seq != n:
                a.violations.append(
                    f"segment {i}: entry seq {st.seq} where {n} was expected (entries missing)"
                )
                break
            for c in st.data.get("calls", ()):
                ck.call(c, st.ts)
                a.calls += 1
            a.steps = max(a.steps, st.step)
            a.last_ms = max(a.last_ms, st.ts)
        ck.finish()
    return a
