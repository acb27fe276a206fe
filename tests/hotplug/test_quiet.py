"""ScanLoop.quiet: what CDI work waits for, so that it never delays a hotplug list."""

from __future__ import annotations

import asyncio

from devplug.config import HotplugSettings
from devplug.hotplug.health import HealthGate
from devplug.hotplug.listener import UeventListener
from devplug.hotplug.loop import ScanLoop
from devplug.hotplug.scanning import ScanRunner
from devplug.model import DeviceInfo, DeviceNode
from devplug.testing.harness import StaticScanner

RESOURCE = "example.com/serial"


class HeldDelivery:
    """A delivery that holds each publication until the test lets it go."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.count = 0

    async def __call__(self, version: int) -> None:
        self.count += 1
        self.entered.set()
        await self.release.wait()
        self.release.clear()
        self.entered.clear()


def quiet_now(loop: ScanLoop) -> bool:
    return loop._quiet.is_set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_quiet_only_while_the_loop_waits_with_nothing_pending() -> None:
    scanner = StaticScanner({RESOURCE: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/tty0"),))}})
    publish = HeldDelivery()
    scan_loop = ScanLoop(
        ScanRunner([scanner]),
        UeventListener(None, None, lambda: None),
        HealthGate(0),
        HotplugSettings(source="none", poll_s=3600, resync_s=3600),
        delivered=publish,
    )
    assert not quiet_now(scan_loop)  # not running yet: its first scan is still to come
    task = asyncio.create_task(scan_loop.run())
    try:
        waiter = asyncio.create_task(scan_loop.quiet())
        async with asyncio.timeout(5):
            await publish.entered.wait()
        await settle()
        assert not waiter.done()  # the first tree is being published
        publish.release.set()
        async with asyncio.timeout(5):
            await waiter  # parked now

        # A wake-up (a uevent's read) ends the quiet at once, before the loop even runs.
        scan_loop.wake()
        assert not quiet_now(scan_loop)
        waiter = asyncio.create_task(scan_loop.quiet())
        async with asyncio.timeout(5):
            await publish.entered.wait()
        await settle()
        assert not waiter.done()  # published, not yet returned from the publication
        publish.release.set()
        async with asyncio.timeout(5):
            await waiter

        # A scan asked for from outside the loop (daemon.rescan) is not quiet either.
        rescan = asyncio.create_task(scan_loop.rescan())
        async with asyncio.timeout(5):
            await publish.entered.wait()
        assert not quiet_now(scan_loop)
        publish.release.set()
        await rescan
        assert quiet_now(scan_loop)
        assert publish.count == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # A loop that stopped keeps nobody waiting.
    async with asyncio.timeout(5):
        await scan_loop.quiet()
