"""The testbed itself: :class:`UmockdevHost` builds, mutates, activates and emits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

from devplug.testing.umockdev.files import (
    _atomic_write,
    _canonical_sys_path,
    _check_name,
    _check_property,
    _check_relative,
    _dev_relative,
    _format_uevent,
    _parse_uevent,
    _write,
)
from devplug.testing.umockdev.wire import _send_all, encode_udev_message

PRELOAD_LIBRARY: Final = "libumockdev-preload.so.0"

_EMPTY: Final[Mapping[str, str]] = MappingProxyType({})

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
_ACTIONS: Final = frozenset(
    {"add", "remove", "change", "move", "online", "offline", "bind", "unbind"}
)

# sun_path is 108 bytes; the preload truncates longer socket paths silently (snprintf).
_MAX_SOCKET_PATH: Final = 107


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


class UeventQueueFullError(RuntimeError):
    """A monitor socket's queue is full (the monitor is not being drained)."""

    def __init__(self, sockets: Sequence[str], delivered: int) -> None:
        self.sockets = tuple(sockets)
        self.delivered = delivered
        super().__init__(
            f"uevent monitor socket queue full: {', '.join(self.sockets)} "
            f"(delivered to {delivered} other socket(s)). An undrained monitor holds only "
            "net.unix.max_dgram_qlen + 1 datagrams; read it (loop.add_reader) between "
            "events or use emit_async()"
        )


def preload_active() -> bool:
    """True when libumockdev-preload is mapped into this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libumockdev-preload" in line for line in maps)
    except OSError:
        return False


@dataclass
class _Device:
    sys_path: str
    subsystem: str
    properties: dict[str, str]
    node: MockNode | None
    # Absolute host paths outside the device dir that belong to this device (class/bus/dev
    # links, the /dev node and its metadata, devlinks); removed with the device.
    external: list[str] = field(default_factory=list)


class UmockdevHost:
    """A hand-built umockdev testbed directory."""

    def __init__(self, root: Path) -> None:
        # Canonical on purpose: with a symlink in UMOCKDEV_DIR, libudev's realpath() of a
        # device leaves the testbed prefix un-stripped and enumeration finds nothing.
        root = Path(root).resolve()
        # The preload traps every path starting with /dev, /sys or /proc; a testbed there
        # is redirected into itself, and 0.17.16 leaks a socket fd per open() below /dev
        # (EMFILE after a few thousand files). For a tmpfs, mount one elsewhere.
        if root.parts[1:2] in (("dev",), ("sys",), ("proc",)):
            raise ValueError(f"testbed must not live below /dev, /sys or /proc: {root}")
        # The preload names event sockets "<root>/event<fd>" and silently truncates a path
        # longer than sun_path; events would then vanish, so refuse up front.
        if len(os.fsencode(root)) + len("/event99999") > _MAX_SOCKET_PATH:
            raise ValueError(f"testbed path too long for unix socket names: {root}")
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            raise ValueError(f"testbed directory is not empty: {root}")
        self.root: Path = root
        self._root = str(root)
        for sub in ("sys/devices", "sys/bus", "sys/class", "sys/dev/char", "sys/dev/block"):
            os.makedirs(os.path.join(self._root, sub))
        os.makedirs(os.path.join(self._root, "dev", ".node"))
        self._devices: dict[str, _Device] = {}
        # Last known subsystem/properties of removed devices, so a "remove" can be emitted
        # after the files are gone (that is the order the kernel uses).
        self._tombstones: dict[str, tuple[str, dict[str, str]]] = {}
        self._seqnum = 0

    # ------------------------------------------------------------------ paths

    def _host(self, sys_path: str) -> str:
        return self._root + sys_path

    def _dev_host(self, rel: str) -> str:
        return os.path.join(self._root, "dev", rel)

    def _known(self, sys_path: str) -> _Device:
        canonical = _canonical_sys_path(sys_path)
        try:
            return self._devices[canonical]
        except KeyError:
            raise ValueError(f"no such device in testbed: {canonical}") from None

    def has_device(self, sys_path: str) -> bool:
        """True if the device exists in the testbed."""
        return _canonical_sys_path(sys_path) in self._devices

    @property
    def devices(self) -> list[str]:
        """Sys paths of all devices, in insertion order."""
        return list(self._devices)

    # ------------------------------------------------------------------ building

    def add_device(
        self,
        sys_path: str,
        subsystem: str,
        *,
        attributes: Mapping[str, str | bytes] = _EMPTY,
        properties: Mapping[str, str] = _EMPTY,
        links: Mapping[str, str] = _EMPTY,
        node: MockNode | None = None,
        devlinks: Sequence[str] = (),
        driver: str | None = None,
        bus: bool | None = None,
    ) -> str:
        """Add a device and return its canonical ``/sys/devices/...`` path.

        ``bus`` overrides whether ``subsystem`` is a bus (``/sys/bus``) or a class.
        Raises ValueError (instead of umockdev's abort) on duplicates and name clashes.
        """
        canonical = _canonical_sys_path(sys_path)
        parts = canonical.split("/")  # ["", "sys", "devices", ...]
        if len(parts) < 4 or parts[2] != "devices":
            raise ValueError(f"device path must be below /sys/devices: {canonical}")
        if canonical in self._devices:
            raise ValueError(f"device already exists: {canonical}")
        _check_name("subsystem", subsystem)
        self._check_parent(canonical)
        name = parts[-1]
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
        props = self._initial_properties(canonical, subsystem, properties, node, devlinks, driver)

        dev = _Device(canonical, subsystem, props, node)
        sys_root = os.path.join(self._root, "sys")
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
            external_links.append(
                os.path.join(sys_root, "dev", dev_kind, f"{node.major}:{node.minor}")
            )
        node_files: list[str] = []
        if node is not None:
            rel = node.relative_path
            node_files = [self._dev_host(rel), self._node_meta(rel)]
            for link in devlinks:
                rel_link = _dev_relative(link)
                node_files += [self._dev_host(rel_link), self._node_meta(rel_link)]
        claimed = [*external_links, *node_files]
        if len(set(claimed)) != len(claimed):
            raise ValueError(f"duplicate node, devlink or class entry for {canonical}")
        for path in claimed:
            if os.path.lexists(path):
                raise ValueError(f"{path} already exists in the testbed (clash for {canonical})")

        # --- write
        host_dir = self._host(canonical)
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
                self._driver_target(canonical, subsystem, driver), os.path.join(host_dir, "driver")
            )
        for link_path in external_links:
            os.makedirs(os.path.dirname(link_path), exist_ok=True)
            os.symlink(os.path.relpath(host_dir, os.path.dirname(link_path)), link_path)
        dev.external.extend(external_links)
        if node is not None:
            self._write_node(dev, node, devlinks)
            _write(os.path.join(host_dir, "dev"), f"{node.major}:{node.minor}")
        _write(os.path.join(host_dir, "uevent"), _format_uevent(props))
        self._devices[canonical] = dev
        self._tombstones.pop(canonical, None)
        return canonical

    def _check_parent(self, canonical: str) -> None:
        parts = canonical.split("/")
        parent = "/".join(parts[:-1])
        if parent in self._devices or len(parts) == 4:
            return  # a registered device, or /sys/devices itself
        if len(parts) == 5:
            return  # bus roots such as /sys/devices/pci0000:00 or /sys/devices/virtual
        if len(parts) == 6 and parts[3] == "virtual":
            return  # /sys/devices/virtual/<class>/<name>
        grandparent = "/".join(parts[:-2])
        if grandparent in self._devices:
            return  # one class glue dir below a device, e.g. .../0000:00:02.0/drm/card0
        raise ValueError(f"parent device of {canonical} must be added first")

    def _initial_properties(
        self,
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

    def _driver_target(self, canonical: str, subsystem: str, driver: str) -> str:
        # Relative like real sysfs; the target dir does not exist (trap 7: read the basename).
        target = os.path.join(self._root, "sys", "bus", subsystem, "drivers", driver)
        return os.path.relpath(target, self._host(canonical))

    def _node_meta(self, rel: str) -> str:
        return os.path.join(self._root, "dev", ".node", rel.replace("/", "_"))

    def _write_node(self, dev: _Device, node: MockNode, devlinks: Sequence[str]) -> None:
        rel = node.relative_path
        path = self._dev_host(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, b"")
        # The preload reports a block device for a file with the sticky bit, else char.
        os.chmod(path, 0o1660 if node.kind == "b" else 0o660)
        meta = self._node_meta(rel)
        os.symlink(f"{node.major}:{node.minor}", meta)
        dev.external += [path, meta]
        for link in devlinks:
            link_path = self._dev_host(_dev_relative(link))
            os.makedirs(os.path.dirname(link_path), exist_ok=True)
            # Relative target: an absolute testbed path would escape the /dev redirection.
            os.symlink(os.path.relpath(path, os.path.dirname(link_path)), link_path)
            # stat() through the link reports the link's own name to the preload, which
            # looks up .node/<link name>; without this entry st_rdev would be 0:0.
            link_meta = self._node_meta(_dev_relative(link))
            os.symlink(f"{node.major}:{node.minor}", link_meta)
            dev.external += [link_path, link_meta]

    def add_dev_dir(self, path: str) -> None:
        """Create an empty /dev directory (e.g. ``dri``) so the host's real one is hidden.

        The preload redirects a /dev path only if it exists in the testbed.
        """
        os.makedirs(self._dev_host(_dev_relative(path)), exist_ok=True)

    # ------------------------------------------------------------------ mutation

    def set_attribute(self, sys_path: str, name: str, value: str | bytes) -> None:
        """Atomically replace (or create) an attribute file."""
        dev = self._known(sys_path)
        _check_relative(name, "attribute")
        if name.split("/")[0] in _RESERVED_NAMES:
            raise ValueError(f"reserved name: {name}")
        path = os.path.join(self._host(dev.sys_path), name)
        if os.path.islink(path) or os.path.isdir(path):
            raise ValueError(f"{name} is a link or directory, not an attribute")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _atomic_write(path, value)

    def set_property(self, sys_path: str, key: str, value: str | None) -> None:
        """Set (or with None remove) a uevent property; rewrites uevent atomically."""
        dev = self._known(sys_path)
        if value is None:
            if key == "SUBSYSTEM":
                raise ValueError("SUBSYSTEM cannot be removed")
            dev.properties.pop(key, None)
        else:
            _check_property(key, value)
            if key == "SUBSYSTEM" and value != dev.subsystem:
                raise ValueError("SUBSYSTEM is fixed by the subsystem link")
            dev.properties[key] = value
        _atomic_write(
            os.path.join(self._host(dev.sys_path), "uevent"), _format_uevent(dev.properties)
        )

    def set_driver(self, sys_path: str, driver: str | None) -> None:
        """Bind to ``driver`` (or unbind with None): the driver link and DRIVER property."""
        dev = self._known(sys_path)
        link = os.path.join(self._host(dev.sys_path), "driver")
        if driver is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
        else:
            _check_name("driver", driver)
            # Replace the link by rename: a plain re-create would race readers.
            tmp = link + ".devplug-tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(self._driver_target(dev.sys_path, dev.subsystem, driver), tmp)
            os.replace(tmp, link)
        self.set_property(dev.sys_path, "DRIVER", driver)

    def set_node_present(self, sys_path: str, present: bool) -> None:
        """Delete (or re-create) a device's /dev node while its sysfs entry stays.

        What a node vanishing under a live device looks like (a driver hiccup, someone
        deleting it); sends no event: emit ``change`` yourself.
        """
        dev = self._known(sys_path)
        if dev.node is None:
            raise ValueError(f"{dev.sys_path} has no device node")
        rel = dev.node.relative_path
        path, meta = self._dev_host(rel), self._node_meta(rel)
        if not present:
            for entry in (path, meta):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry)
            return
        if os.path.lexists(path):
            return
        _write(path, b"")
        os.chmod(path, 0o1660 if dev.node.kind == "b" else 0o660)
        with contextlib.suppress(FileExistsError):
            os.symlink(f"{dev.node.major}:{dev.node.minor}", meta)

    def remove_device(self, sys_path: str) -> list[str]:
        """Remove a device and its descendants; return their sys paths, children first.

        Sends no events: emit ``remove`` for the returned paths in order (trap 1).
        """
        top = self._known(sys_path)
        prefix = top.sys_path + "/"
        doomed = [p for p in self._devices if p == top.sys_path or p.startswith(prefix)]
        doomed.sort(key=lambda p: p.count("/"), reverse=True)
        for path in doomed:
            dev = self._devices.pop(path)
            # Empty dirs such as dev/dri stay on purpose: without them the preload would
            # fall through to the real /dev/dri and leak host devices into the mock.
            for ext in dev.external:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ext)
            self._tombstones[path] = (dev.subsystem, dict(dev.properties))
        shutil.rmtree(self._host(top.sys_path))
        return doomed

    # ------------------------------------------------------------------ activation

    def env(self) -> dict[str, str]:
        """Environment entries that make a subprocess see this testbed."""
        current = os.environ.get("LD_PRELOAD", "")
        entries = current.replace(":", " ").split()
        if not any("libumockdev-preload" in entry for entry in entries):
            entries.insert(0, PRELOAD_LIBRARY)
        return {"LD_PRELOAD": " ".join(entries), "UMOCKDEV_DIR": self._root}

    @contextlib.contextmanager
    def activated(self) -> Iterator[UmockdevHost]:
        """Point this process's preload at the testbed; restore UMOCKDEV_DIR afterwards.

        Create pyudev Monitors inside the block: the socket swap happens at socket() time.
        """
        if not preload_active():
            raise RuntimeError(
                f"{PRELOAD_LIBRARY} is not loaded in this process; run it under "
                "`umockdev-wrapper` (e.g. `umockdev-wrapper python -m pytest ...`) or with "
                f"LD_PRELOAD={PRELOAD_LIBRARY}"
            )
        previous = os.environ.get("UMOCKDEV_DIR")
        os.environ["UMOCKDEV_DIR"] = self._root
        try:
            yield self
        finally:
            if previous is None:
                os.environ.pop("UMOCKDEV_DIR", None)
            else:
                os.environ["UMOCKDEV_DIR"] = previous

    # ------------------------------------------------------------------ events

    def event_sockets(self) -> list[str]:
        """The monitor sockets the preload created in the testbed (``event<fd>``)."""
        found: list[str] = []
        with os.scandir(self._root) as entries:
            for entry in entries:
                if entry.name.startswith("event") and entry.name[5:].isdigit():
                    with contextlib.suppress(FileNotFoundError):
                        if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                            found.append(entry.path)
        return sorted(found)

    def event_properties(
        self, action: str, sys_path: str, extra: Mapping[str, str] = _EMPTY
    ) -> dict[str, str]:
        """The properties :meth:`emit` would send (consumes a SEQNUM)."""
        if action not in _ACTIONS:
            raise ValueError(f"unknown uevent action: {action!r}")
        canonical = _canonical_sys_path(sys_path)
        dev = self._devices.get(canonical)
        if dev is not None:
            subsystem = dev.subsystem
            # Read the file, not the model: it is what a re-reading consumer sees.
            current = _parse_uevent(os.path.join(self._host(canonical), "uevent"))
        elif canonical in self._tombstones:
            subsystem, current = self._tombstones[canonical]
        else:
            raise ValueError(f"no such device (or removed device) in testbed: {canonical}")
        self._seqnum += 1
        props = {
            "ACTION": action,
            "DEVPATH": canonical[len("/sys") :],
            "SUBSYSTEM": subsystem,
            "SEQNUM": str(self._seqnum),
        }
        for key, value in current.items():
            if key not in props:
                props[key] = value
        if "DEVNAME" in props and not props["DEVNAME"].startswith("/"):
            props["DEVNAME"] = "/dev/" + props["DEVNAME"]  # udevd sends absolute names
        for key, value in extra.items():
            _check_property(key, value, allow_event_keys=True)
            props[key] = value
        return props

    def emit(self, action: str, sys_path: str, extra: Mapping[str, str] = _EMPTY) -> int:
        """Send a uevent to every monitor socket; return how many received it.

        Never blocks. Raises UeventQueueFullError if a socket's queue is full (after
        delivering to the others).
        """
        datagram = encode_udev_message(self.event_properties(action, sys_path, extra))
        sent, full = _send_all(self.event_sockets(), datagram)
        if full:
            raise UeventQueueFullError(full, sent)
        return sent

    async def emit_async(
        self,
        action: str,
        sys_path: str,
        extra: Mapping[str, str] = _EMPTY,
        *,
        timeout: float = 5.0,
    ) -> int:
        """Like :meth:`emit`, but waits (asyncio sleeps) while a queue is full."""
        datagram = encode_udev_message(self.event_properties(action, sys_path, extra))
        pending = self.event_sockets()
        delivered = 0
        deadline = time.monotonic() + timeout
        while True:
            sent, pending = _send_all(pending, datagram)
            delivered += sent
            if not pending:
                return delivered
            if time.monotonic() >= deadline:
                raise UeventQueueFullError(pending, delivered)
            # Yield to the loop so the reader callbacks can drain the monitor.
            await asyncio.sleep(0.001)
