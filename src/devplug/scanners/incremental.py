"""Helpers for incremental rescans: which previously built devices an event batch touches.

A device is touched by an event when one of its sysfs sources is the event's path, lies below
it (a PCI function removed with its drm children) or above it (a child of the device changed).
Work is proportional to devices x path depth, not devices x events, so a storm of events over a
big tree stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from devplug.model import DeviceTree, DeviceTreeBuilder


def _self_and_ancestors(path: str) -> Iterator[str]:
    """``/sys/devices/a/b`` -> itself, ``/sys/devices/a``, ``/sys/devices``, ``/sys``."""
    while path and path != "/":
        yield path
        path = path.rsplit("/", 1)[0]


class TouchedPaths:
    """The sysfs paths of an event batch, with fast "does it touch this source?" checks."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = frozenset(paths)
        # A source equal to or above an event path: the event's path and all its ancestors.
        self._at_or_above = {a for p in self.paths for a in _self_and_ancestors(p)}

    def touches(self, source: str) -> bool:
        if source in self._at_or_above:
            return True
        # A source below an event path: one of the source's ancestors is an event path.
        return any(a in self.paths for a in _self_and_ancestors(source))


def split_previous(
    previous: DeviceTree, touched: TouchedPaths
) -> tuple[DeviceTreeBuilder, set[str]]:
    """Keep the untouched devices; return them as a builder, plus the touched sources.

    The caller re-reads the touched sources and the event paths, and adds what it finds.
    """
    kept = DeviceTreeBuilder()
    stale: set[str] = set()
    for resource, devices in previous.items():
        for device_id, info in devices.items():
            if any(touched.touches(source) for source in info.sources):
                stale.update(info.sources)
            else:
                kept.add(resource, device_id, info)
    return kept, stale
