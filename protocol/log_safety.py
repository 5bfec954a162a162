"""Logging that a client cannot abuse: every record is one line of bounded length, and repeated loop errors
(accept() out of file descriptors, say) are rate limited.

Clients put strings into the log (request ids, field names, paths, messages quoting a value). `OneBoundedLine`
sits on the handlers and rewrites each record's message and string arguments: control characters (a newline
would forge a log line) are escaped, and each is cut at MAX_LOGGED_CHARS with a marker saying how much was left
out. It sits on the
handlers, not the loggers, because a logger's filter does not see the records its children propagate.

`RateLimitedLoopErrors` is the event loop's exception handler: the first error of each kind is logged in full,
repeats at most once per `interval_s` with a count of those left out. asyncio reports a failing accept() (out of
file descriptors) on every loop turn that retries it; unbounded, that wrote hundreds of MB a minute.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

MAX_LOGGED_CHARS = 2000  # a message, or one argument of it (a traceback, added by the formatter, is not cut)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029\x85]|\n|\r")


def bounded_line(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` as one line of at most `limit` characters (plus the marker): control characters escaped."""
    cut = len(text) > limit
    shown = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text[:limit])
    return shown + (f" …[{len(text) - limit} more characters not logged]" if cut else "")


class OneBoundedLine(logging.Filter):
    """A handler filter: the record's message and each of its string arguments become bounded lines (the
    arguments are kept apart: uvicorn's access formatter reads them by position)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = bounded_line(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(bounded_line(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: bounded_line(a) if isinstance(a, str) else a for k, a in record.args.items()}
        return True


def install_log_safety(loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Put OneBoundedLine on every handler of these loggers (the root's, uvicorn's), once."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, OneBoundedLine) for f in handler.filters):
                handler.addFilter(OneBoundedLine())


class RateLimitedLoopErrors:
    """An event loop exception handler: each kind of error (its message) is logged by the loop's default
    handler the first time, then at most once per `interval_s`, saying how many were left out meanwhile."""

    def __init__(self, interval_s: float = 10.0, clock: Any = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        kind = str(context.get("message", ""))[:200]
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            context = {**context, "message": f"{kind} ({left_out} more like it in the last {self.interval_s:.0f}s "
                                             "not logged)"}
        loop.default_exception_handler(context)
