"""What scanners can read of a host, as plain values: :func:`snapshot_devices`, for
``devplug capture``.

A snapshot holds every device of the subsystems asked for (every device for None), and each
device above them (a drm card's PCI function, a tty's USB interface): its udev properties as
scanners see them, the attribute files and links of its sysfs dir, its /dev node when a
character or block node is there, and the symlinks under /dev that lead to that node.

Nothing is written and no device node is opened. Attributes are read as any reader of sysfs
reads them, a page at most, except the files whose reading reaches the hardware or that hold
raw firmware or identity data no scanner reads (PCI BARs, ROM, config space, VPD, SCSI
INQUIRY and VPD pages, a monitor's EDID, ATA IDENTIFY data): binary records of serial numbers
and WWNs that scrubbing could not take apart. Directories below a device that are devices of
their own are left to their own entry.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from devplug.scanners.udev.device import MAX_ATTRIBUTE_BYTES, UdevDevice, node_path_problem
from devplug.scanners.udev.source import GONE_ERRNOS, SourceUnavailable, UdevSource

# Read through the hardware (PCI BARs: an I/O BAR's read does port I/O), actions, or raw
# firmware, config and identity data that no scanner reads and that holds serial numbers and
# WWNs: PCI VPD and config space (PCIe's DSN capability), SCSI VPD pages (vpd_pg80: the unit
# serial, vpd_pg83: the WWN designators) and INQUIRY data (vendor-specific bytes hold serials),
# a drm connector's EDID (the monitor's serial).
SKIPPED_ATTRIBUTES: Final = re.compile(
    r"resource\d+(_wc)?|rom|config|vpd(_pg[0-9a-f]+)?|inquiry|edid"
    r"|remove|rescan|reset|bind|unbind|new_id|remove_id"
)
# By subsystem, where the name alone says too little: ata_device's ``id`` is the IDENTIFY
# DEVICE data as hex text (the serial, byte-swapped, and the WWN).
SKIPPED_SUBSYSTEM_ATTRIBUTES: Final = {"ata_device": frozenset({"id"})}
# Properties that describe an event or udev's timing, not the device.
SKIPPED_PROPERTIES: Final = frozenset({"DEVPATH", "USEC_INITIALIZED", "ACTION", "SEQNUM"})
# How deep below a device's dir attribute subdirectories are read (power/, queue/, ...).
MAX_ATTRIBUTE_DEPTH: Final = 2
# Entries of one device's dir (and its subdirs) looked at, at most: a guard, not a real limit.
MAX_DEVICE_ENTRIES: Final = 4096
# Entries under /dev looked at for symlinks to captured nodes.
MAX_DEV_ENTRIES: Final = 100_000
# /dev directories that hold no device links (filesystems and per-process links).
_DEV_SKIPPED: Final = frozenset({"pts", "shm", "mqueue", "hugepages", "fd"})
_MAX_LINK_HOPS: Final = 8


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """One device as captured. Paths below /dev are relative (``dri/card0``)."""

    sys_path: str
    properties: Mapping[str, str]
    attributes: Mapping[str, bytes]
    links: Mapping[str, str]
    node: str | None = None
    devlinks: tuple[str, ...] = ()

    @property
    def subsystem(self) -> str:
        return self.properties["SUBSYSTEM"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The devices, sorted by sys path (parents first), and what could not be read."""

    devices: tuple[DeviceSnapshot, ...]
    # sys path -> why (part of) it was skipped, as UdevSource notes it
    problems: Mapping[str, str] = field(default_factory=dict)


def snapshot_devices(subsystems: Iterable[str] | None) -> Snapshot:
    """Every device of ``subsystems`` (None: of all) and the devices above them.

    Raises SourceUnavailable when sysfs could not be read (not: a device went meanwhile).
    """
    source = UdevSource()
    found: dict[str, UdevDevice] = {}
    groups: list[str | None] = [None] if subsystems is None else [*sorted(set(subsystems))]
    for subsystem in groups:
        for device in source.devices(subsystem):
            current: UdevDevice | None = device
            while current is not None and current.sys_path not in found:
                if current.subsystem is not None:
                    found[current.sys_path] = current
                current = current.parent()
    source.verify()
    nodes: dict[str, str] = {}  # node below /dev -> sys path
    partial: list[tuple[UdevDevice, dict[str, str], str | None]] = []
    for path in sorted(found):
        device = found[path]
        properties = {
            key: value
            for key, value in sorted(device.properties.items())
            if key not in SKIPPED_PROPERTIES
        }
        if "SUBSYSTEM" not in properties:
            continue  # gone since it was listed
        node = _node(device)
        if node is not None:
            nodes[node] = path
        partial.append((device, properties, node))
    devlinks = _links_to_nodes(nodes)
    devices = []
    for device, properties, node in partial:
        skipped = SKIPPED_SUBSYSTEM_ATTRIBUTES.get(properties["SUBSYSTEM"], frozenset())
        attributes, links = _read_dir(device.sys_path, skipped)
        devices.append(
            DeviceSnapshot(
                sys_path=device.sys_path,
                properties=properties,
                attributes=attributes,
                links=links,
                node=node,
                devlinks=tuple(devlinks.get(node, ())) if node is not None else (),
            )
        )
    return Snapshot(tuple(devices), dict(source.problems))


def _node(device: UdevDevice) -> str | None:
    """The node below /dev, if a character or block node is there now."""
    path = device.device_node
    if path is None:
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
        return None
    return path.removeprefix("/dev/")


def _read_dir(sys_path: str, skipped: frozenset[str]) -> tuple[dict[str, bytes], dict[str, str]]:
    """The attribute files and links of a device's dir, by name relative to it; ``skipped``
    names top-level attribute files left out besides SKIPPED_ATTRIBUTES."""
    attributes: dict[str, bytes] = {}
    links: dict[str, str] = {}
    budget = [MAX_DEVICE_ENTRIES]
    _read_subdir(sys_path, "", 0, attributes, links, budget)
    for name in skipped:
        attributes.pop(name, None)
    return attributes, links


def _read_subdir(
    top: str,
    prefix: str,
    depth: int,
    attributes: dict[str, bytes],
    links: dict[str, str],
    budget: list[int],
) -> None:
    directory = os.path.join(top, prefix) if prefix else top
    try:
        with os.scandir(directory) as listing:
            entries = sorted(listing, key=lambda e: e.name)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS or prefix:
            return  # gone, or a subdir that cannot be listed (as umockdev-record skips it)
        raise SourceUnavailable(f"cannot read {directory}: {exc.strerror or exc}") from None
    names = {entry.name for entry in entries}
    if prefix and "uevent" in names:
        return  # a device of its own, captured (or not) as itself
    for entry in entries:
        budget[0] -= 1
        if budget[0] < 0:
            return
        name = entry.name
        # umockdev's format splits "name=value" at the first '='.
        if name.startswith(".") or "=" in name or "\n" in name:
            continue
        relative = f"{prefix}/{name}" if prefix else name
        if entry.is_symlink():
            if name != "subsystem":  # the subsystem is the SUBSYSTEM property
                try:
                    links[relative] = os.readlink(entry.path)
                except OSError:
                    continue
        elif entry.is_dir(follow_symlinks=False):
            if depth < MAX_ATTRIBUTE_DEPTH:
                _read_subdir(top, relative, depth + 1, attributes, links, budget)
        elif name != "uevent" and not SKIPPED_ATTRIBUTES.fullmatch(name):
            value = _read_attribute(entry.path)
            if value is not None:
                attributes[relative] = value


def _read_attribute(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # write-only, EACCES, "no such device": as umockdev-record skips them
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        value = os.read(fd, MAX_ATTRIBUTE_BYTES + 1)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise SourceUnavailable(f"cannot read {path}: {exc.strerror}") from None
        return None
    finally:
        os.close(fd)
    return value if len(value) <= MAX_ATTRIBUTE_BYTES else None


def _links_to_nodes(nodes: Mapping[str, str]) -> dict[str, list[str]]:
    """Symlinks under /dev that lead, through /dev only, to one of ``nodes``: node -> links.

    Read from /dev itself rather than from DEVLINKS: a container without udev's database sees
    the links it has (the by-path links of GPUs), and scanners look at the links, not the
    property.
    """
    found: dict[str, list[str]] = {}
    if not nodes:
        return found
    seen = 0
    pending = ["/dev"]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_DEV_ENTRIES:
                return found
            if entry.name.startswith("."):
                continue
            if entry.is_symlink():
                target = _follow_in_dev(entry.path)
                if target is not None and target in nodes:
                    found.setdefault(target, []).append(entry.path.removeprefix("/dev/"))
            elif entry.is_dir(follow_symlinks=False) and not (
                directory == "/dev" and entry.name in _DEV_SKIPPED
            ):
                pending.append(entry.path)
    for links in found.values():
        links.sort()
    return found


def _follow_in_dev(path: str) -> str | None:
    """The node below /dev a symlink leads to, or None (not a link, or it leaves /dev)."""
    current = path
    for _ in range(_MAX_LINK_HOPS):
        try:
            target = os.readlink(current)
        except OSError:
            break  # not a link (any more): ``current`` is where it leads
        current = os.path.normpath(os.path.join(os.path.dirname(current), target))
        if not current.startswith("/dev/"):
            return None
    else:
        return None
    if current == path or node_path_problem(current) is not None:
        return None
    return current.removeprefix("/dev/")
