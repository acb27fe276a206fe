"""``devplug scan --scanner intel-gpu``: the dry run an operator runs first on a GPU node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from devplug.testing.umockdev import (
    UmockdevHost,
    add_drm_minors,
    add_intel_gpu,
    add_intel_sriov_gpu,
    add_pci_device,
)


def devplug(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def gpu_node(host: UmockdevHost) -> None:
    """An iGPU, an SR-IOV card with two VFs on NUMA node 1, and a non-Intel card."""
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    add_intel_sriov_gpu(host, "0000:03:00.0", card=1, render=129, vfs=2, driver="xe", numa_node=1)
    other = add_pci_device(host, "0000:05:00.0", vendor="0x1002", device="0x73bf", driver="amdgpu")
    add_drm_minors(host, other, card=9, render=137)


def test_scan_table_shows_resource_id_numa_and_nodes_per_gpu(host: UmockdevHost) -> None:
    gpu_node(host)
    result = devplug("scan", "--scanner", "intel-gpu")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE", "NODES"]
    assert rows[1:] == [
        [
            "gpu.intel.com/i915",
            "0000:00:02.0",
            "Healthy",
            "-",
            "/dev/dri/card0",
            "/dev/dri/renderD128",
        ],
        [
            "gpu.intel.com/xe",
            "0000:03:00.1",
            "Healthy",
            "1",
            "/dev/dri/card2",
            "/dev/dri/renderD130",
        ],
        [
            "gpu.intel.com/xe",
            "0000:03:00.2",
            "Healthy",
            "1",
            "/dev/dri/card3",
            "/dev/dri/renderD131",
        ],
    ]


def test_scan_json_with_a_config_section(host: UmockdevHost, short_dir: Path) -> None:
    gpu_node(host)
    config = short_dir / "config.yaml"
    config.write_text(
        "scanners:\n  intel_gpu: {shared_dev_num: 2, bypath: none, monitoring: true}\n"
    )
    result = devplug("scan", "--config", str(config), "--output", "json")
    assert result.returncode == 0, result.stderr
    resources = json.loads(result.stdout)["resources"]
    assert [d["id"] for d in resources["gpu.intel.com/i915"]] == [
        "0000:00:02.0-0",
        "0000:00:02.0-1",
    ]
    assert all(d["mounts"] == [] for d in resources["gpu.intel.com/xe"])
    (monitor,) = resources["gpu.intel.com/monitoring"]
    assert monitor["id"] == "all"
    assert len(monitor["device_nodes"]) == 6  # the PF with VFs is left out, as Intel does


def test_a_bad_section_is_refused_with_the_field_and_the_fix(
    host: UmockdevHost, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    config.write_text("scanners:\n  intel_gpu: {allow_ids: ['0x56c0'], deny_ids: ['0x56a0']}\n")
    result = devplug("scan", "--config", str(config))
    assert result.returncode == 2
    assert "scanners.intel_gpu.deny_ids" in result.stderr
    assert "mutually exclusive" in result.stderr
    assert result.stdout == ""
