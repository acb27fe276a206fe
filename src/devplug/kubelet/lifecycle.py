"""A resource's start and stop hooks (:class:`~devplug.scanners.base.ResourceStarter`,
:class:`~devplug.scanners.base.ResourceStopper`), run with a timeout, retried or logged.

:class:`Lifecycle` belongs to one resource's entry in :mod:`devplug.kubelet.servers`, which
calls :meth:`Lifecycle.start` before the server first listens and :meth:`Lifecycle.stop`
after it stopped. A coroutine hook runs on the loop and is cancelled at the timeout. A plain
one runs in a worker thread (its job is slow device work), which a timeout cannot stop: the
attempt is counted as failed, and the next call of either hook waits for that thread first,
so two calls of a scanner's hooks for one resource never run at once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog, error_reason
from devplug.scanners.base import ResourceStarter, ResourceStopper

log = structlog.get_logger("devplug.lifecycle")


class HookTimeout(Exception):
    """A hook ran past its timeout."""


class Lifecycle:
    """Runs ``hooks``' start and stop for ``resource``; ``hooks`` is fixed for its lifetime
    (a reload that replaces the scanner leaves stop to the scanner whose start ran)."""

    def __init__(
        self,
        resource: str,
        hooks: object | None,
        *,
        timeout_s: float,
        retry_initial_s: float,
        retry_max_s: float,
        leftover: asyncio.Future[Any] | None = None,
    ) -> None:
        self.resource = resource
        self._starter = hooks if isinstance(hooks, ResourceStarter) else None
        self._stopper = hooks if isinstance(hooks, ResourceStopper) else None
        self.timeout_s = timeout_s
        self._backoff = Backoff(retry_initial_s, retry_max_s)
        # A plain hook's call still running after its timeout (or a previous lifecycle's of
        # the same resource, ``leftover``): the next call waits for it.
        self._thread: asyncio.Future[Any] | None = leftover
        self._problems = ProblemLog()
        self.started = False  # start returned (or there is none): stop is owed
        self.start_attempts = 0
        self._log = log.bind(resource=resource)

    @property
    def leftover(self) -> asyncio.Future[Any] | None:
        """A hook's thread that outlived its call, if it still runs (see ``leftover=``)."""
        thread = self._thread
        return thread if thread is not None and not thread.done() else None

    async def start(self) -> None:
        """Return once the start hook returned, retrying with back-off until then."""
        if self._starter is None:
            self.started = True
            return
        while True:
            self.start_attempts += 1
            began = time.perf_counter()
            try:
                await self._call(self._starter.start)
            except Exception as exc:
                delay = self._backoff.next()
                self._problems.report(
                    self._log,
                    "lifecycle.start.failed",
                    _reason(exc),
                    level="warning",
                    retry_in_s=round(delay, 3),
                    attempt=self.start_attempts,
                )
                await asyncio.sleep(delay)
                continue
            self._backoff.reset()
            self._problems.solved()
            self.started = True
            self._log.info(
                "lifecycle.start.complete",
                ms=round((time.perf_counter() - began) * 1000, 1),
                attempts=self.start_attempts,
            )
            return

    async def stop(self) -> None:
        """Run the stop hook once if a start returned; log, never raise, a failure."""
        if not self.started:
            return
        self.started = False
        if self._stopper is None:
            return
        try:
            await self._call(self._stopper.stop)
        except Exception as exc:
            self._log.error("lifecycle.stop.failed", reason=_reason(exc))
        else:
            self._log.info("lifecycle.stop.complete")

    async def _call(self, hook: Callable[[str], object]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._thread is not None:
                    # The last plain call timed out and its thread still runs: wait for it
                    # (its outcome was already counted, as a failure).
                    await asyncio.wait({self._thread})
                    self._thread = None
                if inspect.iscoroutinefunction(hook):
                    await hook(self.resource)
                    return
                thread = self._thread = asyncio.ensure_future(
                    asyncio.to_thread(hook, self.resource)
                )
                try:
                    # Shielded: the timeout must not cancel the future we may wait on later.
                    result = await asyncio.shield(thread)
                finally:
                    if thread.done():
                        self._thread = None
                if inspect.isawaitable(result):
                    await result  # a plain function that returned a coroutine
        except TimeoutError:
            still = " (its thread still runs)" if self._thread is not None else ""
            raise HookTimeout(
                f"{_name(hook)} did not return within {self.timeout_s:g} s{still}"
            ) from None


def _name(hook: Callable[..., object]) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, HookTimeout):
        return str(exc)
    return f"{type(exc).__name__}: {error_reason(exc)}"
