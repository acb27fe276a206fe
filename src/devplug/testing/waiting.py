"""Bounded waits in tests that say, when they run out, what they waited for and why it may not
have come (the state seen last, and what the in-test daemon last logged as a problem)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable

from devplug.testing.daemon_log import daemon_note


def describe_callable(function: Callable[..., object]) -> str:
    """A test's predicate as a reader finds it: ``<lambda> at test_misc.py:42``."""
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", None) or repr(function)[:80]
    name = name.rpartition("<locals>.")[2]  # the file and line say where it was defined
    if code is None:
        return name
    return f"{name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"


@contextlib.asynccontextmanager
async def waiting_for(
    timeout: float | None, what: str, seen: Callable[[], str] | None = None
) -> AsyncIterator[None]:
    """Bound the block by ``timeout`` seconds (None: unbounded). When that runs out, raise
    TimeoutError naming ``what`` was awaited, ``seen()`` (the state at that moment), and the
    in-test daemon's last warnings and errors.

    A TimeoutError the block raises itself passes through untouched.
    """
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            yield
    except TimeoutError:
        if not scope.expired():
            raise
        message = f"timed out after {timeout:g} s waiting for {what}"
        if seen is not None:
            message += f": {seen()}"
        raise TimeoutError(message + daemon_note()) from None


async def eventually(
    condition: Callable[[], object],
    timeout: float = 5.0,
    interval: float = 0.01,
    *,
    what: str | None = None,
) -> None:
    """Return once ``condition()`` is true; TimeoutError after ``timeout`` seconds, naming
    ``what`` (default: the condition's name and where it is defined).

    For what a daemon exposes as state rather than as an event (counters, files on disk, a
    child's log, /proc): polled every ``interval`` seconds. Where there is an event (the
    simulator's ``wait_for_update``, ``daemon.stats.wait_for``), await that instead.
    """
    described = what or describe_callable(condition)
    async with waiting_for(timeout, described, lambda: "it was still false"):
        while not condition():  # noqa: ASYNC110 - the point: state with no event
            await asyncio.sleep(interval)
