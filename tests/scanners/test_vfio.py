"""The VFIO scanner's scans through real pyudev against hand-built umockdev hosts.

Expectations are written from the scanner's contract (the issue and the module docstrings):
one device per IOMMU group whose functions are on a VFIO driver, named by the lowest PCI
address of the functions passed on, carrying every node of the group and KubeVirt's
``PCI_RESOURCE_<RESOURCE>`` variable; groups that cannot go to a VM are reported, never
advertised; health follows drivers and nodes across scans.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from devplug.config import load_settings
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health
from devplug.scanners.registry import build_scanners
from devplug.scanners.udev import UdevSource
from devplug.scanners.vfio import VfioScanner, VfioSettings, kubevirt_variable
from devplug.testing.umockdev import (
    UmockdevHost,
    add_iommufd,
    add_pci_device,
    add_vfio_container,
    add_vfio_function,
    add_vfio_group,
)

FIELD = "scanners.vfio"
SECTION = "vfio_unassignable_groups"

# An Intel X710 (8086:1572) with two functions in IOMMU group 40 on NUMA node 0.
X710 = "intel.com/x710"
X710_VAR = "PCI_RESOURCE_INTEL_COM_X710"
NIC0 = "0000:3b:00.0"
NIC1 = "0000:3b:00.1"
NIC0_PCI = "/sys/devices/pci0000:3b/0000:3b:00.0"
NIC1_PCI = "/sys/devices/pci0000:3b/0000:3b:00.1"
X710_SELECTOR = {"selector": "8086:1572", "resource": X710}

# An NVIDIA RTX 3090 (10de:2204) and its HDMI audio function (10de:1aef) in group 50.
GPU = "0000:65:00.0"
AUDIO = "0000:65:00.1"
GPU_PCI = "/sys/devices/pci0000:65/0000:65:00.0"
AUDIO_PCI = "/sys/devices/pci0000:65/0000:65:00.1"
RTX = "vfio.devplug.io/10de_2204"
RTX_VAR = "PCI_RESOURCE_VFIO_DEVPLUG_IO_10DE_2204"


def dev(*paths: str) -> tuple[DeviceNode, ...]:
    """The nodes a container gets: each at the same path inside, read-write."""
    return tuple(DeviceNode(path, path, "rw") for path in paths)


def scan(settings: VfioSettings | None = None) -> DeviceTree:
    return VfioScanner(settings).scan(UdevSource())


def scan_and_report(
    settings: VfioSettings | None = None,
) -> tuple[DeviceTree, list[dict[str, Any]]]:
    scanner = VfioScanner(settings)
    tree = scanner.scan(UdevSource())
    report = scanner.report()
    assert list(report) == [SECTION]
    groups = report[SECTION]
    assert isinstance(groups, list)
    return tree, groups


def with_x710(**raw: Any) -> VfioSettings:
    return VfioSettings.from_raw({"devices": [X710_SELECTOR], **raw}, FIELD)


def vfio_host(host: UmockdevHost, *, iommufd: bool = True) -> None:
    add_vfio_container(host)
    if iommufd:
        add_iommufd(host)


def add_x710(
    host: UmockdevHost,
    *,
    group: int = 40,
    drivers: tuple[str | None, str | None] = ("vfio-pci", "vfio-pci"),
    numa_node: int = 0,
    vfio_devs: tuple[int | None, int | None] = (0, 1),
) -> tuple[str, str]:
    """The two X710 functions (group ``group``) and the group's node; their sysfs paths."""
    add_vfio_group(host, group)
    first, second = (
        add_vfio_function(
            host,
            address,
            vendor="0x8086",
            device="0x1572",
            group=group,
            driver=driver,
            numa_node=numa_node,
            cls="0x020000",
            vfio_dev=vfio_dev,
        )
        for address, driver, vfio_dev in zip((NIC0, NIC1), drivers, vfio_devs, strict=True)
    )
    return first, second


def add_rtx(
    host: UmockdevHost,
    *,
    group: int = 50,
    audio_driver: str | None = "vfio-pci",
    numa_node: int = 1,
) -> tuple[str, str]:
    add_vfio_group(host, group)
    gpu = add_vfio_function(
        host,
        GPU,
        vendor="0x10de",
        device="0x2204",
        group=group,
        numa_node=numa_node,
        cls="0x030000",
        vfio_dev=2,
    )
    audio = add_vfio_function(
        host,
        AUDIO,
        vendor="0x10de",
        device="0x1aef",
        group=group,
        driver=audio_driver,
        numa_node=numa_node,
        cls="0x040300",
        vfio_dev=3 if audio_driver == "vfio-pci" else None,
    )
    return gpu, audio


def x710_info(**changes: Any) -> DeviceInfo:
    """The healthy X710 group 40 on a host with iommufd, as the issue spells it out."""
    values: dict[str, Any] = {
        "health": Health.HEALTHY,
        "health_reason": "",
        "nodes": dev(
            "/dev/vfio/vfio",
            "/dev/vfio/40",
            "/dev/iommu",
            "/dev/vfio/devices/vfio0",
            "/dev/vfio/devices/vfio1",
        ),
        "env": {X710_VAR: NIC0},
        "numa_nodes": (0,),
        "sources": (NIC0_PCI, NIC1_PCI),
    }
    values.update(changes)
    return DeviceInfo(**values)


# ----------------------------------------------------------------------------- discovery


def test_a_two_function_nic_group_is_one_device_with_every_node(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host)
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree({X710: {NIC0: x710_info()}})
    assert report == []


def test_the_nodes_come_in_the_documented_order(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host, group=7, vfio_devs=(4, 9))
    (info,) = scan(with_x710())[X710].values()
    assert [n.host_path for n in info.nodes] == [
        "/dev/vfio/vfio",
        "/dev/vfio/7",
        "/dev/iommu",
        "/dev/vfio/devices/vfio4",
        "/dev/vfio/devices/vfio9",
    ]


def test_a_function_on_a_host_driver_makes_its_group_unassignable(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host, drivers=("vfio-pci", "i40e"), vfio_devs=(0, None))
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    (group,) = report
    assert group["group"] == 40
    assert group["id"] == NIC0
    assert group["functions"] == [
        {"address": NIC0, "driver": "vfio-pci", "ids": "8086:1572"},
        {"address": NIC1, "driver": "i40e", "ids": "8086:1572"},
    ]
    assert NIC1 in group["reason"] and "i40e" in group["reason"]
    assert NIC0 not in group["reason"]  # the VFIO-bound function is not the problem
    json.dumps(report)  # JSON-ready, as devplug scan prints it


def test_a_host_driver_on_the_lower_function_is_named_too(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host, drivers=("i40e", "vfio-pci"), vfio_devs=(None, 1))
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    (group,) = report
    assert (group["group"], group["id"]) == (40, NIC0)
    assert NIC0 in group["reason"] and "i40e" in group["reason"]


def test_an_unassignable_group_is_warned_about_once_per_episode_and_reason(
    host: UmockdevHost,
) -> None:
    """The daemon rescans on every event and resync: a group refused for the same reason
    scan after scan is a warning once; a new reason, or a refusal after a scan that did not
    refuse it, is a warning again."""
    vfio_host(host, iommufd=False)
    first, second = add_x710(host, drivers=("vfio-pci", "i40e"), vfio_devs=(None, None))
    scanner = VfioScanner(with_x710())

    def warned() -> tuple[DeviceTree, list[str]]:
        with capture_logs() as logs:
            tree = scanner.scan(UdevSource())
        return tree, [
            str(e["reason"])
            for e in logs
            if e["event"] == "vfio.group.unassignable" and e["log_level"] == "warning"
        ]

    _, reasons = warned()
    assert len(reasons) == 1 and "i40e" in reasons[0]
    assert warned() == (DeviceTree(), [])
    host.set_driver(second, "ixgbe")
    _, reasons = warned()
    assert len(reasons) == 1 and "ixgbe" in reasons[0]
    host.set_driver(first, "i40e")  # the whole card back on the host: not refused, not ours
    assert warned() == (DeviceTree(), [])
    host.set_driver(first, "vfio-pci")
    _, reasons = warned()
    assert len(reasons) == 1 and "ixgbe" in reasons[0]


def test_a_gpu_and_its_audio_function_on_vfio_are_one_device(host: UmockdevHost) -> None:
    vfio_host(host)
    add_rtx(host)
    tree, report = scan_and_report()
    assert tree == DeviceTree(
        {
            RTX: {
                GPU: DeviceInfo(
                    nodes=dev(
                        "/dev/vfio/vfio",
                        "/dev/vfio/50",
                        "/dev/iommu",
                        "/dev/vfio/devices/vfio2",
                        "/dev/vfio/devices/vfio3",
                    ),
                    env={RTX_VAR: GPU},
                    numa_nodes=(1,),
                    sources=(GPU_PCI, AUDIO_PCI),
                )
            }
        }
    )
    assert report == []


def test_a_gpu_whose_audio_function_stays_on_snd_hda_intel_is_reported(
    host: UmockdevHost,
) -> None:
    vfio_host(host)
    add_rtx(host, audio_driver="snd_hda_intel")
    tree, report = scan_and_report()
    assert tree == DeviceTree()
    (group,) = report
    assert (group["group"], group["id"]) == (50, GPU)
    assert group["functions"] == [
        {"address": GPU, "driver": "vfio-pci", "ids": "10de:2204"},
        {"address": AUDIO, "driver": "snd_hda_intel", "ids": "10de:1aef"},
    ]
    assert AUDIO in group["reason"] and "snd_hda_intel" in group["reason"]


def test_a_reported_group_is_served_once_its_last_function_moves_to_vfio(
    host: UmockdevHost,
) -> None:
    vfio_host(host)
    _, audio = add_rtx(host, audio_driver="snd_hda_intel")
    scanner = VfioScanner()
    assert scanner.scan(UdevSource()) == DeviceTree()
    reported = scanner.report()[SECTION]
    assert isinstance(reported, list) and len(reported) == 1
    host.set_driver(audio, "vfio-pci")
    tree = scanner.scan(UdevSource())
    assert list(tree) == [RTX]
    info = tree[RTX][GPU]
    assert info.health == Health.HEALTHY
    assert info.env == {RTX_VAR: GPU}
    assert scanner.report() == {SECTION: []}


def test_a_bridge_on_pcieport_does_not_keep_its_group_from_a_vm(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_vfio_group(host, 2)
    bridge = add_pci_device(
        host,
        "0000:00:01.0",
        vendor="0x8086",
        device="0x1901",
        driver="pcieport",
        cls="0x060400",
        iommu_group=2,
    )
    add_vfio_function(
        host,
        "0000:01:00.0",
        vendor="0x8086",
        device="0x1572",
        group=2,
        cls="0x020000",
        parent=bridge,
    )
    tree, report = scan_and_report(with_x710())
    assert report == []
    # The bridge stays with the host: the id and the addresses are the endpoint's.
    assert list(tree) == [X710]
    (device_id, info) = next(iter(tree[X710].items()))
    assert device_id == "0000:01:00.0"
    assert info.health == Health.HEALTHY
    assert info.nodes == dev("/dev/vfio/vfio", "/dev/vfio/2")
    assert dict(info.env) == {X710_VAR: "0000:01:00.0"}


def test_a_non_bridge_function_on_pcieport_is_harmless(host: UmockdevHost) -> None:
    # pcieport also drives Root Complex Event Collectors (class 0x0807): the kernel lets a
    # group with it go to a VM, as with bridges and pci-stub.
    vfio_host(host, iommufd=False)
    add_x710(host, drivers=("vfio-pci", "pcieport"), vfio_devs=(None, None))
    tree, report = scan_and_report(with_x710())
    assert report == []
    (info,) = tree[X710].values()
    assert info.env == {"PCI_RESOURCE_INTEL_COM_X710": NIC0}


def test_a_function_on_pci_stub_is_harmless(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, drivers=("vfio-pci", "pci-stub"), vfio_devs=(None, None))
    tree, report = scan_and_report(with_x710())
    assert report == []
    assert tree == DeviceTree(
        {
            X710: {
                NIC0: x710_info(
                    nodes=dev("/dev/vfio/vfio", "/dev/vfio/40"),
                    env={X710_VAR: NIC0},  # the VFIO-bound functions only
                )
            }
        }
    )


def test_host_devices_are_not_mentioned_at_all(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host, drivers=("i40e", "i40e"), vfio_devs=(None, None))
    add_pci_device(
        host,
        "0000:00:1f.6",
        vendor="0x8086",
        device="0x15bc",
        driver="e1000e",
        cls="0x020000",
        iommu_group=9,
    )
    add_pci_device(  # no IOMMU group at all
        host, "0000:00:14.0", vendor="0x8086", device="0xa36d", driver="xhci_hcd", cls="0x0c0330"
    )
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    assert report == []
    # And beside an advertised group they stay out of it.
    add_rtx(host)
    tree, report = scan_and_report(with_x710())
    assert list(tree) == [RTX] and list(tree[RTX]) == [GPU]
    assert report == []


def test_a_bridge_alone_in_its_group_is_not_mentioned(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_pci_device(
        host,
        "0000:00:1c.0",
        vendor="0x8086",
        device="0x7ab8",
        driver="pcieport",
        cls="0x060400",
        iommu_group=11,
    )
    tree, report = scan_and_report()
    assert tree == DeviceTree()
    assert report == []


def test_a_function_whose_ids_do_not_read_is_skipped(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_vfio_group(host, 60)
    add_pci_device(
        host,
        "0000:af:00.0",
        vendor="0x8086",
        device="0x1572",
        driver="vfio-pci",
        iommu_group=60,
        extra_attributes={"vendor": "garbage"},
    )
    add_x710(host, vfio_devs=(None, None))
    tree, report = scan_and_report(with_x710())
    assert list(tree) == [X710] and list(tree[X710]) == [NIC0]
    assert report == []


def test_a_vfio_function_without_a_driver_bound_is_not_a_host_driver(
    host: UmockdevHost,
) -> None:
    # An unbound function is no obstacle for the kernel either.
    vfio_host(host, iommufd=False)
    add_x710(host, drivers=("vfio-pci", None), vfio_devs=(None, None))
    tree, report = scan_and_report(with_x710())
    assert report == []
    assert tree == DeviceTree(
        {X710: {NIC0: x710_info(nodes=dev("/dev/vfio/vfio", "/dev/vfio/40"), env={X710_VAR: NIC0})}}
    )


def test_vendor_variant_drivers_are_configurable(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, drivers=("vfio-pci", "mlx5_vfio_pci"), vfio_devs=(None, None))
    # With the default drivers the variant is a host driver.
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    assert "mlx5_vfio_pci" in report[0]["reason"]
    settings = with_x710(drivers=["vfio-pci", "mlx5_vfio_pci"])
    tree, report = scan_and_report(settings)
    assert report == []
    assert tree[X710][NIC0].env == {X710_VAR: NIC0}
    assert tree[X710][NIC0].health == Health.HEALTHY


def test_only_the_configured_drivers_count_as_vfio(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, vfio_devs=(None, None))
    # A host that uses a variant driver only: vfio-pci itself is then a host driver.
    tree, report = scan_and_report(with_x710(drivers=["mlx5_vfio_pci"]))
    assert tree == DeviceTree()
    assert report == []


# ------------------------------------------------------------------------- iommufd modes


def test_without_dev_iommu_auto_mode_gives_the_legacy_nodes(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host)  # vfio-dev cdevs exist, but no /dev/iommu to use them with
    assert scan(with_x710()) == DeviceTree(
        {X710: {NIC0: x710_info(nodes=dev("/dev/vfio/vfio", "/dev/vfio/40"))}}
    )


def test_legacy_mode_leaves_the_iommufd_nodes_out(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host)
    assert scan(with_x710(mode="legacy")) == DeviceTree(
        {X710: {NIC0: x710_info(nodes=dev("/dev/vfio/vfio", "/dev/vfio/40"))}}
    )


def test_iommufd_mode_gives_the_iommufd_nodes_only(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host)
    expected = x710_info(
        nodes=dev("/dev/iommu", "/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio1")
    )
    assert scan(with_x710(mode="iommufd")) == DeviceTree({X710: {NIC0: expected}})


def test_iommufd_mode_without_dev_iommu_reports_the_missing_node(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host)
    tree, report = scan_and_report(with_x710(mode="iommufd"))
    assert tree == DeviceTree()
    (group,) = report
    assert (group["group"], group["id"]) == (40, NIC0)
    assert "/dev/iommu" in group["reason"] and "missing" in group["reason"]


def test_a_missing_group_node_keeps_a_new_group_out(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host)
    host.set_node_present("/sys/devices/virtual/vfio/40", False)
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    (group,) = report
    assert "/dev/vfio/40" in group["reason"] and "missing" in group["reason"]


# ------------------------------------------------------------------------------ no-IOMMU


def noiommu_host(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_vfio_group(host, 0, noiommu=True)
    add_vfio_function(
        host, NIC0, vendor="0x8086", device="0x1572", group=0, cls="0x020000", numa_node=0
    )


def test_a_noiommu_group_is_refused_without_allow_noiommu(host: UmockdevHost) -> None:
    noiommu_host(host)
    tree, report = scan_and_report(with_x710())
    assert tree == DeviceTree()
    (group,) = report
    assert (group["group"], group["id"]) == (0, NIC0)
    assert "allow_noiommu" in group["reason"]


def test_a_noiommu_group_is_served_with_allow_noiommu(host: UmockdevHost) -> None:
    noiommu_host(host)
    tree, report = scan_and_report(with_x710(allow_noiommu=True))
    assert report == []
    assert tree == DeviceTree(
        {
            X710: {
                NIC0: DeviceInfo(
                    nodes=dev("/dev/vfio/vfio", "/dev/vfio/noiommu-0"),
                    env={X710_VAR: NIC0},
                    numa_nodes=(0,),
                    sources=(NIC0_PCI,),
                )
            }
        }
    )


# ----------------------------------------------------------------------- NUMA and ids


def test_groups_on_two_numa_nodes(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, numa_node=0, vfio_devs=(None, None))
    add_rtx(host, numa_node=1)
    tree = scan(with_x710())
    assert tree[X710][NIC0].numa_nodes == (0,)
    assert tree[RTX][GPU].numa_nodes == (1,)


def test_a_group_without_numa_information_has_no_topology(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, numa_node=-1)
    assert scan(with_x710())[X710][NIC0].numa_nodes == ()


def rebuild(host: UmockdevHost, groups: tuple[int, int]) -> None:
    """Remove every function and group node, and add them again in the given groups."""
    for path in list(host.devices):
        if path.startswith(("/sys/devices/pci", "/sys/devices/virtual/vfio/")) and host.has_device(
            path
        ):
            host.remove_device(path)
    add_x710(host, group=groups[0])
    add_rtx(host, group=groups[1])


def test_ids_stay_when_the_group_numbers_change(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, group=40)
    add_rtx(host, group=50)
    scanner = VfioScanner(with_x710())
    before = scanner.scan(UdevSource())
    assert {r: list(d) for r, d in before.items()} == {X710: [NIC0], RTX: [GPU]}
    assert before[X710][NIC0].nodes == dev("/dev/vfio/vfio", "/dev/vfio/40")

    # After a reboot the kernel numbers the groups the other way round.
    rebuild(host, (51, 12))
    after = scanner.scan(UdevSource())
    assert {r: list(d) for r, d in after.items()} == {X710: [NIC0], RTX: [GPU]}
    assert after[X710][NIC0] == x710_info(nodes=dev("/dev/vfio/vfio", "/dev/vfio/51"))
    assert after[RTX][GPU].nodes == dev("/dev/vfio/vfio", "/dev/vfio/12")
    assert after[RTX][GPU].health == Health.HEALTHY
    # A scanner that never saw the old numbers agrees.
    assert scan(with_x710()) == after


def test_the_id_is_the_lowest_address_not_the_first_found(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_vfio_group(host, 3)
    for address in ("0000:5e:00.3", "0000:5e:00.1", "0000:5e:00.2"):
        add_vfio_function(host, address, vendor="0x8086", device="0x1572", group=3)
    tree = scan(with_x710())
    assert list(tree[X710]) == ["0000:5e:00.1"]
    # Every function matches the selector: the first one is the group's requested function.
    assert tree[X710]["0000:5e:00.1"].env == {X710_VAR: "0000:5e:00.1"}


# ------------------------------------------------------------------------ resource names


def test_selectors_name_resources_and_the_rest_get_default_names(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host)
    add_rtx(host)
    tree = scan(with_x710())
    assert sorted(tree) == [X710, RTX]
    assert tree[X710][NIC0].env == {X710_VAR: NIC0}
    assert tree[RTX][GPU].env == {RTX_VAR: GPU}
    # Without selectors both get their default names.
    assert sorted(scan()) == ["vfio.devplug.io/10de_2204", "vfio.devplug.io/8086_1572"]


def test_the_default_domain_is_configurable(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_rtx(host)
    settings = VfioSettings.from_raw({"default_domain": "vfio.example.com"}, FIELD)
    tree = scan(settings)
    assert list(tree) == ["vfio.example.com/10de_2204"]
    assert tree["vfio.example.com/10de_2204"][GPU].env == {
        "PCI_RESOURCE_VFIO_EXAMPLE_COM_10DE_2204": GPU
    }


def test_a_selector_for_the_second_function_names_the_group(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_rtx(host)
    settings = VfioSettings.from_raw(
        {"devices": [{"selector": "10de:1aef", "resource": "nvidia.com/ga102_audio"}]}, FIELD
    )
    tree = scan(settings)
    assert list(tree) == ["nvidia.com/ga102_audio"]
    # The id stays the group's lowest address; the VM gets the function the selector names.
    assert tree["nvidia.com/ga102_audio"][GPU].env == {"PCI_RESOURCE_NVIDIA_COM_GA102_AUDIO": AUDIO}


def test_kubevirt_variable_names() -> None:
    assert kubevirt_variable("intel.com/x710") == "PCI_RESOURCE_INTEL_COM_X710"
    assert kubevirt_variable("vfio.devplug.io/10de_2204") == RTX_VAR
    assert kubevirt_variable("nvidia.com/GA102GL_A10") == "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10"


# ------------------------------------------------------------------------------- health


def healthy_scanner(host: UmockdevHost) -> tuple[VfioScanner, str, str]:
    vfio_host(host)
    first, second = add_x710(host)
    add_rtx(host)
    scanner = VfioScanner(with_x710())
    tree = scanner.scan(UdevSource())
    assert tree[X710][NIC0] == x710_info()
    assert tree[RTX][GPU].health == Health.HEALTHY
    return scanner, first, second


def test_an_unbound_function_makes_its_group_unhealthy_and_back(host: UmockdevHost) -> None:
    scanner, _, second = healthy_scanner(host)
    host.set_driver(second, None)
    tree = scanner.scan(UdevSource())
    info = tree[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert "left its VFIO driver" in info.health_reason and NIC1 in info.health_reason
    assert tree[RTX][GPU].health == Health.HEALTHY  # the other group is not affected
    assert scanner.report()[SECTION] == []  # still advertised, so not "unassignable"

    host.set_driver(second, "vfio-pci")
    assert scanner.scan(UdevSource())[X710][NIC0] == x710_info()


def test_a_function_bound_to_a_host_driver_makes_its_group_unhealthy(
    host: UmockdevHost,
) -> None:
    scanner, _, second = healthy_scanner(host)
    host.set_driver(second, "i40e")
    info = scanner.scan(UdevSource())[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert "bound to i40e" in info.health_reason and NIC1 in info.health_reason
    assert scanner.report()[SECTION] == []

    host.set_driver(second, "vfio-pci")
    tree = scanner.scan(UdevSource())
    assert tree[X710][NIC0] == x710_info()
    assert tree[RTX][GPU].health == Health.HEALTHY


def test_a_function_moved_to_pci_stub_has_left_its_vfio_driver(host: UmockdevHost) -> None:
    scanner, _, second = healthy_scanner(host)
    host.set_driver(second, "pci-stub")
    info = scanner.scan(UdevSource())[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert NIC1 in info.health_reason


def test_a_group_moved_entirely_to_pci_stub_says_why_it_is_unhealthy(
    host: UmockdevHost,
) -> None:
    scanner, first, second = healthy_scanner(host)
    host.set_driver(first, "pci-stub")
    host.set_driver(second, "pci-stub")
    info = scanner.scan(UdevSource())[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert NIC0 in info.health_reason and NIC1 in info.health_reason


def test_a_vanished_group_node_makes_the_group_unhealthy_and_back(host: UmockdevHost) -> None:
    scanner, _, _ = healthy_scanner(host)
    node = "/sys/devices/virtual/vfio/40"
    host.set_node_present(node, False)
    tree = scanner.scan(UdevSource())
    info = tree[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert "/dev/vfio/40" in info.health_reason
    assert tree[RTX][GPU].health == Health.HEALTHY

    host.set_node_present(node, True)
    assert scanner.scan(UdevSource())[X710][NIC0] == x710_info()


def test_a_vanished_iommufd_node_is_left_out_in_auto_mode(host: UmockdevHost) -> None:
    # In auto mode the iommufd nodes are a bonus (a kernel may have /dev/iommu without VFIO
    # cdev support): a missing one is not given, and is no reason for ill health.
    scanner, first, _ = healthy_scanner(host)
    host.set_node_present(f"{first}/vfio-dev/vfio0", False)
    info = scanner.scan(UdevSource())[X710][NIC0]
    assert info.health == Health.HEALTHY
    assert "/dev/vfio/devices/vfio0" not in [n.host_path for n in info.nodes]
    host.set_node_present(f"{first}/vfio-dev/vfio0", True)
    assert scanner.scan(UdevSource())[X710][NIC0] == x710_info()


def test_a_vanished_iommufd_node_makes_the_group_unhealthy_in_iommufd_mode(
    host: UmockdevHost,
) -> None:
    vfio_host(host)
    first, _ = add_x710(host)
    scanner = VfioScanner(with_x710(mode="iommufd"))
    assert scanner.scan(UdevSource())[X710][NIC0].health == Health.HEALTHY
    host.set_node_present(f"{first}/vfio-dev/vfio0", False)
    info = scanner.scan(UdevSource())[X710][NIC0]
    assert info.health == Health.UNHEALTHY
    assert "/dev/vfio/devices/vfio0" in info.health_reason


def test_a_vanished_container_node_makes_every_group_unhealthy(host: UmockdevHost) -> None:
    scanner, _, _ = healthy_scanner(host)
    host.set_node_present("/sys/devices/virtual/misc/vfio", False)
    tree = scanner.scan(UdevSource())
    for info in (tree[X710][NIC0], tree[RTX][GPU]):
        assert info.health == Health.UNHEALTHY
        assert "/dev/vfio/vfio" in info.health_reason


def test_a_group_rebound_to_the_host_entirely_stays_listed_unhealthy(
    host: UmockdevHost,
) -> None:
    scanner, first, second = healthy_scanner(host)
    host.set_driver(first, "i40e")
    host.set_driver(second, "i40e")
    for _ in range(2):  # and it stays so, scan after scan
        tree = scanner.scan(UdevSource())
        assert list(tree[X710]) == [NIC0]
        info = tree[X710][NIC0]
        assert info.health == Health.UNHEALTHY
        assert NIC0 in info.health_reason and NIC1 in info.health_reason
        assert "i40e" in info.health_reason
        assert scanner.report()[SECTION] == []

    host.set_driver(first, "vfio-pci")
    host.set_driver(second, "vfio-pci")
    assert scanner.scan(UdevSource())[X710][NIC0] == x710_info()


def test_functions_removed_from_sysfs_drop_their_group(host: UmockdevHost) -> None:
    scanner, first, second = healthy_scanner(host)
    host.remove_device(first)
    host.remove_device(second)
    tree = scanner.scan(UdevSource())
    assert list(tree) == [RTX]
    assert scanner.report()[SECTION] == []
    # The card comes back (a hotplug) on its host driver: a host device, nothing left of it.
    for address in (NIC0, NIC1):
        add_pci_device(
            host,
            address,
            vendor="0x8086",
            device="0x1572",
            driver="i40e",
            cls="0x020000",
            iommu_group=40,
        )
    assert list(scanner.scan(UdevSource())) == [RTX]
    assert scanner.report()[SECTION] == []


# ------------------------------------------------------------------------------- config


def refused(raw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        VfioSettings.from_raw(raw, FIELD)
    return exc.value


@pytest.mark.parametrize("raw", [None, {}])
def test_defaults(raw: dict[str, Any] | None) -> None:
    got = VfioSettings.from_raw(raw, FIELD)
    assert got.drivers == ("vfio-pci",)
    assert got.mode == "auto"
    assert got.allow_noiommu is False
    assert got.default_domain == "vfio.devplug.io"
    assert got.devices == ()
    assert VfioScanner().settings == got


@pytest.mark.parametrize("bad", ["8086-1572", "8086:157", "8086:15722", "gggg:1572", "8086", ""])
def test_a_bad_selector_names_its_field(bad: str) -> None:
    error = refused({"devices": [X710_SELECTOR, {"selector": bad, "resource": "intel.com/b"}]})
    assert error.field == "scanners.vfio.devices[1].selector"
    assert "<vendor>:<device>" in error.message and repr(bad) in error.message


def test_selectors_are_normalised() -> None:
    got = VfioSettings.from_raw(
        {"devices": [{"selector": "0x8086:0x1572", "resource": X710}]}, FIELD
    )
    assert got.resource_for("8086", "1572") == X710
    upper = VfioSettings.from_raw({"devices": [{"selector": "10DE:20B5", "resource": X710}]}, FIELD)
    assert upper.resource_for("10de", "20b5") == X710


def test_a_duplicate_selector_names_the_second_entry() -> None:
    error = refused(
        {
            "devices": [
                X710_SELECTOR,
                {"selector": "0x8086:0x1572", "resource": "intel.com/x710_other"},
            ]
        }
    )
    assert error.field == "scanners.vfio.devices[1].selector"
    assert "8086:1572" in error.message and "devices[0]" in error.message


@pytest.mark.parametrize("bad", ["x710", "kubernetes.io/x710", "intel.com/x/710", "Intel.com/x"])
def test_a_bad_resource_name_names_its_field(bad: str) -> None:
    error = refused({"devices": [{"selector": "8086:1572", "resource": bad}]})
    assert error.field == "scanners.vfio.devices[0].resource"
    assert "invalid resource name" in error.message and repr(bad) in error.message


def test_empty_drivers_are_refused() -> None:
    error = refused({"drivers": []})
    assert error.field == "scanners.vfio.drivers"
    assert "at least one driver" in error.message


def test_a_bad_driver_name_is_refused() -> None:
    error = refused({"drivers": ["vfio-pci", "../vfio"]})
    assert error.field == "scanners.vfio.drivers"
    assert "'../vfio'" in error.message


@pytest.mark.parametrize("bad", ["localhost", "kubernetes.io", "vfio.kubernetes.io", "Vfio.io"])
def test_a_bad_default_domain_is_refused(bad: str) -> None:
    error = refused({"default_domain": bad})
    assert error.field == "scanners.vfio.default_domain"
    assert "DNS domain outside kubernetes.io" in error.message


def test_a_bad_mode_is_refused() -> None:
    error = refused({"mode": "cdev"})
    assert error.field == "scanners.vfio.mode"
    assert "'auto', 'legacy' or 'iommufd'" in error.message


def test_an_unknown_key_gets_a_hint() -> None:
    error = refused({"allow_noiomu": True})
    assert error.field == "scanners.vfio.allow_noiomu"
    assert "did you mean 'allow_noiommu'" in error.message
    nested = refused({"devices": [{"selector": "8086:1572", "resource": X710, "resorce": "x"}]})
    assert nested.field == "scanners.vfio.devices[0].resorce"
    assert "did you mean 'resource'" in nested.message


def test_a_section_that_is_not_a_mapping_is_refused() -> None:
    error = refused(["vfio-pci"])
    assert error.field == FIELD and "must be a mapping" in error.message


def test_scanner_flag_vfio_builds_the_default_scanner() -> None:
    loaded = load_settings(None, {}, ["vfio"], {})
    assert loaded.scanners == {"vfio": None}
    (scanner,) = build_scanners(loaded.scanners)
    assert isinstance(scanner, VfioScanner)
    assert scanner.name == "vfio" and scanner.settings == VfioSettings()


def test_a_config_file_section_is_read_and_checked(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "scanners:\n"
        "  vfio:\n"
        "    mode: legacy\n"
        "    drivers: [vfio-pci, mlx5_vfio_pci]\n"
        "    devices:\n"
        "      - {selector: '8086:1572', resource: intel.com/x710}\n"
    )
    (scanner,) = build_scanners(load_settings(config, {}, ["vfio"], {}).scanners)
    assert isinstance(scanner, VfioScanner)
    assert scanner.settings.mode == "legacy"
    assert scanner.settings.drivers == ("vfio-pci", "mlx5_vfio_pci")
    assert scanner.settings.resource_for("8086", "1572") == X710

    config.write_text(
        "scanners:\n"
        "  vfio:\n"
        "    devices:\n"
        "      - {selector: '8086:1572', resource: intel.com/x710}\n"
        "      - {selector: '8086:1572', resource: intel.com/x710b}\n"
    )
    with pytest.raises(ConfigError) as exc:
        build_scanners(load_settings(config, {}, [], {}).scanners)
    assert exc.value.field == "scanners.vfio.devices[1].selector"


# ---------------------------------------------------------------------------------- CLI


def devplug(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def cli_host(host: UmockdevHost) -> None:
    """The X710 group on vfio-pci (iommufd present) and the GPU whose audio stays on the host."""
    vfio_host(host)
    add_x710(host)
    add_rtx(host, audio_driver="snd_hda_intel")


def test_scan_json_prints_resources_and_unassignable_groups(host: UmockdevHost) -> None:
    cli_host(host)
    result = devplug("scan", "--scanner", "vfio", "-o", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert sorted(document) == ["resources", SECTION]
    (device,) = document["resources"]["vfio.devplug.io/8086_1572"]
    assert device["id"] == NIC0
    assert device["health"] == "Healthy"
    assert device["env"] == {"PCI_RESOURCE_VFIO_DEVPLUG_IO_8086_1572": NIC0}
    assert [n["host_path"] for n in device["device_nodes"]] == [
        "/dev/vfio/vfio",
        "/dev/vfio/40",
        "/dev/iommu",
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/devices/vfio1",
    ]
    assert device["numa_nodes"] == [0]
    assert list(document["resources"]) == ["vfio.devplug.io/8086_1572"]
    (group,) = document[SECTION]
    assert (group["group"], group["id"]) == (50, GPU)
    assert group["functions"] == [
        {"address": GPU, "driver": "vfio-pci", "ids": "10de:2204"},
        {"address": AUDIO, "driver": "snd_hda_intel", "ids": "10de:1aef"},
    ]
    assert AUDIO in group["reason"] and "snd_hda_intel" in group["reason"]


def test_scan_yaml_prints_the_same_document(host: UmockdevHost) -> None:
    cli_host(host)
    as_json = devplug("scan", "--scanner", "vfio", "-o", "json")
    as_yaml = devplug("scan", "--scanner", "vfio", "-o", "yaml")
    assert as_yaml.returncode == 0, as_yaml.stderr
    assert yaml.safe_load(as_yaml.stdout) == json.loads(as_json.stdout)


def test_scan_table_prints_a_note_for_an_unassignable_group(host: UmockdevHost) -> None:
    cli_host(host)
    result = devplug("scan", "--scanner", "vfio")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE", "NODES"]
    assert lines[1].split() == [
        "vfio.devplug.io/8086_1572",
        NIC0,
        "Healthy",
        "0",
        "/dev/vfio/vfio",
        "/dev/vfio/40",
        "/dev/iommu",
        "/dev/vfio/devices/vfio0",
        "/dev/vfio/devices/vfio1",
    ]
    notes = [line for line in lines if line.startswith(f"{SECTION}: ")]
    assert len(notes) == 1
    assert "group 50" in notes[0]
    assert AUDIO in notes[0] and "snd_hda_intel" in notes[0]
    # The GPU is not in the table.
    assert not any(line.startswith("vfio.devplug.io/10de_2204") for line in lines)


def test_scan_table_has_no_notes_when_every_group_is_assignable(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host)
    result = devplug("scan", "--scanner", "vfio")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    assert SECTION not in result.stdout


def test_a_noiommu_group_below_a_bridge_is_served_when_allowed(host: UmockdevHost) -> None:
    """The group's name file is found through the function's iommu_group link wherever the
    function sits in the tree (the link is relative, as in sysfs)."""
    add_vfio_container(host)
    bridge = add_pci_device(
        host, "0000:00:1c.0", vendor="0x8086", device="0x7ab8", driver="pcieport", cls="0x060400"
    )
    add_vfio_group(host, 3, noiommu=True)
    add_vfio_function(
        host,
        "0000:05:00.0",
        vendor="0x8086",
        device="0x1572",
        group=3,
        cls="0x020000",
        parent=bridge,
    )
    refused, report = scan_and_report(VfioSettings())
    assert refused == DeviceTree() and "allow_noiommu" in report[0]["reason"]
    tree = scan(VfioSettings(allow_noiommu=True))
    (info,) = tree["vfio.devplug.io/8086_1572"].values()
    assert [n.host_path for n in info.nodes] == ["/dev/vfio/vfio", "/dev/vfio/noiommu-3"]


# ------------------------------------------------------------------------- review cases


def test_auto_mode_serves_legacy_when_the_kernel_lacks_vfio_cdevs(host: UmockdevHost) -> None:
    # /dev/iommu exists but the functions have no vfio-dev/ (no CONFIG_VFIO_DEVICE_CDEV).
    vfio_host(host)
    add_x710(host, vfio_devs=(None, None))
    tree, report = scan_and_report(with_x710())
    assert report == []
    (info,) = tree[X710].values()
    assert info.health == Health.HEALTHY
    assert [n.host_path for n in info.nodes] == ["/dev/vfio/vfio", "/dev/vfio/40", "/dev/iommu"]


def test_iommufd_mode_refuses_functions_without_an_iommufd_device(host: UmockdevHost) -> None:
    vfio_host(host)
    add_x710(host, vfio_devs=(0, None))
    tree, report = scan_and_report(with_x710(mode="iommufd"))
    assert tree == DeviceTree()
    (group,) = report
    assert NIC1 in group["reason"] and "VFIO cdev" in group["reason"]


def test_a_group_keeps_its_id_and_turns_unhealthy_when_its_first_function_goes(
    host: UmockdevHost,
) -> None:
    vfio_host(host, iommufd=False)
    first, _ = add_x710(host, vfio_devs=(None, None))
    scanner = VfioScanner(with_x710())
    assert set(scanner.scan(UdevSource())[X710]) == {NIC0}
    host.remove_device(first)
    tree = scanner.scan(UdevSource())
    # Not a new device under 0000:3b:00.1 while a VM may hold the group: the same one, sick.
    assert set(tree[X710]) == {NIC0}
    info = tree[X710][NIC0]
    assert info.health == Health.UNHEALTHY and f"function {NIC0} is gone" in info.health_reason
    assert info.env == {"PCI_RESOURCE_INTEL_COM_X710": NIC1}


def test_events_of_other_misc_devices_do_not_rescan(host: UmockdevHost) -> None:
    from devplug.scanners.udev import UdevEvent

    vfio_host(host, iommufd=False)
    add_x710(host, vfio_devs=(None, None))
    scanner = VfioScanner(with_x710())
    tree = scanner.scan(UdevSource())
    kvm = UdevEvent("change", "/sys/devices/virtual/misc/kvm", "misc")
    assert scanner.rescan(UdevSource(), tree, [kvm]) is tree
    vfio = UdevEvent("change", "/sys/devices/virtual/misc/vfio", "misc")
    assert scanner.rescan(UdevSource(), tree, [kvm, vfio]) is None
    unbind = UdevEvent("unbind", f"/sys/devices/pci0000:3b/{NIC0}", "pci")
    assert scanner.rescan(UdevSource(), tree, [unbind]) is None


def test_an_unlisted_vfio_variant_driver_gets_a_hint(host: UmockdevHost) -> None:
    vfio_host(host, iommufd=False)
    add_x710(host, drivers=("vfio-pci", "mlx5_vfio_pci"), vfio_devs=(None, None))
    _, (group,) = scan_and_report(with_x710())
    assert "add it to drivers" in group["reason"]


@pytest.mark.parametrize("value", ["yes", "1", "on"])
def test_allow_noiommu_takes_only_true_or_false(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        VfioSettings.from_raw({"allow_noiommu": value}, FIELD)
    assert refused.value.field == f"{FIELD}.allow_noiommu"


def test_an_empty_devices_list_is_no_devices() -> None:
    assert VfioSettings.from_raw({"devices": None}, FIELD).devices == ()
