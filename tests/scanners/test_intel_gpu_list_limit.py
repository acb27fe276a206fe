"""Intel GPUs and the kubelet's 4 MiB ListAndWatch limit: a host too big for ``shared_dev_num``
is refused at the first scan (a configuration error, exit status 2); after that the daemon's
list limit, the one every scanner has, holds back whole GPUs (a GPU's shares share one
DeviceInfo) with its own log events and metric.

Sizes: with ``shared_dev_num = max_shares_per_gpu(2)`` two GPUs surely fit the kubelet's limit
(the bound assumes the longest address and a NUMA node) and three do not (real ids without
NUMA cost about 85 % of that bound each, so three make about 2.5 halves).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from devplug.config import CdiSettings
from devplug.errors import ConfigError
from devplug.hotplug.scanning import ScanRunner
from devplug.model import DeviceTree, Health
from devplug.scanners.intel_gpu import IntelGpuScanner, IntelGpuSettings, ListTooLargeError
from devplug.scanners.intel_gpu.settings import max_shares_per_gpu
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.simulator import SimulatorRpcError
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu

I915 = "gpu.intel.com/i915"
A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"
SHARES = max_shares_per_gpu(2)


def gpus_in(tree: DeviceTree) -> set[str]:
    return {device_id.rsplit("-", 1)[0] for device_id in tree.get(I915, {})}


def shares_of(gpu: str) -> tuple[str, ...]:
    return tuple(f"{gpu}-{share}" for share in range(SHARES))


def add_events(host: UmockdevHost, pci: str) -> list[UdevEvent]:
    return [
        UdevEvent("add", path, "pci" if path == pci else "drm")
        for path in host.devices
        if path == pci or path.startswith(pci + "/")
    ]


def runner() -> ScanRunner:
    """The Intel scanner behind the daemon's scan runner, list limit included."""
    return ScanRunner([IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))])


def events_named(
    logs: list[structlog.typing.EventDict], event: str
) -> list[structlog.typing.EventDict]:
    return [e for e in logs if e["event"] == event]


def test_a_gpu_that_would_overflow_waits_whole_while_health_changes_go_through(
    host: UmockdevHost,
) -> None:
    first = add_intel_gpu(host, A, card=0, render=128)
    second = add_intel_gpu(host, B, card=1, render=129)
    scans = runner()
    with structlog.testing.capture_logs() as logs:
        tree = scans.scan_blocking().tree
    assert gpus_in(tree) == {A, B}
    # Two GPUs at this shared_dev_num come near the limit: the shared warning, once.
    (near,) = events_named(logs, "list_limit.near")
    assert near["resource"] == I915 and near["log_level"] == "warning"

    third = add_intel_gpu(host, C, card=2, render=130)
    host.set_node_present(f"{first}/drm/card0", False)
    batch = [*add_events(host, third), UdevEvent("change", f"{first}/drm/card0", "drm")]
    with structlog.testing.capture_logs() as logs:
        rescanned = scans.scan_blocking(events=batch)
    assert rescanned.incremental == 1
    assert gpus_in(rescanned.tree) == {A, B}  # the newcomer waits, all its shares...
    assert rescanned.held_back == {I915: shares_of(C)}
    assert rescanned.tree[I915][f"{A}-0"].health is Health.UNHEALTHY  # ...the health change not
    assert len(rescanned.tree[I915]) == 2 * SHARES
    (held,) = events_named(logs, "list_limit.devices_held_back")
    assert held["log_level"] == "error" and held["resource"] == I915
    assert held["held_back"] == [f"{C}-0"] and held["count"] == SHARES and held["units"] == 1
    assert "shared_dev_num" in str(held["fix"])
    # One guard, the daemon's: the scanner logs no events of its own about the limit.
    assert [e["event"] for e in logs if str(e["event"]).startswith("intel_gpu.")] == []
    # A full scan (the resync) comes to the same answer rather than failing.
    again = scans.scan_blocking()
    assert again.tree == rescanned.tree and again.held_back == rescanned.held_back

    # Room again: the waiting GPU is advertised at its next scan.
    for path in host.remove_device(second):
        assert path.startswith(second)
    host.set_node_present(f"{first}/drm/card0", True)
    with structlog.testing.capture_logs() as logs:
        room = scans.scan_blocking()
    assert gpus_in(room.tree) == {A, C} and room.held_back == {}
    assert len(events_named(logs, "list_limit.all_advertised")) == 1


def test_a_gpu_near_the_limit_can_still_turn_unhealthy(host: UmockdevHost) -> None:
    """Health never decides whether a list fits: each id is counted at its unhealthy size."""
    first = add_intel_gpu(host, A, card=0, render=128, numa_node=0)
    add_intel_gpu(host, B, card=1, render=129, numa_node=0)
    scans = runner()
    scans.scan_blocking()
    host.set_node_present(f"{first}/drm/card0", False)
    rescanned = scans.scan_blocking(events=[UdevEvent("change", first, "pci")])
    assert rescanned.incremental == 1 and rescanned.held_back == {}
    assert {info.health for info in rescanned.tree[I915].values()} == {
        Health.HEALTHY,
        Health.UNHEALTHY,
    }
    assert scans.scan_blocking().tree == rescanned.tree


def test_a_host_too_big_at_start_up_is_refused(host: UmockdevHost) -> None:
    for index, address in enumerate((A, B, C)):
        add_intel_gpu(host, address, card=index, render=128 + index)
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))
    with pytest.raises(ListTooLargeError) as refused:
        scanner.scan(UdevSource())
    assert refused.value.field == "scanners.intel_gpu.shared_dev_num"
    assert f"3 GPUs x {SHARES} ids" in refused.value.message
    assert f"at most {max_shares_per_gpu(3)}" in refused.value.message
    # The scan runner passes a first scan's configuration error on, as the refusal it is.
    with pytest.raises(ConfigError):
        runner().scan_blocking()


def test_devplug_scan_exits_with_the_configuration_error(
    host: UmockdevHost, short_dir: Path
) -> None:
    for index, address in enumerate((A, B, C)):
        add_intel_gpu(host, address, card=index, render=128 + index)
    config = short_dir / "config.yaml"
    config.write_text(f"scanners:\n  intel_gpu: {{shared_dev_num: {SHARES}}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "devplug", "scan", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "devplug: configuration error: scanners.intel_gpu.shared_dev_num:" in result.stderr
    assert f"set shared_dev_num to at most {max_shares_per_gpu(3)}" in result.stderr
    assert result.stdout == ""


def test_devplug_run_refuses_to_start_with_the_configuration_error(
    host: UmockdevHost, short_dir: Path, kubelet_dir: Path
) -> None:
    for index, address in enumerate((A, B, C)):
        add_intel_gpu(host, address, card=index, render=128 + index)
    config = short_dir / "config.yaml"
    config.write_text(
        f"hotplug: {{source: none}}\nscanners:\n  intel_gpu: {{shared_dev_num: {SHARES}}}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "devplug",
            "run",
            "--config",
            str(config),
            "--kubelet-dir",
            str(kubelet_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "devplug: configuration error: scanners.intel_gpu.shared_dev_num:" in result.stderr
    assert list(kubelet_dir.iterdir()) == []  # nothing served, no socket left behind


async def test_a_gpu_that_arrives_later_is_held_back_whole_by_the_daemon(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """End to end: the daemon's list limit, not the scanner, holds the third GPU back, so the
    kubelet keeps reading the list, the metric counts its shares, and none of them is served."""
    add_intel_gpu(host, A, card=0, render=128)
    add_intel_gpu(host, B, card=1, render=129)
    # CDI off: specs of 100,000+ devices would only slow the test down.
    settings = daemon_settings(kubelet_dir, cdi=CdiSettings(enabled=False))
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))
    async with running_daemon(settings, [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(I915)
        await session.wait_for_update(lambda listed: len(listed) == 2 * SHARES, timeout=60)
        add_intel_gpu(host, C, card=2, render=130)
        await daemon.rescan()
        assert daemon.metric("devplug_devices_held_back", resource=I915) == float(SHARES)
        listed = session.latest
        assert not session.stream_ended.is_set()
        assert {device_id.rsplit("-", 1)[0] for device_id in listed} == {A, B}
        assert len(listed) == 2 * SHARES
        with pytest.raises(SimulatorRpcError) as refused:
            await session.allocate([f"{C}-0"])
        assert refused.value.code == "NOT_FOUND"
