"""A reload never drops devices, keeps health hold-down, and applies new hooks (issue 15,
item 4).

The daemon runs in-process with a config loader standing in for the file SIGHUP re-reads
(``tests/daemon/test_reload.py`` covers the signal itself); the kubelet simulator records
every list it is sent, so a list that withdrew devices even once is seen.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from devplug.config import HotplugSettings
from devplug.daemon import DaemonStats
from devplug.kubelet.server import socket_path_for
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health
from devplug.scanners.generic import GenericScanner
from devplug.scanners.intel_gpu import IntelGpuScanner
from devplug.scanners.intel_gpu.settings import IntelGpuSettings
from devplug.scanners.udev import UdevSource
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner
from devplug.testing.simulator import ListedDevice
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial

RESOURCE = "example.com/flaky"
SERIAL = "example.com/serial"
I915 = "gpu.intel.com/i915"
WAIT_S = 30.0


class Flaky(StaticScanner):
    """Three devices, or an error such as a scan out of file descriptors meets."""

    name = "flaky"

    def __init__(self, failing: bool = False) -> None:
        node = (DeviceNode("/dev/null"),)
        super().__init__({RESOURCE: {f"dev{i}": DeviceInfo(nodes=node) for i in range(3)}})
        self.failing = failing

    def scan(self, source: UdevSource) -> DeviceTree:
        if self.failing:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.tree


def reloaded_more_than(count: int) -> Callable[[DaemonStats], bool]:
    return lambda stats: stats.reloads > count


async def test_a_reload_while_a_scanner_fails_keeps_its_devices(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    """SIGHUP while the scanner fails: the reloaded config's scanner (failing too) has no
    result of its own yet. Its devices used to be withdrawn (the kubelet saw [3, 3, 0], the
    socket removed); now the last result of the scanner it replaces stands in."""
    settings = daemon_settings(kubelet_dir)
    running = Flaky()
    loader = lambda: (settings, [Flaky(failing=True)])  # noqa: E731 - one answer
    rounds = scaled(2, 50)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(settings, [running], config_loader=loader) as daemon:
            session = await kubelet.wait_for_plugin(RESOURCE)
            await session.wait_for_update(lambda listed: len(listed) == 3)
            running.failing = True
            for round_ in range(rounds):
                daemon.request_reload()
                await daemon.stats.wait_for(reloaded_more_than(round_), timeout=WAIT_S)
                await daemon.rescan()
                assert socket_path_for(kubelet_dir, RESOURCE).exists()
            # Never withdrawn (after a few failures in a row they are reported Unhealthy).
            assert all(len(listed) == 3 for listed in session.updates)
            assert len(daemon.stats.value.advertised[RESOURCE]) == 3
    assert [e["event"] for e in logs if e["event"] == "scan.failed"], "the failures are logged"


def health(listed: Mapping[str, ListedDevice], device_id: str) -> str | None:
    device = listed.get(device_id)
    return None if device is None else device.health


async def test_a_reload_keeps_a_device_held_down(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """A device whose node went missing is Unhealthy; a reload happens; the node comes back.
    The reloaded scanner used to drop the device (it had never advertised it), so the gate
    forgot it and it came back Healthy at once. Now it stays advertised Unhealthy through the
    reload and is held down after it recovers, as without a reload."""
    entry: dict[str, Any] = {"resource": SERIAL, "match": {"subsystem": "tty"}}
    tty = [add_usb_serial(host, index=index) for index in range(2)]
    hotplug = HotplugSettings(source="none", poll_s=3600, resync_s=3600, health_hold_down_s=3600)
    settings = daemon_settings(kubelet_dir, hotplug=hotplug)
    loader = lambda: (settings, [GenericScanner.from_config([entry])])  # noqa: E731
    scanner = GenericScanner.from_config([entry])
    async with running_daemon(settings, [scanner], config_loader=loader) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0", "ttyUSB1"})
        host.set_node_present(tty[1], False)
        await daemon.rescan()
        await session.wait_for_update(lambda listed: health(listed, "ttyUSB1") == "Unhealthy")
        daemon.request_reload()
        await daemon.stats.wait_for(lambda s: s.reloads == 1, timeout=WAIT_S)
        await daemon.rescan()
        assert daemon.stats.value.advertised[SERIAL]["ttyUSB1"].health is Health.UNHEALTHY
        host.set_node_present(tty[1], True)
        await daemon.rescan()
        advertised = daemon.stats.value.advertised[SERIAL]
        assert advertised["ttyUSB1"].health is Health.UNHEALTHY, "held down (the hold-down time)"
        assert "held down" in advertised["ttyUSB1"].health_reason
        assert all(health(listed, "ttyUSB1") == "Unhealthy" for listed in session.updates[1:])


def intel(policy: str) -> IntelGpuScanner:
    raw = {"shared_dev_num": 2, "allocation_policy": policy}
    return IntelGpuScanner(IntelGpuSettings.from_raw(raw, "scanners.intel_gpu"))


async def test_a_reloaded_intel_allocation_policy_takes_effect(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """Two GPUs with two shares each; a reload switches ``allocation_policy`` from ``packed``
    (both shares of one GPU) to ``none`` (one share of each GPU), and GetPreferredAllocation
    answers by the new policy (it used to keep the old scanner's hooks)."""
    for index in range(2):
        add_intel_gpu(host, f"0000:{index + 3:02x}:00.0", card=index, render=128 + index)
    settings = daemon_settings(kubelet_dir)
    loader = lambda: (settings, [intel("none")])  # noqa: E731 - one answer
    async with running_daemon(settings, [intel("packed")], config_loader=loader) as daemon:
        session = await kubelet.wait_for_plugin(I915)
        listed = await session.wait_for_update(lambda listed: len(listed) == 4)
        devices = daemon.stats.value.advertised[I915]

        def gpus(ids: list[str]) -> int:
            return len({devices[i].sources[0] for i in ids})

        available = sorted(listed)
        assert gpus(await session.preferred(available, 2)) == 1
        daemon.request_reload()
        await daemon.stats.wait_for(lambda s: s.reloads == 1, timeout=WAIT_S)
        await daemon.rescan()
        assert gpus(await session.preferred(available, 2)) == 2
