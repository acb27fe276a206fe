"""The one place structlog is configured: JSON to stderr when it is not a terminal, else console.

Event names are dotted (``kubelet.register.complete``); stdout is left to commands' output.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(log_format: str | None = None, level: str = "info") -> None:
    """Configure structlog for the process. ``log_format`` None picks by whether stderr is a tty."""
    if log_format is None:
        log_format = "console" if sys.stderr.isatty() else "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if log_format == "json":
        shared += [structlog.processors.dict_tracebacks]
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached, so tests (and structlog.testing.capture_logs) can reconfigure.
        cache_logger_on_first_use=False,
    )
