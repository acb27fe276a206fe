"""devplug: a Kubernetes device plugin daemon and framework.

The public surface for plugin authors is what ``__all__`` lists: the device model, the scanner
protocols and hooks, the udev view scanners read, the helpers of incremental rescans, the NUMA
preferred-allocation policy a ``PreferredAllocator`` can configure, what an entry point
needs to serve its scanners (``serve``: devplug's command line with the author's scanners;
``with_builtins`` to offer devplug's own beside them; ``SectionSettings`` for their config
sections; ``load_settings``, ``Settings``), the errors (``ScanCancelled`` is the one a scan
lets through), and ``list_message_bytes`` to size a resource's list against the kubelet's
limit. Everything else is internal. Test tools live in :mod:`devplug.testing`.
"""

from typing import TYPE_CHECKING

from devplug._kits.lazy import lazy_names
from devplug._version import __version__
from devplug.errors import (
    AllocationError,
    ConfigError,
    DevplugError,
    InvalidNameError,
    ScanCancelled,
)

if TYPE_CHECKING:
    from devplug.cli import serve
    from devplug.config import SectionSettings, Settings, load_settings
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
    from devplug.preferred import PreferredPolicy, by_first_source, by_info, preferred_ids
    from devplug.scanners.base import (
        Allocator,
        ContainerPreStarter,
        IncrementalScanner,
        PostAllocator,
        PreferredAllocator,
        Reporter,
        ResourceNamer,
        ResourceStarter,
        ResourceStopper,
        Scanner,
    )
    from devplug.scanners.incremental import RemovedPaths, TouchedPaths, TreeEdit
    from devplug.scanners.registry import with_builtins
    from devplug.scanners.udev import UdevDevice, UdevEvent, UdevSource
    from devplug.sizing import list_message_bytes

# Loaded on first use, each from its module: ``import devplug`` (what the command line's
# ``version`` and ``--help`` import, and a scanner's first line) brings neither pyudev nor
# asyncio, pydantic or YAML. Only the version and the errors are eager.
_LAZY = {
    **dict.fromkeys(
        (
            "CdiEdits",
            "CdiHook",
            "ContainerAllocation",
            "DeviceInfo",
            "DeviceNode",
            "DeviceTree",
            "DeviceTreeBuilder",
            "Health",
            "Mount",
        ),
        "devplug.model",
    ),
    **dict.fromkeys(
        ("PreferredPolicy", "by_first_source", "by_info", "preferred_ids"), "devplug.preferred"
    ),
    **dict.fromkeys(
        (
            "Allocator",
            "ContainerPreStarter",
            "IncrementalScanner",
            "PostAllocator",
            "PreferredAllocator",
            "Reporter",
            "ResourceNamer",
            "ResourceStarter",
            "ResourceStopper",
            "Scanner",
        ),
        "devplug.scanners.base",
    ),
    **dict.fromkeys(("RemovedPaths", "TouchedPaths", "TreeEdit"), "devplug.scanners.incremental"),
    **dict.fromkeys(("UdevDevice", "UdevEvent", "UdevSource"), "devplug.scanners.udev"),
    **dict.fromkeys(("SectionSettings", "Settings", "load_settings"), "devplug.config"),
    "serve": "devplug.cli",
    "with_builtins": "devplug.scanners.registry",
    "list_message_bytes": "devplug.sizing",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
    "IncrementalScanner",
    "InvalidNameError",
    "Mount",
    "PostAllocator",
    "PreferredAllocator",
    "PreferredPolicy",
    "RemovedPaths",
    "Reporter",
    "ResourceNamer",
    "ResourceStarter",
    "ResourceStopper",
    "ScanCancelled",
    "Scanner",
    "SectionSettings",
    "Settings",
    "TouchedPaths",
    "TreeEdit",
    "UdevDevice",
    "UdevEvent",
    "UdevSource",
    "__version__",
    "by_first_source",
    "by_info",
    "list_message_bytes",
    "load_settings",
    "preferred_ids",
    "serve",
    "with_builtins",
]
