"""The Intel GPU scanner: ``gpu.intel.com/<driver>`` resources, as Intel's GPU plugin has them.

Each GPU is a PCI function with vendor 0x8086 and a drm card; its resource is named after the
driver udev reports (``i915``, ``xe``), its id is its PCI address (stable when cards renumber),
and with ``shared_dev_num: N`` it gets the ids ``<address>-0`` .. ``<address>-<N-1>``.
A physical function with SR-IOV VFs enabled is not advertised; the VFs are, each on its own.

Health, decided at every scan: a GPU already advertised whose card or render node vanished, or
whose driver unbound, stays in its resource as Unhealthy with the reason, and becomes Healthy
when restored. A GPU bound to another driver (say vfio-pci) leaves the resource, as does one
whose PCI function is gone. A GPU is first advertised only once its card node exists.

Each GPU carries the DRA attributes Intel's own DRA driver publishes (:mod:`.attributes`), so
that a DRA DeviceClass written for Intel's driver selects it when the DRA front serves it.

The kubelet's 4 MiB ListAndWatch limit: a host whose lists would not fit is refused at the
first scan, naming ``shared_dev_num`` (a configuration check, see :mod:`.settings`). After
that, GPUs that would push a list over are the daemon's list limit's to hold back, as for
every scanner: a GPU's shares share one DeviceInfo, so they wait together.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import structlog

from devplug.model import (
    DeviceInfo,
    DeviceNode,
    DeviceTree,
    DeviceTreeBuilder,
    Health,
    Mount,
)
from devplug.naming import natural_key
from devplug.scanners.incremental import PathIndex, RemovedPaths
from devplug.scanners.intel_gpu.attributes import intel_attributes
from devplug.scanners.intel_gpu.discovery import (
    BY_PATH_DIR,
    CARD_NAME,
    GpuFunction,
    pci_path_of_card,
    pci_path_of_event,
    read_function,
)
from devplug.scanners.intel_gpu.entry import GpuEntry, entry_sizes
from devplug.scanners.intel_gpu.monitoring import MONITORING_ID, MONITORING_RESOURCE, MonitorNodes
from devplug.scanners.intel_gpu.policy import preferred_gpu_shares, share_order
from devplug.scanners.intel_gpu.settings import IntelGpuSettings, refuse_if_too_big
from devplug.scanners.udev import UdevEvent, UdevSource

log = structlog.get_logger(__name__)

RESOURCE_PREFIX = "gpu.intel.com/"
# The drm drivers of Intel GPUs: each is a resource, gpu.intel.com/<driver>.
GPU_DRIVERS = frozenset({"i915", "xe"})


class IntelGpuScanner:
    """Scanner for ``scanners.intel_gpu``; also the resources' GetPreferredAllocation policy."""

    name = "intel_gpu"

    def __init__(
        self, settings: IntelGpuSettings | None = None, field: str = "scanners.intel_gpu"
    ) -> None:
        self.settings = settings or IntelGpuSettings()
        self._field = field
        # PCI path -> what the last scan advertised for it (the memory behind Unhealthy).
        self._entries: dict[str, GpuEntry] = {}
        # PCI paths of functions in an SR-IOV setup at the last scan: changes there rescan all.
        self._sriov_paths: set[str] = set()
        # Both of the above, sorted, to find what an event touches without sorting per event.
        self._known = PathIndex()
        self._monitor = MonitorNodes()
        # False until a scan succeeded: a host too big for the kubelet's limit is refused then.
        self._scanned = False

    @classmethod
    def from_config(cls, raw: Any, field: str = "scanners.intel_gpu") -> IntelGpuScanner:
        return cls(IntelGpuSettings.from_raw(raw, field), field)

    @property
    def subsystems(self) -> frozenset[str]:
        # drm for minors coming and going, pci for bind/unbind and SR-IOV changes.
        return frozenset({"drm", "pci"})

    def makes_resource(self, resource: str) -> bool:
        if resource == MONITORING_RESOURCE:
            return self.settings.monitoring
        return resource.removeprefix(RESOURCE_PREFIX) in GPU_DRIVERS and resource.startswith(
            RESOURCE_PREFIX
        )

    # ------------------------------------------------------------------ scans

    def scan(self, source: UdevSource) -> DeviceTree:
        functions: dict[str, GpuFunction] = {}
        for card in source.devices("drm", sys_name=CARD_NAME):
            path = pci_path_of_card(card.sys_path)
            if path is None or path in functions:
                continue  # a virtual drm device (no PCI parent), or a second card of one GPU
            function = read_function(source, path)
            if function is not None:
                functions[path] = function
        for path in self._entries.keys() - functions.keys():
            # Advertised before, no card now: still there (unhealthy) or gone (dropped)?
            function = read_function(source, path)
            if function is not None:
                functions[path] = function
        by_path_dir = self._by_path_dir_exists()
        entries: dict[str, GpuEntry] = {}
        for path, function in functions.items():
            entry = self._evaluate(function, self._entries.get(path), by_path_dir)
            if entry is not None:
                entries[path] = entry
        if not self._scanned:
            refuse_if_too_big(
                self._field, self.settings.shared_dev_num, entry_sizes(entries.values())
            )
        builder = DeviceTreeBuilder()
        for entry in sorted(entries.values(), key=lambda e: share_order(e.ids[0])):
            for device_id in entry.ids:
                builder.add(entry.resource, device_id, entry.info)
        monitor = MonitorNodes(n for entry in entries.values() for n in entry.monitor_nodes)
        if self.settings.monitoring and entries:
            builder.add(MONITORING_RESOURCE, MONITORING_ID, monitor.device())
        tree = builder.build()
        self._entries = entries
        self._monitor = monitor
        self._sriov_paths = {path for path, f in functions.items() if f.sriov_involved}
        self._known = PathIndex(entries.keys() | self._sriov_paths)
        self._scanned = True
        return tree

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        """Re-read the PCI functions the events concern; SR-IOV changes ask for a full scan.

        What a ``remove`` event names is gone without a look: a removed function, or a
        removed drm minor of a function that stays."""
        if any(event.action == "move" for event in events):
            return None
        paths = self._known.touched_by(event.sys_path for event in events)
        paths.update(pci_path_of_event(event.sys_path) for event in events)
        if paths & self._sriov_paths:
            return None  # VFs and their PF decide each other's fate: let a full scan sort it
        gone = RemovedPaths(events)
        by_path_dir = self._by_path_dir_exists()
        entries = dict(self._entries)
        for path in sorted(paths):
            function = None if gone.covers(path) else read_function(source, path)
            if function is not None and gone:
                function = _without_removed_minors(function, gone)
            if function is not None and self._sriov_concerns_gpus(function):
                return None  # VFs and their PF decide each other's fate: a full scan sorts it
            entry = None
            if function is not None:
                entry = self._evaluate(function, self._entries.get(path), by_path_dir)
            if entry is None:
                entries.pop(path, None)
            else:
                entries[path] = entry
        removed = [
            (old.resource, device_id)
            for path in paths
            if (old := self._entries.get(path)) is not None
            for device_id in old.ids
        ]
        added: dict[str, dict[str, DeviceInfo]] = {}
        for path in paths:
            new = entries.get(path)
            if new is not None:
                added.setdefault(new.resource, {}).update(dict.fromkeys(new.ids, new.info))
        if self.settings.monitoring:
            self._update_monitoring(paths, entries, removed, added)
        tree = previous.with_changes(removed, added)
        # SR-IOV paths stay as they were: a rescan that meets one defers to a full scan.
        for path in paths:
            if path in entries:
                self._known.add(path)
            elif path not in self._sriov_paths:
                self._known.discard(path)
        self._entries = entries
        return tree

    def _update_monitoring(
        self,
        paths: set[str],
        entries: Mapping[str, GpuEntry],
        removed: list[tuple[str, str]],
        added: dict[str, dict[str, DeviceInfo]],
    ) -> None:
        """Re-issue the monitoring device if the touched GPUs changed its nodes (or whether
        there is one at all)."""
        changed = False
        for path in paths:
            old, new = self._entries.get(path), entries.get(path)
            before = old.monitor_nodes if old is not None else frozenset()
            after = new.monitor_nodes if new is not None else frozenset()
            if before != after:
                changed = True
                for node in before:
                    self._monitor.discard(node)
                for node in after:
                    self._monitor.add(node)
        if not changed and bool(self._entries) == bool(entries):
            return
        removed.append((MONITORING_RESOURCE, MONITORING_ID))
        if entries:
            added[MONITORING_RESOURCE] = {MONITORING_ID: self._monitor.device()}

    def _sriov_concerns_gpus(self, function: GpuFunction) -> bool:
        """Whether an SR-IOV function is (or belongs to) a GPU, so its change needs a full
        scan; an Intel NIC's PFs and VFs are no concern of ours and are rescanned as usual."""
        if not function.sriov_involved:
            return False
        if function.minors or function.sys_path in self._known:
            return True
        pf = function.physical_function_path
        return pf is not None and pf in self._known

    # ------------------------------------------------------------------ one GPU

    def _evaluate(
        self, function: GpuFunction, previous: GpuEntry | None, by_path_dir: bool
    ) -> GpuEntry | None:
        """What to advertise for ``function`` now, given what was advertised last time."""
        if not self.settings.admits(function.pci_device_id) or function.vfs_enabled > 0:
            return None
        if function.has_card and function.driver is not None:
            if function.driver not in GPU_DRIVERS:
                # A drm card under another driver is not one Intel's GPU plugin serves either
                # way round; a GPU rebound to vfio-pci loses its cards before this is seen.
                log.debug(
                    "intel_gpu.driver_not_served", address=function.address, driver=function.driver
                )
                return None
            resource = RESOURCE_PREFIX + function.driver
            if previous is not None and previous.resource != resource:
                previous = None  # rebound to another GPU driver: a new device there
            # The card node is always needed; another minor's node once the GPU has had it and
            # sysfs still shows the minor (a renumbered minor is a new one, not a missing one).
            had = frozenset() if previous is None else previous.expected
            present = function.present_nodes
            required = {m.dev_path for m in function.minors if m.is_card or m.dev_path in had}
            expected = frozenset(
                m.dev_path for m in function.minors if m.dev_path in present or m.dev_path in had
            )
            missing = sorted(required - function.present_nodes, key=natural_key)
            if missing and previous is None:
                log.debug("intel_gpu.node_missing", address=function.address, nodes=missing)
                return None  # never advertise a GPU before its card node exists
            health, reason = Health.HEALTHY, ""
            if missing:
                health = Health.UNHEALTHY
                reason = f"device node {' '.join(missing)} of {function.address} is missing"
            info = DeviceInfo(
                health=health,
                health_reason=reason,
                nodes=tuple(
                    DeviceNode(m.dev_path)
                    for m in function.minors
                    if m.dev_path in function.present_nodes
                ),
                mounts=self._mounts(function, by_path_dir),
                numa_nodes=() if function.numa_node is None else (function.numa_node,),
                sources=(function.sys_path, *(m.sys_path for m in function.minors)),
                attributes=intel_attributes(function, health),
            )
            return self._entry(resource, function.address, info, present, expected)
        if previous is None:
            return None
        was = previous.resource.removeprefix(RESOURCE_PREFIX)
        if function.driver is None:
            reason = f"no driver is bound to {function.address} (was {was})"
        elif function.driver == was:
            reason = f"{was} is bound to {function.address} but it has no drm card"
        else:
            log.info("intel_gpu.rebound", address=function.address, driver=function.driver, was=was)
            return None
        info = replace(
            previous.info,
            health=Health.UNHEALTHY,
            health_reason=reason,
            sources=(function.sys_path,),
            attributes=intel_attributes(function, Health.UNHEALTHY),
        )
        return self._entry(
            previous.resource, function.address, info, frozenset(), previous.expected
        )

    def _entry(
        self,
        resource: str,
        address: str,
        info: DeviceInfo,
        present: frozenset[str],
        expected: frozenset[str] = frozenset(),
    ) -> GpuEntry:
        shares = self.settings.shared_dev_num
        ids = (address,) if shares == 1 else tuple(f"{address}-{i}" for i in range(shares))
        return GpuEntry(resource, ids, info, present, expected)

    def _mounts(self, function: GpuFunction, by_path_dir: bool) -> tuple[Mount, ...]:
        if self.settings.bypath == "single":
            return tuple(Mount(link) for link in function.by_path_links)
        if self.settings.bypath == "all" and by_path_dir:
            return (Mount(BY_PATH_DIR),)
        return ()

    def _by_path_dir_exists(self) -> bool:
        return self.settings.bypath == "all" and os.path.isdir(BY_PATH_DIR)

    # ------------------------------------------------------------------ allocation hook

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str]:
        if resource == MONITORING_RESOURCE:
            required = list(dict.fromkeys(must_include))
            answer = list(dict.fromkeys([*required, *available]))
            return answer[: max(size, len(required))]
        # (A request of thousands of ids reaches this in a worker thread: the daemon decides
        # that for every hook, by the whole request; see devplug.kubelet.preferring.)
        policy = self.settings.allocation_policy
        return preferred_gpu_shares(policy, available, must_include, size, devices)


def _without_removed_minors(function: GpuFunction, removed: RemovedPaths) -> GpuFunction:
    """``function`` without the drm minors a ``remove`` event named (sysfs may list them a
    moment longer), and without the by-path links of a kind none of its minors has left."""
    minors = tuple(minor for minor in function.minors if not removed.covers(minor.sys_path))
    if len(minors) == len(function.minors):
        return function
    kinds = {"card" if minor.is_card else "render" for minor in minors}
    return replace(
        function,
        minors=minors,
        present_nodes=function.present_nodes & {minor.dev_path for minor in minors},
        by_path_links=tuple(
            link for link in function.by_path_links if link.rsplit("-", 1)[1] in kinds
        ),
    )
