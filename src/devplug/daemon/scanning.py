"""Running scanners off the event loop and merging their trees.

Scanners are synchronous and may take long on big hosts, so a scan runs in a worker thread
(``asyncio.to_thread``). A scanner that raises keeps its previous result (a transient sysfs
error must not drop a resource's capacity); the failure is logged with its reason.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from devplug.errors import ScanCancelled
from devplug.model import DeviceTree
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevSource

log = structlog.get_logger("devplug.scan")


@dataclass(frozen=True, slots=True)
class ScanResult:
    tree: DeviceTree
    # resource -> the scanner that produced it (its hooks serve that resource)
    owners: Mapping[str, Scanner] = field(default_factory=dict)
    duration_s: float = 0.0


class ScanRunner:
    def __init__(self, scanners: Sequence[Scanner]) -> None:
        self.scanners = tuple(scanners)
        self._last: dict[int, DeviceTree] = {}

    def scan_blocking(self, cancelled: threading.Event | None = None) -> ScanResult:
        """Run every scanner once (blocking; call it from a worker thread)."""
        started = time.perf_counter()
        source = UdevSource(cancelled)
        merged = DeviceTree()
        owners: dict[str, Scanner] = {}
        for index, scanner in enumerate(self.scanners):
            try:
                tree = scanner.scan(source)
            except ScanCancelled:
                raise
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
        return ScanResult(merged, owners, time.perf_counter() - started)

    async def scan(self) -> ScanResult:
        cancelled = threading.Event()
        try:
            result = await asyncio.to_thread(self.scan_blocking, cancelled)
        except asyncio.CancelledError:
            # The thread cannot be interrupted; tell it to stop at the next device, so that
            # shutdown (which waits for worker threads) is not held up by a long scan.
            cancelled.set()
            raise
        log.debug(
            "scan.complete",
            resources=len(result.tree),
            devices=result.tree.device_count(),
            ms=round(result.duration_s * 1000, 1),
        )
        return result
