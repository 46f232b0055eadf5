"""aiohttp's log of requests it could not parse, one line each.

A body that does not decompress (bad gzip or deflate) and a request line or header over
aiohttp's limit are answered 400 (by aiohttp itself, or by the error middleware for a body the
handler was reading); aiohttp also logs each at ERROR with a traceback on ``aiohttp.server``:
"Error handling request" from its parser, "Unhandled exception" when it drains the rest of a
body that failed to decode. A client's malformed request is not a server fault, and a client
that sends many would fill the log with tracebacks. :class:`ParseErrorsOneLine`, a filter on
that logger, turns those records into one WARNING line that says what was wrong; every other
record of the logger passes as it is.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

LOGGER = "aiohttp.server"
MAX_DETAIL = 300


def _parse_error(exc: BaseException | None) -> HttpProcessingError | None:
    """The parse error behind ``exc`` (itself, or what caused it), if there is one."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, HttpProcessingError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class ParseErrorsOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        bad = _parse_error(exc)
        if bad is None:
            return True
        detail = " ".join(str(bad.message or type(bad).__name__).split())[:MAX_DETAIL]
        peer = record.args[0] if record.args and isinstance(record.args, tuple) else None
        record.msg = "malformed request%s answered %d: %s"
        record.args = (f" from {peer}" if peer else "", bad.code or 400, detail)
        record.exc_info = record.exc_text = None
        record.stack_info = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_FILTER = ParseErrorsOneLine()


def install() -> None:
    """Put the filter on aiohttp's server logger (once, however many API nodes start)."""
    logger = logging.getLogger(LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
