"""The real daemon on a test's event loop, as a plugin author's test sees it.

:func:`running_daemon` runs devplug's daemon (its udev listener, scan loop, one gRPC server
per resource, CDI specs) inside the test, with short back-off timings, and yields a
:class:`RunningDaemon`: what the daemon has done so far, and what a test may ask of it. The
daemon's parts stay devplug's own (its own tests reach them through
:func:`devplug.testing.harness.in_process_daemon`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devplug._kits.values import Watchable
from devplug.config import Settings
from devplug.daemon import ConfigLoader, Daemon, DaemonStats
from devplug.model import DeviceTree
from devplug.scanners.base import Scanner
from devplug.testing.harness import in_process_daemon


@dataclass(frozen=True, slots=True)
class RunningDaemon:
    """A daemon that :func:`running_daemon` runs."""

    _daemon: Daemon = field(repr=False)

    @property
    def stats(self) -> Watchable[DaemonStats]:
        """What the daemon has done so far (scans, reloads, uevents, CDI specs written), a new
        value on every change: ``await stats.wait_for(predicate, timeout)`` for a condition,
        ``stats.value`` for the latest."""
        return self._daemon.stats

    @property
    def advertised(self) -> DeviceTree:
        """The tree the kubelet is offered now (after the health hold-down and the kubelet's
        list limit)."""
        return self._daemon.stats.value.advertised

    @property
    def kubelet_dir(self) -> Path:
        """The device plugin dir the daemon registers in and puts its sockets."""
        return self._daemon.settings.kubelet_dir

    def socket_path(self, resource: str) -> Path | None:
        """The unix socket ``resource`` is served on; None while it is not served."""
        server = self._daemon.servers.servers.get(resource)
        return None if server is None else server.socket_path

    @property
    def metrics_port(self) -> int | None:
        """The port of the metrics and probes endpoint (``metrics_address``; port 0 picks a
        free one); None when the settings name none."""
        return None if self._daemon.http is None else self._daemon.http.port

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of the daemon's metrics, as a scrape would read it
        (``metric("devplug_devices_held_back", resource="example.com/serial")``); None when
        there is no such sample."""
        return self._daemon.metrics.registry.get_sample_value(name, labels)

    async def rescan(self) -> None:
        """Scan fully now; returns once the result is published."""
        await self._daemon.rescan()

    def request_scan(self) -> None:
        """Ask for a full scan and return at once (``stats`` counts it when it is done)."""
        self._daemon.request_scan()

    def request_reload(self) -> None:
        """What SIGHUP does: call ``config_loader`` again and apply its result (a refused one
        keeps the running config), then scan; returns at once."""
        self._daemon.request_reload()

    def request_stop(self) -> None:
        """Stop the daemon in order, as SIGTERM does; :func:`running_daemon` waits for it on
        exit."""
        self._daemon.request_stop()


@contextlib.asynccontextmanager
async def running_daemon(
    settings: Settings,
    scanners: Sequence[Scanner],
    *,
    config_loader: ConfigLoader | None = None,
) -> AsyncIterator[RunningDaemon]:
    """Start the daemon with ``settings`` (:func:`~devplug.testing.daemon_settings`) and
    ``scanners``, wait for its first scan, and yield it; stop it on exit and check that it
    stopped in order (an error it ended with is raised here).

    While it runs, its last warnings and errors are kept: a wait of the kubelet simulator (or
    :func:`~devplug.testing.eventually`) that times out quotes them. ``config_loader``
    returns ``(settings, scanners)`` for a reload (:meth:`RunningDaemon.request_reload`);
    without it a reload only rescans.
    """
    async with in_process_daemon(settings, scanners, config_loader=config_loader) as daemon:
        yield RunningDaemon(daemon)
