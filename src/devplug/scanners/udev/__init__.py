"""The udev device source: the only package that imports pyudev.

- :mod:`~devplug.scanners.udev.device`: :class:`UdevDevice`, one device as scanners read it;
- :mod:`~devplug.scanners.udev.source`: :class:`UdevSource`, the enumeration a scan runs on;
- :mod:`~devplug.scanners.udev.monitor`: :class:`UdevMonitor`, uevents for the hotplug front;
- :mod:`~devplug.scanners.udev.snapshot`: what scanners can read of a host, as plain values,
  for ``devplug capture``;
- :mod:`~devplug.scanners.udev.record`: umockdev's record format, which ``capture`` writes a
  snapshot in, and ``scan --replay`` and the test tools' testbeds
  (:mod:`devplug.testing.umockdev`) read, checked.

Scanners see only these views: reads of a gone device return None, nothing read is trusted as
a path until checked, and a device whose text is not UTF-8 is skipped with its reason noted.

May use: pyudev, the model and errors. Everything else reads devices through these views.
"""

from __future__ import annotations

from devplug.scanners.udev.device import (
    MAX_ATTRIBUTE_BYTES,
    MAX_NUMA_NODE,
    NAME_MAX,
    UdevDevice,
    is_sys_device_path,
    node_path_problem,
    sub_path_problem,
)
from devplug.scanners.udev.monitor import (
    MONITOR_BUFFER_BYTES,
    UEVENT_ACTIONS,
    ReceivedEvents,
    UdevEvent,
    UdevMonitor,
)
from devplug.scanners.udev.source import SourceUnavailable, UdevSource

__all__ = [
    "MAX_ATTRIBUTE_BYTES",
    "MAX_NUMA_NODE",
    "MONITOR_BUFFER_BYTES",
    "NAME_MAX",
    "UEVENT_ACTIONS",
    "ReceivedEvents",
    "SourceUnavailable",
    "UdevDevice",
    "UdevEvent",
    "UdevMonitor",
    "UdevSource",
    "is_sys_device_path",
    "node_path_problem",
    "sub_path_problem",
]
