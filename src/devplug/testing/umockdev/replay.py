"""A recorded host in a testbed: :func:`add_recorded` adds a record's devices to a
:class:`UmockdevHost`, :func:`host_from_record` builds a new testbed from a record file.

What each line becomes: ``E:`` lines the device's ``uevent`` (where libudev reads every
property back from), ``A:``/``H:`` attribute files with the recorded bytes, ``L:`` links with
the recorded (checked) targets, ``L: driver`` the driver binding, ``N:`` a plain-file node
whose ``stat()`` reports MAJOR:MINOR (a block node for the ``block`` subsystem), and ``S:``
symlinks to it. Devices are added parents first, whatever the record's order (umockdev-record
writes children first).

One exception to the nodes: the memory devices (major 1: ``/dev/null``, ``/dev/zero``,
``/dev/urandom``...) and ``/dev/tty``, ``/dev/console``, ``/dev/ptmx`` are opened by programs
behind their author's back (a subprocess's stdin on ``/dev/null``, libudev's ``ldconfig`` among
them), and umockdev's preload (0.17) ends a process that opens a testbed node without
umockdev-run's ioctl server. Where this machine has the very same node (type and numbers), the
testbed leaves it to this machine's /dev: ``stat()`` reports what the record says all the same.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from devplug.scanners.udev.record import RecordedDevice, RecordError, read_record
from devplug.testing.umockdev.device_files import MockNode
from devplug.testing.umockdev.host import UmockdevHost

# Made from the other lines when the device is added; the recorded values are set after.
_DERIVED = ("DEVNAME", "MAJOR", "MINOR", "DRIVER", "DEVLINKS")


def add_recorded(host: UmockdevHost, devices: Sequence[RecordedDevice], source: str) -> None:
    """Add ``devices`` (checked by :func:`~.record.parse_record`) to ``host``, parents first.

    Raises RecordError naming the device when one clashes with another (the same node twice,
    a file where a directory must be).
    """
    for device in sorted(devices, key=lambda d: d.sys_path.split("/")):
        try:
            _add(host, device)
        except (ValueError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise RecordError(
                f"{source} line {device.line} ({device.sys_path}): cannot add it: {reason}"
            ) from None


def _add(host: UmockdevHost, device: RecordedDevice) -> None:
    properties = dict(device.properties)
    properties.pop("DEVPATH", None)  # the path itself, never a uevent line
    subsystem = properties.pop("SUBSYSTEM")
    recorded = {key: properties.pop(key, None) for key in _DERIVED}
    attributes = dict(device.attributes)
    links = dict(device.links)
    node = None
    dev_attribute = None
    if device.node is not None:
        major, minor = int(recorded["MAJOR"] or 0), int(recorded["MINOR"] or 0)
        node = MockNode(device.node, major, minor, "b" if subsystem == "block" else "c")
        dev_attribute = attributes.pop("dev", None)
    else:
        # No node in /dev: DEVNAME, MAJOR and MINOR are plain properties.
        for key in ("DEVNAME", "MAJOR", "MINOR"):
            value = recorded[key]
            if value is not None:
                properties[key] = value
    shared = node is not None and _same_node_here(node)
    target = links.pop("driver", None)
    driver = posixpath.basename(target) if target is not None else None
    path = host.add_device(
        device.sys_path,
        subsystem,
        attributes=attributes,
        properties=properties,
        links=links,
        node=node,
        devlinks=device.devlinks,
        driver=driver,
        parent_required=False,
    )
    # What add_device made from the node and links, set back to what was recorded where the
    # two differ (a bound device whose uevent lacks DRIVER, DEVLINKS from udev's database that
    # name links /dev does not have).
    made = {
        "DRIVER": driver,
        "DEVLINKS": " ".join(f"/dev/{link}" for link in device.devlinks) or None,
    }
    for key, value in made.items():
        if recorded.get(key) != value:
            host.set_property(path, key, recorded.get(key))
    if node is not None and dev_attribute not in (None, f"{node.major}:{node.minor}".encode()):
        host.set_attribute(path, "dev", dev_attribute)
    if shared:
        host.set_node_present(path, False)


def _same_node_here(node: MockNode) -> bool:
    """Whether ``node`` is one programs open unasked and this machine has it, the same."""
    if not (node.major == 1 or (node.major == 5 and node.minor <= 2)):
        return False
    try:
        found = os.stat(f"/dev/{node.relative_path}")
    except OSError:
        return False
    kind = stat.S_ISBLK(found.st_mode) if node.kind == "b" else stat.S_ISCHR(found.st_mode)
    return kind and (os.major(found.st_rdev), os.minor(found.st_rdev)) == (node.major, node.minor)


def host_from_record(directory: Path, record: Path) -> UmockdevHost:
    """A new testbed in ``directory`` (missing or empty) holding the host ``record`` describes.

    Raises RecordError for a record that cannot be loaded (``directory`` is left empty then),
    FileExistsError when ``directory`` is not empty, OSError when a file cannot be read.
    """
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty: give a new directory")
    devices = read_record(record)
    existed = directory.exists()
    host = UmockdevHost(directory)
    try:
        add_recorded(host, devices, str(record))
    except BaseException:
        _empty(host.root, keep=existed)
        raise
    return host


def _empty(root: Path, *, keep: bool) -> None:
    """Remove what a failed build wrote (the directory was empty or new before it)."""
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
        return
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
