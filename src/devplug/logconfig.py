"""The one place structlog is configured: JSON to stderr when it is not a terminal, else console.

Event names are dotted (``kubelet.register.complete``); stdout is left to commands' output.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


# Tracebacks as dicts, without local variables: a frame's locals hold whatever it was handling
# (raw config bytes, the environment, request contents), which must not reach a log.
NO_LOCALS = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)


def configure(log_format: str | None = None, level: str = "info") -> None:
    """Configure structlog for the process. ``log_format`` None picks by whether stderr is a tty.

    The console format is coloured on a terminal unless ``NO_COLOR`` is set (no-color.org).
    Tracebacks never carry local variables, in either format.
    """
    if log_format is None:
        log_format = "console" if sys.stderr.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if log_format == "json":
        shared += [structlog.processors.ExceptionRenderer(NO_LOCALS)]
        renderer = structlog.processors.JSONRenderer()
    else:
        colors = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        # Plain tracebacks: rich's (the default when rich is installed) print local variables.
        renderer = structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached, so tests (and structlog.testing.capture_logs) can reconfigure.
        cache_logger_on_first_use=False,
    )
