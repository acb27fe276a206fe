"""Kubelet churn: restart after restart, devplug re-registers and sends a fresh list each time,
and holds no more file descriptors, threads or tasks afterwards than before.

"No more", not "as many": a count may drop between the two readings (a connection of the
warm-up restart that gRPC closes late, a worker thread that idles out), and a drop is no leak.
A leak grows with the restarts, so the churn is long enough that one leaked per restart
shows at once.

CI restarts the kubelet 10 times; DEVPLUG_RELIABILITY_LONG=1 restarts it 100 times.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import KubeletSimulator, StaticScanner, daemon_process, daemon_settings
from devplug.testing.harness import in_process_daemon

RESOURCE = "example.com/mem"
CONFIG = """
hotplug: {source: none, poll_s: 3600, resync_s: 3600}
scanners:
  generic:
    - {resource: example.com/mem, match: {subsystem: mem, devnode: /dev/null}}
"""


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def restart_and_wait(kubelet: KubeletSimulator, device: str) -> None:
    """One kubelet restart, then devplug's new registration and its first list."""
    await kubelet.restart()
    session = await kubelet.wait_for_plugin(RESOURCE, timeout=20)
    await session.wait_for_update(lambda listed: device in listed, timeout=20)


async def settle(measure: Callable[[], int], rounds: int = 20) -> int:
    """The value once it has stopped moving (connections close a moment after a restart)."""
    last = measure()
    for _ in range(rounds):
        await asyncio.sleep(0.05)
        now = measure()
        if now == last:
            return now
        last = now
    return last


async def test_a_daemon_process_keeps_its_fds_and_threads_through_kubelet_restarts(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    scaled: Callable[[int, int], int],
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(CONFIG)
    restarts = scaled(10, 100)
    async with daemon_process(config, kubelet_dir) as process:
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=20)
        await session.wait_for_update(lambda listed: "null" in listed)
        # One restart first: the first one opens what every later one reuses.
        await restart_and_wait(kubelet, "null")
        fds_before = await settle(lambda: fd_count(process.pid))
        threads_before = await settle(lambda: thread_count(process.pid))
        for _ in range(restarts):
            await restart_and_wait(kubelet, "null")
        fds_after = await settle(lambda: fd_count(process.pid))
        threads_after = await settle(lambda: thread_count(process.pid))
        registrations = [r for r in kubelet.registrations if r.resource == RESOURCE and r.accepted]
        assert len(registrations) == restarts + 2  # the first, the warm-up, and one per restart
    assert fds_after <= fds_before and threads_after <= threads_before, (
        f"fds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after} "
        f"over {restarts} kubelet restarts"
    )


async def test_an_in_process_daemon_keeps_its_tasks_through_kubelet_restarts(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    scanner = StaticScanner({RESOURCE: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(RESOURCE)
        await session.wait_for_update()
        await restart_and_wait(kubelet, "dev0")
        tasks_before = await settle(lambda: len(asyncio.all_tasks()))
        for _ in range(scaled(10, 100)):
            await restart_and_wait(kubelet, "dev0")
        tasks_after = await settle(lambda: len(asyncio.all_tasks()))
        server = daemon.servers.servers[RESOURCE]
        assert server.registered.is_set()
    assert tasks_after <= tasks_before, f"tasks {tasks_before} -> {tasks_after}"
