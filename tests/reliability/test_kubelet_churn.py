"""Kubelet churn: restart after restart, devplug re-registers and sends a fresh list each time,
and its file descriptors, threads and tasks do not grow with the restarts.

A leak grows with the number of restarts; what a moment holds does not: a connection of
the last restart that gRPC closes late, a worker thread that idles out, grpc-core's thread
pool growing under load. So each count is read as its lowest over half a second (what
outlasts the moment), after a first round of restarts that lets the pools reach their size,
and the growth over a second round must stay below half its restarts: one fd or thread
leaked per restart breaks it, a few held for a moment do not.

CI restarts the kubelet 2 x 20 times; DEVPLUG_RELIABILITY_LONG=1 2 x 100 times.
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


async def lowest(measure: Callable[[], int], readings: int = 10) -> int:
    """The lowest of ``readings`` taken 50 ms apart: what the process holds for good, not
    what it holds for a moment."""
    least = measure()
    for _ in range(readings - 1):
        await asyncio.sleep(0.05)
        least = min(least, measure())
    return least


def grown_with(before: int, after: int, restarts: int) -> bool:
    """Whether a count grew with the restarts: by half of them or more (a leak of one per
    restart grows it by all of them)."""
    return after - before >= restarts / 2


async def test_a_daemon_process_keeps_its_fds_and_threads_through_kubelet_restarts(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    scaled: Callable[[int, int], int],
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(CONFIG)
    restarts = scaled(20, 100)
    async with daemon_process(config, kubelet_dir) as process:
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=20)
        await session.wait_for_update(lambda listed: "null" in listed)
        # The first round opens what every later one reuses, and grows the pools to size.
        for _ in range(restarts):
            await restart_and_wait(kubelet, "null")
        fds_before = await lowest(lambda: fd_count(process.pid))
        threads_before = await lowest(lambda: thread_count(process.pid))
        for _ in range(restarts):
            await restart_and_wait(kubelet, "null")
        fds_after = await lowest(lambda: fd_count(process.pid))
        threads_after = await lowest(lambda: thread_count(process.pid))
        registrations = [r for r in kubelet.registrations if r.resource == RESOURCE and r.accepted]
        assert len(registrations) == 2 * restarts + 1  # the first, and one per restart
    growth = (
        f"fds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after} "
        f"over {restarts} kubelet restarts"
    )
    assert not grown_with(fds_before, fds_after, restarts), growth
    assert not grown_with(threads_before, threads_after, restarts), growth


async def test_an_in_process_daemon_keeps_its_tasks_through_kubelet_restarts(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    scanner = StaticScanner({RESOURCE: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})
    restarts = scaled(20, 100)
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(RESOURCE)
        await session.wait_for_update()
        for _ in range(restarts):
            await restart_and_wait(kubelet, "dev0")
        tasks_before = await lowest(lambda: len(asyncio.all_tasks()))
        for _ in range(restarts):
            await restart_and_wait(kubelet, "dev0")
        tasks_after = await lowest(lambda: len(asyncio.all_tasks()))
        server = daemon.servers.servers[RESOURCE]
        assert server.registered.is_set()
    assert not grown_with(tasks_before, tasks_after, restarts), (
        f"tasks {tasks_before} -> {tasks_after} over {restarts} kubelet restarts"
    )
