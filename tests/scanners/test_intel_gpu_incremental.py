"""The Intel GPU scanner's incremental path: rescan from events == a full scan of the same host.

A GPU's health depends on what the scanner advertised before, so each test runs two scanners
with the same history: one rescans from events (and scans fully only when the rescan asks for
it, as the daemon does), the other only scans fully; their trees must stay equal. SR-IOV
changes (VFs appearing or going, events on a PF with VFs or on a VF) and moves are answered
with None: the caller runs a full scan.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import pytest

from devplug.model import DeviceNode, DeviceTree, Health
from devplug.scanners.intel_gpu import (
    MONITORING_ID,
    MONITORING_RESOURCE,
    IntelGpuScanner,
    IntelGpuSettings,
)
from devplug.scanners.intel_gpu.monitoring import MonitorNodes
from devplug.scanners.udev import UdevEvent, UdevSource
from devplug.testing.umockdev import (
    MockNode,
    UmockdevHost,
    add_drm_minors,
    add_intel_gpu,
    add_intel_sriov_gpu,
    add_pci_device,
)

I915 = "gpu.intel.com/i915"
XE = "gpu.intel.com/xe"


def address(bus: int, function: int = 0) -> str:
    return f"0000:{bus:02x}:00.{function}"


def pci_path(bus: int, function: int = 0) -> str:
    return f"/sys/devices/pci0000:{bus:02x}/{address(bus, function)}"


def events(action: str, paths: Iterable[str]) -> list[UdevEvent]:
    """Events for ``paths``; a remove carries no subsystem (the scanner must not need it)."""
    result = []
    for path in paths:
        device = UdevSource().device(path) if action != "remove" else None
        result.append(UdevEvent(action, path, None if device is None else device.subsystem))
    return result


def added_since(host: UmockdevHost, before: Sequence[str]) -> list[UdevEvent]:
    """``add`` events for the devices added since ``before``, parents first (as the kernel)."""
    known = set(before)
    return events("add", [p for p in host.devices if p not in known])


def node(name: str) -> DeviceNode:
    return DeviceNode(f"/dev/dri/{name}", f"/dev/dri/{name}", "rw")


def ids(tree: DeviceTree, resource: str) -> list[str]:
    return sorted(tree.get(resource, {}))


class Pair:
    """Two scanners with the same settings and history: incremental and full."""

    def __init__(self, settings: IntelGpuSettings | None = None) -> None:
        self.incremental = IntelGpuScanner(settings)
        self.full = IntelGpuScanner(settings)
        self.tree = self.incremental.scan(UdevSource())
        assert self.full.scan(UdevSource()) == self.tree

    def step(self, batch: Sequence[UdevEvent], *, may_ask_full: bool = False) -> DeviceTree:
        """Rescan from ``batch``; assert it equals a full scan; return the new tree.

        With ``may_ask_full`` the rescan may answer None, and the incremental scanner then
        scans fully, as the daemon does; otherwise it must rescan.
        """
        rescanned = self.incremental.rescan(UdevSource(), self.tree, batch)
        if rescanned is None and may_ask_full:
            rescanned = self.incremental.scan(UdevSource())
        assert rescanned is not None, batch
        expected = self.full.scan(UdevSource())
        assert rescanned == expected, (batch, dict(rescanned), dict(expected))
        self.tree = rescanned
        return rescanned

    def step_before_files_go(
        self, batch: Sequence[UdevEvent], gone: Callable[[], object]
    ) -> DeviceTree:
        """Rescan from ``batch`` while the removed devices' sysfs files are still there (the
        kernel sends ``remove``, then deletes them); ``gone()`` then deletes them, and the
        rescan must equal a full scan of the host as it is from then on."""
        rescanned = self.incremental.rescan(UdevSource(), self.tree, batch)
        assert rescanned is not None, batch
        gone()
        expected = self.full.scan(UdevSource())
        assert rescanned == expected, (batch, dict(rescanned), dict(expected))
        self.tree = rescanned
        return rescanned

    def step_asks_full(self, batch: Sequence[UdevEvent]) -> DeviceTree:
        """The rescan must answer None for ``batch``; then the full scan, compared."""
        assert self.incremental.rescan(UdevSource(), self.tree, batch) is None, batch
        tree = self.incremental.scan(UdevSource())
        expected = self.full.scan(UdevSource())
        assert tree == expected, (dict(tree), dict(expected))
        self.tree = tree
        return tree


def remove_minors(host: UmockdevHost, pci: str) -> list[UdevEvent]:
    """Remove every drm minor of ``pci`` (a driver letting go); their remove events."""
    prefix = f"{pci}/drm/"
    doomed = [p for p in host.devices if p.startswith(prefix) and "/" not in p[len(prefix) :]]
    removed: list[str] = []
    for path in doomed:
        removed += host.remove_device(path)
    return events("remove", removed)


def test_subsystems_are_drm_and_pci() -> None:
    assert IntelGpuScanner().subsystems == frozenset({"drm", "pci"})


# ------------------------------------------------------------------------ adds, removes


def test_an_added_gpu_is_advertised(host: UmockdevHost) -> None:
    add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    before = host.devices
    pci = add_intel_gpu(host, address(4), card=1, render=129, driver="xe", numa_node=1)
    batch = added_since(host, before)
    assert [e.sys_path for e in batch] == [pci, f"{pci}/drm/card1", f"{pci}/drm/renderD129"]
    tree = pair.step(batch)
    assert ids(tree, I915) == [address(3)]
    assert ids(tree, XE) == [address(4)]
    info = tree[XE][address(4)]
    assert info.health is Health.HEALTHY
    assert info.nodes == (node("card1"), node("renderD129"))
    assert info.numa_nodes == (1,)


def test_the_card_event_alone_finds_its_gpu(host: UmockdevHost) -> None:
    pair = Pair()
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    tree = pair.step(events("add", [f"{pci}/drm/card0"]))
    assert ids(tree, I915) == [address(3)]
    assert tree[I915][address(3)].nodes == (node("card0"), node("renderD128"))


def test_a_removed_gpu_goes_with_children_first_events(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    removed = host.remove_device(first)
    assert removed == [f"{first}/drm/card0", f"{first}/drm/renderD128", first]
    tree = pair.step(events("remove", removed))
    assert ids(tree, I915) == [address(4)]


def test_a_removed_gpu_goes_with_the_pci_event_alone(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    host.remove_device(first)
    assert ids(pair.step([UdevEvent("remove", first, None)]), I915) == [address(4)]


def test_a_removed_gpu_goes_while_sysfs_still_shows_it(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair(IntelGpuSettings(monitoring=True))
    # The kernel's order, each event sent before its device's directory goes: the minors,
    # the driver letting go of the function, then the function.
    order = host.removal_order(first)
    batch = [*events("remove", order[:2]), UdevEvent("unbind", first, "pci")]
    batch += events("remove", order[2:])
    tree = pair.step_before_files_go(batch, lambda: host.remove_device(first))
    assert ids(tree, I915) == [address(4)]
    assert tree[MONITORING_RESOURCE][MONITORING_ID].nodes == (node("card1"), node("renderD129"))


def test_the_pci_remove_alone_takes_the_gpu_sysfs_still_shows(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    batch = [UdevEvent("remove", first, None)]
    assert ids(pair.step_before_files_go(batch, lambda: host.remove_device(first)), I915) == [
        address(4)
    ]


def test_removed_minors_of_a_gpu_that_stays_are_gone_at_once(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    minors = [f"{pci}/drm/card0", f"{pci}/drm/renderD128"]

    def minors_go() -> None:
        for minor in minors:
            host.remove_device(minor)

    tree = pair.step_before_files_go(events("remove", minors), minors_go)
    sick = tree[I915][address(3)]
    assert sick.health is Health.UNHEALTHY
    assert sick.health_reason == f"i915 is bound to {address(3)} but it has no drm card"


def test_a_removed_render_minor_takes_its_by_path_link_along(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair(IntelGpuSettings(bypath="single"))
    assert len(pair.tree[I915][address(3)].mounts) == 2  # card and render links
    render = f"{pci}/drm/renderD128"
    tree = pair.step_before_files_go(events("remove", [render]), lambda: host.remove_device(render))
    info = tree[I915][address(3)]
    assert info.nodes == (node("card0"),)
    assert [m.host_path for m in info.mounts] == [f"/dev/dri/by-path/pci-{address(3)}-card"]


def test_a_remove_and_an_add_in_one_batch_keep_the_gpu(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    healthy = pair.tree
    order = host.removal_order(pci)
    assert pair.step(events("remove", order) + events("add", order[::-1])) == healthy


def test_a_gpu_added_again_after_its_removal_is_back(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    healthy = pair.tree
    order = host.removal_order(pci)
    assert pair.step_before_files_go(events("remove", order), lambda: host.remove_device(pci)) == (
        DeviceTree()
    )
    add_intel_gpu(host, address(3), card=0, render=128)
    assert pair.step(events("add", order[::-1])) == healthy


def test_a_removed_bridge_takes_the_gpus_below_it(host: UmockdevHost) -> None:
    bridge = add_pci_device(
        host, "0000:00:01.0", vendor="0x8086", device="0x460d", driver="pcieport", cls="0x060400"
    )
    add_intel_gpu(host, "0000:01:00.0", card=0, render=128, parent=bridge)
    add_intel_gpu(host, address(5), card=1, render=129)
    pair = Pair()
    assert ids(pair.tree, I915) == ["0000:01:00.0", address(5)]
    host.remove_device(bridge)
    assert ids(pair.step([UdevEvent("remove", bridge, "pci")]), I915) == [address(5)]


def test_renumbered_minors_through_events(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    other = add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    batch = remove_minors(host, pci)
    before = host.devices
    add_drm_minors(host, pci, card=5, render=133, by_path=address(3))
    tree = pair.step(batch + added_since(host, before))
    assert tree[I915][address(3)].nodes == (node("card5"), node("renderD133"))
    assert tree[I915][address(3)].health is Health.HEALTHY
    assert tree[I915][address(4)].sources[0] == other


def test_events_for_unrelated_devices_leave_the_tree_unchanged(host: UmockdevHost) -> None:
    add_intel_gpu(host, address(3), card=0, render=128)
    nvidia = add_pci_device(host, address(0x65), vendor="0x10de", device="0x2330", driver="nvidia")
    add_drm_minors(host, nvidia, card=1, render=129, by_path=address(0x65))
    vgem = host.add_device("/sys/devices/platform/vgem", "platform")
    add_drm_minors(host, vgem, card=2, render=130)
    virtual = host.add_device(
        "/sys/devices/virtual/drm/card3", "drm", node=MockNode("dri/card3", 226, 3)
    )
    usb = add_pci_device(host, "0000:00:14.0", vendor="0x8086", device="0xa36d", driver="xhci")
    pair = Pair(IntelGpuSettings(monitoring=True))
    before = pair.tree
    batch = [
        UdevEvent("change", nvidia, "pci"),
        UdevEvent("change", f"{nvidia}/drm/card1", "drm"),
        UdevEvent("change", f"{vgem}/drm/card2", "drm"),
        UdevEvent("change", virtual, "drm"),
        UdevEvent("bind", usb, "pci"),
        UdevEvent("remove", pci_path(6), "pci"),  # never existed
    ]
    assert pair.step(batch) == before
    assert pair.step([]) == before
    assert ids(before, I915) == [address(3)]


def test_an_event_does_not_reread_a_sibling(host: UmockdevHost) -> None:
    add_intel_gpu(host, address(3), card=0, render=128)
    sibling = add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    # The sibling's node goes without an event of its own: only a re-read would notice.
    host.set_node_present(f"{sibling}/drm/card1", False)
    tree = pair.incremental.rescan(UdevSource(), pair.tree, events("change", [pci_path(3)]))
    assert tree == pair.tree


# ----------------------------------------------------------------------------- health


def test_a_vanished_node_and_its_change_event(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    healthy = pair.tree[I915][address(3)]
    host.set_node_present(f"{pci}/drm/card0", False)
    tree = pair.step(events("change", [f"{pci}/drm/card0"]))
    sick = tree[I915][address(3)]
    assert sick.health is Health.UNHEALTHY and "/dev/dri/card0" in sick.health_reason
    assert tree[I915][address(4)].health is Health.HEALTHY
    # Still unhealthy after an unrelated batch.
    tree = pair.step(events("change", [pci_path(4)]))
    assert tree[I915][address(3)].health is Health.UNHEALTHY
    host.set_node_present(f"{pci}/drm/card0", True)
    tree = pair.step(events("change", [f"{pci}/drm/card0"]))
    assert tree[I915][address(3)] == healthy


def test_a_vanished_render_node_stays_unhealthy_across_unrelated_batches(
    host: UmockdevHost,
) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    host.set_node_present(f"{pci}/drm/renderD128", False)
    tree = pair.step(events("change", [f"{pci}/drm/renderD128"]))
    assert tree[I915][address(3)].health is Health.UNHEALTHY
    for _ in range(2):
        tree = pair.step(events("change", [pci_path(4)]))
        assert tree[I915][address(3)].health is Health.UNHEALTHY


def test_driver_unbind_and_bind_events(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    healthy = pair.tree
    host.set_driver(pci, None)
    tree = pair.step([UdevEvent("unbind", pci, "pci")])
    sick = tree[I915][address(3)]
    assert sick.health is Health.UNHEALTHY
    assert sick.health_reason.startswith(f"no driver is bound to {address(3)}")
    host.set_driver(pci, "i915")
    assert pair.step([UdevEvent("bind", pci, "pci")]) == healthy


def test_an_unbind_with_its_minors_then_a_rebind_to_xe(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair(IntelGpuSettings(monitoring=True))
    batch = remove_minors(host, pci)
    host.set_driver(pci, None)
    tree = pair.step([*batch, UdevEvent("unbind", pci, "pci")])
    assert tree[I915][address(3)].health is Health.UNHEALTHY
    assert tree[MONITORING_RESOURCE][MONITORING_ID].nodes == (node("card1"), node("renderD129"))
    host.set_driver(pci, "xe")
    before = host.devices
    add_drm_minors(host, pci, card=0, render=128, by_path=address(3))
    tree = pair.step([*added_since(host, before), UdevEvent("bind", pci, "pci")])
    assert ids(tree, I915) == [address(4)]
    assert ids(tree, XE) == [address(3)]
    assert tree[XE][address(3)].health is Health.HEALTHY


def test_a_rebind_to_vfio_pci_drops_the_gpu(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    batch = remove_minors(host, pci)
    host.set_driver(pci, None)
    batch.append(UdevEvent("unbind", pci, "pci"))
    host.set_driver(pci, "vfio-pci")
    batch.append(UdevEvent("bind", pci, "pci"))
    assert pair.step(batch) == DeviceTree({I915: {address(4): pair.tree[I915][address(4)]}})


def test_a_direct_i915_to_xe_rebind_event(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    host.set_driver(pci, "xe")
    tree = pair.step([UdevEvent("bind", pci, "pci")])
    assert list(tree) == [XE]
    assert tree[XE][address(3)].health is Health.HEALTHY


def test_a_gpu_added_without_its_card_node_waits_for_it(host: UmockdevHost) -> None:
    pair = Pair()
    before = host.devices
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    host.set_node_present(f"{pci}/drm/card0", False)
    assert pair.step(added_since(host, before)) == DeviceTree()
    assert pair.step(events("change", [f"{pci}/drm/renderD128"])) == DeviceTree()
    host.set_node_present(f"{pci}/drm/card0", True)
    tree = pair.step(events("change", [f"{pci}/drm/card0"]))
    assert tree[I915][address(3)].health is Health.HEALTHY
    assert tree[I915][address(3)].nodes == (node("card0"), node("renderD128"))


def test_a_gpu_added_without_its_render_node_then_an_unrelated_batch(
    host: UmockdevHost,
) -> None:
    add_intel_gpu(host, address(4), card=1, render=129)
    pair = Pair()
    before = host.devices
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    host.set_node_present(f"{pci}/drm/renderD128", False)
    pair.step(added_since(host, before))
    # Nothing changes for that GPU: the incremental answer must stay that of a full scan.
    pair.step(events("change", [pci_path(4)]))
    host.set_node_present(f"{pci}/drm/renderD128", True)
    tree = pair.step(events("change", [f"{pci}/drm/renderD128"]))
    assert tree[I915][address(3)].health is Health.HEALTHY


# ----------------------------------------------------------------------------- SR-IOV


def test_vfs_appearing_ask_for_a_full_scan(host: UmockdevHost) -> None:
    pf = add_intel_gpu(host, address(0x4D), card=0, render=128, device_id="0x56c0")
    add_intel_gpu(host, address(3), card=5, render=133)
    pair = Pair()
    assert ids(pair.tree, I915) == [address(3), address(0x4D)]  # no VFs yet: the PF is a GPU
    host.set_attribute(pf, "sriov_numvfs", "2")
    before = host.devices
    for index in (1, 2):
        add_intel_gpu(
            host,
            address(0x4D, index),
            card=index,
            render=128 + index,
            device_id="0x56c0",
            physfn=address(0x4D),
        )
    vf_events = added_since(host, before)
    pf_event = UdevEvent("change", pf, "pci")
    for batch in ([pf_event], vf_events, vf_events[:1], vf_events[1:2], [pf_event, *vf_events]):
        assert pair.incremental.rescan(UdevSource(), pair.tree, batch) is None, batch
    tree = pair.step_asks_full([pf_event, *vf_events])
    assert ids(tree, I915) == [address(3), address(0x4D, 1), address(0x4D, 2)]


def test_events_on_a_pf_with_vfs_or_on_a_vf_ask_for_a_full_scan(host: UmockdevHost) -> None:
    pf, (vf1, vf2) = add_intel_sriov_gpu(host, address(0x4D), card=0, render=128, vfs=2)
    plain = add_intel_gpu(host, address(3), card=5, render=133)
    pair = Pair()
    for batch in (
        [UdevEvent("change", pf, "pci")],
        [UdevEvent("change", f"{pf}/drm/card0", "drm")],
        [UdevEvent("change", vf1, "pci")],
        [UdevEvent("change", f"{vf2}/drm/renderD130", "drm")],
        [UdevEvent("change", plain, "pci"), UdevEvent("change", vf1, "pci")],
    ):
        assert pair.incremental.rescan(UdevSource(), pair.tree, batch) is None, batch
    # A VF's node goes: the full scan the daemon then runs marks it.
    host.set_node_present(f"{vf1}/drm/renderD129", False)
    tree = pair.step_asks_full(events("change", [f"{vf1}/drm/renderD129"]))
    assert tree[I915][address(0x4D, 1)].health is Health.UNHEALTHY
    # Events on the plain GPU alone still rescan.
    host.set_node_present(f"{plain}/drm/card5", False)
    tree = pair.step(events("change", [f"{plain}/drm/card5"]))
    assert tree[I915][address(3)].health is Health.UNHEALTHY
    assert tree[I915][address(0x4D, 1)].health is Health.UNHEALTHY


def test_vfs_going_away_ask_for_a_full_scan_and_the_pf_returns(host: UmockdevHost) -> None:
    pf, vfs = add_intel_sriov_gpu(host, address(0x4D), card=0, render=128, vfs=2)
    pair = Pair()
    assert ids(pair.tree, I915) == [address(0x4D, 1), address(0x4D, 2)]
    removed: list[str] = []
    for vf in vfs:
        removed += host.remove_device(vf)
    host.set_attribute(pf, "sriov_numvfs", "0")
    batch = [*events("remove", removed), UdevEvent("change", pf, "pci")]
    assert pair.incremental.rescan(UdevSource(), pair.tree, events("remove", removed)) is None
    tree = pair.step_asks_full(batch)
    assert ids(tree, I915) == [address(0x4D)]
    assert tree[I915][address(0x4D)].nodes == (node("card0"), node("renderD128"))
    # SR-IOV is over for it: its events rescan again.
    host.set_node_present(f"{pf}/drm/card0", False)
    tree = pair.step(events("change", [f"{pf}/drm/card0"]))
    assert tree[I915][address(0x4D)].health is Health.UNHEALTHY


def test_sriov_on_an_intel_nic_does_not_force_full_scans(host: UmockdevHost) -> None:
    add_intel_gpu(host, address(3), card=0, render=128)
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
    add_intel_gpu(host, address(3), card=0, render=128)
    scanner = IntelGpuScanner()
    tree = scanner.scan(UdevSource())
    # VFs appear: their PCI function first, before any drm minor exists.
    vf = add_pci_device(
        host,
        address(3, 1),
        vendor="0x8086",
        device="0x56c0",
        driver="i915",
        extra_links={"physfn": f"../{address(3)}"},
    )
    assert scanner.rescan(UdevSource(), tree, [UdevEvent("add", vf, "pci")]) is None


def test_a_move_asks_for_a_full_scan(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair()
    batch = [UdevEvent("move", f"{pci}/drm/card0", "drm")]
    assert pair.incremental.rescan(UdevSource(), pair.tree, batch) is None
    mixed = [UdevEvent("change", pci, "pci"), UdevEvent("move", f"{pci}/drm/card0", "drm")]
    assert pair.incremental.rescan(UdevSource(), pair.tree, mixed) is None


# ---------------------------------------------------------------- monitoring and shares


def test_monitoring_updates_incrementally(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair(IntelGpuSettings(monitoring=True))

    def monitored(tree: DeviceTree) -> tuple[DeviceNode, ...]:
        return tree[MONITORING_RESOURCE][MONITORING_ID].nodes

    assert monitored(pair.tree) == (node("card0"), node("renderD128"))
    before = host.devices
    second = add_intel_gpu(host, address(4), card=1, render=129, driver="xe")
    tree = pair.step(added_since(host, before))
    assert monitored(tree) == (node("card0"), node("card1"), node("renderD128"), node("renderD129"))
    host.set_node_present(f"{second}/drm/renderD129", False)
    tree = pair.step(events("change", [f"{second}/drm/renderD129"]))
    assert monitored(tree) == (node("card0"), node("card1"), node("renderD128"))
    tree = pair.step(events("remove", host.remove_device(first)))
    assert monitored(tree) == (node("card1"),)
    assert list(tree[MONITORING_RESOURCE]) == [MONITORING_ID]
    tree = pair.step(events("remove", host.remove_device(second)))
    assert tree == DeviceTree()


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


def test_shared_dev_num_3_incrementally(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, address(3), card=0, render=128)
    pair = Pair(IntelGpuSettings(shared_dev_num=3))
    before = host.devices
    add_intel_gpu(host, address(4), card=1, render=129)
    tree = pair.step(added_since(host, before))
    assert ids(tree, I915) == [f"{address(b)}-{i}" for b in (3, 4) for i in range(3)]
    host.set_node_present(f"{first}/drm/card0", False)
    tree = pair.step(events("change", [f"{first}/drm/card0"]))
    assert {i: d.health for i, d in tree[I915].items()} == {
        **{f"{address(3)}-{i}": Health.UNHEALTHY for i in range(3)},
        **{f"{address(4)}-{i}": Health.HEALTHY for i in range(3)},
    }
    host.set_node_present(f"{first}/drm/card0", True)
    host.set_driver(first, "xe")
    tree = pair.step([*events("change", [f"{first}/drm/card0"]), UdevEvent("bind", first, "pci")])
    assert ids(tree, XE) == [f"{address(3)}-{i}" for i in range(3)]
    tree = pair.step(events("remove", host.remove_device(first)))
    assert list(tree) == [I915]
    assert ids(tree, I915) == [f"{address(4)}-{i}" for i in range(3)]


# ------------------------------------------------------------ a random walk of changes

Expect = Literal["rescan", "full"]  # what the rescan must answer: a tree, or None


@dataclass
class Function:
    """One Intel PCI function the walk made, as the walk left it."""

    pci: str
    driver: str | None  # "i915", "xe", "vfio-pci" or None
    minors: tuple[int, int] | None  # (card, render) in sysfs, or None
    vfs: list[str]  # PCI paths of its VFs (a PF with VFs enabled)
    pf: str | None  # the PF's PCI path (a VF)

    @property
    def sriov(self) -> bool:
        return bool(self.vfs) or self.pf is not None

    def minor_paths(self) -> list[str]:
        if self.minors is None:
            return []
        card, render = self.minors
        return [f"{self.pci}/drm/card{card}", f"{self.pci}/drm/renderD{render}"]


class RandomHost:
    """Random GPU hotplug, node, driver and SR-IOV changes on a umockdev host, each with the
    events the kernel would send. Starts with 8 advertised GPUs: six plain ones (i915 or xe,
    NUMA -1, 0 or 1) and a PF with two VFs; plus a non-Intel card and vgem, for noise."""

    def __init__(self, host: UmockdevHost, rng: random.Random) -> None:
        self.host = host
        self.rng = rng
        self.functions: dict[str, Function] = {}
        self.free_cards = list(range(64))
        self.absent: set[str] = set()  # minors whose /dev node the walk deleted
        self.counts = dict.fromkeys(
            ["add", "remove", "flip", "unbind", "bind", "vfio", "renumber", "sriov", "noise"], 0
        )
        nvidia = add_pci_device(host, address(0x65), vendor="0x10de", device="0x2330", driver=None)
        add_drm_minors(host, nvidia, card=self._card(), render=None)
        vgem = host.add_device("/sys/devices/platform/vgem", "platform")
        add_drm_minors(host, vgem, card=self._card(), render=None)
        self.noise_paths = [nvidia, *(p for p in host.devices if "/drm/" in p)]
        for bus in range(3, 10):
            self._add_plain(bus)
        self._enable_vfs(self.functions[pci_path(3)], 2)

    # ------------------------------------------------------------------ building blocks

    def _card(self) -> int:
        """A free card number (renderD is 128 + card), often one another GPU had before."""
        card = self.rng.choice(self.free_cards[:8])
        self.free_cards.remove(card)
        return card

    def _add_minors(self, function: Function) -> None:
        card = self._card()
        name = function.pci.rsplit("/", 1)[1]
        add_drm_minors(self.host, function.pci, card=card, render=128 + card, by_path=name)
        function.minors = (card, 128 + card)

    def _drop_minors(self, function: Function) -> list[UdevEvent]:
        if function.minors is None:
            return []
        self.free_cards.append(function.minors[0])
        self.absent.difference_update(function.minor_paths())
        function.minors = None
        return remove_minors(self.host, function.pci)

    def _forget(self, function: Function) -> None:
        del self.functions[function.pci]
        if function.minors is not None:
            self.free_cards.append(function.minors[0])
            self.absent.difference_update(function.minor_paths())

    def _add_plain(self, bus: int) -> Function:
        driver = self.rng.choice(["i915", "xe"])
        pci = add_pci_device(
            self.host,
            address(bus),
            vendor="0x8086",
            device=self.rng.choice(["0x56a0", "0xe20b", "0x56c0"]),
            driver=driver,
            numa_node=self.rng.choice([-1, 0, 1]),
        )
        function = Function(pci, driver, None, [], None)
        self._add_minors(function)
        self.functions[pci] = function
        return function

    def _enable_vfs(self, pf: Function, count: int) -> None:
        self.host.set_attribute(pf.pci, "sriov_numvfs", str(count))
        bus = int(pf.pci.rsplit(":", 2)[1], 16)
        for index in range(1, count + 1):
            pci = add_pci_device(
                self.host,
                address(bus, index),
                vendor="0x8086",
                device="0x56c0",
                driver=pf.driver,
                numa_node=self.rng.choice([-1, 0, 1]),
                extra_links={"physfn": f"../{address(bus)}"},
            )
            vf = Function(pci, pf.driver, None, [], pf.pci)
            self._add_minors(vf)
            self.functions[pci] = vf
            pf.vfs.append(pci)

    def _plain(self) -> list[Function]:
        return [f for f in self.functions.values() if not f.sriov]

    # ------------------------------------------------------------------ operations

    def add(self) -> tuple[list[UdevEvent], Expect]:
        before = self.host.devices
        bus = self.rng.choice([b for b in range(0x10, 0x40) if pci_path(b) not in self.functions])
        function = self._add_plain(bus)
        if self.rng.random() < 0.3:
            # udev has not made one of its nodes yet; a later flip brings it.
            path = self.rng.choice(function.minor_paths())
            self.host.set_node_present(path, False)
            self.absent.add(path)
        return added_since(self.host, before), "rescan"

    def remove(self) -> tuple[list[UdevEvent], Expect]:
        function = self.rng.choice(self._plain())
        self._forget(function)
        removed = self.host.remove_device(function.pci)
        if self.rng.random() < 0.3:
            return [UdevEvent("remove", function.pci, None)], "rescan"  # the PCI event alone
        return events("remove", removed), "rescan"

    def unbind(self) -> tuple[list[UdevEvent], Expect]:
        function = self.rng.choice(self._plain())
        batch = self._drop_minors(function) if self.rng.random() < 0.7 else []
        function.driver = None
        self.host.set_driver(function.pci, None)
        return [*batch, UdevEvent("unbind", function.pci, "pci")], "rescan"

    def bind(self) -> tuple[list[UdevEvent], Expect]:
        """Bind i915 or xe: to an unbound or vfio-pci GPU, or a direct rebind."""
        before = self.host.devices
        function = self.rng.choice(self._plain())
        function.driver = self.rng.choice(["i915", "xe"])
        self.host.set_driver(function.pci, function.driver)
        if function.minors is None:
            self._add_minors(function)
        return [*added_since(self.host, before), UdevEvent("bind", function.pci, "pci")], "rescan"

    def vfio(self) -> tuple[list[UdevEvent], Expect]:
        function = self.rng.choice(self._plain())
        batch = self._drop_minors(function)
        function.driver = "vfio-pci"
        self.host.set_driver(function.pci, "vfio-pci")
        return [*batch, UdevEvent("bind", function.pci, "pci")], "rescan"

    def renumber(self) -> tuple[list[UdevEvent], Expect]:
        before = self.host.devices
        function = self.rng.choice([f for f in self.functions.values() if f.minors is not None])
        batch = self._drop_minors(function)
        self._add_minors(function)
        return [*batch, *added_since(self.host, before)], "full" if function.sriov else "rescan"

    def sriov(self) -> tuple[list[UdevEvent], Expect]:
        """Disable a PF's VFs, or enable 1-3 VFs on a bound plain GPU."""
        before = self.host.devices
        pfs = [f for f in self.functions.values() if f.vfs]
        candidates = [f for f in self._plain() if f.driver in ("i915", "xe") and f.minors]
        if pfs and (self.rng.random() < 0.5 or not candidates):
            pf = self.rng.choice(pfs)
            removed: list[str] = []
            for vf in pf.vfs:
                self._forget(self.functions[vf])
                removed += self.host.remove_device(vf)
            pf.vfs = []
            self.host.set_attribute(pf.pci, "sriov_numvfs", "0")
            return [*events("remove", removed), UdevEvent("change", pf.pci, "pci")], "full"
        pf = self.rng.choice(candidates)
        self._enable_vfs(pf, self.rng.randint(1, 3))
        return [UdevEvent("change", pf.pci, "pci"), *added_since(self.host, before)], "full"

    def noise(self) -> tuple[list[UdevEvent], Expect]:
        return events("change", [self.rng.choice(self.noise_paths)]), "rescan"

    def flip(self) -> tuple[list[UdevEvent], Expect]:
        """Delete a present node or bring back a deleted one; a change event for its minor."""
        minors = [(f, p) for f in self.functions.values() for p in f.minor_paths()]
        deleted = [(f, p) for f, p in minors if p in self.absent]
        # Bring deleted nodes back more often than not: recoveries are half the story.
        function, path = self.rng.choice(deleted if deleted and self.rng.random() < 0.6 else minors)
        present = path in self.absent
        self.host.set_node_present(path, present)
        if present:
            self.absent.discard(path)
        else:
            self.absent.add(path)
        return events("change", [path]), "full" if function.sriov else "rescan"

    def step(self) -> tuple[list[UdevEvent], Expect]:
        possible = {
            "add": 10 if len(self.free_cards) > 12 else 0,
            "remove": 8 if len(self._plain()) > 3 else 0,
            "unbind": 10 if self._plain() else 0,
            "bind": 10 if self._plain() else 0,
            "vfio": 6 if self._plain() else 0,
            "renumber": 8,
            "sriov": 10 if len(self.free_cards) > 12 else 0,
            "noise": 4,
            "flip": 30,
        }
        name = self.rng.choices(list(possible), weights=list(possible.values()))[0]
        self.counts[name] += 1
        operation: Callable[[], tuple[list[UdevEvent], Expect]] = getattr(self, name)
        return operation()


WALK_SETTINGS = {
    "default": IntelGpuSettings(),
    "monitoring-shared-all": IntelGpuSettings(monitoring=True, shared_dev_num=3, bypath="all"),
}


@pytest.mark.parametrize("settings", sorted(WALK_SETTINGS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_walk_rescans_like_full_scans(
    host: UmockdevHost, seed: int, settings: str
) -> None:
    walk = RandomHost(host, random.Random(seed))
    pair = Pair(WALK_SETTINGS[settings])
    shares = WALK_SETTINGS[settings].shared_dev_num
    gpus = (I915, XE)
    assert sum(len(pair.tree.get(r, {})) for r in gpus) == 8 * shares
    asked_full = sickened = recovered = 0
    for _ in range(30):
        before = {(r, i): info.healthy for r in gpus for i, info in pair.tree.get(r, {}).items()}
        batch, expect = walk.step()
        if expect == "full":
            asked_full += 1
            tree = pair.step_asks_full(batch)
        else:
            tree = pair.step(batch)
        for resource in gpus:
            for device_id, info in tree.get(resource, {}).items():
                was = before.get((resource, device_id))
                sickened += was is True and not info.healthy
                recovered += was is False and info.healthy
    summary = f"{walk.counts}, {asked_full} full, {sickened} sickened, {recovered} recovered"
    # The walk did what it is here for.
    assert asked_full >= 2 and sickened >= 3 * shares and recovered >= 2 * shares, summary
    assert walk.counts["flip"] >= 5 and walk.counts["sriov"] >= 1, summary
    assert sum(1 for count in walk.counts.values() if count) >= 6, summary
