"""The one place structlog is configured: JSON to stderr when it is not a terminal, else console.

Event names are dotted (``kubelet.register.complete``); stdout is left to commands' output.

grpc-core (the C library under grpcio) writes log lines of its own, in absl's plain-text
format (``E1126 01:36:30.355336 13329 add_port.cc:83] Failed to add port ...``), straight to
file descriptor 2: they bypass structlog, break a JSON log, and repeat at every retry. They
cannot be taken into structlog: grpcio offers no hook for absl's log sink, and reading fd 2
back through a pipe would stall grpc's threads whenever the event loop did (and lose a
crash's last words). So :func:`quiet_grpc_core` silences them: every failure devplug meets
through gRPC it logs itself (``server.listen.failed``, ``kubelet.register.failed`` with
gRPC's status; ``devplug status`` prints the error per socket).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
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


# grpcio >= 1.65 reads GRPC_VERBOSITY into absl's minimum log level: NONE sets it to
# "infinity" (and grpc's VLOGs off), so grpc-core writes no line at all. DEBUG, INFO and ERROR
# remain for whoever debugs gRPC itself (with GRPC_TRACE=...); they are honoured when set.
GRPC_CORE_VERBOSITY = "NONE"


def quiet_grpc_core(environ: MutableMapping[str, str] | None = None) -> None:
    """Keep grpc-core's own lines off stderr, unless the environment sets GRPC_VERBOSITY.

    Call it before grpc is first imported: grpc-core reads the variable once, when grpcio
    loads (set afterwards, it has no effect). devplug's entry points do so; a plugin's own
    entry point that imports grpc earlier should call it first.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("GRPC_VERBOSITY", GRPC_CORE_VERBOSITY)
