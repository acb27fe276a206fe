"""``devplug status --pods``: every device of devplug's resources, its health and the
containers that hold it, and whether the kubelet's allocatable set agrees with the plugin.

The holders come from the kubelet's pod resources API (read-only, no API server
credentials); the devices and their health from each plugin's first ListAndWatch list (the
probe of :mod:`devplug.cli.status`). Only devplug's resources are shown: theirs are the
resources whose names devplug's socket names spell. A device a container holds that its
plugin no longer lists (unplugged, unbound) is listed as ``gone``. A resource's devices are
listed by id (:func:`devplug.naming.natural_key`), not in the plugin's order, which moves a
device that turns unhealthy.

One reading, no second look: an allocatable set that differs while the kubelet is taking a
new list shows as a difference (the daemon's metric waits for a second reading). A device the
plugin lists Unhealthy is never *extra*: kubelets before 1.23 count unhealthy devices as
allocatable (kubernetes#104122).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplug._kits.printable import escaped
from devplug.kubelet.podresources import (
    NOT_A_SOCKET,
    Holder,
    PodResourcesUnavailable,
    PodResourcesView,
    read_pod_resources,
)
from devplug.naming import natural_key

GONE = "gone"
AGREES = "agrees"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Listed:
    """A device as its plugin lists it."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceRow:
    resource: str
    id: str
    health: str  # as the plugin lists it, or GONE: held, but no longer listed
    numa_nodes: tuple[int, ...]
    holders: tuple[Holder, ...] | None  # None: unknown (no pod resources API)


@dataclass(frozen=True, slots=True)
class Allocatable:
    """The kubelet's allocatable ids of a resource against the ids its plugin lists Healthy."""

    missing: tuple[str, ...] = ()  # listed Healthy, not allocatable
    extra: tuple[str, ...] = ()  # allocatable, not listed
    known: bool = True

    def describe(self) -> str:
        if not self.known:
            return UNKNOWN
        if not (self.missing or self.extra):
            return AGREES
        parts = [f"missing={len(self.missing)}"] if self.missing else []
        parts += [f"extra={len(self.extra)}"] if self.extra else []
        return ",".join(parts)


@dataclass(frozen=True, slots=True)
class PodsStatus:
    socket: Path
    state: str  # "available", "absent" or "not answering"
    error: str | None
    allocatable_error: str | None
    pods: int
    devices: tuple[DeviceRow, ...]
    allocatable: Mapping[str, Allocatable]

    @property
    def available(self) -> bool:
        return self.state == "available"

    def describe(self) -> str:
        """The one line about the pod resources API."""
        if self.error == NOT_A_SOCKET:  # a file in its place: nothing a restart would fix
            return f"pod resources: {self.socket} is not a socket: holders unknown"
        if not self.available:
            fix = (
                "a kubelet without the pod resources API, or a pod without its mount; "
                "--pod-resources-socket PATH names another"
                if self.state == "absent"
                else "down or restarting"
            )
            return f"pod resources: {self.error} ({fix}): holders unknown"
        line = f"pod resources: {self.pods} pods, read from {self.socket}"
        if self.allocatable_error is not None:
            line += f"; allocatable unknown ({self.allocatable_error})"
        return line

    def document(self) -> dict[str, Any]:
        return {
            "socket": str(self.socket),
            "state": self.state,
            "error": self.error,
            "allocatable_error": self.allocatable_error,
        }


async def read_holders(socket: Path, timeout: float) -> PodResourcesView | PodResourcesUnavailable:
    try:
        return await read_pod_resources(socket, timeout=timeout)
    except PodResourcesUnavailable as exc:
        return exc


def join(
    socket: Path,
    reading: PodResourcesView | PodResourcesUnavailable,
    served: Mapping[str, Sequence[Listed]],
) -> PodsStatus:
    """Each listed device of each of devplug's resources (``served``: resource -> its plugin's
    list) with its holders, and the held ones no longer listed, by resource and id; the
    allocatable check."""
    if isinstance(reading, PodResourcesUnavailable):
        rows = [
            DeviceRow(resource, d.id, d.health, d.numa_nodes, None)
            for resource, listed in sorted(served.items())
            for d in listed
        ]
        unknown = {resource: Allocatable(known=False) for resource in served}
        return PodsStatus(socket, reading.state, reading.reason, None, 0, _by_id(rows), unknown)
    rows = []
    allocatable: dict[str, Allocatable] = {}
    for resource, listed in sorted(served.items()):
        held = reading.held.get(resource, {})
        ids = {d.id for d in listed}
        rows += [
            DeviceRow(resource, d.id, d.health, d.numa_nodes, held.get(d.id, ())) for d in listed
        ]
        rows += [
            DeviceRow(resource, device, GONE, (), holders)
            for device, holders in held.items()
            if device not in ids
        ]
        allocatable[resource] = _compare(listed, reading, resource)
    return PodsStatus(
        socket,
        "available",
        None,
        reading.allocatable_error,
        reading.pods,
        _by_id(rows),
        allocatable,
    )


def _by_id(rows: Iterable[DeviceRow]) -> tuple[DeviceRow, ...]:
    return tuple(sorted(rows, key=lambda row: (row.resource, natural_key(row.id))))


def _compare(listed: Sequence[Listed], reading: PodResourcesView, resource: str) -> Allocatable:
    if reading.allocatable is None:
        return Allocatable(known=False)
    healthy = {d.id for d in listed if d.health == "Healthy"}
    kubelet = reading.allocatable.get(resource, frozenset())
    return Allocatable(_sorted(healthy - kubelet), _sorted(kubelet - {d.id for d in listed}))


def _sorted(ids: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(ids, key=natural_key))


def device_document(row: DeviceRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "health": row.health,
        "numa_nodes": list(row.numa_nodes),
        "holders": None
        if row.holders is None
        else [
            {"namespace": h.namespace, "pod": h.pod, "container": h.container} for h in row.holders
        ],
    }


def allocatable_document(check: Allocatable) -> dict[str, Any]:
    return {
        "state": check.describe() if check.describe() in (AGREES, UNKNOWN) else "differs",
        "missing": None if not check.known else list(check.missing),
        "extra": None if not check.known else list(check.extra),
    }


def devices_table(status: PodsStatus) -> str:
    """One row per device, then the line about the pod resources API; device ids and health
    (the plugin's) and pod and container names (the kubelet's) printed escaped."""
    lines = []
    if status.devices and status.available:
        rows = [("RESOURCE", "DEVICE", "HEALTH", "HELD BY")]
        for device in status.devices:
            holders = ", ".join(str(h) for h in device.holders or ()) or "-"
            rows.append(
                (
                    escaped(device.resource),
                    escaped(device.id),
                    escaped(device.health),
                    escaped(holders),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
            lines.append("  ".join([*cells, row[3]]).rstrip())
    lines.append(escaped(status.describe()))
    return "\n".join(lines) + "\n"
