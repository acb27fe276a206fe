"""Bench-only stand-ins for proposed O(changed) steps, to measure them in a real daemon.

Installed by bench.traced_daemon when ``DEVPLUG_BENCH_PROPOSALS=1`` (``bench.hotplug_stages
--proposals``); nothing in ``src/`` changes. Each keeps the module's own code for every case
it does not cover (a full pass, as today):

- ``HealthGate.gate``: while no device is held down, a map edited from the one gated last
  (``DeviceTree.edit_since``) is gated by looking at the edited ids only;
- ``TreeEdit``: the index of the previous tree's sources (source -> devices, and the sorted
  PathIndex) is kept between rescans and edited with each tree edit, instead of being built
  from every device of the tree on every event.
"""

from __future__ import annotations

from typing import Any

from devplug.hotplug import health
from devplug.model import DeviceTree, Health
from devplug.scanners import incremental

_full_gate = health.HealthGate.gate


def _gate(self: health.HealthGate, raw: DeviceTree) -> DeviceTree:
    last: DeviceTree | None = getattr(self, "_bench_last", None)
    self._bench_last = None  # type: ignore[attr-defined]
    if last is None or self._healthy_since:
        return _remember(self, raw, _full_gate(self, raw))
    edits = {}
    for resource, devices in raw.items():
        before = last.get(resource)
        if before is devices:
            continue
        edit = None if before is None else raw.edit_since(resource, before)
        if edit is None:
            return _remember(self, raw, _full_gate(self, raw))
        edits[resource] = edit
    for resource, edit in edits.items():
        for device_id in edit.added:
            key = (resource, device_id)
            if raw[resource][device_id].health is Health.HEALTHY and (
                self._published.get(key) is Health.UNHEALTHY
            ):
                # A recovery starts a hold-down: the module's own pass does that.
                return _remember(self, raw, _full_gate(self, raw))
    for resource in set(last) - set(raw):
        for device_id in last[resource]:
            self._published.pop((resource, device_id), None)
            self._last_reason.pop((resource, device_id), None)
    for resource, edit in edits.items():
        devices = raw[resource]
        for device_id in edit.removed - edit.added:
            self._published.pop((resource, device_id), None)
            self._last_reason.pop((resource, device_id), None)
        for device_id in edit.added:
            key = (resource, device_id)
            info = devices[device_id]
            if info.health is Health.UNHEALTHY:
                self._last_reason[key] = info.health_reason
                if self._published.get(key) is not Health.UNHEALTHY:
                    health.log.warning(
                        "device.health.changed",
                        resource=resource,
                        device=device_id,
                        health=info.health.value,
                        reason=info.health_reason or "reported by the scanner",
                    )
            self._published[key] = info.health
    return _remember(self, raw, raw)


def _remember(gate: health.HealthGate, raw: DeviceTree, out: DeviceTree) -> DeviceTree:
    # Only a tree passed through unchanged (nothing held down) is a base for the next edit.
    gate._bench_last = raw if out is raw else None  # type: ignore[attr-defined]
    return out


class _Index:
    """The sources of one tree: source -> (resource, id) keys, and the sorted PathIndex."""

    tree: DeviceTree | None = None
    by_source: dict[str, list[tuple[str, str]]]
    paths: incremental.PathIndex


_INDEX = _Index()
_plain_init = incremental.TreeEdit.__init__
_plain_build = incremental.TreeEdit.build


def _index_of(previous: DeviceTree) -> _Index:
    if _INDEX.tree is not previous:
        by_source: dict[str, list[tuple[str, str]]] = {}
        for resource, devices in previous.items():
            for device_id, info in devices.items():
                for source in info.sources:
                    by_source.setdefault(source, []).append((resource, device_id))
        _INDEX.tree, _INDEX.by_source = previous, by_source
        _INDEX.paths = incremental.PathIndex(by_source)
    return _INDEX


def _edit_init(self: Any, previous: DeviceTree, touched: incremental.TouchedPaths) -> None:
    index = _index_of(previous)
    self.previous = previous
    self.stale_sources = index.paths.touched_by(touched.paths)
    self.removed = {key for source in self.stale_sources for key in index.by_source[source]}
    for resource, device_id in self.removed:
        self.stale_sources.update(previous[resource][device_id].sources)
    self._added = {}


def _edit_build(self: Any) -> DeviceTree:
    tree: DeviceTree = _plain_build(self)
    previous = _INDEX.tree
    if previous is None or previous is not self.previous:
        return tree
    by_source, paths = _INDEX.by_source, _INDEX.paths
    for resource, device_id in self.removed:
        for source in previous[resource][device_id].sources:
            keys = by_source.get(source, [])
            if (resource, device_id) in keys:
                keys.remove((resource, device_id))
            if not keys:
                by_source.pop(source, None)
                paths.discard(source)
    for resource, devices in self._added.items():
        for device_id, info in devices.items():
            for source in info.sources:
                by_source.setdefault(source, []).append((resource, device_id))
                paths.add(source)
    _INDEX.tree = tree
    return tree


def install() -> None:
    health.HealthGate.gate = _gate  # type: ignore[method-assign]
    incremental.TreeEdit.__init__ = _edit_init  # type: ignore[method-assign]
    incremental.TreeEdit.build = _edit_build  # type: ignore[method-assign]
