"""A stop's time budget: from the first stop request, how long the whole stop may take.

A pod gets ``terminationGracePeriodSeconds`` (30 s by default) between SIGTERM and SIGKILL, a
systemd unit ``TimeoutStopSec``. Every part of a stop that can wait on someone else's code
(a scanner's stop hook, a hung file system under the CDI dir, a worker thread) takes its
timeout from one :class:`StopBudget`, so the parts together fit the grace period whatever
each of them does. A second stop request cuts the budget short: whoever asked twice wants
the process gone now.

:func:`run_within_budget` runs a process's main coroutine and then waits for the loop's
worker threads, both within the budget; :func:`end_overdue` says what still runs when it is
spent and ends the process (``os._exit``, after the log is flushed): a thread cannot be
stopped, and nothing else would end a process one keeps alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn


class StopBudget:
    """``total_s`` seconds for a stop, counted from :meth:`begin` (loop time)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.deadline: float | None = None  # loop time; None until the stop begins
        self.cut_short = False
        self._moved: asyncio.Event | None = None

    @property
    def begun(self) -> bool:
        return self.deadline is not None

    def begin(self) -> bool:
        """The stop begins now (True), or a stop already under way is asked for again: the
        budget ends now (False)."""
        now = asyncio.get_running_loop().time()
        if self.deadline is None:
            self.deadline = now + self.total_s
            self._moved_event().set()
            return True
        if not self.cut_short:
            self.cut_short = True
            self.deadline = min(self.deadline, now)
            self._moved_event().set()
        return False

    def remaining(self, reserve_s: float = 0.0) -> float:
        """Seconds left (``total_s`` before the stop began), less ``reserve_s`` kept for
        what comes after the caller; never below zero."""
        if self.deadline is None:
            left = self.total_s
        else:
            left = self.deadline - asyncio.get_running_loop().time()
        return max(left - reserve_s, 0.0)

    async def spent(self) -> None:
        """Return once the stop has begun and its budget has run out (or was cut short)."""
        moved = self._moved_event()
        while True:
            moved.clear()
            if self.deadline is not None:
                left = self.deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await moved.wait()
            else:
                await moved.wait()

    async def finish(self, work: Awaitable[Any]) -> bool:
        """Await ``work`` until it ends (True) or the budget is spent first (False: ``work``
        is left running, for a caller that ends the process). Raises what ``work`` raises."""
        task = asyncio.ensure_future(work)
        spent = asyncio.ensure_future(self.spent())
        try:
            await asyncio.wait({task, spent}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            spent.cancel()
        if not task.done():
            return False
        task.result()
        return True

    def _moved_event(self) -> asyncio.Event:
        # Made on first use, inside the loop that waits on it.
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved


@dataclass(frozen=True, slots=True)
class StopOutcome:
    """How a run ended (see :func:`run_within_budget`)."""

    stopped: bool  # the run returned or raised
    threads_done: bool  # the loop's worker threads ended too
    error: BaseException | None = None  # what the run raised

    @property
    def overdue(self) -> bool:
        return not (self.stopped and self.threads_done)


async def run_within_budget(main: Coroutine[Any, Any, None], budget: StopBudget) -> StopOutcome:
    """Run ``main`` to its end, then wait for the loop's worker threads (what ``asyncio.run``
    would wait for without bound after it), both within ``budget`` once it has begun. A run
    that raises begins the budget too: its threads get the same bound.

    The caller of an overdue outcome ends the process (``os._exit``): a worker thread cannot
    be stopped, and neither ``asyncio.run`` nor the interpreter's exit would return while one
    runs. After this, the loop's default executor takes no more work.
    """
    error: BaseException | None = None
    try:
        stopped = await budget.finish(asyncio.create_task(main, name="daemon"))
    except Exception as exc:
        error, stopped = exc, True
    if not stopped:
        return StopOutcome(stopped=False, threads_done=False)
    if not budget.begun:
        budget.begin()
    loop = asyncio.get_running_loop()
    threads_done = await budget.finish(loop.shutdown_default_executor())
    return StopOutcome(stopped=True, threads_done=threads_done, error=error)


def end_overdue(outcome: StopOutcome, budget: StopBudget, logger: Any, status: int) -> NoReturn:
    """Say what still runs when the budget ran out (or was cut short), then end the process
    with ``status`` (1 instead when the stop itself had not finished): nothing else would
    end it while a worker thread runs."""
    why = (
        "asked to stop again"
        if budget.cut_short
        else f"the stop budget of {budget.total_s:g} s (stop_timeout_s) ran out"
    )
    threads = sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    )
    if not outcome.stopped:
        current = asyncio.current_task()
        tasks = sorted(t.get_name() for t in asyncio.all_tasks() if t is not current)
        status = 1
        logger.error(
            "daemon.stop.overdue",
            reason=why,
            pending=tasks[:20],
            threads=len(threads),
            exit_status=status,
        )
    else:
        logger.warning("daemon.threads.abandoned", reason=why, threads=threads[:20])
    end_process(status)


def end_process(status: int) -> NoReturn:
    """Exit now with ``status``, after what was written to stdout and stderr (the log) is
    flushed: no waiting for worker threads, no atexit handlers."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
