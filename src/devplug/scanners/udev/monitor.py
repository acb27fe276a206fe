"""udev events: :class:`UdevMonitor`, a non-blocking netlink socket read in batches.

An event is a hint of where to look, never device state: scanners re-read what it names. An
event that cannot be read (a DEVPATH that is not UTF-8, say) is skipped and counted; the
others read in the same batch are kept.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable
from dataclasses import dataclass

import pyudev

from devplug.scanners.udev.device import is_sys_device_path
from devplug.scanners.udev.source import thread_context

# Kernel uevent actions; anything else on the socket is ignored.
UEVENT_ACTIONS = frozenset(
    {"add", "remove", "change", "move", "online", "offline", "bind", "unbind"}
)
# How much the kernel may queue for us before it drops events (ENOBUFS). Raising it above
# net.core.rmem_max needs CAP_NET_ADMIN; without it the default stays and overflow is handled.
MONITOR_BUFFER_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class UdevEvent:
    """What a uevent said happened. ``add`` and ``change`` say where to look: scanners re-read
    the device from sysfs. ``remove`` is believed (the kernel sends it before it deletes the
    device's sysfs dir): :class:`~devplug.scanners.incremental.RemovedPaths`."""

    action: str
    sys_path: str
    subsystem: str | None


@dataclass(frozen=True, slots=True)
class ReceivedEvents:
    events: tuple[UdevEvent, ...]
    # True when the kernel dropped events because our socket was full (ENOBUFS): what happened
    # in between is unknown, so everything must be rescanned.
    overflowed: bool = False
    # True when the read stopped at ``limit`` with more possibly waiting.
    more: bool = False
    # Events that could not be read (text that is not UTF-8) and were skipped.
    unreadable: int = 0


class UdevMonitor:
    """A non-blocking udev/kernel event socket (pyudev.Monitor), for ``loop.add_reader``.

    ``subsystems`` installs libudev's socket filter, so events of other subsystems never wake
    the daemon; None receives everything.
    """

    def __init__(self, source: str, subsystems: Iterable[str] | None = None) -> None:
        if source not in ("udev", "kernel"):
            raise ValueError(f"monitor source must be 'udev' or 'kernel', got {source!r}")
        self.source = source
        # The calling thread's context: making one per attempt would run ldconfig each time.
        self._monitor: pyudev.Monitor | None = pyudev.Monitor.from_netlink(thread_context(), source)
        for subsystem in sorted(subsystems or ()):
            self._monitor.filter_by(subsystem)
        self._monitor.start()
        with contextlib.suppress(OSError):
            self._monitor.set_receive_buffer_size(MONITOR_BUFFER_BYTES)

    def fileno(self) -> int:
        if self._monitor is None:
            raise ValueError("monitor is closed")
        return int(self._monitor.fileno())

    def _receive_one(self) -> pyudev.Device | None:
        """One event, or None when the socket is empty (raises OSError on socket errors)."""
        if self._monitor is None:
            return None
        # Not the public poll(): it turns the socket's pending error (POLLERR, which is how
        # ENOBUFS shows) into an OSError without errno, losing the one fact that matters here.
        # The socket is non-blocking (start() set it), so this returns None when it is empty.
        device: pyudev.Device | None = self._monitor._receive_device()
        return device

    def receive(self, limit: int) -> ReceivedEvents:
        """Read up to ``limit`` waiting events without blocking.

        ENOBUFS (the kernel dropped events) is reported, not raised; other socket errors raise
        OSError and the monitor should be closed. Unreadable events are counted and skipped.
        """
        events: list[UdevEvent] = []
        overflowed = False
        unreadable = 0
        while len(events) + unreadable < limit:
            try:
                device = self._receive_one()
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                overflowed = True
                continue
            if device is None:
                return ReceivedEvents(tuple(events), overflowed, unreadable=unreadable)
            try:
                events.extend(_events_of(device))
            except UnicodeDecodeError:
                unreadable += 1
        return ReceivedEvents(tuple(events), overflowed, more=True, unreadable=unreadable)

    def close(self) -> None:
        # pyudev closes the socket when the last reference to its monitor goes.
        self._monitor = None


def _events_of(device: pyudev.Device) -> list[UdevEvent]:
    """The events one uevent stands for (none if it is not one we act on); raises
    UnicodeDecodeError if its text is not UTF-8."""
    action = device.action
    sys_path = str(device.sys_path)
    if action not in UEVENT_ACTIONS or not is_sys_device_path(sys_path):
        return []
    subsystem = None if device.subsystem is None else str(device.subsystem)
    found: list[UdevEvent] = []
    if action == "move":
        # A renamed device: its old path is gone, and devices built from it with it.
        old = device.properties.get("DEVPATH_OLD")
        old_path = None if old is None else "/sys" + str(old)
        if old_path is not None and is_sys_device_path(old_path):
            found.append(UdevEvent("remove", old_path, subsystem))
    found.append(UdevEvent(str(action), sys_path, subsystem))
    return found
