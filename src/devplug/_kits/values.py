"""A latest-value holder: readers always get the newest value, never a backlog.

ListAndWatch streams iterate :meth:`LatestValue.as_changed`: a slow reader skips intermediate
values instead of queueing them, so memory stays bounded however fast devices change.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Watchable(Protocol[T_co]):
    """A read-only view of a :class:`LatestValue`: what tests and plugin authors await."""

    @property
    def value(self) -> T_co: ...

    @property
    def version(self) -> int: ...

    async def wait_for(
        self, predicate: Callable[[T_co], bool], timeout: float | None = None
    ) -> T_co: ...

    def as_changed(self) -> AsyncIterator[T_co]: ...


class LatestValue(Generic[T]):
    def __init__(self, initial: T) -> None:
        self._value = initial
        self._version = 0
        self._closed = False
        self._changed = asyncio.Event()

    @property
    def value(self) -> T:
        return self._value

    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    def set(self, value: T) -> None:
        """Publish ``value`` and wake every reader."""
        if self._closed:
            raise RuntimeError("LatestValue is closed")
        self._value = value
        self._bump()

    def close(self) -> None:
        """End every reader's iteration once it has seen the current value."""
        if not self._closed:
            self._closed = True
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    async def wait_changed(self, since_version: int) -> int:
        """Wait until the version differs from ``since_version``; return the new version."""
        while self._version == since_version:
            await self._changed.wait()
        return self._version

    async def wait_for(self, predicate: Callable[[T], bool], timeout: float | None = None) -> T:
        """The first value (the current one included) for which ``predicate`` holds; raises
        TimeoutError after ``timeout`` seconds (None: no limit)."""
        async with asyncio.timeout(timeout):
            async for value in self.as_changed():
                if predicate(value):
                    return value
        raise RuntimeError("closed before the value was reached")

    async def as_changed(self) -> AsyncIterator[T]:
        """Yield the current value, then the latest value after each change, until closed."""
        seen_value_at = -1
        while True:
            if seen_value_at != self._version:
                seen_value_at = self._version
                yield self._value
                continue
            if self._closed:
                return
            await self._changed.wait()
