"""Running scanners off the event loop and merging their trees.

Scanners are synchronous and may take long on big hosts, so a scan runs in a worker thread
(``asyncio.to_thread``). A scanner that raises keeps its previous result (a transient sysfs
error must not drop a resource's capacity); the failure is logged with its reason. A
ConfigError from a scanner's first scan is raised: the host cannot be served as configured.

After udev events every scanner runs: an
:class:`~devplug.scanners.base.IncrementalScanner` updates its previous tree from the events
(or keeps it, when they do not concern it), any other scanner scans fully.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from devplug.errors import ConfigError, ScanCancelled
from devplug.hotplug.list_limit import ListLimit
from devplug.model import DeviceTree
from devplug.scanners.base import IncrementalScanner, Reporter, Scanner
from devplug.scanners.udev import UdevEvent, UdevSource

log = structlog.get_logger("devplug.scan")


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


class ScanRunner:
    def __init__(self, scanners: Sequence[Scanner], list_limit: ListLimit | None = None) -> None:
        self.scanners = tuple(scanners)
        # Shared with the runner of a reloaded config, which keeps what was advertised first.
        self.list_limit = list_limit or ListLimit()
        self._last: dict[int, DeviceTree] = {}
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
        source = UdevSource(cancelled)
        merged = DeviceTree()
        owners: dict[str, Scanner] = {}
        full = incremental = 0
        for index, scanner in enumerate(self.scanners):
            try:
                tree: DeviceTree | None = None
                previous = self._last.get(index)
                incremental_scanner = self._incremental.get(index)
                if events is not None and incremental_scanner is not None and previous is not None:
                    tree = self._rescan(incremental_scanner, source, previous, events)
                    incremental += tree is not None
                if tree is None:
                    tree = scanner.scan(source)
                    full += 1
            except ScanCancelled:
                raise
            except ConfigError:
                if index not in self._last:
                    # The host cannot be served as configured (a list too big for the kubelet,
                    # say): refuse at start-up, as for any configuration error.
                    raise
                log.exception("scan.failed", scanner=scanner.name, kept_previous=True)
                tree = self._last[index]
            except Exception:
                log.exception(
                    "scan.failed", scanner=scanner.name, kept_previous=index in self._last
                )
                tree = self._last.get(index, DeviceTree())
            else:
                self._last[index] = tree
            clash = set(tree) & set(merged)
            if clash:
                log.error(
                    "scan.resource.conflict",
                    scanner=scanner.name,
                    resources=sorted(clash),
                    kept="the first scanner's devices",
                )
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
            fitted, owners, time.perf_counter() - started, full, incremental, extras, held
        )

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
