"""running_daemon's handle and daemon_settings, as a plugin author's test uses them: the real
daemon against the kubelet simulator, through devplug.testing's public names only."""

from __future__ import annotations

import asyncio
import dataclasses
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest

from devplug import DeviceInfo, DeviceNode, Scanner, Settings
from devplug.testing import (
    KubeletSimulator,
    RunningDaemon,
    StaticScanner,
    daemon_settings,
    running_daemon,
)

SERIAL = "example.com/serial"
OTHER = "example.com/other"


def devices(count: int) -> dict[str, DeviceInfo]:
    return {f"dev{i}": DeviceInfo(nodes=(DeviceNode("/dev/null"),)) for i in range(count)}


def test_a_mapping_for_a_section_changes_only_the_keys_it_names(tmp_path: Path) -> None:
    settings = daemon_settings(tmp_path / "kubelet", hotplug={"source": "kernel"})
    assert settings.hotplug.source == "kernel"
    # The test defaults for the keys it did not name: no periodic rescans.
    assert (settings.hotplug.resync_s, settings.hotplug.poll_s) == (3600, 3600)
    assert settings.cdi.dir == tmp_path / "cdi"
    off = daemon_settings(tmp_path / "kubelet", cdi={"enabled": False})
    assert not off.cdi.enabled and off.cdi.dir == tmp_path / "cdi"


async def test_the_handle_answers_what_a_plugin_test_asks(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2)})
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    reloaded = StaticScanner({SERIAL: devices(2), OTHER: devices(1)})

    def loader() -> tuple[Settings, Sequence[Scanner]]:
        return settings, [reloaded]

    async with running_daemon(settings, [scanner], config_loader=loader) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        assert daemon.kubelet_dir == kubelet_dir
        assert set(daemon.advertised[SERIAL]) == {"dev0", "dev1"}
        socket = daemon.socket_path(SERIAL)
        assert socket is not None and socket.parent == kubelet_dir
        assert stat.S_ISSOCK(socket.stat().st_mode)
        assert socket.name in {r.endpoint for r in kubelet.registrations if r.resource == SERIAL}
        assert daemon.socket_path(OTHER) is None
        assert isinstance(daemon.metrics_port, int) and daemon.metrics_port > 0
        assert daemon.metric("devplug_devices", resource=SERIAL, health="Healthy") == 2.0
        assert daemon.metric("devplug_no_such_metric") is None

        scans = daemon.stats.value.full_scans
        scanner.set({SERIAL: devices(3)})
        await daemon.rescan()
        assert daemon.stats.value.full_scans == scans + 1
        assert len(daemon.advertised[SERIAL]) == 3
        daemon.request_scan()
        await daemon.stats.wait_for(lambda s: s.full_scans == scans + 2, timeout=10)

        daemon.request_reload()
        await daemon.stats.wait_for(lambda s: s.reloads == 1, timeout=10)
        await kubelet.wait_for_plugin(OTHER)
        assert daemon.socket_path(OTHER) is not None

        daemon.request_stop()
        await asyncio.wait_for(session.stream_ended.wait(), 10)  # the stop closed the stream


async def test_the_handle_is_small_and_holds_still(kubelet_dir: Path) -> None:
    """What a plugin's test sees of the daemon is the handle's, not the daemon's parts."""
    async with running_daemon(daemon_settings(kubelet_dir), [StaticScanner({})]) as daemon:
        assert isinstance(daemon, RunningDaemon)
        public = {name for name in dir(daemon) if not name.startswith("_")}
        assert public == {
            "advertised",
            "kubelet_dir",
            "metric",
            "metrics_port",
            "request_reload",
            "request_scan",
            "request_stop",
            "rescan",
            "socket_path",
            "stats",
        }
        # Frozen (Python 3.11 reports a frozen slotted dataclass's refusal as a TypeError).
        with pytest.raises((dataclasses.FrozenInstanceError, TypeError)):
            daemon._daemon = None  # type: ignore[misc, assignment]
