"""Incremental rescans: which previously built devices an event batch touches, and the edit.

A device is touched by an event when one of its sysfs sources is the event's path, lies below
it (a PCI function removed with its drm children) or above it (a child of the device changed).
The work is proportional to the events and the devices they touch, not to devices x events, so
a storm of events over a big tree stays cheap; with the scanner's kept :class:`SourceIndex`, not
to the size of the tree either.

Events are hints, re-read from sysfs, except ``remove`` (:class:`RemovedPaths`): the kernel
sends it before it deletes the device's directory, so a re-read may still find the device.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from devplug.model import DeviceInfo, DeviceTree

if TYPE_CHECKING:
    from devplug.scanners.udev import UdevEvent


def _self_and_ancestors(path: str) -> Iterator[str]:
    """``/sys/devices/a/b`` -> itself, ``/sys/devices/a``, ``/sys/devices``, ``/sys``."""
    while path and path != "/":
        yield path
        path = path.rsplit("/", 1)[0]


class RemovedPaths:
    """The paths a batch's ``remove`` events named: each, and everything below it (a PCI
    function's drm minors), is gone, whatever sysfs still shows.

    The kernel sends a device's ``remove`` uevent, then deletes its sysfs directory, so a
    re-read right after the event may find the device still there; believing sysfs would
    keep it advertised until something else made us look again. A path whose last event in
    the batch is not a ``remove`` (the device was added again) is not gone.
    """

    __slots__ = ("paths",)

    def __init__(self, events: Iterable[UdevEvent] = ()) -> None:
        last: dict[str, str] = {}
        for event in events:
            last[event.sys_path] = event.action
        self.paths = frozenset(path for path, action in last.items() if action == "remove")

    def __bool__(self) -> bool:
        return bool(self.paths)

    def covers(self, path: str) -> bool:
        """True if ``path`` is a removed path or lies below one."""
        paths = self.paths
        return bool(paths) and any(p in paths for p in _self_and_ancestors(path))

    def covers_all(self, sources: Iterable[str]) -> bool:
        """True if every one of ``sources`` (at least one) is covered: what was built only
        from removed devices is gone."""
        found = False
        for source in sources:
            if not self.covers(source):
                return False
            found = True
        return found


class TouchedPaths:
    """The sysfs paths of an event batch, with "does it touch this source?" checks."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = frozenset(paths)

    def touched_sources(self, sources: Iterable[str]) -> set[str]:
        """The ``sources`` this batch touches: equal to or above an event path, or below one."""
        return PathIndex(sources).touched_by(self.paths)


class SourceIndex:
    """The sources of one tree: source -> the (resource, id) keys built from it, and the
    sorted :class:`PathIndex` of them.

    A scanner keeps one between rescans: built from the tree of a full scan, it is edited
    by each :meth:`TreeEdit.build` along with the tree, so an event costs a few lookups
    instead of a pass over every device. Given another tree than its own, it indexes that
    one afresh (:meth:`of`).
    """

    def __init__(self, tree: DeviceTree | None = None) -> None:
        self.reset(tree if tree is not None else DeviceTree())

    def reset(self, tree: DeviceTree) -> None:
        """Index ``tree`` (a pass over every device)."""
        by_source: dict[str, set[tuple[str, str]]] = {}
        for resource, devices in tree.items():
            for device_id, info in devices.items():
                for source in info.sources:
                    by_source.setdefault(source, set()).add((resource, device_id))
        self.tree = tree
        self.by_source = by_source
        self.paths = PathIndex(by_source)

    def of(self, tree: DeviceTree) -> SourceIndex:
        """This index, made to index ``tree`` first if it indexes another one."""
        if self.tree is not tree:
            self.reset(tree)
        return self

    def edited(
        self,
        tree: DeviceTree,
        removed: Iterable[tuple[str, str]],
        added: Mapping[str, Mapping[str, DeviceInfo]],
    ) -> None:
        """``tree`` is this index's tree without the ``removed`` keys, plus ``added``."""
        previous, by_source, paths = self.tree, self.by_source, self.paths
        for key in removed:
            resource, device_id = key
            info = previous.get(resource, {}).get(device_id)
            for source in info.sources if info is not None else ():
                keys = by_source.get(source)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del by_source[source]
                        paths.discard(source)
        for resource, devices in added.items():
            for device_id, info in devices.items():
                for source in info.sources:
                    keys = by_source.get(source)
                    if keys is None:
                        keys = by_source[source] = set()
                        paths.add(source)
                    keys.add((resource, device_id))
        self.tree = tree


class TreeEdit:
    """The previous tree minus the devices a batch touched, to which the rescan adds back.

    Offers what a scanner needs of a :class:`~devplug.model.DeviceTreeBuilder` (``in`` and
    ``add``), so the same code fills a full scan's builder or an incremental edit. With the
    scanner's :class:`SourceIndex` (``index``), finding the touched devices costs O(changed)
    and :meth:`build` edits the index; without it, the previous tree is indexed here.
    """

    def __init__(
        self, previous: DeviceTree, touched: TouchedPaths, index: SourceIndex | None = None
    ) -> None:
        self.previous = previous
        self._index = index.of(previous) if index is not None else SourceIndex(previous)
        self._kept = index is not None
        by_source = self._index.by_source
        #: sources of touched devices: the rescan re-reads them (with the event paths).
        self.stale_sources = self._index.paths.touched_by(touched.paths)
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
        tree = self.previous.with_changes(self.removed, self._added)
        if self._kept and self._index.tree is self.previous:
            self._index.edited(tree, self.removed, self._added)
        return tree


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
