"""A step's batch as the model takes it: the scheduler's seqs flattened into one
:class:`~fd.engine.model.forward_batch.ForwardBatch` (prefill chunks and decode tokens together), its
rows split into at most two attention groups, single-token ones (decode) and chunks, so a long
prefill does not pad every decode row to its length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fd.engine.core.outputs import ScheduledSeq
from fd.engine.core.sequence import PLACEHOLDER
from fd.engine.model.forward_batch import AttnGroup, ForwardBatch
from fd.engine.model.llama import Llama, attention_mask, key_blocks


def build_batch(
    model: Llama,
    block_size: int,
    seqs: Sequence[ScheduledSeq],
    last_sampled: Mapping[str, int],
    lora_slots: Mapping[str, int],
    scored: list | None = None,
) -> tuple[ForwardBatch, list[ScheduledSeq]]:
    """The flattened batch of a step, and the seqs to sample for (in logits-row order).
    ``last_sampled``: the token the runner sampled for each request in the step just before,
    which a decode's :data:`~fd.engine.core.sequence.PLACEHOLDER` stands for; ``lora_slots``:
    the slot of each adapter loaded. ``scored``, if given, gets ``(seq, position of its first
    scored prompt token, those tokens)`` for each seq scoring its prompt (``prompt_len``):
    their rows' logits follow the sampled ones'.

    All index arrays travel to the device as one buffer and one split (each upload costs
    ~8 µs, a split of the lot ~2 µs), the masks as another.
    """
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    starts: list[int] = []  # first row of each seq
    for s in seqs:
        starts.append(len(ids))
        bt = s.block_table
        if len(s.token_ids) == 1:
            t = s.token_ids[0]
            if t == PLACEHOLDER:
                try:
                    t = last_sampled[s.request_id]
                except KeyError:
                    raise RuntimeError(
                        f"{s.request_id!r}: a placeholder with no token "
                        "sampled for it in the step before (steps out of "
                        "order?)"
                    ) from None
            ids.append(t)
            p = s.start_pos
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
        else:
            ids.extend(s.token_ids)
            p = np.arange(s.start_pos, s.start_pos + len(s.token_ids))
            pos.extend(p.tolist())
            slots.extend((np.asarray(bt)[p // bs] * bs + p % bs).tolist())
    t = len(ids)
    tp = model.pad_rows(t)
    pad = tp - t
    ids.extend([0] * pad)
    pos.extend([0] * pad)
    slots.extend([model.trash_slot] * pad)
    ints: list[np.ndarray] = [np.asarray(ids), np.asarray(pos), np.asarray(slots)]
    masks: list[np.ndarray] = []

    single = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    chunks = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
    out_index = np.zeros(tp, dtype=np.int64)
    shapes = []  # per group: (S, qmax, L, has q_index, host block tables of a decode group)
    offset = 0  # rows of the concatenated group outputs so far
    identity = True
    for members in (single, chunks):
        if not members:
            continue
        qlens = [len(seqs[i].token_ids) for i in members]
        S, qmax = len(members), max(qlens)
        nb = key_blocks(max(seqs[i].start_pos + q for i, q in zip(members, qlens, strict=False)), bs)
        L = nb * bs
        tables = np.zeros((S, nb), dtype=np.int64)  # padding gathers block 0: masked anyway
        for r, i in enumerate(members):
            bt = seqs[i].block_table[:nb]
            tables[r, : len(bt)] = bt
        if qmax == 1:
            q_index = np.asarray([starts[i] for i in members])
            qpos = np.asarray([seqs[i].start_pos for i in members])[:, None]
            out_index[q_index] = offset + np.arange(S)
        else:
            q_index = np.zeros((S, qmax), dtype=np.int64)
            qpos = np.full((S, qmax), -1, dtype=np.int64)
            for r, (i, q) in enumerate(zip(members, qlens, strict=False)):
                q_index[r, :q] = np.arange(starts[i], starts[i] + q)
                qpos[r, :q] = np.arange(seqs[i].start_pos, seqs[i].start_pos + q)
                out_index[starts[i] : starts[i] + q] = offset + r * qmax + np.arange(q)
        q_index = q_index.reshape(-1)
        same = len(q_index) == tp and np.array_equal(q_index, np.arange(tp))
        identity = identity and same and not shapes
        if not same:
            ints.append(q_index)
        ints.append(tables.reshape(-1))
        masks.append(attention_mask(qpos, L, model.cfg.sliding_window).reshape(-1))
        # every query row's own context on the host, as the attention kernels read it in place
        # (fd/engine/model/cpu_attention.py): its table, its row of q, its length (padding: 1)
        host = (np.repeat(tables, qmax, axis=0), q_index, np.maximum(qpos.reshape(-1) + 1, 1))
        shapes.append((S, qmax, L, not same, host))
        offset += S * qmax
    identity = identity and offset == tp
    if not identity:
        ints.append(out_index)
    sampled = [s for s in seqs if s.sample]
    rows = [starts[i] + len(s.token_ids) - 1 for i, s in enumerate(seqs) if s.sample]
    if scored is not None:
        for i, s in enumerate(seqs):
            if not s.prompt_len:
                continue
            # position t scores prompt token t + 1: the chunk's own next tokens, then the
            # one after the chunk; the prompt's last position scores no prompt token
            end = min(s.start_pos + len(s.token_ids), s.prompt_len - 1)
            if end <= s.start_pos:
                continue
            targets = list(s.token_ids[1 : end - s.start_pos + 1])
            if len(targets) < end - s.start_pos:
                targets.append(s.prompt_next)
            rows.extend(range(starts[i], starts[i] + end - s.start_pos))
            scored.append((s, s.start_pos + 1, targets))
    rows.extend([0] * (model.pad_rows(len(rows)) - len(rows)))
    ints.append(np.asarray(rows))

    it = iter(model.upload(ints, np.int64))
    mt = iter(model.upload(masks, np.float32))
    input_ids, positions, slot_mapping = next(it), next(it), next(it)
    groups = []
    for S, qmax, L, has_q, host in shapes:
        q_index = next(it) if has_q else None
        groups.append(
            AttnGroup(
                num_seqs=S,
                max_q=qmax,
                num_keys=L,
                q_index=q_index,
                ctx_blocks=next(it),
                mask=next(mt).reshape([S, 1, qmax, 1, L]),
                tables=host[0],
                rows=host[1],
                lens=host[2],
            )
        )
    out_idx = None if identity else next(it)
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        groups=groups,
        out_index=out_idx,
        logits_index=next(it),
        lora=_lora_rows(model, lora_slots, seqs, starts),
    )
    return batch, sampled


def _lora_rows(
    model: Llama, lora_slots: Mapping[str, int], seqs: Sequence[ScheduledSeq], starts: list[int]
) -> tuple:
    """Each adapter of the batch and its requests' token rows (none: the base model only)."""
    rows: dict[int, list[int]] = {}
    for s, start in zip(seqs, starts, strict=False):
        if s.sampling.lora:
            try:
                slot = lora_slots[s.sampling.lora]
            except KeyError:
                raise RuntimeError(f"{s.request_id!r}: no LoRA adapter {s.sampling.lora!r} here") from None
            rows.setdefault(slot, []).extend(range(start, start + len(s.token_ids)))
    if not rows:
        return ()
    return tuple(zip(rows, model.upload([np.asarray(r) for r in rows.values()], np.int64), strict=False))
