"""The identity of a run of prompt tokens, shared by the engines' prefix cache and the API's
placement: a full block's hash covers its tokens and, through the hash of the block before it,
every token before them, so two prompts meet on a block only if they agree up to its end.

The engine keys its cache by these hashes (fd/engine/core/block_manager.py) and publishes the
first eight bytes of each in its placement card (fd/control/lanes.py); the API hashes a new
prompt the same way and finds, per engine, how many of its leading blocks that engine holds.
One definition, so the two can never drift apart.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The identity of a block's contents: its tokens and (through ``parent``, the hash of the
    block before it, ``b""`` for the first) every token before them. A 128-bit digest, so two
    different prefixes do not meet by accident (Python's ``hash`` is 64 bits and can be made
    to collide)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def chain_root(lora: str | None) -> bytes:
    """The parent of a request's first block: a LoRA adapter's KV differs from the base
    model's, so its chain starts from its name."""
    return block_hash(b"lora\0" + lora.encode(), ()) if lora else b""


def chain(
    token_ids: Sequence[int], block_size: int, lora: str | None = None, limit: int | None = None
) -> list[bytes]:
    """The hashes of the leading full blocks of ``token_ids`` (at most ``limit``)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[bytes] = []
    parent = chain_root(lora)
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def short(h: bytes) -> int:
    """The 64-bit id of a block hash that a placement card carries (its first eight bytes)."""
    return int.from_bytes(h[:8], "little")


def pack(ids: Iterable[int]) -> bytes:
    """Short ids as a card carries them: eight bytes each."""
    return array("Q", ids).tobytes()


def unpack(blob: bytes) -> frozenset[int]:
    """:func:`pack` read back (a trailing partial id, from a writer of another kind, is
    ignored)."""
    usable = len(blob) - len(blob) % 8
    return frozenset(array("Q", blob[:usable]))


def held(chain_ids: Sequence[int], ids: frozenset[int]) -> int:
    """How many leading blocks of a chain (short ids) ``ids`` holds."""
    n = 0
    for h in chain_ids:
        if h not in ids:
            break
        n += 1
    return n
