"""Prometheus metrics of one daemon (its own registry, so tests and several daemons in one
process do not mix their numbers).

The values are kept here, in plain counters: importing prometheus_client costs ~15 ms of a
start-up whose goal is 250 ms (its package imports its exposition, HTTP and WSGI servers), and
the daemon needs none of it before someone scrapes. The first scrape (or the first look at
:attr:`Metrics.registry`) imports it and builds the same families, samples and ``_created``
series its own Counter, Gauge and Histogram would; the text is prometheus_client's.
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Generic, TypeVar

from devplug._version import __version__
from devplug.model import DeviceMap, DeviceTree

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

# Scans take from about a millisecond (one device's rescan) to seconds (10,000 GPUs).
_SCAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Value:
    """A counter's or a gauge's series (one set of label values)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Buckets:
    """A histogram's series: per-bucket counts (not cumulative), the sum, when created."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1


_S = TypeVar("_S", _Value, _Buckets)


def _build_labels() -> tuple[str, str, str]:
    """devplug's version and the Python and gRPC versions it runs on.

    gRPC's version comes from its installed package's metadata: importing ``grpc`` is the
    kubelet front's business (the layer contracts), and the metadata says the same.
    """
    from importlib import metadata

    try:
        grpc_version = metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        grpc_version = "unknown"
    python = ".".join(str(part) for part in sys.version_info[:3])
    return __version__, python, grpc_version


class _Family(Generic[_S]):
    """One metric: its series by label values, in the order they first appeared."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str]):
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames = tuple(labelnames)
        self.series: dict[tuple[str, ...], _S] = {}

    def _new(self) -> _S:
        raise NotImplementedError

    def labels(self, *values: str) -> _S:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self._new()
        return series


class _Counter(_Family[_Value]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__("counter", name, documentation, labelnames)
        if not labelnames:
            self.labels()  # like prometheus_client: an unlabelled series exists from the start

    def _new(self) -> _Value:
        return _Value()

    def inc(self, amount: float = 1.0) -> None:
        """An unlabelled counter's increment."""
        self.labels().inc(amount)


class _Gauge(_Family[_Value]):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()):
        super().__init__("gauge", name, documentation, labelnames)

    def _new(self) -> _Value:
        return _Value()


class _Histogram(_Family[_Buckets]):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ):
        super().__init__("histogram", name, documentation, labelnames)
        self.bounds = (*buckets, float("inf"))

    def _new(self) -> _Buckets:
        return _Buckets(self.bounds)


def _families(families: Sequence[_Family[_Value] | _Family[_Buckets]]) -> Iterator[Metric]:
    """The families as prometheus_client's own metrics of the same kinds would collect them."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample
    from prometheus_client.utils import floatToGoString

    created = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
        "true",
        "1",
        "t",
    )
    for family in families:
        metric = Metric(family.name, family.documentation, family.kind)
        for values, series in family.series.items():
            labels = dict(zip(family.labelnames, values, strict=True))
            add = metric.samples.append
            if isinstance(series, _Buckets):
                total = 0.0
                for bound, count in zip(series.bounds, series.counts, strict=True):
                    total += count
                    le = {**labels, "le": floatToGoString(bound)}  # type: ignore[no-untyped-call]
                    add(Sample(f"{family.name}_bucket", le, total, None, None))
                add(Sample(f"{family.name}_count", labels, total, None, None))
                add(Sample(f"{family.name}_sum", labels, series.sum, None, None))
            elif family.kind == "counter":
                add(Sample(f"{family.name}_total", labels, series.value, None, None))
            else:
                add(Sample(family.name, labels, series.value, None, None))
            if created and family.kind != "gauge":
                add(Sample(f"{family.name}_created", labels, series.created, None, None))
        yield metric


class Metrics:
    def __init__(self) -> None:
        self._registry: CollectorRegistry | None = None
        self.devices = _Gauge(
            "devplug_devices",
            "Devices advertised to the kubelet, by resource and health.",
            ["resource", "health"],
        )
        self.allocations = _Counter(
            "devplug_allocations",
            "Allocate calls, by resource and result (ok, not_found, invalid, error).",
            ["resource", "result"],
        )
        self.registrations = _Counter(
            "devplug_registrations",
            "Register calls to the kubelet, by resource and result (ok, failed).",
            ["resource", "result"],
        )
        self.kubelet_restarts = _Counter(
            "devplug_kubelet_restarts",
            "Kubelet restarts seen (a resource's server had to register again).",
            ["resource"],
        )
        self.scan_seconds = _Histogram(
            "devplug_scan_duration_seconds",
            "Duration of scans, by kind (full, incremental).",
            ["kind"],
            buckets=_SCAN_BUCKETS,
        )
        self.scan_failures = _Counter(
            "devplug_scan_failures",
            "Scans in which a scanner failed, by scanner (its previous devices were kept).",
            ["scanner"],
        )
        self.udev_events = _Counter(
            "devplug_udev_events", "udev events handled (after batching per device)."
        )
        self.udev_overflows = _Counter(
            "devplug_udev_overflows",
            "Times the kernel dropped udev events for devplug (ENOBUFS); each caused a full scan.",
        )
        self.list_bytes = _Gauge(
            "devplug_listandwatch_message_bytes",
            "Size of the last ListAndWatch message, by resource (the kubelet reads up to 4 MiB).",
            ["resource"],
        )
        self.held_back = _Gauge(
            "devplug_devices_held_back",
            "Devices found but not advertised, by resource: their list would pass the kubelet's "
            "4 MiB receive limit.",
            ["resource"],
        )
        # From the kubelet's pod resources API (devplug.kubelet.holders), as of its last
        # reading that succeeded.
        self.pod_resources_up = _Gauge(
            "devplug_pod_resources_up",
            "1 when the last reading of the kubelet's pod resources API succeeded, 0 when the "
            "socket is absent or did not answer.",
        )
        self.devices_in_use = _Gauge(
            "devplug_devices_in_use",
            "Devices of the resource a container holds, by the kubelet's pod resources API.",
            ["resource"],
        )
        self.unhealthy_in_use = _Gauge(
            "devplug_devices_unhealthy_in_use",
            "Devices a container holds that devplug advertises Unhealthy for a fault (cordoned "
            "ones are devplug_devices_cordoned_in_use).",
            ["resource"],
        )
        self.cordoned_in_use = _Gauge(
            "devplug_devices_cordoned_in_use",
            "Cordoned devices a container still holds: a drain under way (devplug cordon).",
            ["resource"],
        )
        self.gone_while_allocated = _Gauge(
            "devplug_devices_gone_while_allocated",
            "Devices a container holds that devplug no longer advertises (unplugged, unbound).",
            ["resource"],
        )
        self.allocatable_drift = _Gauge(
            "devplug_kubelet_allocatable_drift",
            "Devices on which the kubelet's allocatable set and devplug's healthy ones differ, "
            "by direction: missing (advertised Healthy, not allocatable) and extra (allocatable, "
            "not advertised Healthy). No series while the kubelet gives no allocatable set.",
            ["resource", "direction"],
        )
        # The DRA front's (devplug.dra.front), with a dra section only.
        self.dra_registration = _Gauge(
            "devplug_dra_registered",
            "1 while the kubelet has accepted the DRA plugin's registration and both of its "
            "sockets are in place, else 0.",
        )
        self.dra_slices = _Gauge(
            "devplug_dra_slices", "ResourceSlices of this node's pool, as last published."
        )
        self.dra_devices = _Gauge(
            "devplug_dra_devices", "Devices in this node's pool, as last published."
        )
        self.dra_slice_writes = _Counter(
            "devplug_dra_slice_writes",
            "ResourceSlice create, update and delete requests sent to the API server, by result "
            "(ok, failed, rejected: refused as invalid).",
            ["result"],
        )
        self.dra_calls = _Counter(
            "devplug_dra_calls",
            "NodePrepareResources and NodeUnprepareResources calls, by operation (prepare, "
            "unprepare) and result (ok; claim_errors: some claims got an error; failed: the "
            "call failed as a whole).",
            ["operation", "result"],
        )
        self.dra_prepared_claims = _Gauge(
            "devplug_dra_prepared_claims", "ResourceClaims prepared on this node now."
        )
        # The operator's cordons (devplug.hotplug.cordons), read at each scrape.
        self.cordoned = _Gauge(
            "devplug_devices_cordoned",
            "Devices the operator has cordoned (devplug cordon), by resource, whether or not "
            "the device is present now.",
            ["resource"],
        )
        self.cordoned_advertised = _Gauge(
            "devplug_devices_cordoned_advertised",
            'Of devplug_devices{health="Unhealthy"}, the cordoned devices: present, and '
            "advertised Unhealthy for their cordon rather than a fault.",
            ["resource"],
        )
        self.oldest_cordon = _Gauge(
            "devplug_cordon_oldest_timestamp_seconds",
            "When the resource's oldest cordon was put, in Unix time. No series while the "
            "resource has none.",
            ["resource"],
        )
        self.cordons_unreadable = _Gauge(
            "devplug_cordons_unreadable",
            "1 while the cordon state file cannot be read, so every device is advertised "
            "Unhealthy (failing closed) until it is fixed or removed and devplug reloaded; "
            "else 0.",
        )
        # Called before each scrape, to read numbers kept elsewhere (the DRA front's, the
        # cordons).
        self.refreshers: list[Callable[[], None]] = []
        # Filled in at the first scrape: reading gRPC's package metadata is start-up time that
        # nothing needs before someone scrapes.
        self.build_info = _Gauge(
            "devplug_build_info",
            "devplug's version and the Python and gRPC versions it runs on (always 1).",
            ["version", "python", "grpc"],
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

    # The pod resources follower's readings (devplug.kubelet.holders.HolderEvents).

    def pod_resources_read(
        self,
        in_use: Mapping[str, int],
        unhealthy_in_use: Mapping[str, int],
        gone_while_allocated: Mapping[str, int],
        drift: Mapping[str, tuple[int, int]] | None,
        cordoned_in_use: Mapping[str, int],
    ) -> None:
        """A reading: every per-resource gauge follows it; resources no longer named read 0."""
        self.pod_resources_up.labels().set(1)
        for gauge, counts in (
            (self.devices_in_use, in_use),
            (self.unhealthy_in_use, unhealthy_in_use),
            (self.cordoned_in_use, cordoned_in_use),
            (self.gone_while_allocated, gone_while_allocated),
        ):
            for (resource,), series in gauge.series.items():
                series.set(counts.get(resource, 0))
            for resource, count in counts.items():
                gauge.labels(resource).set(count)
        if drift is None:
            self.allocatable_drift.series.clear()  # unknown, which a 0 would hide
            return
        for (resource, direction), series in self.allocatable_drift.series.items():
            missing, extra = drift.get(resource, (0, 0))
            series.set(missing if direction == "missing" else extra)
        for resource, (missing, extra) in drift.items():
            self.allocatable_drift.labels(resource, "missing").set(missing)
            self.allocatable_drift.labels(resource, "extra").set(extra)

    def pod_resources_unavailable(self) -> None:
        self.pod_resources_up.labels().set(0)

    # The cordons'.

    def cordons_counted(
        self,
        by_resource: Mapping[str, tuple[int, float]],
        unreadable: bool,
        *,
        advertised: Mapping[str, int],
    ) -> None:
        """The cordons now: per resource, (how many, when the oldest was put in Unix time),
        and (``advertised``) how many of them are advertised now. A resource whose cordons
        were all lifted reads 0 and loses its oldest time (a 0 there would read as a cordon
        put in 1970)."""
        self.cordons_unreadable.labels().set(1 if unreadable else 0)
        for (resource,), series in self.cordoned.series.items():
            series.set(by_resource.get(resource, (0, 0.0))[0])
        for (resource,), series in self.cordoned_advertised.series.items():
            series.set(advertised.get(resource, 0))
        for resource in by_resource:
            self.cordoned_advertised.labels(resource).set(advertised.get(resource, 0))
        self.oldest_cordon.series.clear()
        for resource, (count, oldest) in by_resource.items():
            self.cordoned.labels(resource).set(count)
            self.oldest_cordon.labels(resource).set(oldest)

    # The DRA front's.

    def dra_call(self, operation: str, result: str) -> None:
        self.dra_calls.labels(operation, result).inc()

    def dra_registered(self, registered: bool) -> None:
        self.dra_registration.labels().set(1 if registered else 0)

    def dra_counted(
        self,
        *,
        slices: int,
        devices: int,
        writes: int,
        failures: int,
        rejected: int,
        prepared_claims: int,
    ) -> None:
        """The publisher's totals so far (they only grow) and the counts now."""
        self.dra_slices.labels().set(slices)
        self.dra_devices.labels().set(devices)
        self.dra_slice_writes.labels("ok").set(writes - failures)
        self.dra_slice_writes.labels("failed").set(failures - rejected)
        self.dra_slice_writes.labels("rejected").set(rejected)
        self.dra_prepared_claims.labels().set(prepared_claims)

    # Scraping.

    @property
    def registry(self) -> CollectorRegistry:
        """A prometheus_client registry showing these metrics (built on first use)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry()
            self._registry.register(self)
        return self._registry

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's Collector protocol: every family, in the order defined."""
        if not self.build_info.series:
            self.build_info.labels(*_build_labels()).set(1)
        for refresh in self.refreshers:
            refresh()
        return _families(
            [
                self.build_info,
                self.devices,
                self.allocations,
                self.registrations,
                self.kubelet_restarts,
                self.scan_seconds,
                self.scan_failures,
                self.udev_events,
                self.udev_overflows,
                self.list_bytes,
                self.held_back,
                self.pod_resources_up,
                self.devices_in_use,
                self.unhealthy_in_use,
                self.cordoned_in_use,
                self.gone_while_allocated,
                self.allocatable_drift,
                self.cordoned,
                self.cordoned_advertised,
                self.oldest_cordon,
                self.cordons_unreadable,
                self.dra_registration,
                self.dra_slices,
                self.dra_devices,
                self.dra_slice_writes,
                self.dra_calls,
                self.dra_prepared_claims,
            ]
        )

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
