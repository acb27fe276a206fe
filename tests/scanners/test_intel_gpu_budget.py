"""The 4 MiB budget on real scans, SR-IOV devices that are not GPUs, and the monitoring device
kept up to date node by node.

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

from devplug.model import DeviceTree, Health
from devplug.scanners.intel_gpu import (
    MONITORING_ID,
    MONITORING_RESOURCE,
    IntelGpuScanner,
    IntelGpuSettings,
    ListTooLargeError,
)
from devplug.scanners.intel_gpu.monitoring import MonitorNodes
from devplug.scanners.intel_gpu.settings import max_shares_per_gpu
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_pci_device

I915 = "gpu.intel.com/i915"
A, B, C = "0000:03:00.0", "0000:04:00.0", "0000:05:00.0"
SHARES = max_shares_per_gpu(2)


def gpus_in(tree: DeviceTree) -> set[str]:
    return {device_id.rsplit("-", 1)[0] for device_id in tree.get(I915, {})}


def add_events(host: UmockdevHost, pci: str) -> list[UdevEvent]:
    return [
        UdevEvent("add", path, "pci" if path == pci else "drm")
        for path in host.devices
        if path == pci or path.startswith(pci + "/")
    ]


def test_a_gpu_that_would_overflow_waits_while_health_changes_go_through(
    host: UmockdevHost,
) -> None:
    first = add_intel_gpu(host, A, card=0, render=128)
    second = add_intel_gpu(host, B, card=1, render=129)
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))
    tree = scanner.scan(UdevSource())
    assert gpus_in(tree) == {A, B}

    third = add_intel_gpu(host, C, card=2, render=130)
    host.set_node_present(f"{first}/drm/card0", False)
    batch = [*add_events(host, third), UdevEvent("change", f"{first}/drm/card0", "drm")]
    with structlog.testing.capture_logs() as logs:
        rescanned = scanner.rescan(UdevSource(), tree, batch)
    assert rescanned is not None
    assert gpus_in(rescanned) == {A, B}  # the newcomer waits...
    assert rescanned[I915][f"{A}-0"].health is Health.UNHEALTHY  # ...the health change does not
    (held,) = [e for e in logs if e["event"] == "intel_gpu.gpus_held_back"]
    assert held["log_level"] == "error" and held["held_back"] == [C]
    assert held["field"] == "scanners.intel_gpu.shared_dev_num"
    assert "set shared_dev_num to at most" in held["reason"]
    # A full scan (the resync) comes to the same answer rather than failing.
    assert scanner.scan(UdevSource()) == rescanned

    # Room again: the waiting GPU is advertised at its next scan.
    for path in host.remove_device(second):
        assert path.startswith(second)
    host.set_node_present(f"{first}/drm/card0", True)
    assert gpus_in(scanner.scan(UdevSource())) == {A, C}


def test_a_gpu_near_the_limit_can_still_turn_unhealthy(host: UmockdevHost) -> None:
    """Health never decides whether a list fits: each id is counted at its unhealthy size."""
    first = add_intel_gpu(host, A, card=0, render=128, numa_node=0)
    add_intel_gpu(host, B, card=1, render=129, numa_node=0)
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))
    tree = scanner.scan(UdevSource())
    host.set_node_present(f"{first}/drm/card0", False)
    rescanned = scanner.rescan(UdevSource(), tree, [UdevEvent("change", first, "pci")])
    assert rescanned is not None
    assert {info.health for info in rescanned[I915].values()} == {
        Health.HEALTHY,
        Health.UNHEALTHY,
    }
    assert scanner.scan(UdevSource()) == rescanned


def test_a_host_too_big_at_start_up_is_refused(host: UmockdevHost) -> None:
    for index, address in enumerate((A, B, C)):
        add_intel_gpu(host, address, card=index, render=128 + index)
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=SHARES))
    with pytest.raises(ListTooLargeError) as refused:
        scanner.scan(UdevSource())
    assert refused.value.field == "scanners.intel_gpu.shared_dev_num"
    assert f"3 GPUs x {SHARES} ids" in refused.value.message
    assert f"at most {max_shares_per_gpu(3)}" in refused.value.message


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
    assert result.stdout == ""


# ------------------------------------------------------------------------ SR-IOV NICs


def test_sriov_on_an_intel_nic_does_not_force_full_scans(host: UmockdevHost) -> None:
    add_intel_gpu(host, A, card=0, render=128)
    nic = add_pci_device(
        host,
        "0000:18:00.0",
        vendor="0x8086",
        device="0x1592",
        driver="ice",
        cls="0x020000",
        extra_attributes={"sriov_numvfs": "2", "sriov_totalvfs": "64"},
    )
    vf = add_pci_device(
        host,
        "0000:18:01.0",
        vendor="0x8086",
        device="0x1889",
        driver="iavf",
        cls="0x020000",
        extra_links={"physfn": "../0000:18:00.0"},
    )
    scanner = IntelGpuScanner(IntelGpuSettings(monitoring=True))
    tree = scanner.scan(UdevSource())
    batch = [UdevEvent("bind", nic, "pci"), UdevEvent("bind", vf, "pci")]
    rescanned = scanner.rescan(UdevSource(), tree, batch)
    assert rescanned == tree  # answered incrementally (None would mean a full scan)
    # Nothing about the GPUs changed, so the monitoring device is not even re-issued.
    assert rescanned is not None
    assert rescanned[MONITORING_RESOURCE][MONITORING_ID] is tree[MONITORING_RESOURCE][MONITORING_ID]


def test_a_gpu_vf_still_asks_for_a_full_scan(host: UmockdevHost) -> None:
    add_intel_gpu(host, A, card=0, render=128)
    scanner = IntelGpuScanner()
    tree = scanner.scan(UdevSource())
    # VFs appear: their PCI function first, before any drm minor exists.
    vf = add_pci_device(
        host,
        "0000:03:00.1",
        vendor="0x8086",
        device="0x56c0",
        driver="i915",
        extra_links={"physfn": f"../{A}"},
    )
    assert scanner.rescan(UdevSource(), tree, [UdevEvent("add", vf, "pci")]) is None


# ------------------------------------------------------------------- monitoring nodes


def test_monitor_nodes_count_and_keep_natural_order() -> None:
    nodes = MonitorNodes(["/dev/dri/card10", "/dev/dri/card2", "/dev/dri/renderD128"])
    nodes.add("/dev/dri/card2")  # a second holder
    nodes.add("/dev/dri/card1")
    paths = [n.host_path for n in nodes.device().nodes]
    assert paths == ["/dev/dri/card1", "/dev/dri/card2", "/dev/dri/card10", "/dev/dri/renderD128"]
    nodes.discard("/dev/dri/card2")
    assert "/dev/dri/card2" in [n.host_path for n in nodes.device().nodes]  # still held once
    nodes.discard("/dev/dri/card2")
    nodes.discard("/dev/dri/card99")  # never added: no error
    assert [n.host_path for n in nodes.device().nodes] == [
        "/dev/dri/card1",
        "/dev/dri/card10",
        "/dev/dri/renderD128",
    ]
    # The node objects are made once and reused (no re-validation per event).
    assert nodes.device().nodes[0] is nodes.device().nodes[0]


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
