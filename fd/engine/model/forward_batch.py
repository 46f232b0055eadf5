"""What a step hands the model (fd/engine/model/llama.py's ``Llama.hidden``): the batch's rows
flattened, their attention groups, and the question an abort asks between layers. Built by
fd/engine/runner/batch.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle


@dataclass(slots=True)
class AttnGroup:
    """Sequences whose attention runs as one padded batch: [S, Qmax] queries x [S, L] keys."""

    num_seqs: int
    max_q: int
    num_keys: int  # L = blocks per sequence * block_size
    q_index: paddle.Tensor | None  # [S*Qmax] token rows, or None when the rows are already laid out
    ctx_blocks: paddle.Tensor  # [S*L/block_size] each sequence's KV blocks, padded with any block
    mask: paddle.Tensor  # [S, 1, Qmax, 1, L] additive: 0 or MASKED
    # Each query row's context on the host, for attention that reads it in place
    # (fd/engine/model/cpu_attention.py), int64: [S*Qmax, L/block_size] its sequence's blocks,
    # [S*Qmax] its token row and its context length (position + 1; a padding row: 1)
    tables: np.ndarray | None = None
    rows: np.ndarray | None = None
    lens: np.ndarray | None = None


@dataclass(slots=True)
class ForwardBatch:
    input_ids: paddle.Tensor  # [Tp], Tp = pad_rows(T)
    positions: paddle.Tensor  # [Tp]
    slot_mapping: paddle.Tensor  # [Tp]; padding rows write the trash slot
    groups: list[AttnGroup]
    out_index: paddle.Tensor | None  # [Tp] rows of the concatenated group outputs, or None
    logits_index: paddle.Tensor  # [Np] rows to compute logits for, Np a multiple of ROW_ALIGN
    # LoRA adapters of the batch: (slot, the token rows of its requests); empty: the base only
    lora: tuple[tuple[int, paddle.Tensor], ...] = ()
    # Asked before each layer writes its KV: a new slot mapping when the step is to stop
    # writing some requests' blocks (their rows then write the trash slot), else None
    # (fd/engine/runner/step_cut.py: an abort that lands while the step runs)
    new_slots: Callable[[], paddle.Tensor | None] | None = None
