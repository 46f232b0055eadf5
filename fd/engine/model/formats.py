"""What the model's dense weights are held and computed in: the formats, and what vLLM's
``--quantization`` and ``--dtype`` come to for a checkpoint. Apart from the kernels
(fd/engine/model/qgemm.py), so the processes that do not run the model (the CLI, the engine's
loop, the API) decide without loading Paddle."""

from __future__ import annotations

#: what the dense layers' and the head's weights may be held and computed in
WEIGHT_FORMATS = ("float32", "int8", "int4", "bfloat16")


#: vLLM's ``--quantization`` values fd serves (None: not given)
QUANTIZATIONS = ("none", "int8", "gguf")
#: GGUF types whose values the int8 format holds exactly (8-bit blocks of 32, or wider)
_EXACT_IN_INT8 = frozenset({"Q8_0", "F32", "F16", "BF16"})
#: GGUF types the int4 format holds exactly: ``d * q + m`` blocks of 32 with fp16 d and m (Q4_0's
#: are, m = -8 d; Q4_K's sub-blocks have scales of fp16 times 6 bits, which fp16 does not hold)
_EXACT_IN_INT4 = frozenset({"Q4_0", "Q4_1"})


def choose_format(
    quantization: str | None, dtype: str, gguf_types: tuple[str, ...]
) -> tuple[str, str | None]:
    """vLLM's ``--quantization`` and ``--dtype`` against the checkpoint (``gguf_types``: a
    converted GGUF's weight types, () for any other): the weight format
    (:data:`WEIGHT_FORMATS`), and a note where it is not literally what
    was asked. ``--quantization`` not given and ``--dtype auto`` serve a GGUF in its own
    quantization and any other checkpoint in float32; ``none`` is float32 whatever the file."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {quantization}: not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "int8":
        return "int8", None
    if quantization == "gguf" or quantization is None and dtype == "auto" and gguf_types:
        if not gguf_types:
            raise ValueError("--quantization gguf serves a GGUF's own weights: give a .gguf model")
        four = set(gguf_types) & _EXACT_IN_INT4
        coarser = sorted(set(gguf_types) - _EXACT_IN_INT8 - four)
        note = (
            f"the GGUF's {', '.join(coarser)} blocks are computed as 8-bit blocks (int8), which hold "
            "their values to within 1/254 of each block's largest"
            if coarser
            else None
        )
        # (int4 holds each weight that is 4-bit blocks as they are, and the rest in int8)
        return ("int4" if four else "int8"), note
    if dtype == "bfloat16":
        return "bfloat16", None
    if dtype in ("half", "float16"):
        return "bfloat16", f"--dtype {dtype}: a CPU computes half precision in bfloat16"
    return "float32", None
