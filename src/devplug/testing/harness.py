"""Running the daemon inside a test, and a scanner whose devices the test sets.

:func:`in_process_daemon` starts the real daemon (watcher, servers, scan loop) on the test's
event loop with short back-off timings, and stops it on exit, so a test can drive it through
a :class:`~devplug.testing.simulator.KubeletSimulator`; it yields the daemon itself, for
devplug's own tests, which look at its parts. Plugin authors use
:func:`devplug.testing.running_daemon`, which yields a small handle on it.
``daemon_process`` runs ``devplug run`` as a child process instead, for tests of the command
itself (signals, logs, exit status).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel

from devplug.config import CdiSettings, HotplugSettings, Settings
from devplug.daemon import ConfigLoader, Daemon
from devplug.hotplug.listener import MonitorOpener
from devplug.kubelet.server import ServerTiming
from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevMonitor, UdevSource
from devplug.testing.daemon_log import recording

# Short waits so tests finish quickly; the logic is the same as on a node.
FAST_TIMING = ServerTiming(
    register_timeout_s=5.0,
    backoff_initial_s=0.01,
    backoff_max_s=0.2,
    stat_backstop_s=0.5,
    drain_timeout_s=1.0,
    in_use_probe_s=0.5,
    hook_timeout_s=5.0,
    start_retry_initial_s=0.01,
    start_retry_max_s=0.2,
)


# A test fixture's factory: start(settings, scanners, **in_process_daemon's options) ->
# Daemon, each daemon stopped when the test ends.
DaemonStarter = Callable[..., Awaitable[Daemon]]


class StaticScanner:
    """A scanner that reports whatever devices the test last gave it (no hardware involved).

    Subclass it to test hooks (Allocator, PreferredAllocator, ...) without a device source.
    """

    name = "static"

    def __init__(self, resources: Mapping[str, Mapping[str, DeviceInfo]] | None = None) -> None:
        self.tree = DeviceTree(resources)

    def set(self, resources: Mapping[str, Mapping[str, DeviceInfo]]) -> None:
        self.tree = DeviceTree(resources)

    def scan(self, source: UdevSource) -> DeviceTree:
        return self.tree


def daemon_settings(
    kubelet_dir: Path, cdi_dir: Path | None = None, **overrides: object
) -> Settings:
    """Settings for an in-test daemon: no udev events and no periodic rescans unless the test
    asks for them. ``overrides`` are settings keys, as in the config file; a mapping given
    for a section changes only the keys it names (``hotplug={"source": "kernel"}``: uevents,
    still no periodic rescans)."""
    values: dict[str, object] = {
        "kubelet_dir": kubelet_dir,
        "cdi": CdiSettings(dir=cdi_dir or kubelet_dir.parent / "cdi"),
        "hotplug": HotplugSettings(source="none", poll_s=3600, resync_s=3600),
    }
    for key, value in overrides.items():
        section = values.get(key)
        if isinstance(section, BaseModel) and isinstance(value, Mapping):
            value = {**section.model_dump(exclude_unset=True), **value}
        values[key] = value
    return Settings.model_validate(values)


@contextlib.asynccontextmanager
async def in_process_daemon(
    settings: Settings,
    scanners: Sequence[Scanner],
    *,
    timing: ServerTiming = FAST_TIMING,
    monitor_opener: MonitorOpener = UdevMonitor,
    config_loader: ConfigLoader | None = None,
) -> AsyncIterator[Daemon]:
    """Start the daemon, wait for its first scan, yield it; stop it (and check it stopped) after.

    While it runs, its last warnings and errors are kept: a wait of the kubelet simulator (or
    ``eventually``) that times out quotes them.

    ``timing`` sets the servers' waits and back-off; ``monitor_opener`` replaces how the udev
    monitor is opened (to test its failures); ``config_loader`` is what a reload
    (``daemon.request_reload()``, SIGHUP) reads.
    """
    daemon = Daemon(
        settings, scanners, timing, monitor_opener=monitor_opener, config_loader=config_loader
    )
    with recording():  # what it logs as a problem, for the simulator's waits to quote
        task = asyncio.create_task(daemon.run(), name="devplug-daemon")
        first = asyncio.create_task(daemon.first_scan_done.wait())
        try:
            done, _ = await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # the daemon failed during start-up: raise its error here
            yield daemon
        finally:
            first.cancel()
            daemon.request_stop()
            await task


@contextlib.asynccontextmanager
async def daemon_process(
    config: Path,
    kubelet_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    output: int | Path | None = asyncio.subprocess.PIPE,
    module: str = "devplug",
    python: str | None = None,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``devplug run`` as a child process (JSON logs on stderr), stopped with SIGTERM on exit.

    ``env`` is added to this process's environment: pass ``UmockdevHost.env()`` to let the
    daemon see mock hardware. ``output`` is where stdout and stderr go: PIPE to read them, or
    a file's path to append them to (no pipe for the test to drain; read the file after).
    ``module``: run as ``python -m <module> run ...`` (an entry point wrapping devplug's).
    ``python``: the interpreter (default this one; another venv's, to time an install).
    """
    if isinstance(output, Path):
        with output.open("ab") as log:
            async with daemon_process(
                config,
                kubelet_dir,
                *args,
                env=env,
                output=log.fileno(),
                module=module,
                python=python,
            ) as process:
                yield process
        return
    process = await asyncio.create_subprocess_exec(
        python or sys.executable,
        "-m",
        module,
        "run",
        "--config",
        str(config),
        "--kubelet-dir",
        str(kubelet_dir),
        # Beside the plugin dir, never the host's /var/run/cdi, unless args say otherwise.
        "--cdi-dir",
        str(kubelet_dir.parent / "cdi"),
        "--log-format",
        "json",
        *args,
        stdout=output,
        stderr=output,
        env={**os.environ, **(env or {})},
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await process.communicate()
            except TimeoutError:
                process.kill()
                await process.wait()
