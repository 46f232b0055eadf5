"""Logging set-up shared by every fd process: plain text for people, one JSON object per line
(``--log-format json``) for log pipelines. Extra fields passed with ``extra=`` are kept.

In JSON mode every line a process writes is an object, not only its log records: what is
printed (a banner, a library's ``print``, a traceback) is wrapped as one object a line, and a
model worker, whose Paddle writes to file descriptor 2 from C++, has its descriptors 1 and 2
read through pipes (:func:`setup_logging`'s ``capture_fds``). A progress bar is a tqdm bar on
a terminal, nothing on a pipe, and ``{"event": "progress"}`` records in JSON mode
(:func:`progress`): a shipper never sees a ``\\r``."""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TextIO, TypeVar

import orjson

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
T = TypeVar("T")

#: how often a JSON progress record is written while something loads (and at its start and end)
PROGRESS_EVERY_S = 1.0

# Log records, wrapped prints and pumped lines all go out under this one lock, so two never
# interleave within a line.
_LOCK = threading.RLock()
# What setup_logging was last given: (level, format), for a process this one starts (the model
# worker) to log the same way; None: never set up (library use, tests).
_settings: tuple[str, str] | None = None
_streams: dict[str, TextIO] = {}  # "stdout"/"stderr": where lines really go, once wrapped
# A line on stderr is a warning unless it says it is an error: a CLI's one-line error (``fd
# serve: error: ...``), a traceback's head, an exception's last line.
_ERROR_LINE = re.compile(
    r"(?:fd [\w-]+: )?error\b|Traceback \(most recent call last\)|[\w.]+(?:Error|Exception)\b"
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.processName not in ("MainProcess", None):  # (a model worker, an API process)
            out["process"] = record.processName
        for k, v in vars(record).items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        said = getattr(record, "_in_msg", ())  # (fields the message already says, for a shipper)
        extras = " ".join(
            f"{k}={v}"
            for k, v in vars(record).items()
            if k not in _STD and not k.startswith("_") and k not in said
        )
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{t} {record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            line += f"  {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _json_line(text: str, logger: str, level: str) -> str:
    """``text`` as one JSON line: itself when it already is a JSON object (a child process's
    record, passed through), else wrapped."""
    if text.startswith("{") and text.endswith("}"):
        try:
            if isinstance(orjson.loads(text), dict):
                return text
        except orjson.JSONDecodeError:
            pass
    if level == "warning" and _ERROR_LINE.match(text):
        level = "error"
    rec = {"ts": round(time.time(), 3), "level": level, "logger": logger, "msg": text}
    return orjson.dumps(rec).decode()


def _write(stream: TextIO, line: str) -> None:
    with _LOCK:
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe: the reader is gone, nothing to tell)
            pass


class JsonLines(io.TextIOBase):
    """A text stream (``sys.stdout``/``sys.stderr`` in JSON mode) that writes each line it is
    given as one JSON object on ``target``. ``\\r`` ends a line too (a bar redrawn in place
    would otherwise be one endless line)."""

    def __init__(self, target: TextIO, logger: str, level: str):
        self._target = target
        self._logger = logger
        self._level = level
        self._pending = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")

    @property
    def buffer(self) -> BinaryIO:  # (bytes written here go out as they are: run-batch's JSONL answers)
        return self._target.buffer

    def fileno(self) -> int:  # (faulthandler, subprocess: the real descriptor)
        return self._target.fileno()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with _LOCK:
            text = self._pending + s.replace("\r\n", "\n").replace("\r", "\n")
            *lines, self._pending = text.split("\n")
            for line in lines:
                if line.strip():
                    _write(self._target, _json_line(line.rstrip(), self._logger, self._level))
        return len(s)

    def flush(self) -> None:
        self._target.flush()

    def close_line(self) -> None:
        """Write what is left of an unfinished line (at exit)."""
        with _LOCK:
            if self._pending.strip():
                _write(self._target, _json_line(self._pending.rstrip(), self._logger, self._level))
            self._pending = ""


class _FdPump:
    """File descriptors 1 and 2 of this process through pipes, each line read back by a thread
    and written as JSON on the descriptor's old target: what C++ writes (Paddle's glog, its
    fatal-error banners) is a JSON line too. Undone at exit, after the last line is read."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._saved: list[tuple[int, int]] = []
        for fd, name, level in ((1, "stdout", "info"), (2, "stderr", "warning")):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            saved = os.dup(fd)
            target = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
            _streams[name] = target
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self._saved.append((fd, saved))
            t = threading.Thread(target=self._pump, args=(r, target, name, level), daemon=True)
            t.name = f"fd-log-{name}"
            t.start()
            self._threads.append(t)
        atexit.register(self.stop)

    @staticmethod
    def _pump(r: int, target: TextIO, name: str, level: str) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(r, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).replace(b"\r", b"\n").split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace").rstrip()
                if line.strip():
                    _write(target, _json_line(line, name, level))
        if pending.strip():
            _write(target, _json_line(pending.decode("utf-8", "replace").rstrip(), name, level))
        os.close(r)

    def stop(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        for fd, saved in self._saved:  # (the pipes' last write ends close: the pumps see EOF)
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = []
        for t in self._threads:
            t.join(timeout=2.0)


_pump: _FdPump | None = None


def _wrap_std_streams() -> None:
    """``sys.stdout``/``sys.stderr`` as :class:`JsonLines` over the real streams."""
    for name, level in (("stdout", "info"), ("stderr", "warning")):
        current = getattr(sys, name)
        real = current._target if isinstance(current, JsonLines) else current
        _streams[name] = real
        setattr(sys, name, JsonLines(real, name, level))

    def close_lines() -> None:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(stream, JsonLines):
                stream.close_line()

    atexit.register(close_lines)


def _unwrap_std_streams() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, JsonLines):
            stream.close_line()
            setattr(sys, name, stream._target)
    _streams.clear()


def setup_logging(level: str = "info", fmt: str = "text", *, capture_fds: bool = False) -> None:
    """Log records at ``level`` and above to stderr as ``fmt`` ("text" or "json"); warnings
    (``warnings.warn``) become records of the ``py.warnings`` logger. In JSON mode, what is
    printed becomes JSON lines too: through ``sys.stdout``/``sys.stderr`` here, or, with
    ``capture_fds`` (a model worker, whose libraries write to the descriptors from C++),
    through pipes in place of descriptors 1 and 2."""
    global _settings, _pump
    json_mode = fmt == "json"
    if json_mode and capture_fds:
        if _pump is None:
            _unwrap_std_streams()
            _pump = _FdPump()
        err: TextIO = _streams["stderr"]
    elif json_mode:
        _wrap_std_streams()
        err = _streams["stderr"]
    else:
        _unwrap_std_streams()
        err = sys.stderr
    handler = logging.StreamHandler(err)
    handler.lock = _LOCK  # (a record and a wrapped print never share a line)
    handler.setFormatter(JsonFormatter() if json_mode else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    _settings = (level, fmt)


def settings() -> tuple[str, str] | None:
    """(level, format) as :func:`setup_logging` was last given them, for a process this one
    starts; None if it never was."""
    return _settings


def json_mode() -> bool:
    return _settings is not None and _settings[1] == "json"


def say(text: str, **fields: Any) -> None:
    """A line for the operator on stdout (``fd serve``'s banner): the text as it is, or in JSON
    mode one object with ``fields`` beside it."""
    if not json_mode():
        print(text, flush=True)
        return
    rec = {"ts": round(time.time(), 3), "level": "info", "logger": "fd", "msg": text, **fields}
    _write(_streams.get("stdout", sys.stdout), orjson.dumps(rec, default=str).decode())


def progress(items: Iterable[T], what: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items``, telling how far along they are: a tqdm bar when stderr is a terminal (text
    mode), ``{"event": "progress", "what", "done", "total"}`` records at most every
    :data:`PROGRESS_EVERY_S` (and at the start and the end) in JSON mode, else nothing."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if json_mode():
        yield from _progress_records(items, what, total)
        return
    if sys.stderr.isatty():
        from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs: types-tqdm is not a dependency)

        yield from tqdm(items, desc=what, unit=unit, total=total, leave=False)
        return
    yield from items


def _progress_records(items: Iterable[T], what: str, total: int | None) -> Iterator[T]:
    log = logging.getLogger("fd.progress")

    def record(done: int) -> None:
        log.info(
            "%s: %d/%s",
            what,
            done,
            "?" if total is None else total,
            extra={"event": "progress", "what": what, "done": done, "total": total},
        )

    record(0)
    last, done = time.monotonic(), 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S and done != total:
            record(done)
            last = now
    record(done)


class StatsLine:
    """vLLM's periodic throughput line (``Avg prompt throughput: ... tokens/s, ...``), from
    counters its caller keeps: every :meth:`tick` says what the last interval came to, but
    only while busy — something ran in it, or something runs or waits — so an idle server's
    log stays quiet."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._clock = clock
        self._last = clock()
        self._prompt = self._generation = 0
        self._queries = self._hits = 0

    def tick(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        running: int,
        waiting: int,
        kv_usage: float,
        cache_queries: int,
        cache_hits: int,
        **fields: Any,
    ) -> bool:
        """Log the interval since the last tick (counters are totals so far); whether it did."""
        now = self._clock()
        dt = max(now - self._last, 1e-9)
        prompt, generation = prompt_tokens - self._prompt, generation_tokens - self._generation
        queries, hits = cache_queries - self._queries, cache_hits - self._hits
        self._last, self._prompt, self._generation = now, prompt_tokens, generation_tokens
        self._queries, self._hits = cache_queries, cache_hits
        if not (prompt or generation or running or waiting):
            return False
        hit_rate = hits / queries if queries > 0 else 0.0
        self._log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt / dt,
            generation / dt,
            running,
            waiting,
            kv_usage * 100,
            hit_rate * 100,
            extra={
                "event": "stats",
                "prompt_throughput": round(prompt / dt, 1),
                "generation_throughput": round(generation / dt, 1),
                "running": running,
                "waiting": waiting,
                "kv_cache_usage": round(kv_usage, 4),
                "prefix_cache_hit_rate": round(hit_rate, 4),
                **fields,
            },
        )
        return True
