"""Load an HF-format model directory (config.json + safetensors) into :class:`Llama`.

Safetensors is read with a small reader of its own (header JSON + a memory map) rather than
``safetensors.numpy``, because numpy has no bfloat16 and most checkpoints are bf16: those are
widened to float32 here by a bit shift. Every expected tensor is checked by name and shape
before anything is built, so a wrong checkpoint fails with the tensor's name, not deep inside
a matmul.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from fd.control.logs import progress as progress_of
from fd.engine.model.checkpoint_layout import expected_shapes, fused_parts
from fd.engine.model.config import ModelConfig
from fd.engine.model.llama import Llama

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class WeightError(ValueError):
    pass


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """The tensor table of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _tensor(mm: np.memmap, base: int, info: dict) -> np.ndarray:
    dtype = info["dtype"]
    if dtype not in _DTYPES:
        raise WeightError(f"unsupported safetensors dtype {dtype}")
    start, end = info["data_offsets"]
    a = np.frombuffer(
        mm,
        dtype=_DTYPES[dtype],
        count=(end - start) // np.dtype(_DTYPES[dtype]).itemsize,
        offset=base + start,
    ).reshape(info["shape"])
    if dtype == "BF16":  # the high half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        for p in files:
            if not os.path.exists(p):
                raise FileNotFoundError(
                    f"missing {os.path.basename(p)} (listed in model.safetensors.index.json) in {model_dir}"
                )
        return files
    if os.path.exists(single):
        return [single]
    shards = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if shards:
        return [os.path.join(model_dir, n) for n in shards]
    raise FileNotFoundError(f"missing model.safetensors (or *.safetensors shards) in {model_dir}")


def load_weights(model_dir: str, cfg: ModelConfig, progress: bool = True) -> dict[str, np.ndarray]:
    """The float32 weights the model needs, by HF name, each checked against its shape."""
    want = expected_shapes(cfg)
    where: dict[str, tuple[str, dict, int]] = {}
    for path in weight_files(model_dir):
        header, base = read_safetensors_header(path)
        for name, info in header.items():
            where[name] = (path, info, base)
    parts = {n: p for n, p in fused_parts(cfg).items() if n not in where and p[0] in where}
    ends: dict[str, int] = {}
    for name, (fused, start, end) in parts.items():  # (Phi-3: rows of a fused tensor)
        ends[fused] = max(ends.get(fused, 0), end)
        cols = where[fused][1]["shape"][-1]
        where[name] = (where[fused][0], {**where[fused][1], "shape": [end - start, cols]}, where[fused][2])
    for fused, rows in ends.items():
        if where[fused][1]["shape"][0] != rows:
            raise WeightError(f"tensor {fused} has shape {where[fused][1]['shape']}, expected {rows} rows")
    missing = [n for n in want if n not in where]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightError(f"missing tensor {missing[0]}{more} in {model_dir}")
    for name, shape in want.items():
        got = tuple(where[name][1]["shape"])
        if got != shape:
            raise WeightError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
    out: dict[str, np.ndarray] = {}
    maps: dict[str, np.memmap] = {}
    last: tuple[str, np.ndarray | None] = ("", None)  # the fused tensor read last
    # (a bar on a terminal, JSON progress records with --log-format json, else nothing)
    names = progress_of(want, "loading weights", len(want), unit="tensor") if progress else want
    for name in names:
        path, info, base = where[name]
        if path not in maps:
            maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        if name in parts:
            fused, start, end = parts[name]
            if last[0] != fused:  # (its parts come one after another: read it once)
                last = (fused, _tensor(maps[path], base, where[fused][1]))
            out[name] = last[1][start:end]
        else:
            out[name] = _tensor(maps[path], base, info)
    return out


def load_model(
    model_dir: str,
    device: str = "cpu",
    progress: bool = True,
    batch_invariant: bool = False,
    gemms: str = "eager",
    weight_format: str = "float32",
) -> Llama:
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    return Llama(
        cfg,
        load_weights(model_dir, cfg, progress),
        device,
        batch_invariant=batch_invariant,
        gemms=gemms,
        weight_format=weight_format,
    )
