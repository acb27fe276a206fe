"""Who holds devplug's devices, followed against what devplug advertises.

The kubelet's pod resources API (:mod:`.podresources`) has no watch, so :class:`HolderWatch`
follows the tree devplug advertises and reads the API once it has stayed the same for
``settle_s`` (time for the kubelet to take the new lists), and every ``period_s`` besides,
changes or not. A reading waits for the hotplug path to be quiet (``settle_s`` at most): at
10,000 devices it is tens of milliseconds of decoding, whose worker thread takes the
interpreter from the event loop, and a reading after every change of a hotplug storm put that
into every few events' latency (bench.hotplug's remove p99 at 10,000 devices: ~28 ms, 7 ms
without).

While the socket is absent (a kubelet without the API, a pod without the mount: said once,
and the daemon carries on) or does not answer, an inotify watch of its dir wakes it when the
socket is made (a kubelet starting after devplug at boot, or restarting), ``settle_s`` later;
the slow ``absent_period_s`` re-check only backs the watch up.

devplug's resources, whose devices it looks for, are those it advertised since it started and
those a configured scanner declares (``ResourceNamer``): after a restart, a pod may still hold
a device of a resource devplug has not advertised since. Each reading is compared with the
tree:

- a device a container holds that devplug advertises Unhealthy is *unhealthy in use*; the log
  line gives the device's health reason, and one the operator cordoned (``cordoned: ...``, a
  drain under way rather than a fault) is counted apart;
- a device a container holds that devplug no longer advertises (unplugged, unbound, its
  resource gone) is *gone while allocated*;
- *drift*: for each registered resource, the ids the kubelet could allocate (its healthy
  devices, GetAllocatableResources) against the ids devplug advertises Healthy. A difference
  counts once it is seen in two readings in a row, so the moment between a new list and the
  kubelet taking it never does. An id devplug advertises Unhealthy is never *extra*: kubelets
  before 1.23 list unhealthy devices as allocatable too (kubernetes#104122).

Each change is logged once (a device flagged, a flag cleared, drift found or cleared) and
every reading goes to :class:`HolderEvents` (the metrics). :attr:`HolderWatch.report` is the
latest :class:`HoldersReport`, to await.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import structlog

from devplug._kits.dirwatch import DirWatcher
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
from devplug.scanners.base import ResourceNamer, Scanner

log = structlog.get_logger(__name__)

# Ids a log line names, at most (the counts are always whole).
SHOWN_IDS = 10
AVAILABLE = "available"
UNKNOWN = "unknown"
# ProblemLog keys besides the socket's own (None).
_ALLOCATABLE = "allocatable"


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
    extra: frozenset[str]  # the kubelet would allocate them, but devplug does not advertise them


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
    # Of ``unhealthy_in_use``, those the operator cordoned: a drain under way, not a fault.
    cordoned_in_use: frozenset[HeldDevice] = frozenset()


class Advertising(Protocol):
    """What the daemon advertises now (its ``DaemonStats``: the tree the kubelet has had)."""

    @property
    def advertised(self) -> DeviceTree: ...


class HolderEvents(Protocol):
    """Where each reading is reported (the metrics). ``unhealthy_in_use`` counts the faulty
    devices held, ``cordoned_in_use`` the cordoned ones (the two never overlap)."""

    def pod_resources_read(
        self,
        in_use: Mapping[str, int],
        unhealthy_in_use: Mapping[str, int],
        gone_while_allocated: Mapping[str, int],
        drift: Mapping[str, tuple[int, int]] | None,
        cordoned_in_use: Mapping[str, int],
    ) -> None: ...

    def pod_resources_unavailable(self) -> None: ...


class HolderWatch:
    """Reads the pod resources API at ``socket`` and compares it with the tree it follows.

    ``registered()`` names the resources registered with the kubelet now: only those can
    drift (one waiting to register is not allocatable yet, and /readyz says so).
    ``scanners()`` are the configured scanners now: the resources they declare are devplug's
    even before one is advertised.
    """

    def __init__(
        self,
        socket: Path,
        events: HolderEvents,
        registered: Callable[[], Collection[str]],
        timing: HolderTiming = DEFAULT_HOLDER_TIMING,
        *,
        scanners: Callable[[], Iterable[Scanner]] = tuple,
        quiet: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.socket = socket
        # Returns once the hotplug path is quiet; awaited before each reading.
        self._quiet = quiet
        self.timing = timing
        self._events = events
        self._registered = registered
        self._scanners = scanners
        self._report = LatestValue(HoldersReport())
        self._tree = DeviceTree()
        # Every resource advertised since the start: a pod may hold devices of one that went.
        self._known: set[str] = set()
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._problems = ProblemLog()
        self._drift_seen: dict[str, Drift] = {}  # the last reading's, before confirmation
        self._healthy: dict[str, tuple[DeviceMap, frozenset[str]]] = {}
        # The socket's dir: the kubelet making the socket is the moment to look again.
        self.socket_watch = DirWatcher(
            socket.parent,
            lambda name: name == socket.name,
            "podresources",
            missing_level="info",  # a pod without the mount: said once, by the reading too
        )

    @property
    def report(self) -> Watchable[HoldersReport]:
        return self._report

    def follow(self, tree: DeviceTree) -> None:
        """The tree devplug advertises now; a reading follows ``settle_s`` later (while the
        socket is absent, only the socket's appearance or the slow re-check brings one)."""
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
            group.create_task(self.socket_watch.run(), name="pod-resources-watch")
            group.create_task(self._follow_socket(), name="pod-resources-socket")
            group.create_task(self._read_on(), name="pod-resources-read")

    async def _follow(self, state: Watchable[Advertising]) -> None:
        async for now in state.as_changed():
            self.follow(now.advertised)

    async def _follow_socket(self) -> None:
        """Read again when the socket's dir changes while the API cannot be read: the
        kubelet has made its socket. (While it can, the regular readings see to a restart.)"""
        async for _ in self.socket_watch.changes.as_changed():
            if self._report.value.state != AVAILABLE:
                self._changed.set()

    async def _read_on(self) -> None:
        while True:
            await self._next_turn()
            await self.read_now()

    async def _next_turn(self) -> None:
        """Until the next reading is due: ``settle_s`` after the last of a run of changes, or
        the period's end, whichever is first; then a quiet hotplug path."""
        absent = self._report.value.state == ABSENT
        period = self.timing.absent_period_s if absent else self.timing.period_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period):
                await self._changed.wait()
                while True:  # each change while settling starts the settle again
                    self._changed.clear()
                    try:
                        async with asyncio.timeout(self.timing.settle_s):
                            await self._changed.wait()
                    except TimeoutError:
                        break
        self._changed.clear()
        if self._quiet is not None:
            # A storm that never lets the hotplug path rest delays a reading this long at most.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timing.settle_s):
                    await self._quiet()

    async def read_now(self) -> HoldersReport:
        """Read the API now, compare, log and report; returns the new report."""
        async with self._lock:
            tree = self._tree
            try:
                view = await read_pod_resources(self.socket, resources=self._ours())
            except PodResourcesUnavailable as exc:
                return self._unavailable(exc)
            return self._compare(view, tree)

    def _ours(self) -> Callable[[str], bool]:
        """Whether a resource is devplug's (see the module's docstring): asked in the worker
        thread that decodes the answer, so of a snapshot taken now, each name once."""
        known = frozenset(self._known)
        namers = tuple(s for s in self._scanners() if isinstance(s, ResourceNamer))
        answers: dict[str, bool] = {}

        def ours(resource: str) -> bool:
            answer = answers.get(resource)
            if answer is None:
                answer = resource in known or any(n.makes_resource(resource) for n in namers)
                answers[resource] = answer
            return answer

        return ours

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
        cordoned: set[HeldDevice] = set()
        gone: set[HeldDevice] = set()
        in_use: dict[str, int] = {}
        for resource, devices in view.held.items():
            advertised = tree.get(resource)
            in_use[resource] = len(devices)
            for device, holders in devices.items():
                info = None if advertised is None else advertised.get(device)
                if info is not None and info.health == Health.HEALTHY:
                    continue
                held = [HeldDevice(resource, device, holder) for holder in holders]
                (gone if info is None else unhealthy).update(held)
                if info is not None and info.cordoned:
                    cordoned.update(held)
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
            frozenset(cordoned),
        )
        self._log_changes(previous, report, view, tree)
        self._events.pod_resources_read(
            report.in_use,
            _per_resource(report.unhealthy_in_use - report.cordoned_in_use),
            _per_resource(report.gone_while_allocated),
            None if drift is None else {r: _sizes(drift.get(r)) for r in checked | drift.keys()},
            _per_resource(report.cordoned_in_use),
        )
        self._report.set(report)
        return report

    def _note_allocatable(self, view: PodResourcesView) -> None:
        problem = view.allocatable_error
        if problem is None:
            if self._problems.solved(_ALLOCATABLE):
                log.info("podresources.allocatable.available", socket=str(self.socket))
            return
        self._problems.report(
            log,
            "podresources.allocatable.unavailable",
            problem,
            key=_ALLOCATABLE,
            level="info",
            effect="no drift check (GetAllocatableResources needs Kubernetes 1.23+, or "
            "1.21+ with the KubeletPodResourcesGetAllocatable feature gate)",
        )

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
            devices = tree.get(resource, {})
            healthy = self._healthy_ids(resource, devices) if devices else frozenset()
            allocatable = view.allocatable.get(resource, frozenset())
            # An id advertised Unhealthy is allocatable to kubelets before 1.23, which list
            # unhealthy devices too (kubernetes#104122): not extra.
            drift = Drift(healthy - allocatable, allocatable.difference(devices))
            if drift.missing or drift.extra:
                seen[resource] = drift
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
            cordoned = held in report.cordoned_in_use
            # A cordon under a running pod is a drain the operator started: news, not trouble.
            say = log.info if cordoned else log.warning
            say(
                "podresources.device.unhealthy_in_use",
                reason=tree[held.resource][held.device].health_reason,
                cordoned=cordoned,
                **_fields(held),
            )
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
