"""A resource's start and stop hooks (:class:`~devplug.scanners.base.ResourceStarter`,
:class:`~devplug.scanners.base.ResourceStopper`), run with a timeout, retried or logged.

:class:`Lifecycle` belongs to one resource's entry in :mod:`devplug.kubelet.servers`, which
calls :meth:`Lifecycle.start` before the server first listens and :meth:`Lifecycle.stop`
after it stopped. A coroutine hook runs on the loop and is cancelled at the timeout. A plain
one runs in a worker thread (its job is slow device work), which a timeout cannot stop: the
attempt is counted as failed, and the next call of either hook waits for that thread first,
so two calls of a scanner's hooks for one resource never run at once. A hook that raises
``CancelledError`` while nobody cancelled it has failed like any other (a coroutine's own
timeout inside, a cancelled future it awaited): it is logged and a start is retried.

At shutdown a stop hook gets what is left of the daemon's stop budget, if that is less than
the hook timeout (``stop(timeout_s=...)``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Callable
from typing import Any

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.problems import ProblemLog, error_reason
from devplug.scanners.base import ResourceStarter, ResourceStopper

log = structlog.get_logger(__name__)


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
                await self._call(self._starter.start, self.timeout_s)
            except (Exception, asyncio.CancelledError) as exc:
                _reraise_if_cancelled(exc)
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

    async def stop(self, timeout_s: float | None = None) -> None:
        """Run the stop hook once if a start returned; log, never raise, a failure.
        ``timeout_s``: a shorter bound than the hook timeout (what a stop budget has left)."""
        if not self.started:
            return
        self.started = False
        if self._stopper is None:
            return
        bound = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            await self._call(self._stopper.stop, bound)
        except (Exception, asyncio.CancelledError) as exc:
            _reraise_if_cancelled(exc)
            self._log.error("lifecycle.stop.failed", reason=_reason(exc))
        else:
            self._log.info("lifecycle.stop.complete")

    async def _call(self, hook: Callable[[str], object], timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                if self._thread is not None:
                    # The last plain call timed out and its thread still runs: wait for it
                    # (its outcome was already counted, as a failure).
                    await asyncio.wait({self._thread})
                    self._thread = None
                if inspect.iscoroutinefunction(hook):
                    await hook(self.resource)
                    return
                # The executor's own future (what to_thread awaits), not a task around it: a
                # task would turn a CancelledError the hook raises into its own cancellation,
                # and the hook's message with it.
                context = contextvars.copy_context()
                thread = self._thread = asyncio.get_running_loop().run_in_executor(
                    None, context.run, hook, self.resource
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
                f"{_name(hook)} did not return within {timeout_s:g} s{still}"
            ) from None


def _reraise_if_cancelled(exc: BaseException) -> None:
    """Re-raise ``exc`` if it is this task being cancelled (a stop, a removal); a
    CancelledError nobody asked for is the hook's own failure."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise exc


def _name(hook: Callable[..., object]) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, HookTimeout):
        return str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return f"CancelledError (raised by the hook, not a cancellation): {exc}".rstrip(": ")
    return f"{type(exc).__name__}: {error_reason(exc)}"
