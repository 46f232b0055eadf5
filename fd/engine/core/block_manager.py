"""KV-cache blocks: a fixed pool, a free list, one block table per request, and a cache of the
full blocks whose contents are known (prefix caching).

The pool is the resource an abort must give back, so ownership is explicit: every block is
either free or in one or more requests' tables, counted (``refs``); giving back a table twice
raises instead of silently putting a block on the free list twice (which would later hand the
same KV memory to two requests).

Prefix caching (vLLM's automatic prefix caching): a block that a finished step has filled
with a known run of tokens is registered under a hash of those tokens and of every token
before them (:func:`fd.control.prefix.block_hash`), so a request whose prompt begins the same way takes the
block into its own table instead of computing it again. Such a block is never written again
(its holders write only after it), so holders share it read-only; it stays in the cache while
it is free, and is only evicted when the free list hands it out for new contents. Free blocks
go out oldest-freed first, so the blocks freed last (likeliest to be wanted again) stay
longest, and a table goes back tail first, so its prefix, which more requests share, stays
longer than its end. A cached free block counts as free: the pool's accounting is unchanged by caching.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


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
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: list[int] = [0] * num_blocks  # tables holding each block
        self._tables: dict[str, list[int]] = {}
        self._hash: list[bytes | None] = [None] * num_blocks  # contents of a cached block
        self._cached: dict[bytes, int] = {}  # hash -> the block holding those contents

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        """The hashes of the blocks the cache holds (what a placement card publishes)."""
        return list(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def owns(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def num_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def refs(self, block: int) -> int:
        """How many tables hold ``block`` (0: free)."""
        return self._refs[block]

    def tables(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(t) for rid, t in self._tables.items()}

    # ------------------------------------------------------------------ the cache

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks holding the leading ``hashes``, up to the first one missing."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_free_among(self, blocks: Sequence[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    def register(self, request_id: str, index: int, h: bytes) -> None:
        """Block ``index`` of the request's table now holds the contents ``h`` (a finished step
        filled it). If another block already holds them, this one stays private."""
        b = self._tables[request_id][index]
        if self._hash[b] is None and h not in self._cached:
            self._hash[b] = h
            self._cached[h] = b

    # ------------------------------------------------------------------ changes

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Append ``n`` fresh blocks to the request's table (creating it). All or nothing."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocks(f"{request_id}: needs {n} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        new = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in new:
            h = self._hash[b]
            if h is not None:  # evicted: it gets new contents
                del self._cached[h]
                self._hash[b] = None
            self._refs[b] = 1
        table.extend(new)
        return new

    def acquire(self, request_id: str, blocks: Sequence[int]) -> None:
        """Append cached blocks (:meth:`lookup`) to the request's table, shared read-only."""
        table = self._tables.setdefault(request_id, [])
        for b in blocks:
            if self._hash[b] is None:  # pragma: no cover - guarded by construction
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
        table.extend(blocks)

    def shortfall(self, request_id: str, num_tokens: int) -> int:
        """How many blocks beyond the free ones covering ``num_tokens`` would take (0: fits)."""
        missing = self.blocks_for(num_tokens) - self.num_held(request_id)
        return max(0, missing - len(self._free))

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens`` tokens (append on demand)."""
        missing = self.blocks_for(num_tokens) - self.num_held(request_id)
        return self.allocate(request_id, max(0, missing))

    def free(self, request_id: str) -> int:
        """Give the request's whole table back; returns how many blocks that was. A block
        another request still holds stays with it; a cached one stays cached while free."""
        table = self._tables.pop(request_id, None)
        if table is None:
            raise DoubleFree(f"{request_id} holds no block table (already freed?)")
        for b in reversed(table):  # its tail is evicted first: a prefix is kept longest
            if self._refs[b] < 1:  # pragma: no cover - guarded by construction
                raise DoubleFree(f"block {b} is not held by {request_id}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
        return len(table)

    def check(self) -> None:
        """Raise AssertionError unless every block is free or held, with its count right, and
        the cache names each block it holds once."""
        refs = [0] * self._num_total
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice"
            for b in table:
                refs[b] += 1
        for b in range(self._num_total):
            assert refs[b] == self._refs[b], f"block {b}: {self._refs[b]} holders counted, {refs[b]} found"
            assert (b in self._free) == (refs[b] == 0), f"block {b} is free and held, or neither"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"cache entry for block {b} does not match it"
        assert sum(h is not None for h in self._hash) == len(self._cached), "a hash outside the cache"
