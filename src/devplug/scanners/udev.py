"""The udev device source: the only module that imports pyudev.

Scanners see :class:`UdevDevice`, a read-only view that never raises because a device vanished
half-way through a scan: reads of a gone device return None. Nothing read here is trusted as a
path until checked: device nodes must be normalised paths under /dev, link targets are reduced
to a validated basename.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import pyudev

from devplug.errors import ScanCancelled
from devplug.model import is_device_node_path


def is_sys_device_path(path: str) -> bool:
    """True for a normalised path under /sys/devices (what device paths and events carry)."""
    return (
        path.startswith("/sys/devices/")
        and "\0" not in path
        and ".." not in path.split("/")
        and os.path.normpath(path) == path
    )


# Real sysfs attributes are at most a page; anything larger is not an attribute we understand.
MAX_ATTRIBUTE_BYTES = 4096
MAX_NUMA_NODE = 1023


class UdevDevice:
    """A snapshot of one udev device's identity plus lazy, failure-tolerant reads."""

    __slots__ = ("_device", "_properties")

    def __init__(self, device: pyudev.Device) -> None:
        self._device = device
        self._properties: Mapping[str, str] | None = None

    def __repr__(self) -> str:
        return f"UdevDevice({self.sys_path!r})"

    @property
    def sys_path(self) -> str:
        return str(self._device.sys_path)

    @property
    def sys_name(self) -> str:
        return str(self._device.sys_name)

    @property
    def subsystem(self) -> str | None:
        value = self._device.subsystem
        return None if value is None else str(value)

    @property
    def device_type(self) -> str | None:
        value = self._device.device_type
        return None if value is None else str(value)

    @property
    def driver(self) -> str | None:
        """The bound driver, from the DRIVER property (the sysfs link target is not trusted)."""
        return self.property("DRIVER") or None

    @property
    def device_node(self) -> str | None:
        """The /dev path, or None when there is none or it is not a clean path under /dev."""
        value = self._device.device_node
        if value is None:
            return None
        path = str(value)
        return path if is_device_node_path(path) else None

    @property
    def devlinks(self) -> tuple[str, ...]:
        """Symlinks to the node, from the DEVLINKS property (udev's database, or the event)."""
        links = (self.property("DEVLINKS") or "").split()
        return tuple(p for p in links if is_device_node_path(p))

    @property
    def properties(self) -> Mapping[str, str]:
        if self._properties is None:
            try:
                snapshot = {str(k): str(v) for k, v in self._device.properties.items()}
            except (OSError, KeyError, pyudev.DeviceNotFoundError):
                snapshot = {}
            self._properties = MappingProxyType(snapshot)
        return self._properties

    def property(self, key: str) -> str | None:
        """One udev property, looked up alone (cheaper than the full ``properties`` snapshot)."""
        if self._properties is not None:
            return self._properties.get(key)
        try:
            value = self._device.properties.get(key)
        except (OSError, KeyError, pyudev.DeviceNotFoundError):
            return None
        return None if value is None else str(value)

    def attribute(self, name: str) -> str | None:
        """A sysfs attribute as stripped text, or None if missing, unreadable or oversized."""
        if "/" in name or "\0" in name or name in ("", ".", ".."):
            raise ValueError(f"attribute names are plain file names, got {name!r}")
        try:
            raw = self._device.attributes.get(name)
        except (OSError, KeyError, pyudev.DeviceNotFoundError):
            return None
        if raw is None or len(raw) > MAX_ATTRIBUTE_BYTES:
            return None
        text = bytes(raw).decode("utf-8", "replace")
        if "\0" in text:
            return None
        return text.strip()

    def int_attribute(self, name: str, base: int = 0) -> int | None:
        """An integer attribute (decimal, or hex with 0x), or None if absent or not a number."""
        text = self.attribute(name)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            return None

    def link_basename(self, name: str) -> str | None:
        """Basename of a symlink in the device's sysfs dir (e.g. ``iommu_group`` -> "12")."""
        if "/" in name or "\0" in name or name in ("", ".", ".."):
            raise ValueError(f"link names are plain file names, got {name!r}")
        try:
            target = os.readlink(os.path.join(self.sys_path, name))
        except OSError:
            return None
        base = os.path.basename(target.rstrip("/"))
        if not base or base in (".", "..") or "\0" in base:
            return None
        return base

    def parent(
        self, subsystem: str | None = None, device_type: str | None = None
    ) -> UdevDevice | None:
        """The nearest ancestor (of ``subsystem``/``device_type`` when given), or None."""
        try:
            if subsystem is None:
                found = self._device.parent
            else:
                found = self._device.find_parent(subsystem, device_type)
        except (OSError, pyudev.DeviceNotFoundError):
            return None
        return None if found is None else UdevDevice(found)

    def children(self, subsystem: str | None = None) -> list[UdevDevice]:
        try:
            kids = list(self._device.children)
        except (OSError, pyudev.DeviceNotFoundError):
            return []
        return [UdevDevice(k) for k in kids if subsystem is None or k.subsystem == subsystem]

    def numa_node(self) -> int | None:
        """The NUMA node of this device or its nearest ancestor that reports one (-1 = none)."""
        return _numa_of_dir(self.sys_path, {})


def _numa_of_dir(sys_path: str, cache: dict[str, int | None]) -> int | None:
    """Walk up from ``sys_path`` to the first dir with a ``numa_node`` file, as the kernel's
    topology is inherited from the bus device (Intel's plugins do the same walk).

    Reads sysfs paths directly: the PCI function of a drm minor is a few directories up, and
    asking libudev for each parent costs a device object per level. ``cache`` maps dirs
    already walked (siblings share their parent) to their answer.
    """
    walked: list[str] = []
    current = os.path.normpath(sys_path)
    answer: int | None = None
    while current.startswith("/sys/devices/"):
        if current in cache:
            answer = cache[current]
            break
        walked.append(current)
        try:
            with open(os.path.join(current, "numa_node"), "rb") as handle:
                raw = handle.read(64)
        except OSError:
            current = os.path.dirname(current)
            continue
        try:
            node = int(raw.strip(b"\0 \n"))
        except ValueError:
            node = -1
        # Linux has at most 1,024 NUMA nodes (MAX_NUMNODES); anything else is garbage, and a
        # value past int64 would break the whole resource's ListAndWatch message.
        answer = node if 0 <= node <= MAX_NUMA_NODE else None
        break
    for path in walked:
        cache[path] = answer
    return answer


_per_thread = threading.local()


def _thread_context() -> pyudev.Context:
    """A libudev context for the calling thread, made once.

    Making one costs milliseconds (pyudev looks the library up with ``find_library``, which
    runs ``ldconfig``): too much for every incremental rescan. libudev contexts are not
    thread-safe, hence one per thread rather than one per process.
    """
    context: pyudev.Context | None = getattr(_per_thread, "context", None)
    if context is None:
        context = pyudev.Context()
        _per_thread.context = context
    return context


class UdevSource:
    """Enumerates devices through libudev. Create one per scan, in the scanning thread."""

    def __init__(self, cancelled: threading.Event | None = None) -> None:
        self._context = _thread_context()
        self._numa_cache: dict[str, int | None] = {}
        # Set by the daemon when it stops: a scan in a worker thread cannot be cancelled from
        # the event loop, so it checks this between devices instead.
        self._cancelled = cancelled

    def numa_node(self, device: UdevDevice) -> int | None:
        """Like :meth:`UdevDevice.numa_node`, sharing walks between devices of one scan."""
        return _numa_of_dir(device.sys_path, self._numa_cache)

    def devices(
        self,
        subsystem: str | None = None,
        properties: Mapping[str, str] | None = None,
        sys_name: re.Pattern[str] | None = None,
    ) -> Iterator[UdevDevice]:
        """Devices of ``subsystem`` whose properties equal ``properties`` (all of them).

        ``sys_name`` keeps devices whose kernel name matches it in full; with a subsystem it is
        applied to directory entries before any device is opened (a drm class dir holds a
        card's connectors too, which a GPU scan need not open).

        With a subsystem, devices are found by listing its class and bus directories, then
        opened one by one through libudev: the same set libudev's enumerator returns (a test
        compares them), about four times faster, because the enumerator builds and tests every
        device once more before handing out its path. Without one, libudev enumerates all.
        """
        wanted = dict(properties or {})
        if subsystem is None:
            enumerator = self._context.list_devices()
            for key, value in wanted.items():
                enumerator = enumerator.match_property(key, value)
            found: Iterator[pyudev.Device] = iter(enumerator)
        else:
            found = self._subsystem_devices(subsystem, sys_name)
        for device in found:
            if self._cancelled is not None and self._cancelled.is_set():
                raise ScanCancelled("scan cancelled: the daemon is stopping")
            view = UdevDevice(device)
            if sys_name is not None and not sys_name.fullmatch(view.sys_name):
                continue
            if subsystem is not None and any(view.property(k) != v for k, v in wanted.items()):
                continue
            yield view

    def _subsystem_devices(
        self, subsystem: str, sys_name: re.Pattern[str] | None = None
    ) -> Iterator[pyudev.Device]:
        if not subsystem or "/" in subsystem or "\0" in subsystem or subsystem in (".", ".."):
            raise ValueError(f"not a subsystem name: {subsystem!r}")
        seen: set[str] = set()
        for directory in (f"/sys/class/{subsystem}", f"/sys/bus/{subsystem}/devices"):
            try:
                with os.scandir(directory) as entries:
                    paths = sorted(
                        entry.path
                        for entry in entries
                        if sys_name is None or sys_name.fullmatch(entry.name)
                    )
            except OSError:
                continue
            for path in paths:
                try:
                    device = pyudev.Devices.from_sys_path(self._context, path)
                except (OSError, pyudev.DeviceNotFoundError):
                    continue  # not a device (class attribute files), or gone since listing
                if device.subsystem != subsystem or device.sys_path in seen:
                    continue
                seen.add(device.sys_path)
                yield device

    def device(self, sys_path: str) -> UdevDevice | None:
        """The device at ``sys_path`` as it is now, or None if it is gone."""
        if not is_sys_device_path(sys_path):
            raise ValueError(f"not a sysfs device path: {sys_path!r}")
        try:
            return UdevDevice(pyudev.Devices.from_sys_path(self._context, sys_path))
        except (OSError, pyudev.DeviceNotFoundError):
            return None

    @staticmethod
    def node_exists(path: str) -> bool:
        """True if ``path`` is a character or block device node (stat only, never opened)."""
        if not is_device_node_path(path):
            return False
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


# ---------------------------------------------------------------------------------- events

# Kernel uevent actions; anything else on the socket is ignored.
UEVENT_ACTIONS = frozenset(
    {"add", "remove", "change", "move", "online", "offline", "bind", "unbind"}
)
# How much the kernel may queue for us before it drops events (ENOBUFS). Raising it above
# net.core.rmem_max needs CAP_NET_ADMIN; without it the default stays and overflow is handled.
MONITOR_BUFFER_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class UdevEvent:
    """What a uevent said happened. A hint of where to look, never trusted as device state:
    scanners re-read the device from sysfs."""

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
        self._monitor: pyudev.Monitor | None = pyudev.Monitor.from_netlink(
            _thread_context(), source
        )
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
        OSError and the monitor should be closed.
        """
        events: list[UdevEvent] = []
        overflowed = False
        while len(events) < limit:
            try:
                device = self._receive_one()
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                overflowed = True
                continue
            if device is None:
                return ReceivedEvents(tuple(events), overflowed)
            action = device.action
            sys_path = str(device.sys_path)
            if action not in UEVENT_ACTIONS or not is_sys_device_path(sys_path):
                continue
            subsystem = None if device.subsystem is None else str(device.subsystem)
            if action == "move":
                # A renamed device: its old path is gone, and devices built from it with it.
                old = device.properties.get("DEVPATH_OLD")
                old_path = None if old is None else "/sys" + str(old)
                if old_path is not None and is_sys_device_path(old_path):
                    events.append(UdevEvent("remove", old_path, subsystem))
            events.append(UdevEvent(str(action), sys_path, subsystem))
        return ReceivedEvents(tuple(events), overflowed, more=True)

    def close(self) -> None:
        # pyudev closes the socket when the last reference to its monitor goes.
        self._monitor = None
