"""The daemon run in this process until a signal stops it: what ``run`` does, in ``devplug``
and in a plugin's own entry point (:func:`devplug.cli.serve`).

The daemon itself (and with it gRPC) and asyncio are imported when :func:`run_daemon` runs,
so that importing this module stays light: an entry point can call :func:`guard_signals`
before anything slow (the command line does, first thing, for ``run``).

Signals: SIGTERM, SIGINT and SIGQUIT stop the daemon in order (exit 0), SIGHUP reloads the
config. :class:`SignalGuard` holds them from :func:`guard_signals` (or the start of
:func:`run_daemon`) until the process ends, so that no signal meets its default action
(which kills) while modules import, the config loads, the daemon runs or shuts down, or
asyncio waits for worker threads after it. The guard's handlers are the only ones, never
the event loop's own (``loop.add_signal_handler``): handing the signals to the loop and back
leaves a moment with the default action in between (``remove_signal_handler`` resets it), in
which a second SIGTERM right after ``daemon.stopped`` would kill the process. Before the
daemon exists nothing is served, and a stop signal ends the command where it is (loading a
config from a file nobody writes, say): :class:`StopSignalled`, as Ctrl-C ends any command.

The stop, and the threads that would outlive it (the loop's workers, a hook's own), fit the
daemon's stop budget (``stop_timeout_s``, :mod:`devplug._kits.stopping`); a second stop signal
ends the budget at once. When the budget is spent the process says what still runs and ends
with ``os._exit``: a thread that never returns (a scanner's hung stop hook) would otherwise
keep it alive for good, since neither ``asyncio.run`` nor the interpreter's exit returns
before its threads. A hook that blocks the event loop, which carries all of that out, does
not keep it alive either: the stop's :class:`~devplug._kits.stopping.Backstop` ends the
process from a signal handler, or from faulthandler's thread when a C call holds the GIL.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeAlias

from devplug.errors import ConfigError

if TYPE_CHECKING:
    import asyncio

    from devplug._kits.stopping import Backstop
    from devplug.config import Settings
    from devplug.daemon import ConfigLoader, Daemon
    from devplug.scanners.base import Scanner

EXIT_CONFIG = 2  # bad usage or configuration: nothing was served
# Ctrl-C (128 + SIGINT, as a shell reports a command it interrupted): any command, and run
# before the daemon served.
EXIT_INTERRUPTED = 130
# SIGQUIT stops too, as KubeVirt's device plugin manager does.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
HANDLED_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)

# The daemon's ConfigLoader, named here without importing the daemon (imported only when it
# runs, for a quick start of the other commands).
Loader: TypeAlias = "ConfigLoader"


def stop_status(signum: int | None) -> int:
    """The exit status of a command a stop signal ended before the daemon served: Ctrl-C's
    130, as for any command; 0 for SIGTERM and SIGQUIT, as after serving."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 0


class StopSignalled(KeyboardInterrupt):
    """A stop signal before the daemon served: raised by :class:`SignalGuard`'s handler where
    the main thread was (a config read, a plugin's factory), to end the command as Ctrl-C
    does, with :attr:`exit_status` (the command line catches it with KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_status = stop_status(signum)


class SignalGuard:
    """The process's handlers for the stop signals and SIGHUP while devplug serves.

    Before the daemon runs nothing is served: a stop signal raises :class:`StopSignalled`
    where the main thread is, and a second one (the first was swallowed, or a call does not
    return) ends the process at once; a SIGHUP asks for a reload as soon as the daemon runs
    (the config may have changed after it was read). While it runs (:meth:`attach`), the
    handlers pass each signal to it through its loop, and arm its stop's
    :class:`~devplug._kits.stopping.Backstop`, which ends the process when the loop cannot
    (blocked by a hook): at the budget's end, or shortly after a second stop signal. After
    that (:meth:`detach`), while the process waits for the threads it would leave behind, a
    stop signal ends the wait at once. The handlers stay installed throughout: never a moment
    with the default action.
    """

    def __init__(self) -> None:
        self.stop_requested = False
        self.stop_signal: int | None = None  # the first stop signal
        self.reload_requested = False
        self._target: tuple[asyncio.AbstractEventLoop, Daemon] | None = None
        self._backstop: Backstop | None = None  # from attach until the run ends
        self._served = False  # the run ended: nothing left to stop
        self._previous: dict[int, Any] = {}
        # While attached: the wakeup fd's socket pair and the wakeup fd it replaced.
        self._wakeup: tuple[asyncio.AbstractEventLoop, socket.socket, socket.socket, int] | None
        self._wakeup = None

    def install(self) -> None:
        """Take over the signals (only the main thread may: elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous.clear()

    def attach(self, loop: asyncio.AbstractEventLoop, daemon: Daemon, backstop: Backstop) -> None:
        """Pass signals to ``daemon`` from now on, and those that came before it existed;
        arm ``backstop`` (for its stop) when a stop signal comes.

        Call it in the loop's thread (the main one). A Python signal handler runs in the main
        thread once it runs bytecode; a signal the kernel gives another thread (gRPC's, a
        worker's) while the loop waits in epoll is written to the wakeup fd, which the loop
        reads, so that the handler runs at once (what ``loop.add_signal_handler`` does).
        """
        self._target = (loop, daemon)
        self._backstop = backstop
        if threading.current_thread() is threading.main_thread() and self._wakeup is None:
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            loop.add_reader(reader.fileno(), _drain, reader)
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (loop, reader, writer, previous)
        if self.stop_requested:
            daemon.request_stop()
        elif self.reload_requested:
            daemon.request_reload()

    def detach(self) -> None:
        """Stop passing signals to the daemon: its run has ended (a stop signal now ends what
        is left of the stop at once); in the loop's thread, before the loop closes."""
        self._target = None
        if self._wakeup is not None:
            loop, reader, writer, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            if not loop.is_closed():
                loop.remove_reader(reader.fileno())
            reader.close()
            writer.close()

    def finish(self) -> None:
        """The run and its stop are over (the process is about to return): stop signals are
        only remembered from now on."""
        self.detach()
        self._backstop = None
        self._served = True

    @property
    def exit_status(self) -> int:
        """The status for a stop signal that came before the daemon served."""
        return stop_status(self.stop_signal)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self.reload_requested = True
            if self._target is not None:
                loop, daemon = self._target
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
                    loop.call_soon_threadsafe(daemon.request_reload)
            return
        again = self.stop_requested
        self.stop_requested = True
        if self.stop_signal is None:
            self.stop_signal = signum
        if self._target is not None:
            loop, daemon = self._target
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(daemon.request_stop)
            # Armed here, not only by the loop: a loop blocked now would never begin the stop.
            assert self._backstop is not None
            if again:
                self._backstop.cut_short(frame)
            else:
                self._backstop.arm_for(daemon.stop_budget.total_s)
        elif self._backstop is not None:
            self._backstop.cut_short(frame, at_once=True)
        elif self._served:
            return
        elif again:
            from devplug._kits.stopping import end_process

            end_process(self.exit_status)
        else:
            raise StopSignalled(signum)


def _drain(reader: socket.socket) -> None:
    """Empty the wakeup fd: waking the loop was all it was for (the handlers do the rest)."""
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while reader.recv(4096):
            pass


_process_guard: SignalGuard | None = None


def guard_signals() -> SignalGuard:
    """Install the process's :class:`SignalGuard` now, if none is (idempotent); return it.

    Call it first thing in an entry point, before slow imports: until then a SIGHUP kills the
    process. :func:`run_daemon` uses the guard installed here, and leaves it installed for the
    entry point that made it.
    """
    global _process_guard
    if _process_guard is None:
        _process_guard = SignalGuard()
        _process_guard.install()
    return _process_guard


_gc_paused = False


def pause_gc() -> None:
    """Turn the garbage collector off while the daemon's modules import (``devplug run``'s
    own process only: the command line calls it next to :func:`guard_signals`).

    Importing them allocates hundreds of thousands of long-lived objects (pydantic's schemas,
    protobuf descriptors, structlog, gRPC), and each burst of allocations runs a collection
    over all of them that frees almost nothing: 15-20 ms of a start-up whose goal is 250 ms.
    :func:`resume_gc` turns it back on once the daemon is built, before it scans.
    """
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """Undo :func:`pause_gc` (nothing if it did not turn the collector off). What was imported
    meanwhile is frozen (kept out of later passes): it lives as long as the process, and
    otherwise the first collection after this would walk all of it. The imports' cyclic
    garbage is frozen with it (~1,100 objects, ~270 KB here): a collection first would cost
    ~40 ms of start-up to get them back."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def _guarded() -> Iterator[SignalGuard]:
    """The process's guard for the block: the early one, or one made and removed here."""
    global _process_guard
    owned = _process_guard is None
    guard = guard_signals()
    try:
        yield guard
    finally:
        if owned:
            guard.restore()
            _process_guard = None


def run_daemon(
    settings: Settings,
    scanners: Sequence[Scanner],
    reload_config: Loader | None = None,
    *,
    program: str = "devplug",
    guard: SignalGuard | None = None,
) -> int:
    """Serve ``scanners`` with ``settings`` (logging already configured) until SIGTERM,
    SIGINT or SIGQUIT; SIGHUP calls ``reload_config`` (None: it only rescans) and applies the
    result (a refused one keeps the running config). A stop signal before the daemon serves
    ends the call without serving. Without ``guard``, the process's (:func:`guard_signals`)
    is used, or one for the call. While it stops, SIGALRM is the stop's backstop's; when it
    returns with threads still running that the interpreter's exit would wait for (one a
    hook started), it stays so until the stop budget's end, which then ends the process
    (``daemon.threads.abandoned``): call it last, and exit after it, as an entry point does.

    Returns the exit status: 0 after an orderly stop (threads still running when the stop
    budget is spent, or when another stop signal comes, are left behind), 2 when the daemon
    stopped on a configuration error (printed to stderr as ``<program>: configuration
    error: ...``), 130 when SIGINT (Ctrl-C) came before the daemon served, 1 if the daemon
    crashed (logged) or its stop did not finish within the budget or before a second stop
    signal (``daemon.stop.overdue``).
    """
    if guard is None:
        with _guarded() as guard:
            return run_daemon(settings, scanners, reload_config, program=program, guard=guard)
    import structlog

    log = structlog.get_logger(__name__)
    try:
        if not guard.stop_requested:  # one the code it interrupted swallowed
            return _serve(settings, scanners, reload_config, program, guard, log)
    except StopSignalled as stop:
        log.info("daemon.stopped", served=False)
        return stop.exit_status
    log.info("daemon.stopped", served=False)
    return guard.exit_status


def _serve(
    settings: Settings,
    scanners: Sequence[Scanner],
    reload_config: Loader | None,
    program: str,
    guard: SignalGuard,
    log: Any,
) -> int:
    # Before grpc loads: its core's own lines, read back into the log (see logconfig).
    from devplug.logconfig import CoreStderr

    core_stderr = CoreStderr()
    core_stderr.capture()
    import asyncio

    import structlog

    from devplug._kits.stopping import Backstop, UnlockedStderr, end_overdue, run_within_budget
    from devplug.daemon import Daemon
    from devplug.ops.limits import raise_fd_limit

    backstops: list[Backstop] = []  # the run's, once the daemon exists

    async def main() -> int:
        daemon = Daemon(
            settings, scanners, freeze_gc=True, config_loader=reload_config, name=program
        )
        resume_gc()  # everything the daemon runs with is imported; its scans allocate
        loop = asyncio.get_running_loop()
        core_stderr.follow(loop)
        # Its last words are said from a signal handler, past structlog's print lock.
        backstop = Backstop(daemon.stop_budget, structlog.wrap_logger(UnlockedStderr()), loop)
        backstops.append(backstop)
        daemon.stop_budget.watch(backstop.follow)
        # The guard's handlers pass the signals on (not the loop's own: see the module doc).
        guard.attach(loop, daemon, backstop)
        raise_fd_limit()  # systemd's soft 1,024 is too few to serve under load
        status = 0

        def stopped(error: BaseException | None) -> None:
            nonlocal status
            if error is not None:
                status = _crashed(error, program)
            backstop.stopped_status = status

        try:
            # The stop, and the worker threads after it, within the stop budget.
            outcome = await run_within_budget(daemon.run(), daemon.stop_budget, stopped)
        finally:
            guard.detach()
            core_stderr.unfollow()
        if outcome.overdue:
            end_overdue(outcome, daemon.stop_budget, log, status)
        return status

    try:
        status = asyncio.run(main())
    except Exception as exc:  # before the daemon ran: building it failed
        status = _crashed(exc, program)
    finally:
        core_stderr.release()
        # The interpreter's exit waits for every non-daemon thread (one a hook started) for
        # good: bounded by what is left of the budget, and ended by a stop signal (the guard
        # keeps passing them to the backstop while it is armed).
        if not (backstops and backstops[0].bound_exit()):
            guard.finish()
    return status


def _crashed(exc: BaseException, program: str) -> int:
    """Report what ended the daemon; the exit status for it."""
    refused = _config_error_in(exc)
    if refused is not None:
        print(f"{program}: configuration error: {refused}", file=sys.stderr)
        return EXIT_CONFIG
    import structlog

    structlog.get_logger(__name__).error("daemon.crashed", exc_info=exc)
    return 1


def _config_error_in(exc: BaseException) -> ConfigError | None:
    """The ConfigError that stopped the daemon (its task group wraps errors in groups)."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _config_error_in(inner)
            if found is not None:
                return found
    return None
