"""A new device's files in the testbed, and where each testbed file lives.

:func:`_write_device` writes what umockdev itself would write for one device: the sysfs dir
(attributes, links, ``subsystem``, ``driver``, ``dev``, ``uevent``), the class or bus link
that enumeration walks, the ``/sys/dev`` and ``/sys/block`` links, and the /dev node with the
``.node`` metadata the preload takes ``st_rdev`` from, plus devlinks. :class:`_TestbedPaths`
maps sys and /dev paths into the testbed, for this module and for the host's mutations.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from devplug.testing.umockdev.files import (
    _check_name,
    _check_property,
    _check_relative,
    _dev_relative,
    _format_uevent,
    _write,
)

# Subsystems whose devices live under /sys/bus/<subsystem>/devices (all others are classes).
# umockdev keeps a similar built-in list; a caller can override it per device with bus=.
_BUS_SUBSYSTEMS: Final = frozenset(
    {
        "acpi",
        "amba",
        "auxiliary",
        "cpu",
        "cxl",
        "dax",
        "gpio",
        "hid",
        "i2c",
        "mdev",
        "mdio_bus",
        "memory",
        "mmc",
        "nd",
        "nvmem",
        "pci",
        "pci_express",
        "platform",
        "pnp",
        "scsi",
        "sdio",
        "serio",
        "spi",
        "thunderbolt",
        "typec",
        "usb",
        "usb-serial",
        "virtio",
        "vmbus",
        "xen",
        "xen-backend",
    }
)

# Names the module writes itself in a device dir; callers may not use them as attributes/links.
_RESERVED_NAMES: Final = frozenset({"uevent", "subsystem", "driver"})


@dataclass(frozen=True)
class MockNode:
    """A /dev node: ``path`` relative to /dev (a leading ``/dev/`` is accepted)."""

    path: str
    major: int
    minor: int
    kind: Literal["c", "b"] = "c"

    def __post_init__(self) -> None:
        if self.kind not in ("c", "b") or self.major < 0 or self.minor < 0:
            raise ValueError(f"invalid device node: {self}")
        _dev_relative(self.path)

    @property
    def relative_path(self) -> str:
        """The path below /dev, e.g. ``dri/card0``."""
        return _dev_relative(self.path)


@dataclass
class _Device:
    sys_path: str
    subsystem: str
    properties: dict[str, str]
    node: MockNode | None
    # Absolute host paths outside the device dir that belong to this device (class/bus/dev
    # links, the /dev node and its metadata, devlinks); removed with the device.
    external: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _TestbedPaths:
    """Host paths inside the testbed rooted at ``root`` (a canonical absolute path)."""

    root: str

    def device_dir(self, sys_path: str) -> str:
        """The host path of a canonical ``/sys/...`` path."""
        return self.root + sys_path

    def dev_entry(self, rel: str) -> str:
        """The host path of a /dev entry given relative to /dev."""
        return os.path.join(self.root, "dev", rel)

    def node_meta(self, rel: str) -> str:
        """The ``dev/.node`` link whose target ("MAJOR:MINOR") the preload reports as st_rdev."""
        return os.path.join(self.root, "dev", ".node", rel.replace("/", "_"))

    def driver_target(self, canonical: str, subsystem: str, driver: str) -> str:
        """The target of a device's ``driver`` link."""
        # Relative like real sysfs; the target dir does not exist (trap 7: read the basename).
        target = os.path.join(self.root, "sys", "bus", subsystem, "drivers", driver)
        return os.path.relpath(target, self.device_dir(canonical))


def _write_node_file(path: str, node: MockNode) -> None:
    _write(path, b"")
    # The preload reports a block device for a file with the sticky bit, else char.
    os.chmod(path, 0o1660 if node.kind == "b" else 0o660)


def _write_device(
    paths: _TestbedPaths,
    canonical: str,
    subsystem: str,
    *,
    attributes: Mapping[str, str | bytes],
    properties: Mapping[str, str],
    links: Mapping[str, str],
    node: MockNode | None,
    devlinks: Sequence[str],
    driver: str | None,
    bus: bool | None,
) -> _Device:
    """Write a new device's files and return its record (see ``UmockdevHost.add_device``).

    The caller has checked the path's shape, that it is new, the subsystem's name and the
    parent; the rest is checked here. Raises ValueError on name clashes.
    """
    name = canonical.split("/")[-1]
    is_bus = subsystem in _BUS_SUBSYSTEMS if bus is None else bus

    # Validate everything before touching the disk so a failure leaves no half device.
    for attr in attributes:
        _check_relative(attr, "attribute")
        if attr.split("/")[0] in _RESERVED_NAMES or (attr == "dev" and node is not None):
            raise ValueError(f"attribute name clashes with a reserved entry: {attr}")
    for link in links:
        _check_relative(link, "link")
        reserved = link in _RESERVED_NAMES or (link == "dev" and node is not None)
        if reserved or link in attributes:
            raise ValueError(f"link name clashes with another entry: {link}")
    props = _initial_properties(canonical, subsystem, properties, node, devlinks, driver)

    dev = _Device(canonical, subsystem, props, node)
    sys_root = os.path.join(paths.root, "sys")
    if is_bus:
        subsystem_dir = os.path.join(sys_root, "bus", subsystem)
        external_links = [os.path.join(subsystem_dir, "devices", name)]
    else:
        subsystem_dir = os.path.join(sys_root, "class", subsystem)
        external_links = [os.path.join(subsystem_dir, name)]
    if subsystem == "block" and props.get("DEVTYPE") != "partition":
        external_links.append(os.path.join(sys_root, "block", name))
    if node is not None:
        dev_kind = "block" if node.kind == "b" else "char"
        external_links.append(os.path.join(sys_root, "dev", dev_kind, f"{node.major}:{node.minor}"))
    node_files: list[str] = []
    if node is not None:
        rel = node.relative_path
        node_files = [paths.dev_entry(rel), paths.node_meta(rel)]
        for link in devlinks:
            rel_link = _dev_relative(link)
            node_files += [paths.dev_entry(rel_link), paths.node_meta(rel_link)]
    claimed = [*external_links, *node_files]
    if len(set(claimed)) != len(claimed):
        raise ValueError(f"duplicate node, devlink or class entry for {canonical}")
    for path in claimed:
        if os.path.lexists(path):
            raise ValueError(f"{path} already exists in the testbed (clash for {canonical})")

    # --- write
    host_dir = paths.device_dir(canonical)
    os.makedirs(host_dir, exist_ok=True)  # may be an implicit glue dir being promoted
    for attr, value in attributes.items():
        path = os.path.join(host_dir, attr)
        if "/" in attr:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, value)
    for link, target in links.items():
        path = os.path.join(host_dir, link)
        if "/" in link:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)
    os.symlink(os.path.relpath(subsystem_dir, host_dir), os.path.join(host_dir, "subsystem"))
    if driver is not None:
        os.symlink(
            paths.driver_target(canonical, subsystem, driver), os.path.join(host_dir, "driver")
        )
    for link_path in external_links:
        os.makedirs(os.path.dirname(link_path), exist_ok=True)
        os.symlink(os.path.relpath(host_dir, os.path.dirname(link_path)), link_path)
    dev.external.extend(external_links)
    if node is not None:
        _write_node(paths, dev, node, devlinks)
        _write(os.path.join(host_dir, "dev"), f"{node.major}:{node.minor}")
    _write(os.path.join(host_dir, "uevent"), _format_uevent(props))
    return dev


def _initial_properties(
    canonical: str,
    subsystem: str,
    properties: Mapping[str, str],
    node: MockNode | None,
    devlinks: Sequence[str],
    driver: str | None,
) -> dict[str, str]:
    derived: dict[str, str] = {}
    if node is not None:
        # uevent files carry DEVNAME relative to /dev, as the kernel writes it.
        derived["DEVNAME"] = node.relative_path
        derived["MAJOR"] = str(node.major)
        derived["MINOR"] = str(node.minor)
    elif devlinks:
        raise ValueError(f"devlinks need a node: {canonical}")
    if devlinks:
        derived["DEVLINKS"] = " ".join("/dev/" + _dev_relative(link) for link in devlinks)
    if driver is not None:
        _check_name("driver", driver)
        derived["DRIVER"] = driver
    for key, value in properties.items():
        _check_property(key, value)
        if key in derived and derived[key] != value:
            raise ValueError(f"property {key}={value!r} contradicts the arguments")
        if key == "SUBSYSTEM" and value != subsystem:
            raise ValueError(f"SUBSYSTEM={value!r} contradicts subsystem {subsystem!r}")
    # umockdev also writes SUBSYSTEM into uevent; keep it for parity and for emit().
    return {**derived, **properties, "SUBSYSTEM": subsystem}


def _write_node(
    paths: _TestbedPaths, dev: _Device, node: MockNode, devlinks: Sequence[str]
) -> None:
    rel = node.relative_path
    path = paths.dev_entry(rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_node_file(path, node)
    meta = paths.node_meta(rel)
    os.symlink(f"{node.major}:{node.minor}", meta)
    dev.external += [path, meta]
    for link in devlinks:
        link_path = paths.dev_entry(_dev_relative(link))
        os.makedirs(os.path.dirname(link_path), exist_ok=True)
        # Relative target: an absolute testbed path would escape the /dev redirection.
        os.symlink(os.path.relpath(path, os.path.dirname(link_path)), link_path)
        # stat() through the link reports the link's own name to the preload, which
        # looks up .node/<link name>; without this entry st_rdev would be 0:0.
        link_meta = paths.node_meta(_dev_relative(link))
        os.symlink(f"{node.major}:{node.minor}", link_meta)
        dev.external += [link_path, link_meta]
