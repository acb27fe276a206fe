"""udev events for the scan loop: a monitor socket read through ``loop.add_reader``, batched.

No thread waits on the socket: the event loop's selector wakes the reader when datagrams arrive,
the reader drains them into a pending batch (one entry per sysfs path, the newest action wins),
notes when it read them and tells the scan loop, which waits for the burst to end (a short quiet
gap), takes the batch and rescans what it names. Kernel events (used without udevd's) are
re-read once more a second later, when udevd has applied its rules. A ``remove`` is believed
at once (sysfs may show the device a moment longer), and looked at again a second later from
either source, as a ``change``: never a second removal, as the device may be back by then
(its ``add`` lost to an overflow, or a ``udevadm trigger --action=remove`` of a device that
stays). When the kernel drops events
(ENOBUFS) the batch is marked overflowed and the scan loop rescans everything. An event that
cannot be read (a DEVPATH that is not UTF-8) is skipped and logged; the events read with it are
kept. A monitor that cannot be opened, or that fails, is not fatal: the daemon polls instead and
tries to open it again at every poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from devplug._kits.problems import ProblemLog
from devplug.scanners.udev import UdevEvent, UdevMonitor

log = structlog.get_logger(__name__)

UDEV_CONTROL = Path("/run/udev/control")
# Datagrams read per wake-up; more wait for the next one, so a storm cannot hog the loop.
MAX_EVENTS_PER_READ = 256
# Beyond this many distinct pending paths, a full rescan is cheaper than remembering them.
MAX_PENDING_PATHS = 20_000
# With kernel events, the paths are read again this long after, once udevd has applied its
# rules (udevd handles a device in tens of milliseconds; a second leaves ample margin); so are
# removed paths, from either source.
RECHECK_S = 1.0
# Timers may fire a clock tick early; paths due within this are taken in the same pass.
RECHECK_SLACK_S = 0.001

MonitorSource = Literal["udev", "kernel"]
MonitorOpener = Callable[[MonitorSource, frozenset[str] | None], UdevMonitor]


def choose_source(setting: str, udev_control: Path = UDEV_CONTROL) -> MonitorSource | None:
    """The monitor source for ``hotplug.source``; None means no events (polling only).

    ``auto`` takes udevd's events when udevd runs (they come after its rules created nodes and
    links); without udevd (many containers) a udev monitor would open and never hear
    anything, so it takes the kernel's.
    """
    if setting == "auto":
        return "udev" if udev_control.exists() else "kernel"
    choices: dict[str, MonitorSource | None] = {"udev": "udev", "kernel": "kernel", "none": None}
    if setting not in choices:
        raise ValueError(f"unknown hotplug source {setting!r}")
    return choices[setting]


@dataclass(frozen=True, slots=True)
class EventBatch:
    events: tuple[UdevEvent, ...] = ()
    # Events were lost (socket overflow, monitor failure): rescan everything.
    overflowed: bool = False

    def __bool__(self) -> bool:
        return bool(self.events) or self.overflowed


class UeventListener:
    def __init__(
        self,
        source: MonitorSource | None,
        subsystems: frozenset[str] | None,
        on_pending: Callable[[], None],
        opener: MonitorOpener = UdevMonitor,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.source = source
        self.recheck_s = recheck_s
        self.subsystems = subsystems
        self._on_pending = on_pending
        self._opener = opener
        self._monitor: UdevMonitor | None = None
        self._fd = -1
        self._pending: dict[str, UdevEvent] = {}
        # sys path -> (loop time it is due, its event), in due order.
        self._recheck: dict[str, tuple[float, UdevEvent]] = {}
        self._recheck_timer: asyncio.TimerHandle | None = None
        self._overflowed = False
        self._problems = ProblemLog()
        self.received = 0
        self.overflows = 0
        self.unreadable = 0
        # When datagrams were last read (time.monotonic(), the event loop's clock): the scan
        # loop's coalescing window ends once none came for a short while.
        self.last_read = 0.0

    @property
    def active(self) -> bool:
        return self._monitor is not None

    def open(self) -> bool:
        """Open the monitor if it is not open; True if events are being received."""
        if self._monitor is not None:
            return True
        if self.source is None:
            return False
        try:
            monitor = self._opener(self.source, self.subsystems)
            fd = monitor.fileno()
            asyncio.get_running_loop().add_reader(fd, self._on_readable)
        except (OSError, ValueError) as exc:
            self._problems.report(
                log,
                "udev.monitor.unavailable",
                str(exc) or type(exc).__name__,
                key="open",
                field="error",
                source=self.source,
                fallback="polling; will retry opening the monitor at every poll",
            )
            return False
        self._monitor, self._fd = monitor, fd
        self._problems.solved("open")
        log.info(
            "udev.monitor.listening",
            source=self.source,
            subsystems="all" if self.subsystems is None else sorted(self.subsystems),
        )
        return True

    def close(self) -> None:
        if self._recheck_timer is not None:
            self._recheck_timer.cancel()
            self._recheck_timer = None
        self._recheck = {}
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        asyncio.get_running_loop().remove_reader(self._fd)
        monitor.close()
        self._fd = -1

    def retarget(self, subsystems: frozenset[str] | None, source: MonitorSource | None) -> None:
        """Listen to ``subsystems`` from ``source`` from now on (a reload). Closed, then opened
        again when they change: the full scan that follows a reload covers the gap."""
        if (subsystems, source) == (self.subsystems, self.source):
            return
        self.close()
        self.subsystems, self.source = subsystems, source
        self.open()

    def take(self) -> EventBatch:
        """The events received since the last call (and whether some were lost)."""
        batch = EventBatch(tuple(self._pending.values()), self._overflowed)
        self._pending = {}
        self._overflowed = False
        return batch

    def _on_readable(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        try:
            received = monitor.receive(MAX_EVENTS_PER_READ)
        except OSError as exc:
            log.error(
                "udev.monitor.failed",
                source=self.source,
                error=str(exc),
                fallback="full rescan, then polling until the monitor reopens",
            )
            self.close()
            self._overflowed = True
            self._on_pending()
            return
        if received.overflowed:
            self.overflows += 1
            log.warning(
                "udev.monitor.overflow",
                source=self.source,
                consequence="events were lost; rescanning everything",
            )
            self._overflowed = True
        if received.unreadable:
            self.unreadable += received.unreadable
            # Once per wake-up at most: a flood of bad events must not flood the log too.
            log.warning(
                "udev.event.unreadable",
                source=self.source,
                count=received.unreadable,
                reason="not UTF-8",
                consequence="skipped; the other events read with it are kept",
            )
        self.received += len(received.events)
        if received.events:
            self.last_read = time.monotonic()
        self._add_pending(received.events)
        if received.events:
            self._schedule_recheck(received.events)
        if received.events or received.overflowed:
            self._on_pending()

    def _add_pending(self, events: Iterable[UdevEvent]) -> None:
        for event in events:
            self._pending[event.sys_path] = event
        if len(self._pending) > MAX_PENDING_PATHS:
            self._pending = {}
            self._overflowed = True

    def _schedule_recheck(self, events: Iterable[UdevEvent]) -> None:
        """Re-read the paths of kernel events, and removed paths, once more a while later.

        Kernel events come before udevd runs its rules: the device's udev properties (ID_*,
        DEVLINKS) may not exist yet. Without udevd's own events (no udevd, or a pod outside
        the host network namespace, where they are not delivered) nothing else would tell us
        when they do. A removal, believed at once, is looked at again whatever the source: a
        device still there then (a remove event for a device that stays) comes back.
        """
        loop = asyncio.get_running_loop()
        due = loop.time() + self.recheck_s
        for event in events:
            if event.action == "remove":
                # Done already (scanners believe a removal at once): the re-check only looks.
                again = dataclasses.replace(event, action="change")
            elif self.source == "kernel":
                again = event
            else:
                continue
            # Re-inserted at the end: the dict stays ordered by due time.
            self._recheck.pop(event.sys_path, None)
            self._recheck[event.sys_path] = (due, again)
        if len(self._recheck) > MAX_PENDING_PATHS:
            self._recheck = {}
            self._overflowed = True  # the full rescan this causes re-reads everything anyway
        if self._recheck_timer is None and self._recheck:
            first_due = next(iter(self._recheck.values()))[0]
            self._recheck_timer = loop.call_at(first_due, self._recheck_now)

    def _recheck_now(self) -> None:
        """Re-read the paths that are due; re-arm the timer for the next one."""
        self._recheck_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time() + RECHECK_SLACK_S
        due: list[UdevEvent] = []
        while self._recheck:
            path, (when, event) = next(iter(self._recheck.items()))
            if when > now:
                self._recheck_timer = loop.call_at(when, self._recheck_now)
                break
            del self._recheck[path]
            due.append(event)
        if due and self._monitor is not None:
            self._add_pending(due)
            self._on_pending()
