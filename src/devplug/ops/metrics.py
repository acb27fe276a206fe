"""Prometheus metrics of one daemon (its own registry, so tests and several daemons in one
process do not mix their numbers). Exposition is prometheus_client's."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping, Sized

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from devplug.model import DeviceMap, DeviceTree

# Scans take from about a millisecond (one device's rescan) to seconds (10,000 GPUs).
_SCAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.devices = Gauge(
            "devplug_devices",
            "Devices advertised to the kubelet, by resource and health.",
            ["resource", "health"],
            registry=r,
        )
        self.allocations = Counter(
            "devplug_allocations",
            "Allocate calls, by resource and result (ok, not_found, invalid, error).",
            ["resource", "result"],
            registry=r,
        )
        self.registrations = Counter(
            "devplug_registrations",
            "Register calls to the kubelet, by resource and result (ok, failed).",
            ["resource", "result"],
            registry=r,
        )
        self.kubelet_restarts = Counter(
            "devplug_kubelet_restarts",
            "Kubelet restarts seen (a resource's server had to register again).",
            ["resource"],
            registry=r,
        )
        self.scan_seconds = Histogram(
            "devplug_scan_duration_seconds",
            "Duration of scans, by kind (full, incremental).",
            ["kind"],
            buckets=_SCAN_BUCKETS,
            registry=r,
        )
        self.scan_failures = Counter(
            "devplug_scan_failures",
            "Scans in which a scanner failed, by scanner (its previous devices were kept).",
            ["scanner"],
            registry=r,
        )
        self.udev_events = Counter(
            "devplug_udev_events", "udev events handled (after batching per device).", registry=r
        )
        self.udev_overflows = Counter(
            "devplug_udev_overflows",
            "Times the kernel dropped udev events for devplug (ENOBUFS); each caused a full scan.",
            registry=r,
        )
        self.list_bytes = Gauge(
            "devplug_listandwatch_message_bytes",
            "Size of the last ListAndWatch message, by resource (the kubelet reads up to 4 MiB).",
            ["resource"],
            registry=r,
        )
        self.held_back = Gauge(
            "devplug_devices_held_back",
            "Devices found but not advertised, by resource: their list would pass the kubelet's "
            "4 MiB receive limit.",
            ["resource"],
            registry=r,
        )
        self._held_labels: set[str] = set()
        self._device_labels: set[tuple[str, str]] = set()
        # resource -> (the device map last counted, its counts by health)
        self._counted: dict[str, tuple[DeviceMap, Tally[tuple[str, str]]]] = {}

    def set_devices(self, tree: DeviceTree) -> None:
        """The devices gauge follows the advertised tree; resources that went read 0.

        Counted again only for resources whose device map changed (trees share the maps of
        unchanged resources), and for a map edited from the one counted last time only the ids
        the edit changed: a hotplug event must not cost a pass over 10,000 devices.
        """
        counts: Tally[tuple[str, str]] = Tally()
        seen: dict[str, tuple[DeviceMap, Tally[tuple[str, str]]]] = {}
        for resource, devices in tree.items():
            cached = self._counted.get(resource)
            if cached is None or cached[0] is not devices:
                edit = None if cached is None else tree.edit_since(resource, cached[0])
                if edit is None:
                    tally = Tally((resource, str(info.health)) for info in devices.values())
                else:
                    # An edit of the map counted last time: count only the ids it changed.
                    tally = cached[1].copy()  # type: ignore[index]
                    tally.subtract((resource, str(edit.base[i].health)) for i in edit.removed)
                    tally.update((resource, str(devices[i].health)) for i in edit.added)
                    tally = +tally
                cached = (devices, tally)
            seen[resource] = cached
            counts.update(cached[1])
        self._counted = seen
        for labels in self._device_labels - counts.keys():
            self.devices.labels(*labels).set(0)
        for labels, count in counts.items():
            self.devices.labels(*labels).set(count)
        self._device_labels |= counts.keys()

    def set_held_back(self, held: Mapping[str, Sized]) -> None:
        """Resources with devices held back by the list limit; those that have room read 0."""
        for resource in self._held_labels - held.keys():
            self.held_back.labels(resource).set(0)
        for resource, ids in held.items():
            self.held_back.labels(resource).set(len(ids))
        self._held_labels |= held.keys()

    # The kubelet front's events (devplug.kubelet.seams.ServingEvents).

    def registered(self, resource: str, ok: bool) -> None:
        self.registrations.labels(resource, "ok" if ok else "failed").inc()

    def kubelet_restarted(self, resource: str) -> None:
        self.kubelet_restarts.labels(resource).inc()

    def allocated(self, resource: str, result: str) -> None:
        self.allocations.labels(resource, result).inc()

    def list_built(self, resource: str, size_bytes: int) -> None:
        self.list_bytes.labels(resource).set(size_bytes)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
