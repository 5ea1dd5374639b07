"""Logging for our aiohttp servers: a malformed request is one short line, and few of them.

aiohttp's server logs every request it cannot parse (not even HTTP: ``b"GARBAGE\\r\\n\\r\\n"``, a
header line without a colon, an oversized line) as ``Error handling request from <address>``
with the parser's full traceback, at ERROR (aiohttp 3.14 logs a bad method on a connection's
first request at DEBUG, everything else at ERROR).  Anyone who can reach the port can so write
about 30 lines to the log per request sent: a flood fills disks and buries what matters.

:func:`install` (called by ``meridian-agent`` and ``meridian-controller`` right after they
configure logging) adds a :class:`MalformedRequests` filter to the ``aiohttp.server`` logger.
It rewrites such a record into one line at INFO (it is the client's fault, not the server's)::

    malformed HTTP request from 127.0.0.1 (BadHttpMessage: 400, message: Invalid header ...)

and lets at most one through per client address per ``interval_s`` (60 s), and at most
``burst`` (10) per ``interval_s`` from all addresses together (a client with many addresses
is limited too).  The ones it drops are counted, and the next line it lets through says how
many (``; 199 more malformed requests not logged since the last such line``).  Records of
every other kind (a handler's own failure) are left as they are.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

SERVER_LOGGER = "aiohttp.server"
_MAX_ADDRESSES = 4096  # addresses remembered; the oldest is forgotten first
_MAX_REASON = 160  # characters of the parser's message kept in the line


def _malformed(exc: BaseException | None) -> bool:
    """Whether ``exc`` is aiohttp's parser refusing the request (``HttpProcessingError`` and its
    subclasses: ``BadHttpMessage``, ``BadHttpMethod``, ``LineTooLong``, ``InvalidHeader``...).
    Matched by name: servers import nothing of aiohttp but ``aiohttp.web``."""
    if exc is None:
        return False
    return any(
        c.__name__ == "HttpProcessingError" and c.__module__.startswith("aiohttp")
        for c in type(exc).__mro__
    )


def _one_line(text: str) -> str:
    """The parser's message on one line, printable ASCII, at most ``_MAX_REASON`` characters:
    it quotes what the client sent."""
    flat = " ".join(text.split()).encode("ascii", "backslashreplace").decode("ascii")
    return flat if len(flat) <= _MAX_REASON else flat[: _MAX_REASON - 3] + "..."


class MalformedRequests(logging.Filter):
    """Malformed-request records of ``aiohttp.server`` as one line each, rate-limited (see the
    module docstring); ``clock`` is for tests."""

    def __init__(
        self,
        *,
        interval_s: float = 60.0,
        burst: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()  # address -> when its last line was
        self._window_start = float("-inf")
        self._window_lines = 0
        self.dropped = 0  # since the last line let through
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not _malformed(exc):
            return True
        assert exc is not None
        args = record.args if isinstance(record.args, tuple) else ()
        address = str(args[0]) if args else "an unknown address"
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._window_start, self._window_lines = now, 0
        last = self._last.get(address)
        if (last is not None and now - last < self.interval_s) or self._window_lines >= self.burst:
            self.dropped += 1
            self.dropped_total += 1
            return False
        self._last[address] = now
        self._last.move_to_end(address)
        while len(self._last) > _MAX_ADDRESSES:
            self._last.popitem(last=False)
        self._window_lines += 1
        reason = _one_line(f"{type(exc).__name__}: {exc}")
        more = (
            f"; {self.dropped} more malformed requests not logged since the last such line"
            if self.dropped
            else ""
        )
        self.dropped = 0
        record.msg = "malformed HTTP request from %s (%s)%s"
        record.args = (address, reason, more)
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        if record.levelno > logging.INFO:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def install(*, interval_s: float = 60.0, burst: int = 10) -> MalformedRequests:
    """Add :class:`MalformedRequests` to the ``aiohttp.server`` logger, once: a second call
    returns the filter already there."""
    logger = logging.getLogger(SERVER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, MalformedRequests):
            return existing
    installed = MalformedRequests(interval_s=interval_s, burst=burst)
    logger.addFilter(installed)
    return installed


def uninstall(installed: MalformedRequests) -> None:
    """Remove a filter :func:`install` added (tests)."""
    logging.getLogger(SERVER_LOGGER).removeFilter(installed)


# -- OTLP export problems ----------------------------------------------------------------------

# The loggers of OpenTelemetry's OTLP exporters and of the SDK's batching and periodic readers:
# each logs every failed export (a collector down: one line per batch and one per retry, with
# a traceback now and then) and the span processor a line per span dropped from a full queue.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp",
    "opentelemetry.exporter.http",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.sdk.trace.export",
)


class OncePerInterval(logging.Filter):
    """Lets one record through per ``interval_s`` of all the loggers it is on together, as
    one line (an exception becomes ``(Type: message)``, no traceback), and counts the others:
    the next line it lets through says how many it left out.  ``clock`` is for tests."""

    def __init__(
        self, *, what: str, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.what = what
        self.interval_s = interval_s
        self._clock = clock
        self._last = float("-inf")
        self.dropped = 0  # since the last line let through
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now - self._last < self.interval_s:
            self.dropped += 1
            self.dropped_total += 1
            return False
        self._last = now
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            text += f" ({type(exc).__name__}: {exc})"
        more = (
            f"; {self.dropped} more {self.what} lines not logged in the last {self.interval_s:g}s"
            if self.dropped
            else ""
        )
        self.dropped = 0
        record.msg = "%s: %s%s"
        flat = " ".join(text.split())
        record.args = (self.what, flat if len(flat) <= 400 else flat[:397] + "...", more)
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


_export_filter: OncePerInterval | None = None


def install_export_filter(*, interval_s: float = 60.0) -> OncePerInterval:
    """One :class:`OncePerInterval` (``OTLP export``) for the whole process, on every logger
    created so far under :data:`EXPORT_LOGGERS` (a logger's filters see only its own records,
    so each one gets it); call it again after importing an exporter to cover its loggers."""
    global _export_filter
    if _export_filter is None:
        _export_filter = OncePerInterval(what="OTLP export", interval_s=interval_s)
    names = [*EXPORT_LOGGERS, *logging.Logger.manager.loggerDict]
    for name in names:
        if any(name == p or name.startswith(p + ".") for p in EXPORT_LOGGERS):
            logger = logging.getLogger(name)
            if _export_filter not in logger.filters:
                logger.addFilter(_export_filter)
    return _export_filter
