"""Hand-built umockdev testbeds: real pyudev code against mock hardware, in-process.
Of devplug it imports only the record format (the rest is the standard library), so any
scanner's tests can use it.

A host recorded in umockdev's record format (``umockdev-record``, ``devplug capture``) is
read by :mod:`devplug.scanners.udev.record` and built by :mod:`.replay`.

The testbed is a directory laid out like the one ``umockdev-run`` creates (``sys/``,
``dev/``, ``dev/.node/``), written directly with file operations: no GObject, not
umockdev's own description loader (which is quadratic, see UDEV-TESTING.md trap 6), no ioctl
server.

The process that reads the testbed must have ``libumockdev-preload.so.0`` loaded (start it
with ``umockdev-wrapper``); :meth:`UmockdevHost.activated` then points the preload at the
testbed by setting ``UMOCKDEV_DIR`` at run time, which the preload reads on every call.

Facts this package relies on (umockdev 0.17.16, ``src/libumockdev-preload.c``):

* ``/sys/...`` is always redirected to ``$UMOCKDEV_DIR/sys/...``; ``/dev/...`` only when the
  path exists in the testbed, otherwise the real ``/dev`` is used.
* ``stat()`` of a plain file under ``$UMOCKDEV_DIR/dev`` reports a char device, or a block
  device when the file has the sticky bit; ``st_rdev`` comes from the symlink
  ``dev/.node/<path below /dev with '/' -> '_'>`` whose target is ``"MAJOR:MINOR"``.
* A uevent netlink socket becomes an ``AF_UNIX`` datagram socket bound at
  ``$UMOCKDEV_DIR/event<fd>``; umockdev's sender (``src/uevent_sender.c``) writes a libudev
  datagram (40-byte header, then NUL-terminated ``KEY=VALUE`` strings) to every
  ``event[0-9]*`` socket. :meth:`UmockdevHost.emit` does the same from Python.
"""

from devplug.scanners.udev.record import (
    RecordedDevice,
    RecordError,
    format_record,
    parse_record,
    read_record,
)
from devplug.testing.umockdev.device_files import MockNode
from devplug.testing.umockdev.host import PRELOAD_LIBRARY, UmockdevHost, preload_active
from devplug.testing.umockdev.presets import (
    add_drm_minors,
    add_intel_gpu,
    add_intel_sriov_gpu,
    add_iommufd,
    add_pci_device,
    add_usb_serial,
    add_vfio_container,
    add_vfio_function,
    add_vfio_group,
)
from devplug.testing.umockdev.replay import add_recorded, host_from_record
from devplug.testing.umockdev.uevents import UeventQueueFullError
from devplug.testing.umockdev.wire import encode_udev_message

__all__ = [
    "PRELOAD_LIBRARY",
    "MockNode",
    "RecordError",
    "RecordedDevice",
    "UeventQueueFullError",
    "UmockdevHost",
    "add_drm_minors",
    "add_intel_gpu",
    "add_intel_sriov_gpu",
    "add_iommufd",
    "add_pci_device",
    "add_recorded",
    "add_usb_serial",
    "add_vfio_container",
    "add_vfio_function",
    "add_vfio_group",
    "encode_udev_message",
    "format_record",
    "host_from_record",
    "parse_record",
    "preload_active",
    "read_record",
]
