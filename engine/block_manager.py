"""KV-cache blocks: a fixed pool, a free list, and one block table per request.

The pool is the resource an abort must give back, so ownership is explicit: every block is
either on the free list or in exactly one request's table, and giving back a table twice
raises instead of silently putting a block on the free list twice (which would later hand the
same KV memory to two requests).

The free list is a FIFO deque so allocation is deterministic and a just-freed block is the
last to be reused; with prefix caching that is the order in which cached blocks should be
evicted. Prefix caching would add a ref count and a content hash per block; tables would
still be per request.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks; nothing was allocated."""


class DoubleFree(RuntimeError):
    """A table (or block) was given back that is not held."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self._num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: list[str | None] = [None] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def owns(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def num_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def owner(self, block: int) -> str | None:
        return self._owner[block]

    def tables(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(t) for rid, t in self._tables.items()}

    # ------------------------------------------------------------------ changes

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Append ``n`` blocks to the request's table (creating it). All or nothing."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocks(f"{request_id}: needs {n} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        new = [self._free.popleft() for _ in range(n)]
        for b in new:
            self._owner[b] = request_id
        table.extend(new)
        return new

    def shortfall(self, request_id: str, num_tokens: int) -> int:
        """How many blocks beyond the free ones covering ``num_tokens`` would take (0: fits)."""
        missing = self.blocks_for(num_tokens) - self.num_held(request_id)
        return max(0, missing - len(self._free))

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` tokens (append on demand)."""
        missing = self.blocks_for(num_tokens) - self.num_held(request_id)
        return self.allocate(request_id, max(0, missing))

    def free(self, request_id: str) -> int:
        """Give the request's whole table back; returns how many blocks that was."""
        table = self._tables.pop(request_id, None)
        if table is None:
            raise DoubleFree(f"{request_id} holds no block table (already freed?)")
        for b in table:
            if self._owner[b] != request_id:  # pragma: no cover - guarded by construction
                raise DoubleFree(f"block {b} is not held by {request_id}")
            self._owner[b] = None
            self._free.append(b)
        return len(table)

    def check(self) -> None:
        """Raise AssertionError unless every block is free or held by exactly one table."""
        seen: dict[int, str] = {}
        for rid, table in self._tables.items():
            for b in table:
                assert b not in seen, f"block {b} held by {seen[b]} and {rid}"
                assert self._owner[b] == rid, f"block {b} owner mismatch"
                seen[b] = rid
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        for b in free:
            assert b not in seen, f"block {b} is free and held by {seen[b]}"
            assert self._owner[b] is None
        assert len(free) + len(seen) == self._num_total, "blocks leaked"
