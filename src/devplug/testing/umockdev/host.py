"""The testbed itself: :class:`UmockdevHost` keeps the devices, mutates and activates them.

Writing a new device's files lives in ``device_files.py``, building and sending uevents in
``uevents.py``; the host keeps what both need (the devices, the removed ones, the SEQNUM).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Final

from devplug.testing.umockdev.device_files import (
    _RESERVED_NAMES,
    _Device,
    _TestbedPaths,
    _write_device,
    _write_node_file,
)

# "X as X": re-exported, as both lived here before (presets and callers import them).
from devplug.testing.umockdev.device_files import MockNode as MockNode
from devplug.testing.umockdev.files import (
    _atomic_write,
    _canonical_sys_path,
    _check_name,
    _check_property,
    _check_relative,
    _dev_relative,
    _format_uevent,
    _parse_uevent,
)
from devplug.testing.umockdev.uevents import (
    UeventQueueFullError as UeventQueueFullError,
)
from devplug.testing.umockdev.uevents import (
    _check_action,
    _event_properties,
    _event_sockets,
    _send_uevent,
    _send_uevent_async,
)
from devplug.testing.umockdev.wire import encode_udev_message

PRELOAD_LIBRARY: Final = "libumockdev-preload.so.0"

_EMPTY: Final[Mapping[str, str]] = MappingProxyType({})

# sun_path is 108 bytes; the preload truncates longer socket paths silently (snprintf).
_MAX_SOCKET_PATH: Final = 107


def preload_active() -> bool:
    """True when libumockdev-preload is mapped into this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libumockdev-preload" in line for line in maps)
    except OSError:
        return False


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
        self._paths = _TestbedPaths(self._root)
        for sub in ("sys/devices", "sys/bus", "sys/class", "sys/dev/char", "sys/dev/block"):
            os.makedirs(os.path.join(self._root, sub))
        os.makedirs(os.path.join(self._root, "dev", ".node"))
        self._devices: dict[str, _Device] = {}
        # Last known subsystem/properties of removed devices, so a "remove" can be emitted
        # after the files are gone (that is the order the kernel uses).
        self._tombstones: dict[str, tuple[str, dict[str, str]]] = {}
        self._seqnum = 0

    # ------------------------------------------------------------------ lookup

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
        parent_required: bool = True,
    ) -> str:
        """Add a device and return its canonical ``/sys/devices/...`` path.

        ``bus`` overrides whether ``subsystem`` is a bus (``/sys/bus``) or a class.
        ``parent_required=False`` lets the directories above be plain directories, as real
        sysfs has some that are no device of a subsystem (``/sys/devices/system/cpu``,
        ``/sys/devices/pnp0``): what a recorded host needs.
        Raises ValueError (instead of umockdev's abort) on duplicates and name clashes.
        """
        canonical = _canonical_sys_path(sys_path)
        parts = canonical.split("/")  # ["", "sys", "devices", ...]
        if len(parts) < 4 or parts[2] != "devices":
            raise ValueError(f"device path must be below /sys/devices: {canonical}")
        if canonical in self._devices:
            raise ValueError(f"device already exists: {canonical}")
        _check_name("subsystem", subsystem)
        if parent_required:
            self._check_parent(canonical)
        dev = _write_device(
            self._paths,
            canonical,
            subsystem,
            attributes=attributes,
            properties=properties,
            links=links,
            node=node,
            devlinks=devlinks,
            driver=driver,
            bus=bus,
        )
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

    def add_dev_dir(self, path: str) -> None:
        """Create an empty /dev directory (e.g. ``dri``) so the host's real one is hidden.

        The preload redirects a /dev path only if it exists in the testbed.
        """
        os.makedirs(self._paths.dev_entry(_dev_relative(path)), exist_ok=True)

    # ------------------------------------------------------------------ mutation

    def set_attribute(self, sys_path: str, name: str, value: str | bytes) -> None:
        """Atomically replace (or create) an attribute file."""
        dev = self._known(sys_path)
        _check_relative(name, "attribute")
        if name.split("/")[0] in _RESERVED_NAMES:
            raise ValueError(f"reserved name: {name}")
        path = os.path.join(self._paths.device_dir(dev.sys_path), name)
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
            os.path.join(self._paths.device_dir(dev.sys_path), "uevent"),
            _format_uevent(dev.properties),
        )

    def set_driver(self, sys_path: str, driver: str | None) -> None:
        """Bind to ``driver`` (or unbind with None): the driver link and DRIVER property."""
        dev = self._known(sys_path)
        link = os.path.join(self._paths.device_dir(dev.sys_path), "driver")
        if driver is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
        else:
            _check_name("driver", driver)
            # Replace the link by rename: a plain re-create would race readers.
            tmp = link + ".devplug-tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(self._paths.driver_target(dev.sys_path, dev.subsystem, driver), tmp)
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
        path, meta = self._paths.dev_entry(rel), self._paths.node_meta(rel)
        if not present:
            for entry in (path, meta):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry)
            return
        if os.path.lexists(path):
            return
        _write_node_file(path, dev.node)
        with contextlib.suppress(FileExistsError):
            os.symlink(f"{dev.node.major}:{dev.node.minor}", meta)

    def removal_order(self, sys_path: str) -> list[str]:
        """A device and its descendants, children first: the order the kernel removes them.

        Found by walking the device's own directory (not every device of the testbed), so
        that it costs the same with 10 devices or 30,000.
        """
        top = self._known(sys_path)
        found: list[str] = []
        for directory, _, _ in os.walk(self._paths.device_dir(top.sys_path)):
            path = directory[len(self._root) :]
            if path in self._devices:
                found.append(path)
        found.sort(key=lambda p: p.count("/"), reverse=True)
        return found

    def remove_device(self, sys_path: str) -> list[str]:
        """Remove a device and its descendants; return their sys paths, children first.

        Sends no events: emit ``remove`` for the returned paths in order (trap 1), or use
        :meth:`unplug` for the kernel's order (each event before its device's files go).
        """
        top = self._known(sys_path)
        doomed = self.removal_order(top.sys_path)
        for path in doomed:
            self._forget(path)
        shutil.rmtree(self._paths.device_dir(top.sys_path))
        return doomed

    def _forget(self, path: str) -> None:
        """Drop one device's record and its files outside its directory (links, nodes)."""
        dev = self._devices.pop(path)
        # Empty dirs such as dev/dri stay on purpose: without them the preload would fall
        # through to the real /dev/dri and leak host devices into the mock.
        for ext in dev.external:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ext)
        self._tombstones[path] = (dev.subsystem, dict(dev.properties))

    async def unplug(
        self, sys_path: str, *, linger_s: float = 0.0, timeout: float = 5.0
    ) -> list[str]:
        """Remove a device and its descendants the way the kernel does, with their uevents.

        For each device, children first: its /dev node goes (devtmpfs deletes it before the
        event), a bound driver is unbound and ``unbind`` sent, then ``remove`` is sent while
        the sysfs directory is still there, and only then does the directory go. A consumer
        woken by the event may find the device in sysfs still. (The kernel also drops the
        directory's attributes and ``uevent`` file just before the event; the testbed keeps
        them, which is the harder case for a consumer.)

        ``linger_s`` > 0: every event is sent first, and the directories go that much later
        (the kernel's thread preempted between its event and the deletion, or a consumer
        that reads sooner than this machine lets the test see). ``timeout``: as for
        :meth:`emit_async`. Returns the paths, in the order their events were sent.
        """
        order = self.removal_order(sys_path)
        for path in order:
            dev = self._devices[path]
            if dev.node is not None:
                self.set_node_present(path, False)
            if "DRIVER" in dev.properties:
                self.set_driver(path, None)
                await self.emit_async("unbind", path, timeout=timeout)
            await self.emit_async("remove", path, timeout=timeout)
            if linger_s <= 0:
                # Its children went before it: nothing below it is a device any more.
                self._forget(path)
                shutil.rmtree(self._paths.device_dir(path))
        if linger_s > 0:
            await asyncio.sleep(linger_s)
            self.remove_device(sys_path)
        return order

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
        return _event_sockets(self._root)

    def event_properties(
        self, action: str, sys_path: str, extra: Mapping[str, str] = _EMPTY
    ) -> dict[str, str]:
        """The properties :meth:`emit` would send (consumes a SEQNUM)."""
        _check_action(action)
        canonical = _canonical_sys_path(sys_path)
        dev = self._devices.get(canonical)
        if dev is not None:
            subsystem = dev.subsystem
            # Read the file, not the model: it is what a re-reading consumer sees.
            current = _parse_uevent(os.path.join(self._paths.device_dir(canonical), "uevent"))
        elif canonical in self._tombstones:
            subsystem, current = self._tombstones[canonical]
        else:
            raise ValueError(f"no such device (or removed device) in testbed: {canonical}")
        self._seqnum += 1
        return _event_properties(action, canonical, subsystem, current, self._seqnum, extra)

    def emit(self, action: str, sys_path: str, extra: Mapping[str, str] = _EMPTY) -> int:
        """Send a uevent to every monitor socket; return how many received it.

        Never blocks. Raises UeventQueueFullError if a socket's queue is full (after
        delivering to the others).
        """
        datagram = encode_udev_message(self.event_properties(action, sys_path, extra))
        return _send_uevent(self.event_sockets(), datagram)

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
        return await _send_uevent_async(self.event_sockets(), datagram, timeout)
