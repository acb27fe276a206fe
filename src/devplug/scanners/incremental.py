"""Incremental rescans: which previously built devices an event batch touches, and the edit.

A device is touched by an event when one of its sysfs sources is the event's path, lies below
it (a PCI function removed with its drm children) or above it (a child of the device changed).
The work is proportional to the events and the devices they touch (plus one pass to index the
previous tree), not to devices x events, so a storm of events over a big tree stays cheap.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator

from devplug.model import DeviceInfo, DeviceTree


def _self_and_ancestors(path: str) -> Iterator[str]:
    """``/sys/devices/a/b`` -> itself, ``/sys/devices/a``, ``/sys/devices``, ``/sys``."""
    while path and path != "/":
        yield path
        path = path.rsplit("/", 1)[0]


class TouchedPaths:
    """The sysfs paths of an event batch, with "does it touch this source?" checks."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = frozenset(paths)

    def touched_sources(self, sources: Iterable[str]) -> set[str]:
        """The ``sources`` this batch touches: equal to or above an event path, or below one."""
        return PathIndex(sources).touched_by(self.paths)


class TreeEdit:
    """The previous tree minus the devices a batch touched, to which the rescan adds back.

    Offers what a scanner needs of a :class:`~devplug.model.DeviceTreeBuilder` (``in`` and
    ``add``), so the same code fills a full scan's builder or an incremental edit.
    """

    def __init__(self, previous: DeviceTree, touched: TouchedPaths) -> None:
        self.previous = previous
        by_source: dict[str, list[tuple[str, str]]] = {}
        for resource, devices in previous.items():
            for device_id, info in devices.items():
                for source in info.sources:
                    by_source.setdefault(source, []).append((resource, device_id))
        #: sources of touched devices: the rescan re-reads them (with the event paths).
        self.stale_sources = touched.touched_sources(by_source)
        self.removed = {key for source in self.stale_sources for key in by_source[source]}
        # A device built from several sources goes if any is touched; re-read all of them.
        for resource, device_id in self.removed:
            self.stale_sources.update(previous[resource][device_id].sources)
        self._added: dict[str, dict[str, DeviceInfo]] = {}

    def __contains__(self, key: tuple[str, str]) -> bool:
        resource, device_id = key
        if device_id in self._added.get(resource, {}):
            return True
        return key not in self.removed and device_id in self.previous.get(resource, {})

    def add(self, resource: str, device_id: str, info: DeviceInfo) -> None:
        if (resource, device_id) in self:
            raise ValueError(f"duplicate device id {device_id!r} in resource {resource!r}")
        self._added.setdefault(resource, {})[device_id] = info

    def build(self) -> DeviceTree:
        return self.previous.with_changes(self.removed, self._added)


class PathIndex:
    """A set of sysfs paths kept sorted between scans, so that finding the ones an event batch
    touches costs a few set lookups and a bisect per event, not a sort of every path."""

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._members = set(paths)
        self._sorted = sorted(self._members)

    def __contains__(self, path: object) -> bool:
        return path in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, path: str) -> None:
        if path not in self._members:
            self._members.add(path)
            bisect.insort(self._sorted, path)

    def discard(self, path: str) -> None:
        if path in self._members:
            self._members.remove(path)
            del self._sorted[bisect.bisect_left(self._sorted, path)]

    def touched_by(self, event_paths: Iterable[str]) -> set[str]:
        """Members equal to or above an event path, or below one."""
        hits: set[str] = set()
        for path in event_paths:
            hits.update(a for a in _self_and_ancestors(path) if a in self._members)
            prefix = path + "/"
            start = bisect.bisect_left(self._sorted, prefix)
            for member in itertools.islice(self._sorted, start, None):
                if not member.startswith(prefix):
                    break
                hits.add(member)
        return hits
