"""Work that must be done, but not while a caller waits: calls queued now run together later.

Allocate's log line is the case: rendered and written right after the answer, on a CPU just
woken up, it costs tens of microseconds (ten times its cost in a warm loop) and competes with
the kubelet reading the answer. Queued, it is written at most ``delay_s`` later, and the lines
of a burst of calls are written in one go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

log = structlog.get_logger("devplug.later")


class Later:
    """Calls queued with :meth:`call` run on the event loop ``delay_s`` after the first of
    them, all together; once ``max_pending`` are waiting, at the loop's next turn (so memory
    stays bounded however fast they come, and no caller's own turn pays for the batch).
    Whoever owns it calls :meth:`flush` when it stops, so an orderly stop loses none; a crash
    loses the last ``delay_s`` worth."""

    def __init__(self, delay_s: float, max_pending: int) -> None:
        self.delay_s = delay_s
        self.max_pending = max_pending
        self._pending: list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]]
        self._pending = []
        self._due: asyncio.Handle | None = None  # the flush to come
        self._due_now = False  # that flush is at the loop's next turn

    def call(self, function: Callable[..., object], *args: object, **kwargs: object) -> None:
        """Run ``function(*args, **kwargs)`` later (needs a running event loop)."""
        self._pending.append((function, args, kwargs))
        if len(self._pending) >= self.max_pending and not self._due_now:
            if self._due is not None:
                self._due.cancel()
            self._due = asyncio.get_running_loop().call_soon(self.flush)
            self._due_now = True
        elif self._due is None:
            self._due = asyncio.get_running_loop().call_later(self.delay_s, self.flush)

    def flush(self) -> None:
        """Run every queued call now, in the order queued; one that raises is logged and the
        others still run."""
        if self._due is not None:
            self._due.cancel()
            self._due = None
            self._due_now = False
        pending, self._pending = self._pending, []
        for function, args, kwargs in pending:
            try:
                function(*args, **kwargs)
            except Exception:
                log.exception("later.call_failed", call=getattr(function, "__qualname__", "?"))

    def __len__(self) -> int:
        return len(self._pending)
