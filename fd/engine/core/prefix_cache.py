"""Prefix caching, the scheduler's side: each request's chain of block hashes over the
:class:`~fd.engine.core.block_manager.BlockManager`'s cache.

A full block's hash covers its tokens and, through the hash of the block before it, every
token before them (:func:`~fd.engine.core.block_manager.block_hash`), so two requests meet on a
block only if their whole prefixes up to it agree. The chain is kept on the request
(``Sequence.block_hashes``: each hash computed once) with how many of its blocks are in the
cache (``Sequence.num_registered``).
"""

from __future__ import annotations

from fd.control.prefix import block_hash, chain_root
from fd.engine.core.block_manager import BlockManager
from fd.engine.core.sequence import Sequence


class PrefixCache:
    def __init__(self, blocks: BlockManager, enabled: bool) -> None:
        self.blocks = blocks
        self.enabled = enabled

    def hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The hashes of the request's first ``n`` full blocks (computed once each)."""
        hs, bs = seq.block_hashes, self.blocks.block_size
        first = chain_root(seq.sampling.lora)
        while len(hs) < n:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else first, seq.token_ids[i * bs : (i + 1) * bs]))
        return hs[:n]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a request about to start can take instead of computing them: its
        leading full blocks, short of its last token (which must be fed to sample the next).
        None for a request scoring its prompt: every position's logits are wanted."""
        if not self.enabled or seq.num_computed_tokens or seq.sampling.prompt_logprobs is not None:
            return []
        return self.blocks.lookup(self.hashes(seq, (seq.num_tokens - 1) // self.blocks.block_size))

    def register(self, seq: Sequence) -> None:
        """Its blocks that finished steps have filled are cached: nothing writes them again,
        and a later step can share them (this one is done: no step can be mid-way through
        writing them). Nothing, with prefix caching off."""
        if not self.enabled:
            return
        full = seq.num_computed_tokens // self.blocks.block_size
        if full <= seq.num_registered:
            return
        for i, h in enumerate(self.hashes(seq, full)[seq.num_registered :], seq.num_registered):
            self.blocks.register(seq.request_id, i, h)
        seq.num_registered = full
