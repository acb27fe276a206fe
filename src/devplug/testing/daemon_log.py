"""The warnings and errors an in-test daemon logged last, for a timed-out wait to quote.

A test that waits for the kubelet simulator to see a resource mostly times out because the
daemon could not serve it (a scanner raised, a socket could not be made) and logged why; pytest
shows that log only as captured output below a bare TimeoutError. While a ``running_daemon``
runs, a structlog processor keeps the last few warning and error events of the process, and
the waits of :mod:`devplug.testing` put them in their errors.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import deque
from collections.abc import Iterator, MutableMapping
from typing import Any

import structlog

# Enough to show a cause and what followed from it; more would bury the wait's own message.
KEPT_EVENTS = 3
MAX_VALUE_CHARS = 300
# structlog's method names at warning level and above.
PROBLEM_METHODS = frozenset({"warning", "warn", "error", "exception", "critical", "fatal"})
# Fields every event has or that repeat another: not worth a test reader's attention.
_SKIPPED_FIELDS = frozenset({"event", "timestamp", "level", "exc_info", "stack_info", "logger"})


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    if len(text) > MAX_VALUE_CHARS:
        text = text[:MAX_VALUE_CHARS] + "..."
    return repr(text) if any(c.isspace() for c in text) or not text.isprintable() else text


def describe_event(method_name: str, event_dict: MutableMapping[str, Any]) -> str:
    """One log event as one line: ``scan.failed [error] scanner=misc reason='...'``."""
    parts = [f"{event_dict.get('event')} [{method_name}]"]
    parts += [f"{k}={_shown(v)}" for k, v in event_dict.items() if k not in _SKIPPED_FIELDS]
    exc_info = event_dict.get("exc_info")
    error = exc_info if isinstance(exc_info, BaseException) else None
    if exc_info is True:
        error = sys.exc_info()[1]  # a processor runs inside the logging call's except block
    if error is not None:
        summary = f"{type(error).__name__}: {error}"
        if not any(summary in str(v) for v in event_dict.values()):
            parts.append(f"exception={_shown(summary)}")
    return " ".join(parts)


class _Recorder:
    """A structlog processor keeping the last warning and error events (any thread)."""

    def __init__(self) -> None:
        self.events: deque[str] = deque(maxlen=KEPT_EVENTS)
        self.users = 0
        self.installed_in: list[Any] | None = None
        self.lock = threading.Lock()

    def __call__(
        self, logger: object, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if method_name in PROBLEM_METHODS:
            self.events.append(describe_event(method_name, event_dict))
        return event_dict


_RECORDER = _Recorder()


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Keep the process's warning and error events while the block runs (nested blocks, one
    per in-test daemon, share one record; it starts empty and is dropped at the last exit)."""
    with _RECORDER.lock:
        if _RECORDER.users == 0:
            _RECORDER.events.clear()
            # In place, as structlog.testing.capture_logs does: loggers bound earlier hold
            # this very list.
            processors = structlog.get_config()["processors"]
            processors.insert(0, _RECORDER)
            _RECORDER.installed_in = processors
        _RECORDER.users += 1
    try:
        yield
    finally:
        with _RECORDER.lock:
            _RECORDER.users -= 1
            if _RECORDER.users == 0:
                for processors in (_RECORDER.installed_in, structlog.get_config()["processors"]):
                    while processors is not None and _RECORDER in processors:
                        processors.remove(_RECORDER)
                _RECORDER.installed_in = None
                _RECORDER.events.clear()


def daemon_note() -> str:
    """What the in-test daemons last logged at warning level or above, as lines to append to a
    failure; "" when no ``running_daemon`` is running (nothing of the daemon to quote)."""
    with _RECORDER.lock:
        if _RECORDER.users == 0:
            return ""
        events = list(_RECORDER.events)
    if not events:
        return "\nthe in-test daemon logged no warning or error"
    lines = "".join(f"\n  {line}" for line in events)
    return f"\nthe in-test daemon's last warnings and errors (newest last):{lines}"
