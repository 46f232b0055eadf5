"""Stream entry ids (``<ms>-<seq>``) as numbers, so that readers can order and compare them.

Redis hands entry ids back as ``bytes``; callers and people write them as ``str``, sometimes
without the sequence part (``"12"``). Every reader's cursor is compared through
:func:`entry_id_key`, so all these spellings of one id compare equal.
"""

from __future__ import annotations


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def entry_id_key(entry_id: bytes | str) -> tuple[int, int]:
    """Stream entry ids as sortable numbers (``b"12-3"`` -> ``(12, 3)``; ``"12"`` -> ``(12, 0)``)."""
    ms, _, seq = _b(entry_id).partition(b"-")
    return int(ms), int(seq or 0)


def normal_entry_id(entry_id: bytes | str) -> bytes:
    """``entry_id`` spelled as Redis spells it (``b"<ms>-<seq>"``); ValueError for anything else."""
    try:
        ms, seq = entry_id_key(entry_id)
    except ValueError:
        raise ValueError(f"not a stream entry id: {entry_id!r}") from None
    return b"%d-%d" % (ms, seq)


def ts_of_entry_id(entry_id: str | bytes | None) -> int:
    """The millisecond part of an entry id (0 for none, or for one that is not an id): the
    ``ts`` of an event typed without one."""
    if entry_id is None:
        return 0
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    try:
        return int(entry_id.split("-", 1)[0])
    except ValueError:
        return 0
