"""Tasks whose lifetime is a block: started on entry, cancelled and awaited on exit.

Entered one after another in an ``AsyncExitStack``, they stop in the reverse order of their
start, by structure rather than by a hand-written list of cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.asynccontextmanager
async def running(
    group: asyncio.TaskGroup, coroutine: Coroutine[Any, Any, T], name: str
) -> AsyncIterator[asyncio.Task[T]]:
    """Run ``coroutine`` as a named task of ``group`` for the duration of the block (its
    failure reaches the group, which stops the daemon)."""
    task = group.create_task(coroutine, name=name)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.wait({task})
