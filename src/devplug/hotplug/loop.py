"""The scan loop: when to scan, and handing each result on.

A full scan at start, then: udev events (read by the listener on the loop) -> incremental
rescans, coalesced over the burst (until no datagram came for QUIET_GAP_S, for
hotplug.coalesce_ms at most); the resync period (the poll period while no monitor can be
opened) -> a full scan; a request (SIGHUP, tests) -> a full scan; a health hold-down that
ends, or an operator's cordon put or lifted (:meth:`ScanLoop.regate`) -> the gate's new view,
without a rescan; a scanner that failed -> a full scan again after a back-off (0.5 s doubling
to 30 s; its previous result is advertised meanwhile). Nothing wakes the loop otherwise.

Each result goes through the health gate and is published as one value,
:attr:`ScanLoop.advertised` (an :class:`Advertised`: the tree and, per resource, its scanner).
The fronts follow it, each with its own diff (trees record their edits, so a hotplug event
costs what it changed); the loop knows none of them. After each publication it awaits
``delivered`` (the composition's: until the kubelet front, whose lists the kubelet waits on,
has taken that tree) before it goes on. Work that must never delay the hotplug path (the CDI
sync's) awaits :meth:`ScanLoop.quiet` between its slices: it returns while the loop is parked
with nothing pending, so from a uevent's read to its list's delivery such work stands still
(unless that takes longer than the waiter's own bound: the CDI sync's is half a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.values import LatestValue, Watchable
from devplug.config import HotplugSettings
from devplug.hotplug.health import HealthGate
from devplug.hotplug.listener import EventBatch, MonitorSource, UeventListener
from devplug.hotplug.scanning import ScanResult, ScanRunner
from devplug.model import DeviceTree
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevEvent

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Advertised:
    """One publication: the advertised tree and, per resource, the scanner whose hooks serve
    it (the fronts read what they need of it through protocols of their own)."""

    tree: DeviceTree
    owners: Mapping[str, Scanner]


# Awaited after each publication with its version (of ScanLoop.advertised): returns once the
# followers that must have each tree before the loop goes on have taken it.
Delivery = Callable[[int], Awaitable[None]]
# Told of every scan (metrics, stats) and of every batch of events taken.
ScanObserver = Callable[[ScanResult], None]
EventObserver = Callable[[EventBatch], None]

# The coalescing window ends once no datagram was read for this long (a burst is over: a
# GPU's PCI function, card and render minor come back to back), or at hotplug.coalesce_ms.
QUIET_GAP_S = 0.0005

# After a scan in which a scanner failed, the next full scan comes this soon, doubling.
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 30.0


class ScanLoop:
    def __init__(
        self,
        runner: ScanRunner,
        listener: UeventListener,
        health: HealthGate,
        settings: HotplugSettings,
        *,
        delivered: Delivery | None = None,
        observe: ScanObserver | None = None,
        observe_events: EventObserver | None = None,
        reload: Callable[[], Awaitable[None]] | None = None,
        freeze_gc: bool = False,
    ) -> None:
        self.runner = runner
        self.listener = listener
        self.health = health
        self.settings = settings
        self._delivered = delivered
        # None until the first scan is published.
        self._advertised: LatestValue[Advertised | None] = LatestValue(None)
        self._observe = observe
        self._observe_events = observe_events
        self._reload = reload
        # gc.freeze() is process-wide: the daemon's own process asks for it (cli), tests don't.
        self.freeze_gc = freeze_gc
        self.first_scan_done = asyncio.Event()
        self._full_rescans = LatestValue(0)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._full_requested = False
        self._reload_requested = False
        self._raw = DeviceTree()
        self._owners: Mapping[str, Scanner] = {}
        self._retry = Backoff(RETRY_INITIAL_S, RETRY_MAX_S)
        # True while the last scan had a failed scanner (a full scan is due after a back-off).
        self._failing = False
        # Set while the hotplug path is quiet (see quiet()); _parked: run() waits for work.
        self._quiet = asyncio.Event()
        self._parked = False

    @property
    def advertised(self) -> Watchable[Advertised | None]:
        """What the loop publishes: the advertised tree and its owners (None before the first
        scan). Every front follows it."""
        return self._advertised

    def wake(self) -> None:
        """Something happened (a udev event): look at once."""
        self._wake.set()
        self._quiet.clear()

    async def quiet(self) -> None:
        """Return once the hotplug path is quiet: the loop parked, waiting for work, with no
        event, request or scan pending (at once if it is). After a uevent it returns only
        once that event's tree has been published and delivered, so the kubelet front's
        streams, woken by it, run before anything that awaited this."""
        await self._quiet.wait()

    def _note_quiet(self) -> None:
        if self._parked and not self._wake.is_set() and not self._lock.locked():
            self._quiet.set()
        else:
            self._quiet.clear()

    def request_scan(self) -> None:
        """Ask for a full scan now; returns at once."""
        self._full_requested = True
        self.wake()

    def request_reload(self) -> None:
        """Ask for the configuration to be read again (then a full scan); returns at once."""
        self._reload_requested = True
        self.request_scan()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """No scan runs during the block (a reload's trial scan shares the list limit)."""
        async with self._lock:
            yield

    def reconfigure(
        self,
        runner: ScanRunner,
        settings: HotplugSettings,
        subsystems: frozenset[str] | None,
        source: MonitorSource | None,
    ) -> None:
        """A reloaded config's scanners and hotplug settings. The health gate keeps its memory
        (a device held down stays held down); only its period may change."""
        self.runner = runner
        self.settings = settings
        self.health.hold_down_s = settings.health_hold_down_s
        self.listener.retarget(subsystems, source)

    async def rescan(self) -> None:
        """Scan fully now and publish the result (tests, SIGHUP, the periodic resync)."""
        await self._scan_and_publish(None)
        self._full_rescans.set(self._full_rescans.value + 1)

    @property
    def full_rescans(self) -> Watchable[int]:
        """Full scans of every scanner published so far (the first included), counted once
        delivered; an event batch that a scanner takes in full is not one."""
        return self._full_rescans

    @property
    def scanned(self) -> DeviceTree:
        """What the scanners found last (before the health gate): every device there is."""
        return self._raw

    async def regate(self) -> None:
        """Gate the scanners' last tree again and publish it, without a rescan (the operator
        cordoned a device, or lifted a cordon); returns once it is delivered. Before the
        first scan there is nothing to publish: that scan is gated as things are then."""
        if not self.first_scan_done.is_set():
            return
        await self._publish_health()
        if self.health.next_deadline() is not None:
            # A hold-down began (a lifted cordon): the loop, parked until its own deadlines,
            # must learn of this one.
            self.wake()

    async def _scan_and_publish(self, events: Sequence[UdevEvent] | None) -> None:
        """A scan (incremental for ``events``, else full), published."""
        async with self._lock:
            self._quiet.clear()
            result = await self.runner.scan(events)
            if self._observe is not None:
                self._observe(result)
            self._raw, self._owners = result.tree, result.owners
            self._failing = bool(result.failed)
            if not self._failing:
                self._retry.reset()
            await self._publish(self.health.gate(self._raw), self._owners)
        self._note_quiet()

    async def _publish_health(self) -> None:
        """Publish devices whose hold-down ended (no rescan: the scanners' view is current)."""
        async with self._lock:
            self._quiet.clear()
            await self._publish(self.health.gate(self._raw), self._owners)
        self._note_quiet()

    async def _publish(self, tree: DeviceTree, owners: Mapping[str, Scanner]) -> None:
        """Publish, then wait for its delivery (under the lock: one tree at a time)."""
        self._advertised.set(Advertised(tree, owners))
        if self._delivered is not None:
            await self._delivered(self._advertised.version)

    def _resync_period(self) -> float:
        """Until the next full scan: soon after a failed one, else the resync (or poll) period."""
        period = self.settings.resync_s if self.listener.active else self.settings.poll_s
        return min(period, self._retry.next()) if self._failing else period

    async def run(self) -> None:
        """Full scan, then follow events, periods, requests and deadlines until cancelled.

        The monitor opens before the first scan, so nothing that happens between the scan and
        the first event read is missed.
        """
        loop = asyncio.get_running_loop()
        self.listener.open()
        try:
            await self.rescan()
            self.first_scan_done.set()
            if self.freeze_gc:
                # The first tree and servers are long-lived: keep them out of GC passes.
                gc.freeze()
            next_full = loop.time() + self._resync_period()
            while True:
                await self._sleep_until(loop.time, next_full)
                coalesce_s = self.settings.coalesce_ms / 1000  # a reload may change it
                if self._wake.is_set() and coalesce_s > 0 and not self._full_requested:
                    # Events come in bursts (a card and its nodes, a driver binding): let the
                    # burst finish so it costs one rescan.
                    await self._coalesce(coalesce_s)
                self._wake.clear()
                batch = self.listener.take()
                if self._observe_events is not None:
                    self._observe_events(batch)
                if self._reload_requested:
                    self._reload_requested = False
                    if self._reload is not None:
                        await self._reload()
                if self._full_requested or batch.overflowed or loop.time() >= next_full:
                    self._full_requested = False
                    if not self.listener.active and loop.time() >= next_full:
                        # Only at the poll period: a monitor that keeps failing must not turn
                        # into a loop of full scans.
                        self.listener.open()
                    await self.rescan()
                    next_full = loop.time() + self._resync_period()
                elif batch.events:
                    await self._scan_and_publish(batch.events)
                    if self._failing:
                        next_full = min(next_full, loop.time() + self._resync_period())
                else:
                    await self._publish_health()
        finally:
            self.listener.close()
            # Nothing to give way to any more: whoever waits for quiet must not wait forever.
            self._parked = True
            self._quiet.set()

    async def _coalesce(self, most_s: float) -> None:
        """Wait until no datagram was read for QUIET_GAP_S, or ``most_s`` at most."""
        clock = time.monotonic  # the listener's clock
        deadline = clock() + most_s
        while True:
            now = clock()
            quiet_left = self.listener.last_read + QUIET_GAP_S - now
            if quiet_left <= 0 or now >= deadline:
                return
            await asyncio.sleep(min(quiet_left, deadline - now))

    async def _sleep_until(self, now: Callable[[], float], next_full: float) -> None:
        """Until a wake-up, the next full scan or the next hold-down deadline."""
        deadline = next_full
        health_due = self.health.next_deadline()
        if health_due is not None:
            # The gate has its own clock: convert its deadline to loop time.
            deadline = min(deadline, now() + health_due - self.health.now())
        self._parked = True
        self._note_quiet()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._wake.wait()
        finally:
            self._parked = False
            self._quiet.clear()
