"""How the operator's commands on this machine find a running ``fd serve`` on its embedded
control plane, whose port is chosen at random: the server writes a small JSON file per key
prefix once it listens (``{"redis_url", "api_url", "pid"}``) and removes it when it stops, so
``fd status``, ``fd trace`` and ``fd abort`` need no ``--redis-url`` there.

The folder is ``$FD_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/fd``, else ``~/.cache/fd/run``. A
file whose server is gone (killed, so it could not remove it) is ignored and removed by the
next reader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import orjson


def runtime_dir() -> Path:
    if os.environ.get("FD_RUNTIME_DIR"):
        return Path(os.environ["FD_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "fd"
    return Path.home() / ".cache" / "fd" / "run"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        return True
    return True


@dataclass(frozen=True)
class LocalServe:
    """The record of one ``fd serve`` under a key prefix."""

    prefix: str

    @property
    def path(self) -> Path:
        return runtime_dir() / f"serve-{self.prefix}.json"

    def write(self, redis_url: str, api_url: str) -> None:
        """Say where this process's control plane is (the last ``fd serve`` started wins)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(orjson.dumps({"redis_url": redis_url, "api_url": api_url, "pid": os.getpid()}))
        tmp.replace(self.path)  # (readers see the old file or the new one, never half of one)

    def remove(self) -> None:
        """Take this process's record away (not one a later ``fd serve`` wrote over it)."""
        if self._read().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def redis_url(self) -> str | None:
        """The control plane of a live ``fd serve`` under this prefix, or None."""
        rec = self._read()
        pid, url = rec.get("pid"), rec.get("redis_url")
        if not isinstance(pid, int) or not isinstance(url, str):
            return None
        if not _alive(pid):
            self.path.unlink(missing_ok=True)
            return None
        return url

    def _read(self) -> dict:
        try:
            rec = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return rec if isinstance(rec, dict) else {}
