"""GGUF files converted once into HF directories under a cache, for ``--model FILE.gguf``.

Converting dequantizes every tensor (seconds for a small model, minutes for a large one), so
the result is kept: under ``<cache>/gguf/<key>/<model name>/``, where the key hashes the
file's real path, size and modification time and the converter's version (a changed file, or
a fixed converter, converts again), and the last part is the name the model is served under.
A conversion is written into a temporary directory beside its place and renamed into it when
complete, so a crash or a second process converting the same file never leaves half a model
where a reader would take it for whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from fd.engine.model.gguf import GGUFCheckpoint, model_name

#: Bumped whenever a conversion would come out different, so old cached ones are not reused.
CONVERTER_VERSION = 2  # (2: config.json names the GGUF's weight types, "fd_gguf")


def cached_path(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """Where ``gguf_file``'s conversion lives (whether or not it is there yet)."""
    real = os.path.realpath(gguf_file)
    st = os.stat(real)
    key = hashlib.sha256(f"{CONVERTER_VERSION}\0{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[
        :16
    ]
    return Path(cache_dir) / "gguf" / key / model_name(real)


def cached_hf_dir(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The HF directory of ``gguf_file``, converted on first use."""
    target = cached_path(gguf_file, cache_dir)
    if (target / "config.json").exists():
        return target
    ckpt = GGUFCheckpoint(os.fspath(gguf_file))  # (refuses what it cannot convert before writing)
    print(f"converting {gguf_file} into {target} (once) ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ckpt.write_hf_dir(os.fspath(tmp), progress=progress)
        try:
            os.rename(tmp, target)
        except OSError:  # (another process finished first: its conversion is the same)
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
