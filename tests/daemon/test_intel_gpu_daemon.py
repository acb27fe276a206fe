"""The Intel GPU scanner served end to end: umockdev GPUs -> daemon -> kubelet simulator.

What a pod that used Intel's GPU plugin relies on: the resource names, device nodes and
by-path mounts in Allocate, and GetPreferredAllocation following the configured policy (with
must-include ids, which Intel's plugin ignores). Hotplug events drive health both ways.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import UeventDaemon, health

from devplug.daemon import Daemon
from devplug.model import DeviceNode, Mount
from devplug.scanners.intel_gpu import IntelGpuScanner
from devplug.testing import KubeletSimulator, ListedDevice, SimulatorRpcError
from devplug.testing.umockdev import UmockdevHost, add_drm_minors, add_intel_gpu

I915 = "gpu.intel.com/i915"
XE = "gpu.intel.com/xe"
MONITORING = "gpu.intel.com/monitoring"
IGPU = "0000:00:02.0"
DGPU = "0000:03:00.0"
DGPU2 = "0000:04:00.0"


@pytest.fixture
def daemon_for(uevent_daemon: UeventDaemon) -> Callable[[dict[str, Any]], Awaitable[Daemon]]:
    """Factory: an in-process daemon running the Intel GPU scanner with the given section."""
    return lambda section: uevent_daemon([IntelGpuScanner.from_config(section)])


def three_gpus(host: UmockdevHost) -> dict[str, str]:
    """An integrated i915 GPU without NUMA and two discrete xe cards on NUMA nodes 0 and 1."""
    host.add_dev_dir("dri/by-path")
    return {
        IGPU: add_intel_gpu(host, IGPU, card=0, render=128),
        DGPU: add_intel_gpu(
            host, DGPU, card=1, render=129, driver="xe", device_id="0xe20b", numa_node=0
        ),
        DGPU2: add_intel_gpu(
            host, DGPU2, card=2, render=130, driver="xe", device_id="0xe20b", numa_node=1
        ),
    }


async def test_resources_nodes_and_by_path_mounts_reach_the_kubelet(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    three_gpus(host)
    await daemon_for({"monitoring": True})

    i915 = await kubelet.wait_for_plugin(I915)
    xe = await kubelet.wait_for_plugin(XE)
    monitoring = await kubelet.wait_for_plugin(MONITORING)
    assert (await i915.wait_for_update()) == {IGPU: ListedDevice(IGPU, "Healthy", ())}
    assert (await xe.wait_for_update()) == {
        DGPU: ListedDevice(DGPU, "Healthy", (0,)),
        DGPU2: ListedDevice(DGPU2, "Healthy", (1,)),
    }
    assert set(await monitoring.wait_for_update()) == {"all"}

    (answer,) = await xe.allocate([DGPU2])
    assert answer.nodes == (DeviceNode("/dev/dri/card2"), DeviceNode("/dev/dri/renderD130"))
    assert answer.mounts == (
        Mount(f"/dev/dri/by-path/pci-{DGPU2}-card"),
        Mount(f"/dev/dri/by-path/pci-{DGPU2}-render"),
    )
    assert all(m.read_only for m in answer.mounts)
    assert dict(answer.env) == {}  # Intel's plugin sets none either

    (telemetry,) = await monitoring.allocate(["all"])
    assert {n.host_path for n in telemetry.nodes} == {
        "/dev/dri/card0",
        "/dev/dri/card1",
        "/dev/dri/card2",
        "/dev/dri/renderD128",
        "/dev/dri/renderD129",
        "/dev/dri/renderD130",
    }

    with pytest.raises(SimulatorRpcError) as refused:
        await xe.allocate(["0000:09:00.0"])
    assert refused.value.code == "NOT_FOUND"
    assert len(await xe.allocate([DGPU])) == 1  # and it keeps serving


async def test_preferred_allocation_follows_the_policy_and_must_include(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    three_gpus(host)
    await daemon_for({"shared_dev_num": 3, "allocation_policy": "packed"})
    xe = await kubelet.wait_for_plugin(XE)
    listed = await xe.wait_for_update()
    everything = sorted(listed)
    assert everything == [f"{DGPU}-{i}" for i in range(3)] + [f"{DGPU2}-{i}" for i in range(3)]
    assert (await xe.get_options()).get_preferred_allocation_available

    # Packed fills the first GPU.
    assert await xe.preferred(everything, 2) == [f"{DGPU}-0", f"{DGPU}-1"]
    # A must-include share on the second GPU (NUMA node 1) keeps the rest there.
    assert await xe.preferred(everything, 3, must_include=[f"{DGPU2}-1"]) == [
        f"{DGPU2}-1",
        f"{DGPU2}-0",
        f"{DGPU2}-2",
    ]


async def test_spread_policy_over_grpc_takes_distinct_gpus_first(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    for index in range(3):
        address = f"0000:0{index + 3}:00.0"
        add_intel_gpu(host, address, card=index, render=128 + index, driver="xe")
    await daemon_for({"shared_dev_num": 2, "allocation_policy": "none"})
    xe = await kubelet.wait_for_plugin(XE)
    everything = sorted(await xe.wait_for_update())
    assert await xe.preferred(everything, 3) == [
        "0000:03:00.0-0",
        "0000:04:00.0-0",
        "0000:05:00.0-0",
    ]


async def test_node_loss_and_unbind_events_make_a_gpu_unhealthy_and_back(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    paths = three_gpus(host)
    daemon = await daemon_for({})
    xe = await kubelet.wait_for_plugin(XE)
    await xe.wait_for_update(lambda listed: len(listed) == 2)

    card = f"{paths[DGPU]}/drm/card1"
    host.set_node_present(card, False)
    await host.emit_async("change", card)
    await xe.wait_for_update(lambda listed: health(listed)[DGPU] == "Unhealthy")
    with pytest.raises(SimulatorRpcError) as refused:
        await xe.allocate([DGPU])
    assert "unhealthy" in refused.value.details

    seen = len(xe.updates)
    host.set_node_present(card, True)
    await host.emit_async("change", card)
    await xe.wait_for_update(lambda listed: health(listed)[DGPU] == "Healthy", after=seen)

    seen = len(xe.updates)
    host.set_driver(paths[DGPU2], None)
    await host.emit_async("unbind", paths[DGPU2])
    await xe.wait_for_update(lambda listed: health(listed)[DGPU2] == "Unhealthy", after=seen)
    reason = daemon.servers.servers[XE].devices.value[DGPU2].health_reason
    assert reason == f"no driver is bound to {DGPU2} (was xe)"

    seen = len(xe.updates)
    host.set_driver(paths[DGPU2], "xe")
    await host.emit_async("bind", paths[DGPU2])
    await xe.wait_for_update(lambda listed: health(listed)[DGPU2] == "Healthy", after=seen)
    assert daemon.stats.value.full_scans == 1  # all of it through incremental rescans


async def test_a_renumbered_card_keeps_its_id_and_allocates_its_new_nodes(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    paths = three_gpus(host)
    await daemon_for({})
    xe = await kubelet.wait_for_plugin(XE)
    await xe.wait_for_update(lambda listed: len(listed) == 2)

    # The driver reloads and the card comes back as card7 / renderD135.
    for minor in ("renderD129", "card1"):
        for path in host.remove_device(f"{paths[DGPU]}/drm/{minor}"):
            await host.emit_async("remove", path)
    for path in add_drm_minors(host, paths[DGPU], card=7, render=135, by_path=None):
        await host.emit_async("add", path)

    async with asyncio.timeout(5):
        while True:
            (answer,) = await xe.allocate([DGPU])
            if answer.nodes[0].host_path == "/dev/dri/card7":
                break
            await asyncio.sleep(0.01)
    assert answer.nodes == (DeviceNode("/dev/dri/card7"), DeviceNode("/dev/dri/renderD135"))
    assert set(xe.latest) == {DGPU, DGPU2}


async def test_gpu_specs_are_written_and_allocate_names_them(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any], short_dir: Path
) -> None:
    three_gpus(host)
    daemon = await daemon_for({"shared_dev_num": 2})
    xe = await kubelet.wait_for_plugin(XE)
    await xe.wait_for_update(lambda listed: len(listed) == 4)
    spec_path = short_dir / "cdi" / "gpu.intel.com-xe.json"
    async with asyncio.timeout(5):
        while daemon.cdi_catalog.get(XE) is None:  # noqa: ASYNC110 - no event to await
            await asyncio.sleep(0.01)
    spec = json.loads(spec_path.read_text())
    assert spec["kind"] == XE and spec["cdiVersion"] == "0.5.0"  # ids start with a digit
    assert [d["name"] for d in spec["devices"]] == [
        f"{DGPU}-0",
        f"{DGPU}-1",
        f"{DGPU2}-0",
        f"{DGPU2}-1",
    ]
    edits = spec["devices"][2]["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/dri/card2", "/dev/dri/renderD130"]
    assert [m["containerPath"] for m in edits["mounts"]] == [
        f"/dev/dri/by-path/pci-{DGPU2}-card",
        f"/dev/dri/by-path/pci-{DGPU2}-render",
    ]
    assert all("ro" in m["options"] for m in edits["mounts"])

    (answer,) = await xe.allocate([f"{DGPU2}-0", f"{DGPU2}-1"])
    assert answer.cdi_devices == (f"{XE}={DGPU2}-0", f"{XE}={DGPU2}-1")
    # Device specs stay by default (runtimes without CDI); shares of one GPU give its nodes once.
    assert [n.host_path for n in answer.nodes] == ["/dev/dri/card2", "/dev/dri/renderD130"]
