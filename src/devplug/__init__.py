"""devplug: a Kubernetes device plugin daemon and framework.

The public surface for plugin authors is what ``__all__`` lists: the device model, the scanner
protocols and hooks, and the udev view scanners read. Everything else is internal. Test tools
live in :mod:`devplug.testing`.
"""

from devplug._version import __version__
from devplug.errors import AllocationError, ConfigError, DevplugError, InvalidNameError
from devplug.model import (
    CdiEdits,
    CdiHook,
    ContainerAllocation,
    DeviceInfo,
    DeviceNode,
    DeviceTree,
    DeviceTreeBuilder,
    Health,
    Mount,
)
from devplug.scanners.base import (
    Allocator,
    ContainerPreStarter,
    PostAllocator,
    PreferredAllocator,
    Scanner,
)
from devplug.scanners.udev import UdevDevice, UdevSource

__all__ = [
    "AllocationError",
    "Allocator",
    "CdiEdits",
    "CdiHook",
    "ConfigError",
    "ContainerAllocation",
    "ContainerPreStarter",
    "DeviceInfo",
    "DeviceNode",
    "DeviceTree",
    "DeviceTreeBuilder",
    "DevplugError",
    "Health",
    "InvalidNameError",
    "Mount",
    "PostAllocator",
    "PreferredAllocator",
    "Scanner",
    "UdevDevice",
    "UdevSource",
    "__version__",
]
