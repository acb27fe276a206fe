"""The daemon: one asyncio.run, one TaskGroup, orderly shutdown on SIGTERM/SIGINT.

Tasks: the kubelet dir watcher, the scan loop (fed by udev events, see ``events``), and one
server per resource (started by the manager). A task that fails unexpectedly brings the
TaskGroup down and the daemon exits non-zero, so a supervisor restarts it; expected trouble
(kubelet away, unwritable dirs, vanished devices) is handled where it happens and never ends
the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

from devplug.cdi.allocate import CdiNames, CdiOptions
from devplug.cdi.catalog import CdiCatalog
from devplug.cdi.sync import CdiSync, default_instance
from devplug.config import Settings, parse_address
from devplug.errors import ConfigError
from devplug.hotplug.health import HealthGate
from devplug.hotplug.listener import UDEV_CONTROL, MonitorOpener, UeventListener, choose_source
from devplug.hotplug.scanning import ScanRunner, event_subsystems
from devplug.kubelet.registration import KubeletDirWatcher
from devplug.kubelet.server import DEFAULT_TIMING, ServerTiming
from devplug.kubelet.servers import Manager
from devplug.model import DeviceTree
from devplug.ops.http import StatusEndpoint
from devplug.ops.metrics import Metrics
from devplug.ops.systemd import SystemdNotifier
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevEvent, UdevMonitor

log = structlog.get_logger("devplug.daemon")

# Reads and validates the config file again: (settings, their scanners), or ConfigError.
ConfigLoader = Callable[[], tuple[Settings, Sequence[Scanner]]]


class Daemon:
    def __init__(
        self,
        settings: Settings,
        scanners: Sequence[Scanner],
        timing: ServerTiming = DEFAULT_TIMING,
        *,
        monitor_opener: MonitorOpener = UdevMonitor,
        udev_control: Path = UDEV_CONTROL,
        freeze_gc: bool = False,
        notifier: SystemdNotifier | None = None,
        config_loader: ConfigLoader | None = None,
    ) -> None:
        self.settings = settings
        # systemd's notify protocol (a no-op outside a Type=notify unit).
        self.notifier = notifier if notifier is not None else SystemdNotifier()
        self.metrics = Metrics()
        self.http: StatusEndpoint | None = None
        # Reads and validates the config again on SIGHUP (None: SIGHUP only rescans).
        self._config_loader = config_loader
        self._reload_requested = False
        self.reloads = 0
        self.scan_runner = ScanRunner(scanners)
        self.watcher = KubeletDirWatcher(settings.kubelet_dir)
        self.timing = timing
        self.stop_requested = asyncio.Event()
        self.manager: Manager | None = None
        self.first_scan_done = asyncio.Event()
        hotplug = settings.hotplug
        self.health = HealthGate(hotplug.health_hold_down_s)
        # gc.freeze() is process-wide: the daemon's own process asks for it (cli), tests don't.
        self.freeze_gc = freeze_gc
        self._udev_control = udev_control
        self.listener = UeventListener(
            choose_source(hotplug.source, udev_control),
            event_subsystems(scanners),
            self._wake_scan_loop,
            monitor_opener,
        )
        # Counters for tests, benchmarks and (later) metrics.
        self.full_scans = 0
        self.incremental_scans = 0
        cdi = settings.cdi
        # What the spec files on disk define, shared by the CDI task and every servicer.
        self.cdi_catalog = CdiCatalog()
        instance = cdi.instance or default_instance(scanners)
        self.cdi_sync = CdiSync(cdi, self.cdi_catalog, instance) if cdi.enabled else None
        self._cdi_options = (
            CdiNames(CdiOptions(self.cdi_catalog, cdi.annotations, cdi.device_specs))
            if cdi.enabled
            else None
        )
        self._scan_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._full_scan_requested = False
        self._raw = DeviceTree()
        self._owners: Mapping[str, Scanner] = {}

    def request_stop(self) -> None:
        self.stop_requested.set()

    def request_reload(self) -> None:
        """SIGHUP: read the config again (keeping the running one if it is wrong), rescan."""
        self._reload_requested = True
        self.request_scan()

    def request_scan(self) -> None:
        """Ask the scan loop for a full scan now (SIGHUP); returns at once."""
        self._full_scan_requested = True
        self._wake_scan_loop()

    def _wake_scan_loop(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        log.info(
            "daemon.started",
            kubelet_dir=str(self.settings.kubelet_dir),
            scanners=[s.name for s in self.scan_runner.scanners],
        )
        async with asyncio.TaskGroup() as group:
            manager = Manager(
                self.settings.kubelet_dir,
                self.watcher,
                group,
                self.timing,
                self._cdi_options,
                self.metrics,
            )
            self.manager = manager
            watcher = group.create_task(self.watcher.run(), name="kubelet-watcher")
            scan_loop = group.create_task(self._scan_loop(), name="scan-loop")
            cdi_task = None
            if self.cdi_sync is not None:
                cdi_task = group.create_task(self.cdi_sync.run(), name="cdi-sync")
            watchdog = group.create_task(self.notifier.watchdog(), name="systemd-watchdog")
            if self.settings.metrics_address is not None:
                host, port = parse_address(self.settings.metrics_address)
                endpoint = StatusEndpoint(host, port, self.metrics.exposition, self.not_ready)
                try:
                    await endpoint.start()
                    self.http = endpoint
                except OSError as exc:
                    # Devices matter more than their metrics: serve on without the endpoint.
                    log.error(
                        "http.unavailable",
                        address=self.settings.metrics_address,
                        reason=exc.strerror or str(exc),
                        fix="choose a free metrics_address, or leave it unset",
                    )
            ready = group.create_task(self._announce_ready(), name="systemd-ready")
            try:
                await self.stop_requested.wait()
                log.info("daemon.stopping")
                self.notifier.notify("STOPPING=1", "STATUS=stopping")
                ready.cancel()
                watchdog.cancel()
                # The scan loop first, so no scan applies a tree while servers shut down.
                scan_loop.cancel()
                await asyncio.wait({scan_loop})
                watcher.cancel()
                await manager.shutdown()
                if cdi_task is not None and self.cdi_sync is not None:
                    cdi_task.cancel()
                    await asyncio.wait({cdi_task})
                    await self.cdi_sync.close()
            finally:
                self.listener.close()
                self.notifier.close()
                if self.http is not None:
                    await self.http.close()
        log.info("daemon.stopped")

    def not_ready(self) -> list[str]:
        """What keeps the daemon from being ready: empty once the first scan is done and every
        advertised resource is registered with the kubelet (/readyz)."""
        if not self.first_scan_done.is_set() or self.manager is None:
            return ["the first scan"]
        return sorted(
            f"{name} (not registered)"
            for name, server in self.manager.servers.items()
            if not server.registered.is_set()
        )

    async def _announce_ready(self) -> None:
        """READY=1 once every resource of the first scan is registered with the kubelet."""
        await self.first_scan_done.wait()
        manager = self.manager
        if manager is None:
            return
        servers = list(manager.servers.values())
        if servers:
            self.notifier.notify(f"STATUS=registering {len(servers)} resource(s) with the kubelet")
            await asyncio.gather(*(server.registered.wait() for server in servers))
            status = f"STATUS=serving {len(servers)} resource(s), all registered"
        else:
            status = "STATUS=no devices found; watching for them"
        self.notifier.notify("READY=1", status)
        log.info("daemon.ready", resources=len(servers))

    async def rescan(self) -> None:
        """Scan fully now and apply the result (tests, SIGHUP, the periodic resync)."""
        await self._scan_and_apply(None)

    async def _scan_and_apply(self, events: Sequence[UdevEvent] | None) -> None:
        if self.manager is None:
            raise RuntimeError("the daemon is not running")
        async with self._scan_lock:
            result = await self.scan_runner.scan(events)
            self.full_scans += result.full
            self.incremental_scans += result.incremental
            kind = "incremental" if result.full == 0 and result.incremental else "full"
            self.metrics.scan_seconds.labels(kind).observe(result.duration_s)
            self.metrics.set_held_back(result.held_back)
            self._raw, self._owners = result.tree, result.owners
            await self._publish(self.health.gate(self._raw))

    async def _apply_health(self) -> None:
        """Publish devices whose hold-down ended (no rescan: the scanners' view is current)."""
        if self.manager is None:
            raise RuntimeError("the daemon is not running")
        async with self._scan_lock:
            await self._publish(self.health.gate(self._raw))

    async def _publish(self, tree: DeviceTree) -> None:
        """To the servers first (the kubelet waits on them), then to the CDI task."""
        if self.manager is None:
            raise RuntimeError("the daemon is not running")
        await self.manager.apply(tree, self._owners)
        self.metrics.set_devices(tree)
        if self.cdi_sync is not None:
            self.cdi_sync.submit(tree)

    async def _reload(self) -> None:
        """Apply a new config's scanners and hotplug settings; the next scan makes resources
        follow. Settings a running daemon cannot change are reported, not applied."""
        if self._config_loader is None:
            return
        try:
            settings, scanners = await asyncio.to_thread(self._config_loader)
        except ConfigError as exc:
            log.error(
                "config.reload.refused",
                field=exc.field,
                reason=exc.message,
                kept="the running configuration",
            )
            return
        except Exception:
            log.exception("config.reload.failed", kept="the running configuration")
            return
        fixed = [
            name
            for name in ("kubelet_dir", "cdi", "log_format", "log_level", "metrics_address")
            if getattr(settings, name) != getattr(self.settings, name)
        ]
        runner = ScanRunner(scanners, self.scan_runner.list_limit)
        try:
            # A trial scan: a config the host cannot be served with (a list too big for the
            # kubelet, say) is refused here, not by stopping the daemon. Under the scan lock:
            # it shares the list limit, which one scan at a time may use.
            async with self._scan_lock:
                await runner.scan()
        except ConfigError as exc:
            log.error(
                "config.reload.refused",
                field=exc.field,
                reason=exc.message,
                kept="the running configuration",
            )
            return
        if fixed:
            log.warning("config.reload.needs_restart", settings=fixed, applied=False)
        kept = {name: getattr(self.settings, name) for name in fixed}
        self.settings = settings.model_copy(update=kept)
        self.scan_runner = runner
        # The gate keeps its memory (a device held down stays held down); only its period may
        # change.
        self.health.hold_down_s = self.settings.hotplug.health_hold_down_s
        subsystems = event_subsystems(scanners)
        source = choose_source(self.settings.hotplug.source, self._udev_control)
        if (subsystems, source) != (self.listener.subsystems, self.listener.source):
            # Close then open before the full scan that follows: nothing is missed for good.
            self.listener.close()
            self.listener.subsystems, self.listener.source = subsystems, source
            self.listener.open()
        self.reloads += 1
        log.info("config.reloaded", scanners=[s.name for s in scanners], restart_needed=fixed)

    def _resync_period(self) -> float:
        hotplug = self.settings.hotplug
        return hotplug.resync_s if self.listener.active else hotplug.poll_s

    async def _scan_loop(self) -> None:
        """Full scan, then: events -> incremental rescans; the resync period -> full scan.

        The monitor opens before the first scan, so nothing that happens between the scan and
        the first event read is missed. Nothing here wakes up unless an event, a signal, the
        resync period or a health hold-down deadline calls for it.
        """
        loop = asyncio.get_running_loop()
        self.listener.open()
        await self.rescan()
        self.first_scan_done.set()
        if self.freeze_gc:
            # The first tree and servers are long-lived: keep them out of GC passes.
            gc.freeze()
        next_full = loop.time() + self._resync_period()
        while True:
            deadline = next_full
            health_due = self.health.next_deadline()
            if health_due is not None:
                # The gate has its own clock: convert its deadline to loop time.
                deadline = min(deadline, loop.time() + health_due - self.health.now())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._wake.wait()
            coalesce_s = self.settings.hotplug.coalesce_ms / 1000  # a reload may change it
            if self._wake.is_set() and coalesce_s > 0 and not self._full_scan_requested:
                # Events come in bursts (a card and its nodes, a driver binding): let the burst
                # finish so it costs one rescan.
                await asyncio.sleep(coalesce_s)
            self._wake.clear()
            batch = self.listener.take()
            self.metrics.udev_events.inc(len(batch.events))
            if batch.overflowed:
                self.metrics.udev_overflows.inc()
            if self._reload_requested:
                self._reload_requested = False
                await self._reload()
            if self._full_scan_requested or batch.overflowed or loop.time() >= next_full:
                self._full_scan_requested = False
                if not self.listener.active and loop.time() >= next_full:
                    # Only at the poll period: a monitor that keeps failing must not turn
                    # into a loop of full scans.
                    self.listener.open()
                await self.rescan()
                next_full = loop.time() + self._resync_period()
            elif batch.events:
                await self._scan_and_apply(batch.events)
            else:
                await self._apply_health()


async def run_until_signalled(daemon: Daemon) -> None:
    """Run the daemon; SIGTERM/SIGINT stop it, SIGHUP reloads the config and rescans."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    try:
        await daemon.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)
