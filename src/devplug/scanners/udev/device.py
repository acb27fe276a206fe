"""One udev device as scanners see it: :class:`UdevDevice`, read-only and failure-tolerant.

Reads of a device that vanished half-way through a scan return None. Nothing read here is
trusted as a path until checked: device nodes must be normalised paths under /dev whose
components fit a file name, link targets are reduced to a validated basename, and attribute
names are relative paths that stay in /sys once sysfs's links are followed. Text that is not
UTF-8 reads as absent, and the device's sysfs path is noted with the reason (``problems``), so
one odd device is skipped with a warning instead of failing its scanner's whole scan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType

import pyudev

from devplug.model import is_device_node_path

# Real sysfs attributes are at most a page; anything larger is not an attribute we understand.
MAX_ATTRIBUTE_BYTES = 4096
MAX_NUMA_NODE = 1023
# Linux's NAME_MAX and PATH_MAX. libudev aborts the process (an assertion in
# sd_device_get_devname) on a DEVNAME whose first component is longer than NAME_MAX, so the
# node path is built from the DEVNAME property and checked here, never asked of libudev.
NAME_MAX = 255
PATH_MAX = 4096

# sys path -> why (part of) it could not be read; filled by reads, reported by the scan.
Problems = MutableMapping[str, str]


def is_sys_device_path(path: str) -> bool:
    """True for a normalised path under /sys/devices (what device paths and events carry)."""
    return (
        path.startswith("/sys/devices/")
        and "\0" not in path
        and ".." not in path.split("/")
        and os.path.normpath(path) == path
    )


def node_path_problem(path: str) -> str | None:
    """Why ``path`` is not usable as a device node path (None: it is)."""
    if not is_device_node_path(path):
        return "not a normalised path under /dev"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return "not UTF-8"
    if len(encoded) >= PATH_MAX:
        return f"longer than {PATH_MAX - 1} bytes"
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        return f"a path component is longer than {NAME_MAX} bytes"
    return None


def sub_path_problem(name: str) -> str | None:
    """Why ``name`` is not a path relative to a device's sysfs dir (None: it is)."""
    if not name:
        return "it is empty"
    if "\0" in name:
        return "it contains a NUL byte"
    if name.startswith("/"):
        return "it is absolute"
    try:
        encoded = name.encode("utf-8")  # what pyudev hands libudev
    except UnicodeEncodeError:
        return "it is not UTF-8"
    if len(encoded) >= PATH_MAX:
        return f"it is longer than {PATH_MAX - 1} bytes"
    for part in encoded.split(b"/"):
        if part in (b"", b".", b".."):
            return "it has an empty, '.' or '..' component"
        if len(part) > NAME_MAX:
            return f"a component is longer than {NAME_MAX} bytes"
    return None


def checked_sub_path(name: object, what: str) -> str:
    """``name`` if it is a sysfs sub-path (see :func:`sub_path_problem`), else ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"{what} names are strings, got {type(name).__name__}")
    problem = sub_path_problem(name)
    if problem is not None:
        raise ValueError(
            f"{what} names are paths relative to the device's sysfs dir, such as 'vendor' or "
            f"'queue/rotational'; got {name!r}: {problem}"
        )
    return name


def _undecodable(what: str) -> str:
    return f"{what} is not UTF-8; read as absent"


class UdevDevice:
    """A snapshot of one udev device's identity plus lazy, failure-tolerant reads."""

    __slots__ = ("_device", "_problems", "_properties")

    def __init__(self, device: pyudev.Device, problems: Problems | None = None) -> None:
        self._device = device
        self._properties: Mapping[str, str] | None = None
        self._problems: Problems = {} if problems is None else problems

    def __repr__(self) -> str:
        return f"UdevDevice({self.sys_path!r})"

    def _note(self, problem: str) -> None:
        self._problems.setdefault(self.sys_path, problem)

    @property
    def sys_path(self) -> str:
        # Decodable for every device a UdevSource hands out (it skips the others).
        return str(self._device.sys_path)

    @property
    def sys_name(self) -> str:
        return str(self._device.sys_name)

    @property
    def subsystem(self) -> str | None:
        try:
            value = self._device.subsystem
        except UnicodeDecodeError:
            self._note(_undecodable("SUBSYSTEM"))
            return None
        return None if value is None else str(value)

    @property
    def device_type(self) -> str | None:
        try:
            value = self._device.device_type
        except UnicodeDecodeError:
            self._note(_undecodable("DEVTYPE"))
            return None
        return None if value is None else str(value)

    @property
    def driver(self) -> str | None:
        """The bound driver, from the DRIVER property (the sysfs link target is not trusted)."""
        return self.property("DRIVER") or None

    @property
    def device_node(self) -> str | None:
        """The /dev path, or None when there is none or it is not a clean path under /dev.

        Built from DEVNAME (relative in sysfs' uevent file, absolute in events) rather than
        asked of libudev, which aborts on a name it cannot represent.
        """
        name = self.property("DEVNAME")
        if not name:
            return None
        path = name if name.startswith("/") else "/dev/" + name
        problem = node_path_problem(path)
        if problem is not None:
            self._note(f"device node name {path[:80]!a}: {problem}; skipped")
            return None
        return path

    @property
    def devlinks(self) -> tuple[str, ...]:
        """Symlinks to the node, from the DEVLINKS property (udev's database, or the event)."""
        links = (self.property("DEVLINKS") or "").split()
        return tuple(p for p in links if node_path_problem(p) is None)

    @property
    def properties(self) -> Mapping[str, str]:
        """Every udev property; values that are not UTF-8 are left out (and noted)."""
        if self._properties is None:
            snapshot: dict[str, str] = {}
            try:
                raw = self._device.properties
                for key in raw:
                    try:
                        snapshot[str(key)] = str(raw[key])
                    except UnicodeDecodeError:
                        self._note(_undecodable(f"property {key}"))
            except UnicodeDecodeError:
                self._note(_undecodable("a property name"))
            except (OSError, KeyError, pyudev.DeviceNotFoundError):
                pass  # gone: reads as no properties
            self._properties = MappingProxyType(snapshot)
        return self._properties

    def property(self, key: str) -> str | None:
        """One udev property, looked up alone (cheaper than the full ``properties`` snapshot)."""
        if self._properties is not None:
            return self._properties.get(key)
        try:
            value = self._device.properties.get(key)
        except UnicodeDecodeError:
            self._note(_undecodable(f"property {key}"))
            return None
        except (OSError, KeyError, pyudev.DeviceNotFoundError):
            return None
        return None if value is None else str(value)

    def attribute(self, name: str) -> str | None:
        """A sysfs attribute as stripped text, or None if missing, unreadable or oversized.

        ``name`` is a path relative to the device's sysfs dir, as pyudev takes it: ``vendor``,
        ``queue/rotational``, ``device/vendor`` (through sysfs's own link to the parent). A
        name that is not such a path raises ValueError; one that leads out of /sys through a
        link reads as None (and is noted).
        """
        if not self._inside_sysfs(checked_sub_path(name, "attribute")):
            return None
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
        """Basename of a symlink below the device's sysfs dir (``iommu_group`` -> "12",
        ``device/driver`` -> "i915"); ``name`` as for :meth:`attribute`."""
        if not self._inside_sysfs(checked_sub_path(name, "link")):
            return None
        try:
            target = os.readlink(os.path.join(self.sys_path, name))
        except OSError:
            return None
        base = os.path.basename(target.rstrip("/"))
        if not base or base in (".", "..") or "\0" in base:
            return None
        return base

    def _inside_sysfs(self, name: str) -> bool:
        """Whether the dir holding ``name`` (a checked sub-path) is still in /sys once its links
        are followed. libudev follows every link on the way (sysfs's ``device``, ``driver``,
        ``iommu_group``), all of which stay in /sys on a real host; one that leaves it (a
        tampered or mock sysfs) must not turn an attribute read into a read of any file."""
        folder = os.path.dirname(name)
        if not folder:
            return True  # a plain name: libudev refuses to read through a link there
        resolved = os.path.realpath(os.path.join(self.sys_path, folder))
        if resolved.startswith("/sys/"):
            return True
        self._note(f"{name!a} leads out of /sys (to {resolved[:80]!a}); read as absent")
        return False

    def parent(
        self, subsystem: str | None = None, device_type: str | None = None
    ) -> UdevDevice | None:
        """The nearest ancestor (of ``subsystem``/``device_type`` when given), or None."""
        try:
            if subsystem is None:
                found = self._device.parent
            else:
                found = self._device.find_parent(subsystem, device_type)
            if found is not None:
                str(found.sys_path)  # an ancestor is part of the path we hold: decodable
        except (OSError, UnicodeDecodeError, pyudev.DeviceNotFoundError):
            return None
        return None if found is None else UdevDevice(found, self._problems)

    def children(self, subsystem: str | None = None) -> list[UdevDevice]:
        kids: list[UdevDevice] = []
        try:
            for kid in self._device.children:
                try:
                    if subsystem is not None and kid.subsystem != subsystem:
                        continue
                    str(kid.sys_path)
                except UnicodeDecodeError:
                    self._note(_undecodable("a child's sysfs path or subsystem"))
                    continue
                kids.append(UdevDevice(kid, self._problems))
        except (OSError, pyudev.DeviceNotFoundError):
            return []
        return kids

    def numa_node(self) -> int | None:
        """The NUMA node of this device or its nearest ancestor that reports one (-1 = none)."""
        return numa_of_dir(self.sys_path, {})


def numa_of_dir(sys_path: str, cache: dict[str, int | None]) -> int | None:
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
