"""Running scanners off the event loop and merging their trees.

Scanners are synchronous and may take long on big hosts, so a scan runs in a worker thread
(``asyncio.to_thread``). A scan error is never "no devices": a scanner that raises, or whose
source could not be read (out of file descriptors: libudev would have read every device as
node-less), keeps its previous result; the result names it in ``failed`` so that the scan loop
retries soon, and the failure is logged when it starts or changes, and when it ends. After
UNKNOWN_AFTER_FAILURES failed scans in a row the kept devices are reported Unhealthy (their
state is unknown by then: the kubelet stops placing pods on them, yet keeps the capacity and
the pods it placed); the next good scan reports them as they are. A
ConfigError from a scanner's first scan is raised: the host cannot be served as configured.
A device that cannot be read (text that is not UTF-8, a node name libudev cannot take) is
skipped by its scanner, and logged with its sysfs path; the others are served.

After udev events every scanner runs: an
:class:`~devplug.scanners.base.IncrementalScanner` updates its previous tree from the events
(or keeps it, when they do not concern it), any other scanner scans fully. A ``remove`` event
is believed over sysfs, which may show the device a moment longer (the kernel sends the event,
then deletes the directory): of what such a scan built anew, a device whose every sysfs source
a ``remove`` named (or lies below one) is left out. Scanners that know more (a GPU whose card
went but whose PCI function stays is Unhealthy, not gone) see to it in their rescans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import structlog

from devplug._kits.problems import ProblemLog, error_reason
from devplug.errors import ConfigError, ScanCancelled
from devplug.hotplug.list_limit import ListLimit
from devplug.model import DeviceTree, Health
from devplug.scanners.base import IncrementalScanner, Reporter, Scanner
from devplug.scanners.incremental import RemovedPaths
from devplug.scanners.udev import SourceUnavailable, UdevEvent, UdevSource

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ScanResult:
    tree: DeviceTree
    # resource -> the scanner that produced it (its hooks serve that resource)
    owners: Mapping[str, Scanner] = field(default_factory=dict)
    duration_s: float = 0.0
    # How many scanners ran a full scan and how many an incremental one.
    full: int = 0
    incremental: int = 0
    # Sections scanners report beside their devices (Reporter), for ``devplug scan``.
    extras: Mapping[str, object] = field(default_factory=dict)
    # resource -> the ids left out of ``tree`` because its list would not fit (ListLimit)
    held_back: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # resource -> the scanners whose devices for it were dropped (another scanner had it first)
    conflicts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Scanners that failed this time (raised, or their source could not be read): their
    # previous devices, if any, were kept; the scan loop retries soon.
    failed: tuple[str, ...] = ()
    # scanner name -> why it failed ("RuntimeError: ..."), for ``devplug scan`` to say
    failure_reasons: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Adopting(Protocol):
    """A scanner that keeps state between scans (what it advertised), told the last tree of
    the scanner it replaces on a reload."""

    def adopt(self, previous: DeviceTree) -> None: ...


def event_subsystems(scanners: Sequence[Scanner]) -> frozenset[str] | None:
    """The subsystems whose events concern any of ``scanners`` (None: all of them)."""
    wanted: set[str] = set()
    for scanner in scanners:
        subsystems = scanner.subsystems if isinstance(scanner, IncrementalScanner) else None
        if subsystems is None:
            return None
        wanted |= subsystems
    return frozenset(wanted)


HELD_BACK_SECTION = "held_back"
# Failed scans in a row after which a scanner's kept devices are reported Unhealthy: with the
# scan loop's back-off (0.5 s doubling) that is about 4 s of failing.
UNKNOWN_AFTER_FAILURES = 4


def unknown_state(tree: DeviceTree, reason: str) -> DeviceTree:
    """``tree`` with every device Unhealthy for ``reason``."""
    return DeviceTree(
        {
            resource: {
                device_id: dataclasses.replace(info, health=Health.UNHEALTHY, health_reason=reason)
                for device_id, info in devices.items()
            }
            for resource, devices in tree.items()
        }
    )


def _without_removed(
    tree: DeviceTree, edited_from: DeviceTree | None, gone: RemovedPaths
) -> DeviceTree:
    """``tree`` without the devices built only from removed devices. A full scan's tree
    (``edited_from`` None) is checked whole; an incremental rescan's only where it differs
    from the tree it edited: maps taken over as they were, and devices its edit did not
    re-read, the scanner left alone (the events did not concern them)."""
    doomed: list[tuple[str, str]] = []
    for resource, devices in tree.items():
        ids: Iterable[str] = devices
        if edited_from is not None:
            before = edited_from.get(resource)
            if devices is before:
                continue
            edit = tree.edit_since(resource, before) if before is not None else None
            if edit is not None:
                ids = edit.added
        doomed.extend((resource, i) for i in ids if gone.covers_all(devices[i].sources))
    return tree.with_changes(doomed, {}) if doomed else tree


class ScanRunner:
    def __init__(
        self,
        scanners: Sequence[Scanner],
        list_limit: ListLimit | None = None,
        *,
        replacing: ScanRunner | None = None,
    ) -> None:
        """``replacing``: the runner of the configuration this one replaces (a reload). Its
        list limit is shared (what was advertised first keeps its place), and each of its
        scanners' last trees stands in for the new scanner of the same name until that one
        has scanned once: a reload while a scanner fails must not withdraw its devices."""
        self.scanners = tuple(scanners)
        if list_limit is None and replacing is not None:
            list_limit = replacing.list_limit
        self.list_limit: ListLimit = list_limit or ListLimit()
        self._last: dict[int, DeviceTree] = {}
        # scanner index -> failed scans in a row
        self._failures: dict[int, int] = {}
        if replacing is not None:
            before = {s.name: replacing._last.get(i) for i, s in enumerate(replacing.scanners)}
            for index, scanner in enumerate(self.scanners):
                tree = before.get(scanner.name)
                if tree is not None:
                    self._last[index] = tree
                    if isinstance(scanner, Adopting):
                        scanner.adopt(tree)
        self._problems: ProblemLog = ProblemLog() if replacing is None else replacing._problems
        # Protocol isinstance checks are slow: resolve once.
        self._incremental = {
            index: scanner
            for index, scanner in enumerate(self.scanners)
            if isinstance(scanner, IncrementalScanner)
        }

    def scan_blocking(
        self,
        cancelled: threading.Event | None = None,
        events: Sequence[UdevEvent] | None = None,
    ) -> ScanResult:
        """Run the scanners (blocking; call it from a worker thread).

        Without ``events`` every scanner scans fully. With them, an incremental scanner that
        has a previous tree updates it from the events; the others scan fully.
        """
        started = time.perf_counter()
        source: UdevSource | None = None
        try:
            source = UdevSource(cancelled)
        except Exception as exc:
            # No libudev context (a new worker thread out of descriptors, say): every scanner
            # fails this time, and keeps its previous result.
            unusable: Exception | None = exc
        else:
            unusable = None
        merged = DeviceTree()
        owners: dict[str, Scanner] = {}
        conflicts: dict[str, tuple[str, ...]] = {}
        failed: dict[str, str] = {}
        full = incremental = 0
        gone = RemovedPaths(events or ())
        for index, scanner in enumerate(self.scanners):
            try:
                if source is None:
                    raise SourceUnavailable(f"no udev source: {unusable}") from unusable
                tree: DeviceTree | None = None
                previous = self._last.get(index)
                incremental_scanner = self._incremental.get(index)
                if events is not None and incremental_scanner is not None and previous is not None:
                    tree = self._rescan(incremental_scanner, source, previous, events)
                    incremental += tree is not None
                edited_from = previous if tree is not None else None
                if tree is None:
                    tree = scanner.scan(source)
                    full += 1
                source.verify()
                if gone:
                    tree = _without_removed(tree, edited_from, gone)
            except ScanCancelled:
                raise
            except Exception as exc:
                if isinstance(exc, ConfigError) and index not in self._last:
                    # The host cannot be served as configured (a list too big for the kubelet,
                    # say): refuse at start-up, as for any configuration error.
                    raise
                failed[scanner.name] = self._failed(scanner, exc, kept_previous=index in self._last)
                tree = self._last.get(index, DeviceTree())
                self._failures[index] = self._failures.get(index, 0) + 1
                if self._failures[index] >= UNKNOWN_AFTER_FAILURES:
                    reason = f"state unknown: scanner {scanner.name} failing ({error_reason(exc)})"
                    tree = unknown_state(tree, reason)
            else:
                self._last[index] = tree
                self._failures.pop(index, None)
                if self._problems.solved(("scanner", scanner.name)):
                    log.info("scan.recovered", scanner=scanner.name)
            clash = set(tree) & set(merged)
            if clash:
                log.error(
                    "scan.resource.conflict",
                    scanner=scanner.name,
                    resources=sorted(clash),
                    kept="the first scanner's devices",
                )
                for resource in clash:
                    conflicts[resource] = (*conflicts.get(resource, ()), scanner.name)
                tree = DeviceTree({k: v for k, v in tree.items() if k not in clash})
            merged = merged.merged(tree)
            owners.update(dict.fromkeys(tree, scanner))
        extras: dict[str, object] = {}
        for scanner in self.scanners:
            if isinstance(scanner, Reporter):
                for section, content in scanner.report().items():
                    if section in ("resources", HELD_BACK_SECTION) or section in extras:
                        # "resources" lists only what is advertised; sections are one owner's.
                        log.error("scan.report.clash", scanner=scanner.name, section=section)
                        continue
                    extras[section] = content
        if source is not None:
            self._report_devices(source, full_scan=events is None)
        fitted, held = self.list_limit.fit(merged)
        if held:
            extras[HELD_BACK_SECTION] = [
                {
                    "id": resource,
                    "summary": f"{resource}: {len(ids):,} devices",
                    "reason": "over the kubelet's 4 MiB ListAndWatch limit; not advertised",
                    "ids": list(ids),
                }
                for resource, ids in sorted(held.items())
            ]
        return ScanResult(
            fitted,
            owners,
            time.perf_counter() - started,
            full,
            incremental,
            extras,
            held,
            failed=tuple(failed),
            failure_reasons=failed,
            conflicts=conflicts,
        )

    def _failed(self, scanner: Scanner, exc: Exception, *, kept_previous: bool) -> str:
        """Log a scanner's failure when it starts or changes (every retry would flood); return
        the reason."""
        problem = f"{type(exc).__name__}: {error_reason(exc)}"
        self._problems.report(
            log,
            "scan.failed",
            problem,
            key=("scanner", scanner.name),
            scanner=scanner.name,
            kept_previous=kept_previous,
            retry="soon, with back-off",
            exc_info=exc,
        )
        return problem

    def _report_devices(self, source: UdevSource, *, full_scan: bool) -> None:
        """Warn once about each device skipped (or read in part); after a full scan, say which
        ones read cleanly again (an incremental one does not re-read them all)."""
        for sys_path, problem in source.problems.items():
            self._problems.report(
                log,
                "scan.device.unreadable",
                problem,
                key=("device", sys_path),
                level="warning",
                sys_path=sys_path,
            )
        if not full_scan:
            return
        for key in self._problems.unsolved():
            if isinstance(key, tuple) and key[0] == "device" and key[1] not in source.problems:
                self._problems.solved(key)
                log.info("scan.device.readable", sys_path=key[1])

    @staticmethod
    def _rescan(
        scanner: IncrementalScanner,
        source: UdevSource,
        previous: DeviceTree,
        events: Sequence[UdevEvent],
    ) -> DeviceTree | None:
        """The incremental result, or None for a full scan (also when the rescan fails: the
        events are taken, so only a full scan can still account for them)."""
        try:
            return scanner.rescan(source, previous, events)
        except ScanCancelled:
            raise
        except Exception:
            log.exception("scan.incremental.failed", scanner=scanner.name, fallback="full scan")
            return None

    async def scan(self, events: Sequence[UdevEvent] | None = None) -> ScanResult:
        cancelled = threading.Event()
        try:
            result = await asyncio.to_thread(self.scan_blocking, cancelled, events)
        except asyncio.CancelledError:
            # The thread cannot be interrupted; tell it to stop at the next device, so that
            # shutdown (which waits for worker threads) is not held up by a long scan.
            cancelled.set()
            raise
        log.debug(
            "scan.complete",
            resources=len(result.tree),
            devices=result.tree.device_count(),
            events=None if events is None else len(events),
            full=result.full,
            incremental=result.incremental,
            ms=round(result.duration_s * 1000, 1),
        )
        return result
