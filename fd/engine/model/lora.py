"""LoRA adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), as
vLLM's ``--lora-modules`` serves them: each adapted projection ``W`` becomes ``W + s·B·A``
(``s = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) for the requests that name the adapter,
while the rest of the batch runs the base model.

Only what a plain LoRA of the attention and MLP projections needs is taken; anything else an
adapter asks for (DoRA, biases, a new embedding or head, ``fan_in_fan_out``) is refused when it
is loaded, by name, instead of being served wrong.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from fd.engine.model.config import ModelConfig
from fd.engine.model.loader import WeightError, read_safetensors_header, read_tensor

#: The projections an adapter may change, and their (input, output) sizes.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(input, output) features of a projection."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scale: float
    # per layer: module -> (A [r, in], B [out, r]), as PEFT stores them
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int | None = None) -> Adapter:
    path = os.fspath(path)
    conf_path = os.path.join(path, "adapter_config.json")
    if not os.path.exists(conf_path):
        raise FileNotFoundError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    with open(conf_path, encoding="utf-8") as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise WeightError(f"LoRA adapter {name!r}: peft_type {conf['peft_type']!r} is not LORA")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if conf.get(key, ok) not in (ok, None):
            raise WeightError(f"LoRA adapter {name!r}: {key}={conf[key]!r} is not supported")
    if conf.get("modules_to_save"):
        raise WeightError(
            f"LoRA adapter {name!r}: modules_to_save {conf['modules_to_save']} is not "
            "supported (only LoRA of the attention and MLP projections)"
        )
    rank = int(conf.get("r", 8))
    if max_rank is not None and rank > max_rank:
        raise WeightError(f"LoRA adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}")
    alpha = float(conf.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise FileNotFoundError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    header, base = read_safetensors_header(file)
    layers: list[dict[str, list]] = [{} for _ in range(cfg.num_hidden_layers)]
    for key, info in header.items():
        m = _KEY.match(key.replace(".default.", "."))
        if m is None:
            raise WeightError(
                f"LoRA adapter {name!r}: tensor {key} is not a LoRA of a projection "
                f"({', '.join(MODULES)}) of a decoder layer"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES or layer >= cfg.num_hidden_layers:
            raise WeightError(f"LoRA adapter {name!r}: tensor {key} names no projection of this model")
        if layer in cfg.sparse_layers and module in ("gate_proj", "up_proj", "down_proj"):
            raise WeightError(
                f"LoRA adapter {name!r}: tensor {key} adapts an MLP that is experts in this "
                "model (LoRA of experts is not supported)"
            )
        fan_in, fan_out = module_shape(cfg, module)
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(info["shape"]) != want:
            raise WeightError(
                f"LoRA adapter {name!r}: tensor {key} has shape {info['shape']}, expected {list(want)}"
            )
        layers[layer].setdefault(module, [None, None])["AB".index(which)] = read_tensor(file, base, info)
    out: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    for n, mods in enumerate(layers):
        for module, (a, b) in mods.items():
            if a is None or b is None:
                raise WeightError(
                    f"LoRA adapter {name!r}: layer {n} {module} has lora_{'A' if a is None else 'B'} missing"
                )
        out.append({k: (v[0], v[1]) for k, v in mods.items()})
    if not any(out):
        raise WeightError(f"LoRA adapter {name!r}: no LoRA tensors in {file}")
    return Adapter(name, path, rank, scale, out)


def save_adapter(
    path: str,
    cfg: ModelConfig,
    rank: int,
    alpha: float,
    seed: int = 0,
    modules: tuple[str, ...] = MODULES,
    std: float = 0.05,
) -> None:
    """A random adapter in PEFT's format (tests and benchmarks: no adapter can be downloaded)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for n in range(cfg.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = module_shape(cfg, module)
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{n}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, std, (rank, fan_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, std, (fan_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": alpha,
                "target_modules": list(modules),
                "bias": "none",
                "fan_in_fan_out": False,
            },
            f,
        )
