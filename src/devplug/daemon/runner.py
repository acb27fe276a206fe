"""The daemon: one asyncio.run, one TaskGroup, orderly shutdown on SIGTERM/SIGINT.

Tasks: the kubelet dir watcher, the scan loop, and one server per resource (started by the
manager). A task that fails unexpectedly brings the TaskGroup down and the daemon exits
non-zero, so a supervisor restarts it; expected trouble (kubelet away, unwritable dirs,
vanished devices) is handled where it happens and never ends the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Sequence

import structlog

from devplug.config import Settings
from devplug.daemon.kubelet import KubeletDirWatcher
from devplug.daemon.manager import Manager
from devplug.daemon.scanning import ScanRunner
from devplug.daemon.server import DEFAULT_TIMING, ServerTiming
from devplug.scanners.base import Scanner

log = structlog.get_logger("devplug.daemon")


class Daemon:
    def __init__(
        self,
        settings: Settings,
        scanners: Sequence[Scanner],
        timing: ServerTiming = DEFAULT_TIMING,
    ) -> None:
        self.settings = settings
        self.scan_runner = ScanRunner(scanners)
        self.watcher = KubeletDirWatcher(settings.kubelet_dir)
        self.timing = timing
        self.stop_requested = asyncio.Event()
        self.manager: Manager | None = None
        self.first_scan_done = asyncio.Event()
        self._scan_lock = asyncio.Lock()
        self._scan_requested = asyncio.Event()

    def request_stop(self) -> None:
        self.stop_requested.set()

    def request_scan(self) -> None:
        """Ask the scan loop to scan now (SIGHUP); returns at once."""
        self._scan_requested.set()

    async def run(self) -> None:
        log.info(
            "daemon.started",
            kubelet_dir=str(self.settings.kubelet_dir),
            scanners=[s.name for s in self.scan_runner.scanners],
        )
        async with asyncio.TaskGroup() as group:
            manager = Manager(self.settings.kubelet_dir, self.watcher, group, self.timing)
            self.manager = manager
            watcher = group.create_task(self.watcher.run(), name="kubelet-watcher")
            scan_loop = group.create_task(self._scan_loop(manager), name="scan-loop")
            await self.stop_requested.wait()
            log.info("daemon.stopping")
            # The scan loop first, so no scan applies a tree while servers shut down.
            scan_loop.cancel()
            await asyncio.wait({scan_loop})
            watcher.cancel()
            await manager.shutdown()
        log.info("daemon.stopped")

    async def rescan(self) -> None:
        """Scan now and apply the result (tests, and the scan loop itself)."""
        if self.manager is None:
            raise RuntimeError("the daemon is not running")
        async with self._scan_lock:
            result = await self.scan_runner.scan()
            await self.manager.apply(result.tree, result.owners)

    async def _scan_loop(self, manager: Manager) -> None:
        interval = self.settings.hotplug.poll_s
        while True:
            self._scan_requested.clear()
            await self.rescan()
            if not self.first_scan_done.is_set():
                self.first_scan_done.set()
                # The first tree and servers are long-lived: keep them out of GC passes.
                gc.freeze()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._scan_requested.wait()


async def run_until_signalled(daemon: Daemon) -> None:
    """Run the daemon; SIGTERM/SIGINT stop it, SIGHUP rescans."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    loop.add_signal_handler(signal.SIGHUP, daemon.request_scan)
    try:
        await daemon.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)
