"""Logging a recurring problem once when it appears or changes, not on every retry.

Retried trouble (an unwritable dir, a refused registration, a device that cannot be read)
would otherwise flood the log at the retry rate. :class:`ProblemLog` logs a problem at its
level when it is new for its key or differs from the last one, at debug otherwise, and says
when it is solved.
"""

from __future__ import annotations

import errno
from collections.abc import Hashable
from typing import Any


class ProblemLog:
    """The last problem per key (any hashable: a resource, a file, a device)."""

    def __init__(self) -> None:
        self._last: dict[Hashable, str] = {}

    def report(
        self,
        logger: Any,
        event: str,
        problem: str,
        *,
        key: Hashable = None,
        level: str = "error",
        field: str = "reason",
        **fields: object,
    ) -> bool:
        """Log ``event`` at ``level`` (the problem under ``field``) if ``problem`` is new for
        ``key``, else at debug; True when it was logged at ``level``."""
        fields[field] = problem
        if self._last.get(key) == problem:
            logger.debug(event, **fields)
            return False
        self._last[key] = problem
        getattr(logger, level)(event, **fields)
        return True

    def solved(self, key: Hashable = None) -> bool:
        """Forget ``key``'s problem; True if there was one (so callers can log the recovery)."""
        return self._last.pop(key, None) is not None

    def current(self, key: Hashable = None) -> str | None:
        return self._last.get(key)

    def unsolved(self) -> list[Hashable]:
        """The keys with a problem, oldest first."""
        return list(self._last)


def error_reason(exc: BaseException) -> str:
    """A short reason for a log: ``"ENOSPC: No space left on device"`` for an OSError."""
    if not isinstance(exc, OSError):
        return str(exc)
    if isinstance(exc, FileExistsError) and exc.strerror:
        return f"EEXIST: {exc.strerror}"
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{name}: {exc.strerror or exc}" if name else str(exc)
