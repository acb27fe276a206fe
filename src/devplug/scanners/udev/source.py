"""The device source scanners enumerate: :class:`UdevSource`, over libudev.

A scan must never mistake "could not look" for "nothing there": a device dir that is gone is
absent, but any other failure to read sysfs (EMFILE when the process is out of file
descriptors, EACCES, EIO) raises :class:`SourceUnavailable`, so that the scan loop keeps the
scanner's previous result and retries. libudev itself swallows such errors (a device whose
uevent file cannot be opened just has no properties), hence :meth:`UdevSource.verify`, which
the scan runner calls after each scanner to check that the process could still open files.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Mapping

import pyudev

from devplug.errors import ScanCancelled
from devplug.model import is_device_node_path
from devplug.scanners.udev.device import (
    Problems,
    UdevDevice,
    is_sys_device_path,
    numa_of_dir,
)

# Errors that mean "not there (any more)": the rest mean the source could not be read.
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ENXIO})
# Errors that mean the process (or system) is out of file descriptors.
FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})


class SourceUnavailable(Exception):
    """sysfs could not be read (not: a device is gone). The scan's result would be wrong."""


_per_thread = threading.local()


def thread_context() -> pyudev.Context:
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


# Whether a kernel name is one a scanner asked for.
NameMatcher = Callable[[str], bool]


def name_matcher(sys_name: str | re.Pattern[str] | None) -> NameMatcher | None:
    """The test ``UdevSource.devices`` applies for ``sys_name`` (None: every name).

    A string is a glob as libudev's sysname match reads it (pyudev's ``sys_name=``), so an
    exact name matches itself; a compiled pattern must match the whole name.
    """
    if sys_name is None:
        return None
    if isinstance(sys_name, re.Pattern):
        if not isinstance(sys_name.pattern, str):
            raise TypeError("sys_name: a bytes pattern never matches a kernel name; use a str one")
        return lambda name: sys_name.fullmatch(name) is not None
    if not isinstance(sys_name, str):
        raise TypeError(
            "sys_name must be a kernel name or glob (str, e.g. 'card[0-9]*') or a compiled "
            f"regular expression (re.compile(...)), got {type(sys_name).__name__}"
        )
    if not sys_name or "/" in sys_name or "\0" in sys_name:
        raise ValueError(
            f"sys_name {sys_name!r} matches no device: kernel names are non-empty and hold no "
            "'/' or NUL; pass None for every name"
        )
    if not any(c in sys_name for c in "*?["):
        return lambda name: name == sys_name
    glob = re.compile(fnmatch.translate(sys_name))
    return lambda name: glob.match(name) is not None


def _check_subsystem(subsystem: object) -> None:
    if not isinstance(subsystem, str):
        raise TypeError(f"subsystem must be a str, got {type(subsystem).__name__}")
    if not subsystem or "/" in subsystem or "\0" in subsystem or subsystem in (".", ".."):
        raise ValueError(f"not a subsystem name: {subsystem!r}")


def _unavailable(what: str, exc: OSError) -> SourceUnavailable:
    reason = exc.strerror or str(exc)
    return SourceUnavailable(f"cannot read {what}: {reason} (errno {exc.errno})")


class UdevSource:
    """Enumerates devices through libudev. Create one per scan, in the scanning thread."""

    def __init__(self, cancelled: threading.Event | None = None) -> None:
        self._context = thread_context()
        self._numa_cache: dict[str, int | None] = {}
        # Set by the daemon when it stops: a scan in a worker thread cannot be cancelled from
        # the event loop, so it checks this between devices instead.
        self._cancelled = cancelled
        #: sys path (ascii-escaped when not UTF-8) -> why it was skipped or partly unreadable.
        self.problems: Problems = {}

    def numa_node(self, device: UdevDevice) -> int | None:
        """Like :meth:`UdevDevice.numa_node`, sharing walks between devices of one scan."""
        return numa_of_dir(device.sys_path, self._numa_cache)

    def verify(self) -> None:
        """Raise SourceUnavailable if files cannot be opened now (out of descriptors).

        libudev reads a device's uevent file lazily and reads a failure as "no properties", so
        a scan run while the process is out of descriptors would see devices without nodes and
        drop them. A scan is only as good as this check after it.
        """
        try:
            fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in FD_ERRNOS:
                raise _unavailable("sysfs", exc) from None
            return
        os.close(fd)

    def devices(
        self,
        subsystem: str | None = None,
        properties: Mapping[str, str] | None = None,
        sys_name: str | re.Pattern[str] | None = None,
    ) -> Iterator[UdevDevice]:
        """Devices of ``subsystem`` whose properties equal ``properties`` (all of them).

        ``sys_name`` keeps devices by kernel name: a string is a shell-style glob, as pyudev's
        ``list_devices(sys_name=...)`` takes it (libudev matches it with fnmatch): ``card[0-9]*``,
        or an exact name such as ``kvm``; a compiled regular expression must match the whole
        name. With a subsystem it is applied to directory entries before any device is opened
        (a drm class dir holds a card's connectors too, which a GPU scan need not open).

        The arguments are checked here, not when the devices are first read: a bad one raises
        TypeError or ValueError naming it.

        With a subsystem, devices are found by listing its class and bus directories, then
        opened one by one through libudev: the same set libudev's enumerator returns (a test
        compares them), about four times faster, because the enumerator builds and tests every
        device once more before handing out its path. Without one, libudev enumerates all.

        A device whose sysfs path or name is not UTF-8 is skipped and noted in ``problems``.
        """
        if subsystem is not None:
            _check_subsystem(subsystem)
        return self._devices(subsystem, dict(properties or {}), name_matcher(sys_name))

    def _devices(
        self,
        subsystem: str | None,
        wanted: Mapping[str, str],
        named: NameMatcher | None,
    ) -> Iterator[UdevDevice]:
        if subsystem is None:
            enumerator = self._context.list_devices()
            for key, value in wanted.items():
                enumerator = enumerator.match_property(key, value)
            found: Iterator[pyudev.Device] = iter(enumerator)
        else:
            found = self._subsystem_devices(subsystem, named)
        for device in found:
            if self._cancelled is not None and self._cancelled.is_set():
                raise ScanCancelled("scan cancelled: the daemon is stopping")
            view = self._view(device)
            if view is None:
                continue
            if named is not None and not named(view.sys_name):
                continue
            if subsystem is not None and any(view.property(k) != v for k, v in wanted.items()):
                continue
            yield view

    def _view(self, device: pyudev.Device) -> UdevDevice | None:
        """``device`` for scanners, or None (noted) when its path or name is not UTF-8."""
        try:
            str(device.sys_path)
            str(device.sys_name)
        except UnicodeDecodeError as exc:
            raw = exc.object if isinstance(exc.object, bytes) else b"?"
            self.problems.setdefault(ascii(raw)[2:-1], "sysfs path is not UTF-8; skipped")
            return None
        return UdevDevice(device, self.problems)

    def _subsystem_devices(
        self, subsystem: str, named: NameMatcher | None = None
    ) -> Iterator[pyudev.Device]:
        seen: set[str] = set()
        for directory in (f"/sys/class/{subsystem}", f"/sys/bus/{subsystem}/devices"):
            try:
                with os.scandir(directory) as entries:
                    paths = sorted(
                        entry.path for entry in entries if named is None or named(entry.name)
                    )
            except OSError as exc:
                if exc.errno in GONE_ERRNOS:
                    continue  # no such class or bus on this host
                raise _unavailable(directory, exc) from None
            for path in paths:
                try:
                    device = pyudev.Devices.from_sys_path(self._context, path)
                    key = str(device.sys_path)
                    same = device.subsystem == subsystem
                except (OSError, pyudev.DeviceNotFoundError):
                    continue  # not a device (class attribute files), or gone since listing
                except UnicodeError:
                    # A name that is not UTF-8 (scandir hands it out surrogate-escaped).
                    shown = ascii(path)[1:-1]
                    self.problems.setdefault(shown, "sysfs path is not UTF-8; skipped")
                    continue
                if not same or key in seen:
                    continue
                seen.add(key)
                yield device

    def device(self, sys_path: str) -> UdevDevice | None:
        """The device at ``sys_path`` as it is now, or None if it is gone."""
        if not is_sys_device_path(sys_path):
            raise ValueError(f"not a sysfs device path: {sys_path!r}")
        try:
            found = pyudev.Devices.from_sys_path(self._context, sys_path)
        except (OSError, UnicodeError, pyudev.DeviceNotFoundError):
            return None
        return self._view(found)

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
