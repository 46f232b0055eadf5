"""Load an HF-format model directory (config.json + safetensors) into :class:`Llama`.

Safetensors is read with a small reader of its own (header JSON + a read per tensor) rather
than ``safetensors.numpy``, because numpy has no bfloat16 and most checkpoints are bf16: those
are widened to float32 here by a bit shift. Every expected tensor is checked by name and shape
before anything is built, so a wrong checkpoint fails with the tensor's name, not deep inside
a matmul. The model then reads each tensor as it takes it (:class:`Checkpoint`), so a model
held in fewer bytes never holds the float32 checkpoint whole: loading the default model peaked
at ~1.5 GB of RSS with it read up front, against ~1.0 GB held after.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

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


def read_tensor(path: str, base: int, info: dict) -> np.ndarray:
    """One tensor of a safetensors file (its data from ``base``), as float32."""
    dtype = info["dtype"]
    if dtype not in _DTYPES:
        raise WeightError(f"unsupported safetensors dtype {dtype}")
    start, end = info["data_offsets"]
    count = (end - start) // np.dtype(_DTYPES[dtype]).itemsize
    a = np.fromfile(path, dtype=_DTYPES[dtype], count=count, offset=base + start)
    if a.size != count:
        raise WeightError(f"{path} ends inside a tensor ({os.path.getsize(path)} bytes): a partial download?")
    a = a.reshape(info["shape"])
    if dtype == "BF16":  # the high half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


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


class Checkpoint(Mapping[str, np.ndarray]):
    """The float32 weights a model needs, by HF name, each read from its file when asked (a
    fused tensor's parts, asked one after another, from one read), with the last one kept for
    a second ask (a tied head's)."""

    def __init__(
        self,
        where: dict[str, tuple[str, dict, int]],
        parts: dict[str, tuple[str, int, int]],
        want: dict[str, tuple[int, ...]],
        progress: bool,
    ):
        self._where, self._parts, self._want = where, parts, want
        self._last: tuple[str, np.ndarray] | None = None
        self._told: set[str] = set()  # the tensors read so far, for the progress
        # (a bar on a terminal, JSON progress records with --log-format json, else nothing):
        # one step a tensor read
        self._ticks = (
            iter(progress_of(range(len(want)), "loading weights", len(want), unit="tensor"))
            if progress
            else None
        )

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._want:
            raise KeyError(name)
        fused, start, end = self._parts.get(name, (name, 0, 0))
        if self._last is None or self._last[0] != fused:
            path, info, base = self._where[fused]
            self._last = (fused, read_tensor(path, base, info))
        if self._ticks is not None and name not in self._told:
            self._told.add(name)
            next(self._ticks, None)
            if len(self._told) == len(self._want):
                for _ in self._ticks:  # (the bar's end: the last record, the bar closed)
                    pass
        return self._last[1][start:end] if name in self._parts else self._last[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._want)

    def __len__(self) -> int:
        return len(self._want)


def open_checkpoint(model_dir: str, cfg: ModelConfig, progress: bool = True) -> Checkpoint:
    """The weights of ``model_dir`` that ``cfg``'s model needs, each checked by name and shape
    now and read when asked."""
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
    return Checkpoint(where, parts, want, progress)


def load_weights(model_dir: str, cfg: ModelConfig, progress: bool = True) -> dict[str, np.ndarray]:
    """Every weight :func:`open_checkpoint` gives, read now (a caller that edits them)."""
    return dict(open_checkpoint(model_dir, cfg, progress))


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
        open_checkpoint(model_dir, cfg, progress),
        device,
        batch_invariant=batch_invariant,
        gemms=gemms,
        weight_format=weight_format,
    )
