"""The VFIO scanner served end to end: umockdev IOMMU groups -> daemon -> kubelet simulator.

What a KubeVirt VM pod relies on: one device per IOMMU group with its NUMA node, Allocate
answering every node of the group and ``PCI_RESOURCE_<RESOURCE>`` with one address per group
(its requested function, groups in address order), so that virt-launcher, which gives the
n-th address to the n-th host device of the resource, gives each host device its own group;
GetPreferredAllocation packing on a NUMA node, bind/unbind events driving health, and the
group's CDI spec.
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
from devplug.model import DeviceNode, Health
from devplug.scanners.vfio import VfioScanner
from devplug.testing import KubeletSimulator, ListedDevice, SimulatorRpcError
from devplug.testing.kubevirt import VirtLauncherError, virt_launcher_assignment
from devplug.testing.umockdev import (
    UmockdevHost,
    add_iommufd,
    add_vfio_container,
    add_vfio_function,
    add_vfio_group,
)

X710 = "intel.com/x710"
VARIABLE = "PCI_RESOURCE_INTEL_COM_X710"
SECTION = {"devices": [{"selector": "8086:1572", "resource": X710}]}

# Four X710 groups: two functions in group 40 and one in 41 on NUMA node 0, one each in
# groups 90 and 91 on NUMA node 1.
A0, A1 = "0000:3b:00.0", "0000:3b:00.1"
B = "0000:3c:00.0"
C = "0000:86:00.0"
D = "0000:87:00.0"


# address -> (IOMMU group, its iommufd device vfioN), as four_groups() builds them.
LAYOUT = {A0: (40, 0), A1: (40, 1), B: (41, 2), C: (90, 3), D: (91, 4)}


def nodes(*paths: str) -> tuple[DeviceNode, ...]:
    return tuple(DeviceNode(path) for path in paths)


GROUP_A_NODES = nodes(
    "/dev/vfio/vfio",
    "/dev/vfio/40",
    "/dev/iommu",
    "/dev/vfio/devices/vfio0",
    "/dev/vfio/devices/vfio1",
)


@pytest.fixture
def daemon_for(uevent_daemon: UeventDaemon) -> Callable[[dict[str, Any]], Awaitable[Daemon]]:
    """Factory: an in-process daemon running the VFIO scanner with the given section."""
    return lambda section: uevent_daemon([VfioScanner.from_config(section)])


def four_groups(host: UmockdevHost) -> dict[str, str]:
    """The X710 groups above on a host with iommufd; address -> sysfs path."""
    add_vfio_container(host)
    add_iommufd(host)
    layout = [(A0, 40, 0, 0), (A1, 40, 0, 1), (B, 41, 0, 2), (C, 90, 1, 3), (D, 91, 1, 4)]
    paths = {}
    for address, group, numa, vfio_dev in layout:
        if not host.has_device(f"/sys/devices/virtual/vfio/{group}"):
            add_vfio_group(host, group)
        paths[address] = add_vfio_function(
            host,
            address,
            vendor="0x8086",
            device="0x1572",
            group=group,
            numa_node=numa,
            cls="0x020000",
            vfio_dev=vfio_dev,
        )
    return paths


async def test_groups_reach_the_kubelet_with_topology_and_allocate_every_node(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    four_groups(host)
    await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    assert (await x710.wait_for_update()) == {
        A0: ListedDevice(A0, "Healthy", (0,)),
        B: ListedDevice(B, "Healthy", (0,)),
        C: ListedDevice(C, "Healthy", (1,)),
        D: ListedDevice(D, "Healthy", (1,)),
    }

    (answer,) = await x710.allocate([A0])
    assert answer.nodes == GROUP_A_NODES
    # A1's nodes are there (the whole group goes to the container), its address is not.
    assert dict(answer.env) == {VARIABLE: A0}
    assert answer.mounts == ()

    (single,) = await x710.allocate([D])
    assert single.nodes == nodes(
        "/dev/vfio/vfio", "/dev/vfio/91", "/dev/iommu", "/dev/vfio/devices/vfio4"
    )
    assert dict(single.env) == {VARIABLE: D}

    # The second function of a group is not a device of its own.
    with pytest.raises(SimulatorRpcError) as refused:
        await x710.allocate([A1])
    assert refused.value.code == "NOT_FOUND"


async def test_two_groups_in_one_container_get_one_address_each_in_address_order(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    four_groups(host)
    await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    await x710.wait_for_update(lambda listed: len(listed) == 4)

    (answer,) = await x710.allocate([C, A0])
    assert dict(answer.env) == {VARIABLE: f"{A0},{C}"}
    assert answer.nodes == nodes(
        "/dev/vfio/vfio",
        "/dev/vfio/90",
        "/dev/iommu",
        "/dev/vfio/devices/vfio3",
        "/dev/vfio/40",
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/devices/vfio1",
    )
    # The other order gives the same variable; two containers each get their own groups only.
    (reverse,) = await x710.allocate([A0, C])
    assert dict(reverse.env) == {VARIABLE: f"{A0},{C}"}
    first, second = await x710.allocate([B], [D])
    assert dict(first.env) == {VARIABLE: B}
    assert dict(second.env) == {VARIABLE: D}


def opened_by_qemu(address: str, mode: str) -> set[str]:
    """The nodes QEMU opens in the container to attach the function at ``address``."""
    group, vfio_dev = LAYOUT[address]
    if mode == "legacy":
        return {"/dev/vfio/vfio", f"/dev/vfio/{group}"}
    return {"/dev/iommu", f"/dev/vfio/devices/vfio{vfio_dev}"}


@pytest.mark.parametrize("mode", ["legacy", "iommufd"])
async def test_virt_launcher_gives_each_host_device_its_own_group(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any], mode: str
) -> None:
    """A VM asks for N host devices of a resource, its pod for N units: whatever the groups'
    shapes, virt-launcher's n-th host device gets the n-th group's requested function, and the
    container can open it."""
    four_groups(host)
    await daemon_for({**SECTION, "mode": mode})
    x710 = await kubelet.wait_for_plugin(X710)
    await x710.wait_for_update(lambda listed: len(listed) == 4)

    async def vm_with(units: list[str]) -> tuple[list[str], set[str]]:
        (answer,) = await x710.allocate(units)
        assigned = virt_launcher_assignment(dict(answer.env), [X710] * len(units))
        return assigned, {node.container_path for node in answer.nodes}

    # A single-function group.
    assigned, paths = await vm_with([D])
    assert assigned == [D]
    assert opened_by_qemu(D, mode) <= paths
    # A multi-function group: the VM gets the requested function; the sibling's nodes are in
    # the container (its group is the VM's alone), its address takes no host device slot.
    assigned, paths = await vm_with([A0])
    assert assigned == [A0]
    assert opened_by_qemu(A0, mode) | opened_by_qemu(A1, mode) <= paths
    # Mixed, in the kubelet's (arbitrary) order: three host devices, three groups, the first
    # host device on the lowest address.
    assigned, paths = await vm_with([C, A0, B])
    assert assigned == [A0, B, C]
    assert set().union(*(opened_by_qemu(a, mode) for a in (A0, A1, B, C))) <= paths
    # Two host devices get two groups (A0 and C), never A0 and its sibling A1 of one group.
    assigned, _ = await vm_with([C, A0])
    assert assigned == [A0, C]
    # One unit is one host device: a VM asking for more than its pod got does not start.
    (answer,) = await x710.allocate([A0])
    with pytest.raises(VirtLauncherError):
        virt_launcher_assignment(dict(answer.env), [X710, X710])


async def test_preferred_allocation_packs_groups_on_the_must_include_numa_node(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    four_groups(host)
    await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    everything = sorted(await x710.wait_for_update(lambda listed: len(listed) == 4))
    assert (await x710.get_options()).get_preferred_allocation_available

    assert await x710.preferred(everything, 2, must_include=[C]) == [C, D]
    assert await x710.preferred(everything, 2, must_include=[B]) == [B, A0]
    # Without must-include, two groups on one node rather than one on each.
    assert await x710.preferred([A0, C, D], 2) == [C, D]


async def test_unbind_and_bind_events_drive_health_and_allocate(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    paths = four_groups(host)
    daemon = await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    await x710.wait_for_update(lambda listed: len(listed) == 4)

    seen = len(x710.updates)
    host.set_driver(paths[A1], None)
    await host.emit_async("unbind", paths[A1])
    listed = await x710.wait_for_update(
        lambda listed: health(listed)[A0] == "Unhealthy", after=seen
    )
    assert health(listed) == {A0: "Unhealthy", B: "Healthy", C: "Healthy", D: "Healthy"}
    info = daemon.servers.servers[X710].devices.value[A0]
    assert info.health == Health.UNHEALTHY
    assert "left its VFIO driver" in info.health_reason and A1 in info.health_reason

    with pytest.raises(SimulatorRpcError) as refused:
        await x710.allocate([A0])
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "unhealthy" in refused.value.details
    # The daemon keeps serving the other groups.
    (answer,) = await x710.allocate([B])
    assert dict(answer.env) == {VARIABLE: B}

    # Bound to a host driver instead: still unhealthy, now with that reason.
    host.set_driver(paths[A1], "i40e")
    await host.emit_async("bind", paths[A1])
    server = daemon.servers.servers[X710]
    async with asyncio.timeout(5):
        while "bound to i40e" not in server.devices.value[A0].health_reason:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert A1 in server.devices.value[A0].health_reason
    assert health(x710.latest)[A0] == "Unhealthy"

    seen = len(x710.updates)
    host.set_driver(paths[A1], "vfio-pci")
    await host.emit_async("bind", paths[A1])
    await x710.wait_for_update(lambda listed: health(listed)[A0] == "Healthy", after=seen)
    (answer,) = await x710.allocate([A0])
    assert answer.nodes == GROUP_A_NODES
    assert dict(answer.env) == {VARIABLE: A0}


async def test_a_vanished_group_node_is_seen_through_its_change_event(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Callable[..., Any]
) -> None:
    four_groups(host)
    await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    await x710.wait_for_update(lambda listed: len(listed) == 4)

    group = "/sys/devices/virtual/vfio/41"
    seen = len(x710.updates)
    host.set_node_present(group, False)
    await host.emit_async("change", group)
    listed = await x710.wait_for_update(lambda listed: health(listed)[B] == "Unhealthy", after=seen)
    assert health(listed) == {A0: "Healthy", B: "Unhealthy", C: "Healthy", D: "Healthy"}

    seen = len(x710.updates)
    host.set_node_present(group, True)
    await host.emit_async("change", group)
    await x710.wait_for_update(lambda listed: health(listed)[B] == "Healthy", after=seen)


async def test_the_cdi_spec_carries_each_groups_nodes_and_allocate_names_it(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    daemon_for: Callable[..., Any],
    kubelet_dir: Path,
) -> None:
    four_groups(host)
    daemon = await daemon_for(SECTION)
    x710 = await kubelet.wait_for_plugin(X710)
    await x710.wait_for_update(lambda listed: len(listed) == 4)
    async with asyncio.timeout(5):
        while daemon.cdi_catalog.get(X710) is None:  # noqa: ASYNC110 - no event to await
            await asyncio.sleep(0.01)

    spec = json.loads((kubelet_dir.parent / "cdi" / "intel.com-x710.json").read_text())
    assert spec["kind"] == X710
    assert [d["name"] for d in spec["devices"]] == [A0, B, C, D]
    edits = spec["devices"][0]["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == [n.host_path for n in GROUP_A_NODES]
    # No env in the spec: CDI would set each device's PCI_RESOURCE_* in turn and the last
    # group's addresses would win over the merged list that Allocate carries.
    assert "env" not in edits
    assert [n["path"] for n in spec["devices"][2]["containerEdits"]["deviceNodes"]] == [
        "/dev/vfio/vfio",
        "/dev/vfio/90",
        "/dev/iommu",
        "/dev/vfio/devices/vfio3",
    ]

    (answer,) = await x710.allocate([C, A0])
    assert answer.cdi_devices == (f"{X710}={C}", f"{X710}={A0}")
    assert dict(answer.env) == {VARIABLE: f"{A0},{C}"}
