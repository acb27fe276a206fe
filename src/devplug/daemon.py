"""The daemon: the parts wired together, started in order, stopped in reverse.

- :mod:`devplug.hotplug` scans (at start, on udev events, on the resync) and publishes the
  advertised tree, one value (``scan_loop.advertised``);
- :mod:`devplug.kubelet` follows it and serves each resource to the kubelet;
- :mod:`devplug.cdi` follows it and keeps the CDI spec files in line with it;
- :mod:`devplug.dra` (with a ``dra`` section) follows it and serves the resources the section
  names through DRA: ResourceSlices and the kubelet DRA plugin; the servers leave them out;
- :mod:`devplug.ops` counts, answers probes, talks to systemd and takes the operator's
  commands on a local socket (cordons: the health gate in :mod:`devplug.hotplug` applies them
  to the advertised tree, so every front follows them).

They meet only here, and no tree passes through here: each front follows the published value
and works out its own diff. After each publication the scan loop waits until the kubelet
front has the tree (the kubelet waits on its lists; CDI, which waits for the loop's quiet,
comes after it). Each part is entered into one ``AsyncExitStack`` in dependency order,
so shutdown is LIFO by structure: systemd hears STOPPING first, the scan loop stops before
the servers it feeds, the servers before the kubelet dir watch they wait on, the CDI specs
go after the servers (so Allocate never names a spec already removed), the listener last.
A task that fails unexpectedly brings the TaskGroup down and the daemon exits non-zero, so a
supervisor restarts it; expected trouble (kubelet away, unwritable dirs, vanished devices) is
handled where it happens and never ends the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from devplug._kits import collector
from devplug._kits.stopping import StopBudget
from devplug._kits.tasks import running
from devplug._kits.values import LatestValue, Watchable
from devplug.cdi.allocate import CdiCatalog, CdiNames, CdiOptions
from devplug.config import Settings, parse_address
from devplug.errors import ConfigError
from devplug.hotplug.cordon_requests import CordonRequests
from devplug.hotplug.cordons import STATE_SUFFIX, CordonBook
from devplug.hotplug.health import HealthGate
from devplug.hotplug.listener import (
    UDEV_CONTROL,
    EventBatch,
    MonitorOpener,
    UeventListener,
    choose_source,
)
from devplug.hotplug.loop import ScanLoop
from devplug.hotplug.scanning import ScanResult, ScanRunner, event_subsystems
from devplug.kubelet.holders import HolderWatch
from devplug.kubelet.podresources import default_socket
from devplug.kubelet.registration import KubeletDirWatcher
from devplug.kubelet.server import DEFAULT_TIMING, ServerTiming
from devplug.kubelet.servers import ResourceServers
from devplug.model import ContainerAllocation, DeviceTree
from devplug.ops.control import ControlChannel, control_dir, control_name, socket_path
from devplug.ops.http import StatusEndpoint
from devplug.ops.metrics import Metrics
from devplug.ops.systemd import SystemdNotifier
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevMonitor

if TYPE_CHECKING:
    from devplug.cdi.sync import CdiSync
    from devplug.dra.front import DraFront
    from devplug.hotplug.loop import Advertised

log = structlog.get_logger(__name__)

# The CDI task starts once the kubelet has had the first list of every resource of the first
# scan (its modules and its first render would otherwise delay that list), or this long after
# the first scan if some resource has none by then (no kubelet yet, say).
CDI_START_TIMEOUT_S = 1.0

# Of the stop budget, what is kept after the stop hooks for the steps that follow them (the
# kubelet dir watch, the log line, the worker threads' end): milliseconds, with room to spare.
STOP_LAST_STEPS_S = 1.0

# After a full scan, the garbage collector is settled once the CDI specs follow the new tree;
# this long at most (a spec that cannot be written never does).
SETTLE_CDI_WAIT_S = 30.0

# Reads the configuration and builds the scanners: (settings, their scanners), or ConfigError
# naming the bad field. Called at start and again on every SIGHUP.
ConfigLoader = Callable[[], tuple[Settings, Sequence[Scanner]]]


@dataclass(frozen=True, slots=True)
class DaemonStats:
    """What the daemon has done so far: await it (``daemon.stats.wait_for(...)``) rather than
    poll. A new value is published whenever one of these changes."""

    full_scans: int = 0
    incremental_scans: int = 0
    reloads: int = 0
    udev_events: int = 0
    udev_overflows: int = 0
    # The tree advertised to the kubelet (after the health gate and the list limit).
    advertised: DeviceTree = field(default_factory=DeviceTree)
    # Resources whose CDI spec is on disk as written (Allocate names their devices).
    cdi_specs: frozenset[str] = frozenset()
    cdi_writes: int = 0
    cdi_failures: int = 0


def _more_than(count: int) -> Callable[[int], bool]:
    return lambda value: value > count


def _other_than(tree: DeviceTree | None) -> Callable[[DeviceTree | None], bool]:
    return lambda value: value is not tree


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
        name: str = "devplug",
    ) -> None:
        self.settings = settings
        self._udev_control = udev_control
        # Reads and validates the config again on SIGHUP (None: SIGHUP only rescans).
        self._config_loader = config_loader
        self._stats = LatestValue(DaemonStats())
        self.metrics = Metrics()
        # systemd's notify protocol (a no-op outside a Type=notify unit).
        self.systemd = notifier if notifier is not None else SystemdNotifier()
        self.http: StatusEndpoint | None = None
        # Bumped whenever a resource's registration may have changed (STATUS= follows it).
        self._registrations = LatestValue(0)
        self.stop_requested = asyncio.Event()
        # What a stop may take in all, from the first stop request (stop hooks, CDI clean-up;
        # devplug.plugin bounds the worker threads after it, and the process, with it too).
        self.stop_budget = StopBudget(settings.stop_timeout_s)
        self._stopped = False  # run() has returned after an orderly stop

        hotplug = settings.hotplug
        # The operator's cordons, kept beside the sockets (the program's ``name`` keeps two
        # daemons on a node apart); the health gate applies them to the advertised tree.
        name = control_name(name)
        self.cordons = CordonBook(control_dir(settings.kubelet_dir) / f"{name}{STATE_SUFFIX}")
        self.metrics.refreshers.append(self._count_cordons)
        listener = UeventListener(
            choose_source(hotplug.source, udev_control),
            event_subsystems(scanners),
            self._wake_scan_loop,
            monitor_opener,
        )
        self.scan_loop = ScanLoop(
            ScanRunner(scanners),
            listener,
            HealthGate(hotplug.health_hold_down_s, cordons=self.cordons),
            hotplug,
            delivered=self._delivered,
            observe=self._scanned,
            observe_events=self._events_taken,
            reload=self._reload,
            freeze_gc=freeze_gc,
        )
        # The collector is the process's: only the process's own daemon settles it (tests
        # share theirs between daemons).
        self._freeze_gc = freeze_gc

        self.watcher = KubeletDirWatcher(settings.kubelet_dir)
        # devplug cordon, uncordon and status's cordons, on a socket beside the plugins'.
        self.control = ControlChannel(
            socket_path(settings.kubelet_dir, name),
            CordonRequests(self.cordons, self.scan_loop, name).handle,
            changes=self.watcher.changes,
            on_listening=self.cordons.restore_file,
        )
        cdi = settings.cdi
        # What the spec files on disk define, shared by the CDI task and every servicer.
        self.cdi_catalog = CdiCatalog(on_change=self._cdi_changed)
        self._cdi_sync: CdiSync | None = None
        self._cdi_running = asyncio.Event()  # set once the CDI task runs
        self._cdi_scanners = tuple(scanners)  # they name this daemon's instance
        # Resources whose first ListAndWatch list is out (the CDI task waits for those of the
        # first scan; see _run_cdi).
        self._lists_out: LatestValue[frozenset[str]] = LatestValue(frozenset())
        names: CdiNames | None = None
        if cdi.enabled:
            names = CdiNames(CdiOptions(self.cdi_catalog, cdi.annotations, cdi.device_specs))
        dra = settings.dra
        self.servers = ResourceServers(
            settings.kubelet_dir,
            self.watcher,
            timing,
            extension=names,
            events=_Events(self),
            stop_hooks_bound=self._stop_hooks_bound,
            # One front per resource: those of the dra section are the DRA front's alone.
            served_elsewhere=frozenset(dra.resources if dra is not None else ()),
        )
        # The DRA front (None without a dra section); ConfigError naming NODE_NAME, KUBECONFIG
        # or the dra setting that is wrong.
        self.dra: DraFront | None = None
        if dra is not None:
            from devplug.dra.front import DraFront

            assert names is not None  # the settings refuse a dra section without CDI
            self.dra = DraFront.from_environment(
                dra,
                scanners,
                os.environ,
                advertised=self.scan_loop.advertised,
                cdi=_CdiIds(names, self.scan_loop.advertised),
                observe_calls=self.metrics.dra_call,
            )
            self.metrics.refreshers.append(self._count_dra)
        # Who holds each device, from the kubelet's pod resources API beside its dir.
        self.holders = HolderWatch(
            default_socket(settings.kubelet_dir),
            self.metrics,
            self._registered_resources,
            scanners=lambda: self.scan_loop.runner.scanners,  # the reloaded ones after SIGHUP
            quiet=self.scan_loop.quiet,
        )

    # ------------------------------------------------------------------ public controls

    @property
    def cdi_sync(self) -> CdiSync | None:
        """The CDI task's state (None when CDI is off). Made by the task once the first lists
        are out (see :data:`CDI_START_TIMEOUT_S`), or here on first use, whichever is first."""
        cdi = self.settings.cdi
        if self._cdi_sync is None and cdi.enabled:
            from devplug.cdi.sync import CdiSync, default_instance

            instance = cdi.instance or default_instance(self._cdi_scanners)
            # CDI work yields to the hotplug path: a slice starts only while it is quiet.
            self._cdi_sync = CdiSync(
                cdi,
                self.cdi_catalog,
                instance,
                on_change=self._cdi_changed,
                quiet=self.scan_loop.quiet,
            )
        return self._cdi_sync

    @property
    def stats(self) -> Watchable[DaemonStats]:
        return self._stats

    @property
    def listener(self) -> UeventListener:
        return self.scan_loop.listener

    @property
    def first_scan_done(self) -> asyncio.Event:
        return self.scan_loop.first_scan_done

    def request_stop(self) -> None:
        """Stop, within the stop budget; asked again while stopping, the budget ends now
        (the process then ends at once: see devplug.plugin)."""
        if not self.stop_budget.begin() and not self._stopped:
            log.warning("daemon.stop.cut_short", reason="asked to stop again while stopping")
        self.stop_requested.set()

    def _stop_hooks_bound(self) -> float:
        """What the scanners' stop hooks may take at shutdown: the stop budget left, less
        what comes after them (the CDI clean-up's own bound, the last steps)."""
        after = STOP_LAST_STEPS_S
        if self._cdi_sync is not None:
            from devplug.cdi.sync import CLOSE_TIMEOUT_S

            after += CLOSE_TIMEOUT_S
        return self.stop_budget.remaining(after)

    def request_reload(self) -> None:
        """SIGHUP: read the config again (keeping the running one if it is wrong), rescan."""
        self.scan_loop.request_reload()

    def request_scan(self) -> None:
        """Ask the scan loop for a full scan now (SIGHUP); returns at once."""
        self.scan_loop.request_scan()

    async def rescan(self) -> None:
        """Scan fully now and publish the result (tests, the periodic resync)."""
        await self.scan_loop.rescan()

    def _wake_scan_loop(self) -> None:
        self.scan_loop.wake()

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        log.info(
            "daemon.started",
            kubelet_dir=str(self.settings.kubelet_dir),
            scanners=[s.name for s in self.scan_loop.runner.scanners],
        )
        await self.cordons.load()  # before the first scan, which they apply to
        async with asyncio.TaskGroup() as group, contextlib.AsyncExitStack() as parts:
            if self.settings.cdi.enabled:
                parts.push_async_callback(self._close_cdi)  # after its task has stopped
                await parts.enter_async_context(running(group, self._run_cdi(), name="cdi-sync"))
            await parts.enter_async_context(
                running(group, self.watcher.run(), name="kubelet-watcher")
            )
            await parts.enter_async_context(self.servers.serving(group))
            await parts.enter_async_context(
                running(group, self.servers.follow(self.scan_loop.advertised), name="servers")
            )
            if self.dra is not None:
                # Before the first scan: the kubelet may prepare claims of the checkpoint
                # (their answers are kept) while the pool is still being published.
                await parts.enter_async_context(running(group, self.dra.run(), name="dra"))
                await parts.enter_async_context(
                    running(group, self._follow_dra_registration(), name="dra-registration")
                )
            await self._start_http(parts)
            await parts.enter_async_context(
                running(group, self.holders.run(self.stats), name="pod-resources")
            )
            await parts.enter_async_context(running(group, self.scan_loop.run(), name="scan-loop"))
            if self._freeze_gc:
                await parts.enter_async_context(
                    running(group, self._settle_collector(), name="gc-settle")
                )
            # After the scan loop it changes (and stopped before it).
            await parts.enter_async_context(running(group, self.control.run(), name="control"))
            parts.callback(self.systemd.close)
            await parts.enter_async_context(
                running(group, self.systemd.watchdog(), name="systemd-watchdog")
            )
            await parts.enter_async_context(
                running(group, self._announce_ready(), name="systemd-ready")
            )
            if self.settings.cdi.enabled:
                # No CDI work once stopping: a spec written now would only be deleted again.
                # (Not a cancel: the task is cancelled once, last, so that a write under way
                # is finished and recorded, and specs on disk stay until it is closed.)
                parts.callback(self._stop_cdi)
            parts.callback(self._stopping)
            await self.stop_requested.wait()
        self._stopped = True
        log.info("daemon.stopped")

    async def _run_cdi(self) -> None:
        """The CDI task, once the first lists are out: specs were never on the kubelet's path
        (Allocate names a device through CDI only once its spec is on disk), so their modules
        and first render wait rather than delay the first list."""
        await self.first_scan_done.wait()
        served = set(self.servers.servers)  # the first scan's, delivered by now
        with contextlib.suppress(TimeoutError):
            await self._lists_out.wait_for(served.issubset, timeout=CDI_START_TIMEOUT_S)
        if self.stop_requested.is_set():
            return  # stopping before the first lists: no spec to write only to delete
        sync = self.cdi_sync
        assert sync is not None
        self._cdi_running.set()
        await sync.run(self.scan_loop.advertised)

    def _stop_cdi(self) -> None:
        if self._cdi_sync is not None:
            self._cdi_sync.stop()

    async def _close_cdi(self) -> None:
        if self._cdi_sync is not None:
            await self._cdi_sync.close()

    def _list_built(self, resource: str) -> None:
        if resource not in self._lists_out.value:
            # Noted on the next turn of the loop: gRPC hands this list to its core first.
            asyncio.get_running_loop().call_soon(self._list_out, resource)

    def _list_out(self, resource: str) -> None:
        self._lists_out.set(self._lists_out.value | {resource})

    def _stopping(self) -> None:
        log.info("daemon.stopping")
        self.systemd.notify("STOPPING=1", "STATUS=stopping")

    async def _start_http(self, parts: contextlib.AsyncExitStack) -> None:
        if self.settings.metrics_address is None:
            return
        host, port = parse_address(self.settings.metrics_address)
        endpoint = StatusEndpoint(host, port, self.metrics.exposition, self.not_ready)
        try:
            await endpoint.start()
        except OSError as exc:
            # Devices matter more than their metrics: serve on without the endpoint.
            log.error(
                "http.unavailable",
                address=self.settings.metrics_address,
                reason=exc.strerror or str(exc),
                fix="choose a free metrics_address, or leave it unset",
            )
            return
        self.http = endpoint
        parts.push_async_callback(endpoint.close)

    def not_ready(self) -> list[str]:
        """What keeps the daemon from being ready (/readyz): empty once the first scan is done
        and every advertised resource is registered with the kubelet. Serving but waiting for
        the kubelet is not ready: the kubelet does not know these devices, and a DaemonSet's
        rollout should stop at a pod in that state (see docs/operations.md)."""
        if not self.first_scan_done.is_set():
            return ["the first scan"]
        waiting = self.servers.unregistered()
        if self.dra is not None and not self.dra.registered():
            waiting.append(f"DRA driver {self.dra.driver}")
        if not waiting:
            return []
        listed = ", ".join(f"{name} (not registered)" for name in waiting)
        return [f"serving, waiting for the kubelet: {listed}"]

    def _status(self) -> str:
        """The STATUS= line systemd shows for what the daemon does now."""
        if not self.first_scan_done.is_set():
            return "STATUS=scanning"
        served = len(self.servers.servers)
        waiting = len(self.servers.unregistered())
        if self.dra is not None:  # its resources are served (and registered) together
            served += len(self.dra.resources)
            waiting += 0 if self.dra.registered() else len(self.dra.resources)
        if not served:
            return "STATUS=no devices found; watching for them"
        if not waiting:
            return f"STATUS=serving {served} resource(s), all registered"
        return f"STATUS=serving {served} resource(s); waiting for the kubelet to register {waiting}"

    def _registered_resources(self) -> set[str]:
        return set(self.servers.servers) - set(self.servers.unregistered())

    def _registration_changed(self) -> None:
        self._registrations.set(self._registrations.value + 1)

    async def _follow_dra_registration(self) -> None:
        assert self.dra is not None
        async for registered in self.dra.registration_changes():
            self.metrics.dra_registered(registered)
            self._registration_changed()

    def _count_cordons(self) -> None:
        """The cordons' numbers, for a scrape."""
        tree = self._stats.value.advertised
        advertised = Counter(
            resource
            for (resource, device_id), _ in self.cordons.items()
            if (info := tree.get(resource, {}).get(device_id)) is not None and info.cordoned
        )
        self.metrics.cordons_counted(
            self.cordons.by_resource(),
            unreadable=self.cordons.unreadable is not None,
            advertised=advertised,
        )

    def _count_dra(self) -> None:
        """The DRA front's numbers, for a scrape."""
        assert self.dra is not None
        slices = self.dra.slices
        self.metrics.dra_counted(
            slices=slices.slices,
            devices=slices.devices,
            writes=slices.writes,
            failures=slices.failures,
            rejected=slices.rejected,
            prepared_claims=len(self.dra.prepared()),
        )

    async def _announce_ready(self) -> None:
        """READY=1 once the first scan is published: devplug serves from then on (its probes
        and metrics; its sockets as soon as a kubelet is there). Not later: the kubelet may
        come much later (a node that joins its cluster after boot), and a unit still starting
        until then would hold up boot and ``systemctl start``. STATUS= then follows every
        change in registration."""
        self.systemd.notify(self._status())
        await self.first_scan_done.wait()
        status = self._status()
        self.systemd.notify("READY=1", status)
        log.info(
            "daemon.ready",
            resources=len(self.servers.servers),
            waiting_for_kubelet=len(self.servers.unregistered()),
        )
        while True:
            await self._registrations.wait_changed(self._registrations.version)
            now = self._status()
            if now != status:
                self.systemd.notify(now)
                status = now

    # ------------------------------------------------------------------ the flow

    async def _delivered(self, version: int) -> None:
        """After the scan loop's publication ``version``: once the servers have it (the
        kubelet waits on them), count what is advertised now."""
        await self.servers.applied.wait_for(lambda applied: applied >= version)
        self._registration_changed()  # resources added or removed
        advertised = self.scan_loop.advertised.value
        if advertised is not None:
            self.metrics.set_devices(advertised.tree)
            self._update_stats(advertised=advertised.tree)

    def _scanned(self, result: ScanResult) -> None:
        kind = "incremental" if result.full == 0 and result.incremental else "full"
        self.metrics.scan_seconds.labels(kind).observe(result.duration_s)
        self.metrics.set_held_back(result.held_back)
        for scanner in result.failed:
            self.metrics.scan_failures.labels(scanner).inc()
        stats = self._stats.value
        self._update_stats(
            full_scans=stats.full_scans + result.full,
            incremental_scans=stats.incremental_scans + result.incremental,
        )

    def _events_taken(self, batch: EventBatch) -> None:
        if not batch:
            return
        self.metrics.udev_events.inc(len(batch.events))
        if batch.overflowed:
            self.metrics.udev_overflows.inc()
        stats = self._stats.value
        self._update_stats(
            udev_events=stats.udev_events + len(batch.events),
            udev_overflows=stats.udev_overflows + batch.overflowed,
        )

    async def _settle_collector(self) -> None:
        """Keep the device tree and what is made from it out of the collector's automatic
        passes (devplug._kits.collector): after every full scan of the loop (the first, the
        resyncs, reloads), once the CDI specs follow the tree advertised and the hotplug path
        is quiet. A full scan makes every device anew; between two, a hotplug event's tree is
        an edit of the last one that shares its unchanged devices, so what is frozen stays
        what is in use."""
        settled = 0
        while True:
            settled = await self.scan_loop.full_rescans.wait_for(_more_than(settled))
            if self.settings.cdi.enabled:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SETTLE_CDI_WAIT_S):
                        await self._cdi_follows()
            await self.scan_loop.quiet()
            done = collector.settle()
            log.debug(
                "daemon.collector.settled",
                ms=round(done.seconds * 1000, 1),
                collected=done.collected,
                frozen=done.frozen,
            )

    async def _cdi_follows(self) -> None:
        """Until a CDI pass has ended on the tree advertised at a quiet moment."""
        await self._cdi_running.wait()  # the CDI task makes its state first
        sync = self._cdi_sync
        assert sync is not None
        while True:
            await self.scan_loop.quiet()
            advertised = self.scan_loop.advertised.value
            passed = sync.passed.value
            if advertised is None or passed is advertised.tree:
                return
            await sync.passed.wait_for(_other_than(passed))

    def _cdi_changed(self) -> None:
        sync = self._cdi_sync
        self._update_stats(
            cdi_specs=frozenset(self.cdi_catalog.resources()),
            cdi_writes=0 if sync is None else sync.writes,
            cdi_failures=0 if sync is None else sync.failures,
        )

    def _update_stats(self, **changes: object) -> None:
        self._stats.set(dataclasses.replace(self._stats.value, **changes))  # type: ignore[arg-type]

    async def _reload(self) -> None:
        """Apply a new config's scanners and hotplug settings; the full scan that follows
        makes resources (and their hooks) follow. Settings a running daemon cannot change are
        reported, not applied."""
        # Whatever the config: a state file that could not be read may have been fixed.
        await self.cordons.reread()
        if self._config_loader is None:
            return
        try:
            settings, scanners = await asyncio.to_thread(self._config_loader)
            if self.dra is not None:
                # The running dra section stays (restart only): its resources must stay made.
                from devplug.dra.front import check_resources

                check_resources(self.dra.resources, scanners)
        except ConfigError as exc:
            self._refused(exc)
            return
        except Exception:
            log.exception("config.reload.failed", kept="the running configuration")
            return
        runner = ScanRunner(scanners, replacing=self.scan_loop.runner)
        try:
            # A trial scan: a config the host cannot be served with (a list too big for the
            # kubelet, say) is refused here, not by stopping the daemon. Exclusive: it shares
            # the list limit, which one scan at a time may use.
            async with self.scan_loop.exclusive():
                await runner.scan()
        except ConfigError as exc:
            self._refused(exc)
            return
        fixed = self.settings.restart_only_changes(settings)
        if fixed:
            log.warning("config.reload.needs_restart", settings=fixed, applied=False)
        self.settings = self.settings.reloaded(settings)
        if not self.stop_budget.begun:
            self.stop_budget.total_s = self.settings.stop_timeout_s
        hotplug = self.settings.hotplug
        self.scan_loop.reconfigure(
            runner,
            hotplug,
            event_subsystems(scanners),
            choose_source(hotplug.source, self._udev_control),
        )
        self._update_stats(reloads=self._stats.value.reloads + 1)
        log.info("config.reloaded", scanners=[s.name for s in scanners], restart_needed=fixed)
        # The full scan that publishes the new scanners' tree. The SIGHUP's own request may
        # have been taken already: a SIGHUP during an earlier reload (refused, say) asks for
        # this reload and for a full scan, which the loop runs right after that earlier reload,
        # with the old scanners; nothing would publish this one's until the resync.
        self.scan_loop.request_scan()

    @staticmethod
    def _refused(exc: ConfigError) -> None:
        log.error(
            "config.reload.refused",
            field=exc.field,
            reason=exc.message,
            kept="the running configuration",
        )


class _CdiIds:
    """The CDI ids DRA's Prepare answers with: what the device-plugin front's Allocate names
    for the same device (its very code path, ``CdiNames``), so only while the spec on disk
    defines the device as advertised now (devplug.dra.claims.CdiIds)."""

    def __init__(self, names: CdiNames, advertised: Watchable[Advertised | None]) -> None:
        self._names = names
        self._advertised = advertised

    def cdi_device_ids(self, resource: str, device_id: str) -> tuple[str, ...]:
        published = self._advertised.value
        info = None if published is None else published.tree.get(resource, {}).get(device_id)
        if info is None:
            return ()
        self._names.confirm(resource)  # never name a spec that is gone
        answer = self._names.extend(resource, [device_id], ContainerAllocation(), {device_id: info})
        return answer.cdi_devices


class _Events:
    """What the servers report: counted by the metrics; the first lists also start the CDI
    task (:meth:`Daemon._run_cdi`)."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon
        self._metrics = daemon.metrics

    def registered(self, resource: str, ok: bool) -> None:
        self._metrics.registered(resource, ok)
        self._daemon._registration_changed()

    def kubelet_restarted(self, resource: str) -> None:
        self._metrics.kubelet_restarted(resource)
        # The server clears its registration in this same step, before STATUS is worked out.
        self._daemon._registration_changed()

    def allocated(self, resource: str, result: str) -> None:
        self._metrics.allocated(resource, result)

    def list_built(self, resource: str, size_bytes: int) -> None:
        self._metrics.list_built(resource, size_bytes)
        self._daemon._list_built(resource)
