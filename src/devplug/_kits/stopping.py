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

All of that runs on the event loop, and a stop hook can block the loop (``time.sleep`` in a
coroutine) or hold the interpreter (a C call that keeps the GIL). The :class:`Backstop` ends
the process then: an alarm (SIGALRM) whose Python handler runs wherever the main thread is
stuck in Python code or a system call, and says where; behind it faulthandler's own C
thread, which needs neither the loop nor the GIL, prints every thread's traceback to stderr
and exits with status 1. It also bounds the interpreter's exit, which waits for every
non-daemon thread (a hook's own) without end (:meth:`Backstop.bound_exit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

# How long the event loop gets to end an overdue stop itself (it says the most: the tasks
# still stopping) before the backstop's alarm does: a loop that turns ends it in milliseconds.
LOOP_GRACE_S = 2.0
# How long the alarm's Python handler gets before faulthandler ends the process: it runs at
# once unless a C call holds the interpreter.
FAULTHANDLER_AFTER_S = 2.0


class StopBudget:
    """``total_s`` seconds for a stop, counted from :meth:`begin` (``time.monotonic``, the
    loop's clock, so that it counts on after the loop has closed)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.deadline: float | None = None  # monotonic time; None until the stop begins
        self.cut_short = False
        self._moved: asyncio.Event | None = None
        self._watchers: list[Callable[[StopBudget], None]] = []

    @property
    def begun(self) -> bool:
        return self.deadline is not None

    def watch(self, watcher: Callable[[StopBudget], None]) -> None:
        """Call ``watcher`` (in the loop, at once) when the stop begins and when it is cut
        short: what must act on the deadline without the loop (:class:`Backstop`)."""
        self._watchers.append(watcher)

    def begin(self) -> bool:
        """The stop begins now (True), or a stop already under way is asked for again: the
        budget ends now (False). In the loop's thread."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.total_s
            self._moved_event().set()
            self._tell_watchers()
            return True
        if not self.cut_short:
            self.cut_short = True
            self.deadline = min(self.deadline, now)
            self._moved_event().set()
            self._tell_watchers()
        return False

    def remaining(self, reserve_s: float = 0.0) -> float:
        """Seconds left (``total_s`` before the stop began), less ``reserve_s`` kept for
        what comes after the caller; never below zero."""
        left = self.total_s if self.deadline is None else self.deadline - time.monotonic()
        return max(left - reserve_s, 0.0)

    async def spent(self) -> None:
        """Return once the stop has begun and its budget has run out (or was cut short)."""
        moved = self._moved_event()
        while True:
            moved.clear()
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
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

    def _tell_watchers(self) -> None:
        for watcher in self._watchers:
            watcher(self)


@dataclass(frozen=True, slots=True)
class StopOutcome:
    """How a run ended (see :func:`run_within_budget`)."""

    stopped: bool  # the run returned or raised
    threads_done: bool  # the loop's worker threads ended too
    error: BaseException | None = None  # what the run raised

    @property
    def overdue(self) -> bool:
        return not (self.stopped and self.threads_done)


async def run_within_budget(
    main: Coroutine[Any, Any, None],
    budget: StopBudget,
    on_stopped: Callable[[BaseException | None], None] | None = None,
) -> StopOutcome:
    """Run ``main`` to its end, then wait for the loop's worker threads (what ``asyncio.run``
    would wait for without bound after it), both within ``budget`` once it has begun. A run
    that raises begins the budget too: its threads get the same bound. ``on_stopped`` hears
    how ``main`` ended (None, or what it raised) before the threads are awaited.

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
    if on_stopped is not None:
        on_stopped(error)
    if not budget.begun:
        budget.begin()
    loop = asyncio.get_running_loop()
    threads_done = await budget.finish(loop.shutdown_default_executor())
    return StopOutcome(stopped=True, threads_done=threads_done, error=error)


def stop_reason(budget: StopBudget, asked_again: bool = False) -> str:
    """Why a stop ends before all of it finished, in the words of the log lines."""
    if budget.cut_short or asked_again:
        return "asked to stop again"
    return f"the stop budget of {budget.total_s:g} s (stop_timeout_s) ran out"


def end_overdue(
    outcome: StopOutcome,
    budget: StopBudget,
    logger: Any,
    status: int,
    *,
    reason: str | None = None,
    blocked_in: FrameType | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> NoReturn:
    """Say what still runs when the budget ran out (or was cut short), then end the process
    with ``status`` (1 instead when the stop itself had not finished): nothing else would
    end it while a worker thread runs.

    Called from the loop (``pending``: its tasks but the caller), or by the :class:`Backstop`
    from a signal handler while ``loop`` is blocked in ``blocked_in`` (the main thread's frame,
    said as ``blocked_in``: where it is stuck, innermost last).
    """
    why = stop_reason(budget) if reason is None else reason
    threads = sorted(
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    )
    if not outcome.stopped:
        status = 1
        where: dict[str, Any] = {}
        if blocked_in is None:
            current = asyncio.current_task()
            tasks = sorted(t.get_name() for t in asyncio.all_tasks() if t is not current)
        else:
            # The blocked task is one of them: the frame is inside it.
            tasks = sorted(t.get_name() for t in asyncio.all_tasks(loop)) if loop else []
            where["blocked_in"] = frames(blocked_in)
        logger.error(
            "daemon.stop.overdue",
            reason=why,
            pending=tasks[:20],
            threads=len(threads),
            exit_status=status,
            **where,
        )
    else:
        logger.warning("daemon.threads.abandoned", reason=why, threads=threads[:20])
    end_process(status)


def frames(frame: FrameType, limit: int = 8) -> list[str]:
    """The innermost ``limit`` frames of a stack, ``file:line in function``, innermost last."""
    return [
        f"{entry.filename}:{entry.lineno} in {entry.name}"
        for entry in traceback.extract_stack(frame, limit=None)[-limit:]
    ]


def end_process(status: int) -> NoReturn:
    """Exit now with ``status``, after what was written to stdout and stderr (the log) is
    flushed: no waiting for worker threads, no atexit handlers."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class Backstop:
    """Ends the process when its stop is overdue and the event loop does not end it itself.

    :meth:`follow` a :class:`StopBudget`: once the stop begins, the backstop is armed for the
    deadline plus :data:`LOOP_GRACE_S`, the loop's own chance (:func:`end_overdue` from the
    loop, which names the tasks still stopping). When that passes, SIGALRM's handler says
    where the main thread is stuck and ends the process (:func:`end_overdue`, written past the
    print lock that the interrupted code may hold). If no Python code can run at all (a C
    call holding the GIL), faulthandler's thread prints every thread's traceback to stderr
    :data:`FAULTHANDLER_AFTER_S` later and exits with status 1.

    ``stopped_status`` is the status of a run that has stopped in order (its threads may
    still run): the backstop then abandons the threads with that status; None while the
    stop is under way (status 1).

    Arm and cut it short from the main thread (the loop's, or a signal handler): SIGALRM's
    handler can only be set there. Elsewhere only faulthandler is armed.
    """

    def __init__(
        self, budget: StopBudget, logger: Any, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.budget = budget
        self.logger = logger
        self.loop = loop
        self.stopped_status: int | None = None
        self.asked_again = False
        self._at: float | None = None  # monotonic time the alarm is set for
        self._previous: Any = None  # SIGALRM's handler before ours; None: ours is not set

    def follow(self, budget: StopBudget) -> None:
        """A :meth:`StopBudget.watch` watcher: armed for the budget's deadline."""
        assert budget.deadline is not None
        self.arm(budget.deadline + LOOP_GRACE_S)

    def arm(self, at: float) -> None:
        """End the process at ``at`` (monotonic time) unless it ended first; only ever sooner."""
        if self._at is not None and self._at <= at:
            return
        self._at = at
        delay = max(at - time.monotonic(), 0.001)
        if threading.current_thread() is threading.main_thread():
            if self._previous is None:
                self._previous = signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, delay)
        faulthandler.dump_traceback_later(delay + FAULTHANDLER_AFTER_S, exit=True, file=_stderr())

    def arm_for(self, total_s: float) -> None:
        """A stop begins now with a budget of ``total_s``: armed for its end, whether or not
        the loop turns to begin it."""
        self.arm(time.monotonic() + total_s + LOOP_GRACE_S)

    def cut_short(self, frame: FrameType | None, *, at_once: bool = False) -> None:
        """A stop asked for again: end the process once the loop has had its grace (it is
        told too, and says more), or ``at_once`` (no loop to tell), from the signal handler
        whose ``frame`` is where the main thread was."""
        self.asked_again = True
        if at_once:
            self._end(frame)
        self.arm(time.monotonic() + LOOP_GRACE_S)

    def bound_exit(self) -> bool:
        """The loop has closed and the process is about to exit. If threads that the
        interpreter's exit waits for still run (a thread a hook started), stay armed for the
        budget's end (no grace: no loop is left to act first) and return True; else disarm.

        The interpreter's exit first runs its own thread exit hooks (an idle executor's
        workers end there), then waits for the rest: this lets it, and ends the process
        (``daemon.threads.abandoned``) only if the wait outlasts the budget.
        """
        current = threading.current_thread()
        if not any(t is not current and not t.daemon for t in threading.enumerate()):
            self.disarm()
            return False
        deadline = self.budget.deadline
        self.arm(time.monotonic() + self.budget.total_s if deadline is None else deadline)
        return True

    def disarm(self) -> None:
        """The process ends on its own: no alarm, no faulthandler, SIGALRM's handler back."""
        self._at = None
        faulthandler.cancel_dump_traceback_later()
        if self._previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self._previous = None

    def _alarm(self, signum: int, frame: FrameType | None) -> None:
        self._end(frame)

    def _end(self, frame: FrameType | None) -> NoReturn:
        stopped = self.stopped_status is not None
        end_overdue(
            StopOutcome(stopped=stopped, threads_done=False),
            self.budget,
            self.logger,
            self.stopped_status or 0,
            reason=stop_reason(self.budget, self.asked_again),
            blocked_in=frame,
            loop=self.loop,
        )


def _stderr() -> int:
    """The descriptor of ``sys.stderr`` (which may not be 2: devplug.logconfig.CoreStderr),
    else 2."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2


class UnlockedStderr:
    """A structlog logger that writes each line to stderr's descriptor with ``os.write``:
    for the last words of a process said from a signal handler, which may have interrupted
    a line written under structlog's print lock (taking that lock again would hang)."""

    def msg(self, message: str) -> None:
        data = (message + "\n").encode(errors="replace")
        fd = _stderr()
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(fd, data) :]

    log = debug = info = warning = error = critical = exception = msg
