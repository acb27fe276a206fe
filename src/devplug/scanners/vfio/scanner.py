"""The VFIO scanner: PCI functions bound to a VFIO driver, served one IOMMU group per device.

A group can only go to one VM, so each device is a group: its id is the lowest PCI address of
its functions (stable across reboots, unlike the group number) and its answer carries every
node of the group. ``PCI_RESOURCE_<RESOURCE>`` gets one address per group: its requested
function (see :func:`requested_function`), because virt-launcher gives the n-th address of the
variable to the n-th host device of the resource; the Allocate answer lists them sorted (see
:meth:`VfioScanner.post_allocate`). A group with a function on a host driver (bridges
excepted) is not assignable: it is reported by ``devplug scan`` with the reason, never
advertised.

Health, at every scan: a group already advertised whose function leaves its VFIO driver
(unbound, or bound to another driver) or whose nodes vanish stays listed as Unhealthy with
the reason, and is Healthy again when restored. devplug never binds or unbinds drivers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from devplug._kits.problems import ProblemLog
from devplug.model import (
    ContainerAllocation,
    DeviceInfo,
    DeviceNode,
    DeviceTree,
    DeviceTreeBuilder,
    Health,
)
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.scanners.vfio.discovery import PciFunction, read_functions
from devplug.scanners.vfio.settings import VfioSettings

log = structlog.get_logger(__name__)

CONTAINER_NODE = "/dev/vfio/vfio"
IOMMUFD_NODE = "/dev/iommu"
# Drivers a function may sit on without keeping its group from a VM: the kernel lets groups
# with them be used (they manage DMA themselves; pcieport also serves RCECs, not only bridges).
_HARMLESS_DRIVERS = frozenset({"pci-stub", "pcieport"})
# misc devices that concern VFIO: /dev/vfio/vfio and /dev/iommu (not /dev/kvm and the like).
_VFIO_MISC = ("/misc/vfio", "/misc/iommu")
REPORT_SECTION = "vfio_unassignable_groups"
# A PCI vendor or device id as default resource names carry it (discovery reads them so).
_HEX4 = re.compile(r"[0-9a-f]{4}")


def kubevirt_variable(resource: str) -> str:
    """KubeVirt's name for a resource's PCI addresses: ``PCI_RESOURCE_`` + the name
    upper-cased with "." and "/" as "_" (``intel.com/x710`` -> ``PCI_RESOURCE_INTEL_COM_X710``)."""
    return "PCI_RESOURCE_" + resource.upper().replace(".", "_").replace("/", "_")


@dataclass(frozen=True, slots=True)
class _Entry:
    resource: str
    info: DeviceInfo
    vfio_functions: frozenset[str]  # addresses that were on a VFIO driver when advertised


class VfioScanner:
    """Scanner for ``scanners.vfio``."""

    name = "vfio"

    def __init__(self, settings: VfioSettings | None = None) -> None:
        self.settings = settings or VfioSettings()
        self._drivers = frozenset(self.settings.drivers)
        self._entries: dict[str, _Entry] = {}  # group id -> what was advertised
        self._ids: dict[str, str] = {}  # address of a VFIO function -> its group's id
        self._unassignable: list[dict[str, Any]] = []
        self._refused = ProblemLog()  # group id -> why it cannot be served

    @classmethod
    def from_config(cls, raw: Any, field: str = "scanners.vfio") -> VfioScanner:
        return cls(VfioSettings.from_raw(raw, field))

    @property
    def subsystems(self) -> frozenset[str]:
        # pci: bind/unbind and hotplug; vfio: group nodes; vfio-dev: iommufd nodes;
        # misc: /dev/vfio/vfio and /dev/iommu.
        return frozenset({"pci", "vfio", "vfio-dev", "misc"})

    def makes_resource(self, resource: str) -> bool:
        """A selector's resource, or a default name (``<default_domain>/<vendor>_<device>``)
        of ids no selector maps (those always take the selector's resource)."""
        settings = self.settings
        if any(entry.resource == resource for entry in settings.devices):
            return True
        domain, _, ids = resource.partition("/")
        vendor, _, device = ids.partition("_")
        return (
            domain == settings.default_domain
            and _HEX4.fullmatch(vendor) is not None
            and _HEX4.fullmatch(device) is not None
            and settings.resource_for(vendor, device) is None
        )

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        """A full scan when an event may concern VFIO; the previous tree otherwise.

        A group is decided by all its functions and nodes together, so a batch that concerns
        PCI or VFIO devices gets a full scan (about 60 ms per 300 functions under umockdev).
        Other ``misc`` devices (``/dev/kvm`` changes at every VM start and stop) are skipped.
        """
        if any(_concerns_vfio(event) for event in events):
            return None
        return previous

    def post_allocate(
        self,
        resource: str,
        requests: Sequence[Sequence[str]],
        answers: Sequence[ContainerAllocation],
    ) -> Sequence[ContainerAllocation]:
        """``PCI_RESOURCE_<RESOURCE>`` in address order, whatever the request's order.

        The merged answer lists one address per group in the order the kubelet named the ids,
        and the kubelet takes them from a set: the same groups could reach a VM's host
        devices in a different order at every start. Sorted, the first host device of the
        resource always gets the lowest address.
        """
        variable = kubevirt_variable(resource)
        sorted_answers = []
        for answer in answers:
            value = answer.env.get(variable)
            if value:
                env = {**answer.env, variable: ",".join(sorted(value.split(",")))}
                answer = replace(answer, env=env)
            sorted_answers.append(answer)
        return sorted_answers

    def report(self) -> Mapping[str, object]:
        return {REPORT_SECTION: list(self._unassignable)}

    def scan(self, source: UdevSource) -> DeviceTree:
        groups: dict[int, list[PciFunction]] = {}
        for function in read_functions(source):
            if function.group is not None:
                groups.setdefault(function.group, []).append(function)
        iommufd = source.node_exists(IOMMUFD_NODE)
        entries: dict[str, _Entry] = {}
        unassignable: list[dict[str, Any]] = []
        for group, members in sorted(groups.items()):
            endpoints = [f for f in members if not f.is_bridge]
            if not endpoints:
                continue
            # The id of the group's device: the one it had, if any of its functions was in an
            # advertised group (a removed first function must not turn it into a new device
            # while a VM may hold it), else its lowest address.
            group_id = next(
                (self._ids[f.address] for f in endpoints if f.address in self._ids),
                endpoints[0].address,
            )
            previous = self._entries.get(group_id)
            entry, problem = self._evaluate(source, group, members, endpoints, previous, iommufd)
            if entry is not None:
                entries[group_id] = entry
            elif problem is not None:
                unassignable.append(
                    {
                        "group": group,
                        "id": group_id,
                        "summary": f"group {group} ({_describe(members)})",
                        "functions": [
                            {
                                "address": f.address,
                                "driver": f.driver,
                                "ids": f"{f.vendor}:{f.device}",
                            }
                            for f in members
                        ],
                        "reason": problem,
                    }
                )
        builder = DeviceTreeBuilder()
        for group_id, entry in sorted(entries.items()):
            builder.add(entry.resource, group_id, entry.info)
        self._entries = entries
        self._ids = {a: group_id for group_id, e in entries.items() for a in e.vfio_functions}
        self._log_unassignable(unassignable)
        self._unassignable = unassignable
        return builder.build()

    def _log_unassignable(self, groups: list[dict[str, Any]]) -> None:
        """A warning the first time a group is refused for a reason (the daemon's operators
        do not run ``devplug scan``); again if a scan in between did not refuse it."""
        refused_now = {group["id"] for group in groups}
        for group_id in self._refused.unsolved():
            if group_id not in refused_now:
                self._refused.solved(group_id)
        for group in groups:
            self._refused.report(
                log,
                "vfio.group.unassignable",
                group["reason"],
                key=group["id"],
                level="warning",
                group=group["group"],
                id=group["id"],
            )

    def _evaluate(
        self,
        source: UdevSource,
        group: int,
        members: list[PciFunction],
        endpoints: list[PciFunction],
        previous: _Entry | None,
        iommufd: bool,
    ) -> tuple[_Entry | None, str | None]:
        """(what to advertise, or None with the reason it is not assignable, if it is ours)."""
        on_vfio = [f for f in endpoints if f.driver in self._drivers]
        if not on_vfio and previous is None:
            return None, None  # a host device: not ours to mention
        noiommu = any(f.noiommu for f in members)
        if noiommu and not self.settings.allow_noiommu:
            return (
                None,
                "no IOMMU (vfio-noiommu): no DMA isolation; set allow_noiommu: true to serve it",
            )
        problems = self._driver_problems(endpoints, previous)
        if previous is not None:
            present = {f.address for f in endpoints}
            problems.extend(
                f"function {address} is gone"
                for address in sorted(previous.vfio_functions - present)
            )
        nodes, optional = self._nodes(group, noiommu, on_vfio, iommufd)
        if self.settings.mode == "iommufd" and not noiommu:
            problems.extend(
                f"function {f.address} has no iommufd device (vfio-dev/vfioN): the kernel "
                "lacks VFIO cdev support; use mode auto or legacy"
                for f in on_vfio
                if not f.vfio_devs
            )
        missing = [node for node in nodes if not source.node_exists(node)]
        present_optional = [node for node in optional if source.node_exists(node)]
        if previous is None and (problems or missing):
            return None, "; ".join([*problems, *(f"device node {n} is missing" for n in missing)])
        assert previous is not None or on_vfio
        resource = previous.resource if previous is not None else self._resource(endpoints)
        problems.extend(f"device node {node} is missing" for node in missing)
        if previous is not None and not on_vfio:
            # Every function left VFIO: keep the group listed as unhealthy, as it was.
            reason = "; ".join(problems) or "no function of the group is on a VFIO driver"
            info = replace(previous.info, health=Health.UNHEALTHY, health_reason=reason)
            return _Entry(resource, info, previous.vfio_functions), None
        addresses = [f.address for f in on_vfio]
        numa = {f.numa_node for f in endpoints if f.numa_node is not None}
        requested = requested_function(on_vfio, self.settings.selector_for(resource))
        info = DeviceInfo(
            health=Health.UNHEALTHY if problems else Health.HEALTHY,
            health_reason="; ".join(problems),
            nodes=tuple(
                DeviceNode(node) for node in [*nodes, *present_optional] if node not in missing
            ),
            # One address per group: its siblings reach the container as nodes only.
            env={kubevirt_variable(resource): requested.address},
            numa_nodes=tuple(sorted(numa)),
            sources=tuple(f.sys_path for f in members),
        )
        # Remembered while the group is listed: a function that vanishes keeps it unhealthy
        # until the function is back (a VM may hold the group as it was).
        vfio_functions = frozenset(addresses) | (
            previous.vfio_functions if previous else frozenset()
        )
        return _Entry(resource, info, vfio_functions), None

    def _driver_problems(self, endpoints: list[PciFunction], previous: _Entry | None) -> list[str]:
        problems = []
        for function in endpoints:
            if function.driver in self._drivers:
                continue
            was_vfio = previous is not None and function.address in previous.vfio_functions
            if was_vfio and function.driver is None:
                problems.append(
                    f"function {function.address} left its VFIO driver (no driver bound)"
                )
            elif was_vfio:
                # pci-stub included: harmless for a group, but this function left the VM's set.
                problems.append(
                    f"function {function.address} left its VFIO driver: it is bound to "
                    f"{function.driver}"
                )
            elif function.driver is not None and function.driver not in _HARMLESS_DRIVERS:
                hint = (
                    f" (if {function.driver} is a VFIO driver, add it to drivers)"
                    if "vfio" in function.driver
                    else ""
                )
                problems.append(
                    f"function {function.address} is bound to {function.driver}, a host "
                    f"driver{hint}"
                )
        return problems

    def _nodes(
        self, group: int, noiommu: bool, on_vfio: list[PciFunction], iommufd: bool
    ) -> tuple[list[str], list[str]]:
        """(nodes the group needs, nodes it gets only where they exist)."""
        legacy = [CONTAINER_NODE, f"/dev/vfio/noiommu-{group}" if noiommu else f"/dev/vfio/{group}"]
        if noiommu:
            return legacy, []  # iommufd has no no-IOMMU groups
        fd_nodes = [IOMMUFD_NODE] + [
            f"/dev/vfio/devices/{name}" for f in on_vfio for name in f.vfio_devs
        ]
        mode = self.settings.mode
        if mode == "legacy":
            return legacy, []
        if mode == "iommufd":
            return fd_nodes, []
        # auto: the iommufd nodes are a bonus where the kernel has them (/dev/iommu without
        # VFIO cdev support has no /dev/vfio/devices/*): never a reason to refuse a group.
        return legacy, fd_nodes if iommufd else []

    def _resource(self, endpoints: list[PciFunction]) -> str:
        """The resource of the first function (by address) that a selector names, else the
        default name of the first function."""
        for function in endpoints:
            resource = self.settings.resource_for(function.vendor, function.device)
            if resource is not None:
                return resource
        first = endpoints[0]
        return self.settings.default_resource(first.vendor, first.device)


def requested_function(on_vfio: Sequence[PciFunction], selectors: frozenset[str]) -> PciFunction:
    """The function a VM gets when it asks for the group (``on_vfio`` non-empty, in address
    order): the first one a selector of the group's resource names, else the first one.

    The others stay in the container (the group node or their iommufd nodes) but out of
    ``PCI_RESOURCE_*``: an address there is a host device slot of its own in virt-launcher,
    and a sibling taking a slot leaves one of the VM's devices without its group.
    """
    return next((f for f in on_vfio if f"{f.vendor}:{f.device}" in selectors), on_vfio[0])


def _describe(members: list[PciFunction]) -> str:
    return ", ".join(f"{f.address} {f.driver or 'no driver'}" for f in members)


def _concerns_vfio(event: UdevEvent) -> bool:
    if event.subsystem == "misc":
        return event.sys_path.endswith(_VFIO_MISC)
    return True  # pci, vfio, vfio-dev (what the monitor lets through), or unknown
