"""Waiting in tests for state that has no event to await."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(
    condition: Callable[[], object], timeout: float = 5.0, interval: float = 0.01
) -> None:
    """Return once ``condition()`` is true; TimeoutError after ``timeout`` seconds.

    For what a daemon exposes as state rather than as an event (counters, files on disk, a
    child's log, /proc): polled every ``interval`` seconds. Where there is an event (the
    simulator's ``wait_for_update``, ``daemon.stats.wait_for``), await that instead.
    """
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the point: state with no event
            await asyncio.sleep(interval)
