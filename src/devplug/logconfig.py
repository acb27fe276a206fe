"""The one place structlog is configured: JSON to stderr when it is not a terminal, else console.

Event names are dotted (``kubelet.register.complete``); stdout is left to commands' output.

grpc-core (the C library under grpcio) writes log lines of its own, in absl's plain-text
format (``E1126 01:36:30.355336 13329 add_port.cc:83] Failed to add port ...``), straight to
file descriptor 2, once per retry; grpcio offers no hook for absl's log sink. What the
daemon does with them (:class:`CoreStderr`), and why:

- Silencing them (``GRPC_VERBOSITY=NONE``, :func:`quiet_grpc_core`) loses what devplug
  never sees itself: the reason a kubelet sent GOAWAY (devplug's own Register only fails
  with DEADLINE_EXCEEDED), accept failures in gRPC's listener (EMFILE), keepalive
  timeouts; and NONE sets absl's minimum level above FATAL, so even a CHECK failure that
  aborts the process says nothing. Only the short-lived ``status`` command keeps that.
- Leaving them (``GRPC_VERBOSITY=ERROR``) puts plain text in a JSON log, repeated per retry.
- So the daemon keeps ERROR and reads fd 2 back: fd 2 becomes a pipe, and Python's
  ``sys.stderr`` (structlog's lines, tracebacks) moves to a copy of the real stderr, so
  devplug's own lines never pass through it. The event loop reads the pipe: each absl line
  becomes ``grpc.core.log`` (its severity as the level, ``source`` and ``message``; errors
  and warnings repeated per retry are counted, :class:`~devplug._kits.repeats.RepeatLog`),
  any other text ``stderr.line``. The pipe's write end is non-blocking: when the loop stalls
  and the pipe (1 MiB) fills, grpc's threads lose lines rather than wait (the reason a pipe
  was refused before: a blocking one stalls gRPC with the loop). faulthandler writes to the
  real stderr, so a crash (SIGSEGV, or the SIGABRT after a CHECK failure) still leaves a
  traceback of every thread; the one thing lost is the text of a fatal error that CPython
  writes to fd 2 itself mid-run (``Fatal Python error: ...`` from ``Py_FatalError``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import logging
import os
import re
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, TextIO

import structlog

if TYPE_CHECKING:
    import asyncio

    from devplug._kits.repeats import RepeatLog

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
# "infinity" (above FATAL: nothing at all is written), ERROR to errors and fatal errors.
# DEBUG and INFO remain for whoever debugs gRPC itself (with GRPC_TRACE=...); an operator's
# own setting is honoured.
GRPC_CORE_VERBOSITY = "NONE"  # the status command: its own errors say it all
GRPC_CORE_VERBOSITY_ROUTED = "ERROR"  # the daemon: its lines read back (CoreStderr)


def quiet_grpc_core(environ: MutableMapping[str, str] | None = None) -> None:
    """Keep grpc-core's own lines off stderr, unless the environment sets GRPC_VERBOSITY.

    Call it before grpc is first imported: grpc-core reads the variable once, when grpcio
    loads (set afterwards, it has no effect). For a short command; the daemon routes them
    into its log instead (:class:`CoreStderr`).
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("GRPC_VERBOSITY", GRPC_CORE_VERBOSITY)


# An absl log line: severity letter, MMDD, time, thread id, file:line, message.
ABSL_LINE = re.compile(rb"([IWEF])\d{4} [\d:.]+ +(\d+) ([^\s\]]+:\d+)\] ?(.*)")
ABSL_LEVELS = {b"I": "info", b"W": "warning", b"E": "error", b"F": "critical"}
PIPE_BYTES = 1 << 20  # what the pipe holds while the loop does not read it
LINE_BYTES = 16 * 1024  # a longer line is cut there
REPEAT_INTERVAL_S = 60.0  # one summary per minute for lines grpc-core repeats per retry


class CoreStderr:
    """File descriptor 2, where C code writes (grpc-core's absl lines), read back into
    structlog by the event loop (see the module doc for why).

    :meth:`capture` before grpc loads (nothing is lost meanwhile: the pipe holds it),
    :meth:`follow` once the loop runs, :meth:`release` before the process exits: what is
    left in the pipe is logged and fd 2 is the real stderr again.
    """

    def __init__(self) -> None:
        self._real: int | None = None  # a copy of the real stderr
        self._pipe: int | None = None  # the pipe's read end
        self._partial = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._repeats: RepeatLog | None = None
        self._log = structlog.get_logger(__name__)

    def capture(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Point fd 2 at a pipe, and Python's stderr (and structlog, and faulthandler) at
        the real stderr; grpc-core's errors on (GRPC_VERBOSITY=ERROR unless ``environ``
        says otherwise: call it before grpc loads). Children started from now on share the
        pipe as their stderr."""
        if self._real is not None:
            return
        environ = os.environ if environ is None else environ
        environ.setdefault("GRPC_VERBOSITY", GRPC_CORE_VERBOSITY_ROUTED)
        sys.stderr.flush()
        real = os.dup(2)  # not inherited: children get the pipe, as C code here does
        read, write = os.pipe()
        with contextlib.suppress(OSError):  # over the system's pipe-max-size: the default
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(read, False)
        os.set_blocking(write, False)  # a full pipe drops a writer's line, never holds it
        os.dup2(write, 2)
        os.close(write)
        self._real, self._pipe = real, read
        sys.stderr = _text_on(real, sys.stderr)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
        faulthandler.enable(file=sys.stderr, all_threads=True)

    def follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the pipe in ``loop`` from now on."""
        if self._pipe is None or self._loop is not None:
            return
        from devplug._kits.repeats import RepeatLog

        self._loop = loop
        self._repeats = RepeatLog(self._log, REPEAT_INTERVAL_S)
        loop.add_reader(self._pipe, self._drain)

    def unfollow(self) -> None:
        """Stop reading in the loop (before it closes); what it owes is logged."""
        if self._loop is None:
            return
        if not self._loop.is_closed() and self._pipe is not None:
            self._loop.remove_reader(self._pipe)
        self._drain()
        if self._repeats is not None:
            self._repeats.flush()
        self._loop = self._repeats = None

    def release(self) -> None:
        """Log what is left in the pipe, and give fd 2 back to the real stderr."""
        if self._real is None or self._pipe is None:
            return
        self.unfollow()
        self._drain()
        if self._partial:
            self._line(self._partial)
            self._partial = b""
        os.dup2(self._real, 2)
        os.close(self._pipe)
        self._pipe = None

    def _drain(self) -> None:
        assert self._pipe is not None
        while True:
            try:
                chunk = os.read(self._pipe, 65536)
            except (BlockingIOError, InterruptedError):
                return
            if not chunk:
                return
            *lines, rest = (self._partial + chunk).split(b"\n")
            self._partial = rest[:LINE_BYTES]
            for line in lines:
                self._line(line[:LINE_BYTES])

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.strip():
            return
        found = ABSL_LINE.fullmatch(line)
        if found is None:
            # Not grpc-core's: a child's stderr, another C library's text, the rest of a
            # message that held a newline.
            text = line.decode(errors="replace")
            if self._news("stderr.line", "warning", "", line=text):
                self._log.warning("stderr.line", line=text)
            return
        level = ABSL_LEVELS[found[1]]
        source = found[3].decode(errors="replace")
        message = found[4].decode(errors="replace")
        # Errors and warnings come once per retry; INFO and DEBUG only when asked for, all.
        counted = level in ("error", "warning")
        if counted and not self._news(
            "grpc.core.log", level, source, source=source, message=message
        ):
            return
        write = {
            "info": self._log.info,
            "warning": self._log.warning,
            "error": self._log.error,
            "critical": self._log.critical,
        }[level]
        write("grpc.core.log", source=source, message=message)

    def _news(self, event: str, level: str, category: str, **fields: str) -> bool:
        """Whether to log a line in full, or only count it (RepeatLog: per event and
        category, here gRPC's source line, a fixed set whatever a peer sends)."""
        if self._repeats is None:  # the loop has gone: nothing left to count them
            return True
        return self._repeats.admit(event, level, category, **fields)


def _text_on(fd: int, like: TextIO) -> TextIO:
    """A text stream on ``fd`` as ``like`` is (its encoding and errors), line-buffered."""
    return open(
        fd,
        "w",
        buffering=1,
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors=getattr(like, "errors", None) or "backslashreplace",
        closefd=False,
    )
