"""Who holds devplug's devices, followed against what devplug advertises.

The kubelet's pod resources API (:mod:`.podresources`) has no watch, so :class:`HolderWatch`
follows the tree devplug advertises and reads the API ``settle_s`` after each new one (time
for the kubelet to take the new lists; changes meanwhile join in), every ``period_s``
besides, and only every ``absent_period_s`` while the socket is absent (a kubelet without the
API, a pod without the mount: said once, and the daemon carries on). Each reading is
compared with the tree:

- a device a container holds that devplug advertises Unhealthy is *unhealthy in use*;
- a device a container holds that devplug no longer advertises (unplugged, unbound, its
  resource gone) is *gone while allocated*;
- *drift*: for each registered resource, the ids the kubelet could allocate (its healthy
  devices, GetAllocatableResources) against the ids devplug advertises Healthy. A difference
  counts once it is seen in two readings in a row, so the moment between a new list and the
  kubelet taking it never does.

Each change is logged once (a device flagged, a flag cleared, drift found or cleared) and
every reading goes to :class:`HolderEvents` (the metrics). :attr:`HolderWatch.report` is the
latest :class:`HoldersReport`, to await.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import structlog

from devplug._kits.problems import ProblemLog
from devplug._kits.values import LatestValue, Watchable
from devplug.kubelet.podresources import (
    ABSENT,
    Holder,
    PodResourcesUnavailable,
    PodResourcesView,
    read_pod_resources,
)
from devplug.model import DeviceMap, DeviceTree, Health

log = structlog.get_logger(__name__)

# Ids a log line names, at most (the counts are always whole).
SHOWN_IDS = 10
AVAILABLE = "available"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class HolderTiming:
    """When the API is read (see the module's docstring)."""

    period_s: float = 30.0
    absent_period_s: float = 300.0
    settle_s: float = 2.0


DEFAULT_HOLDER_TIMING = HolderTiming()


@dataclass(frozen=True, slots=True, order=True)
class HeldDevice:
    resource: str
    device: str
    holder: Holder


@dataclass(frozen=True, slots=True)
class Drift:
    """How the kubelet's allocatable ids of a resource differ from devplug's healthy ones."""

    missing: frozenset[str]  # advertised Healthy, but the kubelet cannot allocate them
    extra: frozenset[str]  # the kubelet would allocate them, but they are not advertised Healthy


_NO_COUNTS: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class HoldersReport:
    """The latest reading. ``state``: ``unknown`` before the first, then ``available``,
    ``absent`` or ``not answering``; the holders and flags are those of the last reading that
    succeeded."""

    state: str = UNKNOWN
    reason: str | None = None
    reads: int = 0  # readings that succeeded
    failures: int = 0
    view: PodResourcesView | None = None
    # resource -> devices a container holds
    in_use: Mapping[str, int] = field(default_factory=lambda: _NO_COUNTS)
    unhealthy_in_use: frozenset[HeldDevice] = frozenset()
    gone_while_allocated: frozenset[HeldDevice] = frozenset()
    # resource -> its confirmed drift; None: unknown (the kubelet gives no allocatable set)
    drift: Mapping[str, Drift] | None = None


class Advertising(Protocol):
    """What the daemon advertises now (its ``DaemonStats``: the tree the kubelet has had)."""

    @property
    def advertised(self) -> DeviceTree: ...


class HolderEvents(Protocol):
    """Where each reading is reported (the metrics)."""

    def pod_resources_read(
        self,
        in_use: Mapping[str, int],
        unhealthy_in_use: Mapping[str, int],
        gone_while_allocated: Mapping[str, int],
        drift: Mapping[str, tuple[int, int]] | None,
    ) -> None: ...

    def pod_resources_unavailable(self) -> None: ...


class HolderWatch:
    """Reads the pod resources API at ``socket`` and compares it with the tree it follows.

    ``registered()`` names the resources registered with the kubelet now: only those can
    drift (one waiting to register is not allocatable yet, and /readyz says so).
    """

    def __init__(
        self,
        socket: Path,
        events: HolderEvents,
        registered: Callable[[], Collection[str]],
        timing: HolderTiming = DEFAULT_HOLDER_TIMING,
    ) -> None:
        self.socket = socket
        self.timing = timing
        self._events = events
        self._registered = registered
        self._report = LatestValue(HoldersReport())
        self._tree = DeviceTree()
        # Every resource advertised since the start: a pod may hold devices of one that went.
        self._known: set[str] = set()
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._problems = ProblemLog()
        self._drift_seen: dict[str, Drift] = {}  # the last reading's, before confirmation
        self._healthy: dict[str, tuple[DeviceMap, frozenset[str]]] = {}
        self._allocatable_problem: str | None = None

    @property
    def report(self) -> Watchable[HoldersReport]:
        return self._report

    def follow(self, tree: DeviceTree) -> None:
        """The tree devplug advertises now; a reading follows ``settle_s`` later (while the
        socket is absent, only the slow re-check does)."""
        if tree is self._tree:
            return
        self._tree = tree
        self._known.update(tree)
        if self._report.value.state != ABSENT:
            self._changed.set()

    async def run(self, state: Watchable[Advertising]) -> None:
        """Follow the tree ``state`` advertises and read the API, until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow(state), name="pod-resources-follow")
            group.create_task(self._read_on(), name="pod-resources-read")

    async def _follow(self, state: Watchable[Advertising]) -> None:
        async for now in state.as_changed():
            self.follow(now.advertised)

    async def _read_on(self) -> None:
        while True:
            await self._next_turn()
            await self.read_now()

    async def _next_turn(self) -> None:
        absent = self._report.value.state == ABSENT
        period = self.timing.absent_period_s if absent else self.timing.period_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period):
                await self._changed.wait()
                await asyncio.sleep(self.timing.settle_s)
        self._changed.clear()

    async def read_now(self) -> HoldersReport:
        """Read the API now, compare, log and report; returns the new report."""
        async with self._lock:
            tree = self._tree
            try:
                view = await read_pod_resources(self.socket, resources=frozenset(self._known))
            except PodResourcesUnavailable as exc:
                return self._unavailable(exc)
            return self._compare(view, tree)

    # ------------------------------------------------------------------ a reading that failed

    def _unavailable(self, exc: PodResourcesUnavailable) -> HoldersReport:
        absent = exc.state == ABSENT
        retry = self.timing.absent_period_s if absent else self.timing.period_s
        self._problems.report(
            log,
            "podresources.unavailable",
            exc.reason,
            level="info" if absent else "warning",
            socket=str(self.socket),
            state=exc.state,
            effect="holders unknown: no unhealthy-in-use, gone-while-allocated or drift checks",
            retry_in_s=retry,
        )
        self._events.pod_resources_unavailable()
        previous = self._report.value
        report = dataclasses.replace(
            previous, state=exc.state, reason=exc.reason, failures=previous.failures + 1
        )
        self._report.set(report)
        return report

    # ------------------------------------------------------------------ a reading

    def _compare(self, view: PodResourcesView, tree: DeviceTree) -> HoldersReport:
        previous = self._report.value
        if previous.state != AVAILABLE:
            self._problems.solved()
            log.info("podresources.available", socket=str(self.socket), pods=view.pods)
        self._note_allocatable(view)
        unhealthy: set[HeldDevice] = set()
        gone: set[HeldDevice] = set()
        in_use: dict[str, int] = {}
        for resource, devices in view.held.items():
            advertised = tree.get(resource)
            in_use[resource] = len(devices)
            for device, holders in devices.items():
                info = None if advertised is None else advertised.get(device)
                if info is not None and info.health == Health.HEALTHY:
                    continue
                flagged = gone if info is None else unhealthy
                flagged.update(HeldDevice(resource, device, holder) for holder in holders)
        checked, drift = self._drift(view, tree)
        report = HoldersReport(
            AVAILABLE,
            None,
            previous.reads + 1,
            previous.failures,
            view,
            MappingProxyType(in_use),
            frozenset(unhealthy),
            frozenset(gone),
            None if drift is None else MappingProxyType(drift),
        )
        self._log_changes(previous, report, view, tree)
        self._events.pod_resources_read(
            report.in_use,
            _per_resource(report.unhealthy_in_use),
            _per_resource(report.gone_while_allocated),
            None if drift is None else {r: _sizes(drift.get(r)) for r in checked | drift.keys()},
        )
        self._report.set(report)
        return report

    def _note_allocatable(self, view: PodResourcesView) -> None:
        problem = view.allocatable_error
        if problem is not None and problem != self._allocatable_problem:
            log.info(
                "podresources.allocatable.unavailable",
                reason=problem,
                effect="no drift check (GetAllocatableResources needs Kubernetes 1.23+, or "
                "1.21+ with the KubeletPodResourcesGetAllocatable feature gate)",
            )
        self._allocatable_problem = problem

    def _healthy_ids(self, resource: str, devices: DeviceMap) -> frozenset[str]:
        """Cached per device map: a tree shares the maps of the resources that did not change."""
        cached = self._healthy.get(resource)
        if cached is not None and cached[0] is devices:
            return cached[1]
        ids = frozenset(i for i, info in devices.items() if info.health == Health.HEALTHY)
        self._healthy[resource] = (devices, ids)
        return ids

    def _drift(
        self, view: PodResourcesView, tree: DeviceTree
    ) -> tuple[set[str], dict[str, Drift] | None]:
        """The resources checked, and those of them whose drift is confirmed (None: the
        kubelet gives no allocatable set)."""
        if view.allocatable is None:
            self._drift_seen = {}
            return set(), None
        registered = set(self._registered())
        # A resource devplug withdrew that the kubelet still offers drifts too.
        resources = (registered & tree.keys()) | (view.allocatable.keys() - tree.keys())
        seen: dict[str, Drift] = {}
        for resource in resources:
            devices = tree.get(resource)
            healthy = frozenset() if devices is None else self._healthy_ids(resource, devices)
            allocatable = view.allocatable.get(resource, frozenset())
            if healthy != allocatable:
                seen[resource] = Drift(healthy - allocatable, allocatable - healthy)
        for resource in self._healthy.keys() - tree.keys():
            del self._healthy[resource]
        confirmed = {r: d for r, d in seen.items() if r in self._drift_seen}
        self._drift_seen = seen
        return resources, confirmed

    # ------------------------------------------------------------------ one line per change

    def _log_changes(
        self,
        previous: HoldersReport,
        report: HoldersReport,
        view: PodResourcesView,
        tree: DeviceTree,
    ) -> None:
        unhealthy_before, unhealthy = previous.unhealthy_in_use, report.unhealthy_in_use
        gone_before, gone = previous.gone_while_allocated, report.gone_while_allocated
        for held in sorted(unhealthy - unhealthy_before):
            log.warning("podresources.device.unhealthy_in_use", **_fields(held))
        for held in sorted(gone - gone_before):
            log.warning("podresources.device.gone_while_allocated", **_fields(held))
        for was, cleared in (
            ("unhealthy_in_use", unhealthy_before - unhealthy),
            ("gone_while_allocated", gone_before - gone),
        ):
            for held in sorted(cleared):
                now = _now(held, view, tree)
                log.info("podresources.device.cleared", was=was, now=now, **_fields(held))
        before_drift = previous.drift or {}
        now_drift = report.drift or {}
        for resource, drift in sorted(now_drift.items()):
            if before_drift.get(resource) != drift:
                log.warning(
                    "podresources.drift.found",
                    resource=resource,
                    missing=len(drift.missing),
                    extra=len(drift.extra),
                    missing_ids=sorted(drift.missing)[:SHOWN_IDS],
                    extra_ids=sorted(drift.extra)[:SHOWN_IDS],
                )
        if report.drift is not None:
            for resource in sorted(before_drift.keys() - now_drift.keys()):
                log.info("podresources.drift.cleared", resource=resource)


def _fields(held: HeldDevice) -> dict[str, str]:
    holder = held.holder
    return {
        "resource": held.resource,
        "device": held.device,
        "namespace": holder.namespace,
        "pod": holder.pod,
        "container": holder.container,
    }


def _now(held: HeldDevice, view: PodResourcesView, tree: DeviceTree) -> str:
    """What became of a device no longer flagged."""
    if held.holder not in view.holders(held.resource, held.device):
        return "released"
    info = tree.get(held.resource, {}).get(held.device)
    if info is None:
        return "gone"
    return "healthy" if info.health == Health.HEALTHY else "unhealthy"


def _sizes(drift: Drift | None) -> tuple[int, int]:
    return (0, 0) if drift is None else (len(drift.missing), len(drift.extra))


def _per_resource(flagged: frozenset[HeldDevice]) -> dict[str, int]:
    devices: dict[str, set[str]] = {}
    for held in flagged:
        devices.setdefault(held.resource, set()).add(held.device)
    return {resource: len(ids) for resource, ids in devices.items()}
