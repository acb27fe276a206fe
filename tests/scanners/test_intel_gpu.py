"""The Intel GPU scanner's full scans through real pyudev against hand-built umockdev hosts.

Expectations are written from the scanner's contract (the issue and the module docstrings):
PCI functions with vendor 0x8086 and a drm card, ids by PCI address, resources by driver,
SR-IOV PFs hidden behind their VFs, NUMA from the PCI function, by-path mounts, and health
kept across scans by the scanner's memory of what it advertised.
"""

from __future__ import annotations

import pytest

from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health, Mount
from devplug.scanners.intel_gpu import (
    MONITORING_ID,
    MONITORING_RESOURCE,
    IntelGpuScanner,
    IntelGpuSettings,
)
from devplug.scanners.udev import UdevSource
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

# A small but realistic host: an SR-IOV Flex card, a discrete Battlemage on xe, an iGPU.
FLEX = "0000:4d:00.0"  # Data Center GPU Flex 170 (0x56c0), two VFs enabled
FLEX_PCI = "/sys/devices/pci0000:4d/0000:4d:00.0"
FLEX_VF1 = "/sys/devices/pci0000:4d/0000:4d:00.1"
FLEX_VF2 = "/sys/devices/pci0000:4d/0000:4d:00.2"
BMG = "0000:03:00.0"  # Arc B580 (0xe20b) on xe
BMG_PCI = "/sys/devices/pci0000:03/0000:03:00.0"
IGPU = "0000:00:02.0"  # Alder Lake-S iGPU (0x4680)
IGPU_PCI = "/sys/devices/pci0000:00/0000:00:02.0"


def node(name: str) -> DeviceNode:
    """What a container gets for /dev/dri/<name>: the same path inside, read-write."""
    return DeviceNode(f"/dev/dri/{name}", f"/dev/dri/{name}", "rw")


def link(address: str, kind: str) -> Mount:
    """udev's /dev/dri/by-path link of a GPU, bind-mounted read-only at the same path."""
    path = f"/dev/dri/by-path/pci-{address}-{kind}"
    return Mount(path, path, read_only=True)


# Intel's DRA driver's model and family of the PCI device ids used here (its ModelDetails
# table); any other id is "Unknown" in both.
INTEL_NAMES = {
    "0x56a0": ("A770", "Arc A-Series"),
    "0x56c0": ("Flex 170", "Data Center Flex"),
    "0xe20b": ("B580", "Arc B-Series"),
}


def intel(
    pci: str,
    *,
    device_id: str = "0x56a0",
    driver: str = "i915",
    sriov: bool = False,
    vf: bool = False,
    healthy: bool = True,
) -> dict[str, str | bool]:
    """The DRA attributes Intel's own DRA driver publishes for the GPU at ``pci``, by the
    names and in the formats of its node_state.go."""
    model, family = INTEL_NAMES.get(device_id, ("Unknown", "Unknown"))
    root, address = pci.split("/")[3], pci.rsplit("/", 1)[1]
    return {
        "model": model,
        "family": family,
        "driver": driver,
        "sriov": sriov,
        "type": "vf" if vf else "gpu",
        "pciId": device_id,
        "health": "Healthy" if healthy else "Unhealthy",
        "pciAddress": address,
        "pciRoot": root.split(":")[1],  # pci0000:4d -> 4d, the bus alone
    }


def gpu(
    pci: str,
    card: int,
    render: int | None,
    *,
    numa: tuple[int, ...] = (),
    mounts: tuple[Mount, ...] | None = None,
    device_id: str = "0x56a0",
    driver: str = "i915",
    sriov: bool = False,
    vf: bool = False,
) -> DeviceInfo:
    """The healthy DeviceInfo of a GPU at ``pci`` with cardN/renderDN and bypath single."""
    address = pci.rsplit("/", 1)[1]
    names = [f"card{card}"] + ([] if render is None else [f"renderD{render}"])
    if mounts is None:
        mounts = (link(address, "card"),) + (() if render is None else (link(address, "render"),))
    return DeviceInfo(
        health=Health.HEALTHY,
        health_reason="",
        nodes=tuple(node(name) for name in names),
        mounts=mounts,
        numa_nodes=numa,
        sources=(pci, *(f"{pci}/drm/{name}" for name in names)),
        attributes=intel(pci, device_id=device_id, driver=driver, sriov=sriov, vf=vf),
    )


def scan(settings: IntelGpuSettings | None = None) -> DeviceTree:
    return IntelGpuScanner(settings).scan(UdevSource())


def ids(tree: DeviceTree, resource: str) -> list[str]:
    return sorted(tree.get(resource, {}))


def build_host(host: UmockdevHost) -> None:
    add_intel_sriov_gpu(host, FLEX, card=0, render=128, vfs=2, numa_node=0)
    add_intel_gpu(host, BMG, card=3, render=131, device_id="0xe20b", driver="xe", numa_node=1)
    add_intel_gpu(host, IGPU, card=4, render=132, device_id="0x4680", numa_node=-1)


# ----------------------------------------------------------------------------- discovery


def test_a_realistic_host_gives_exactly_the_expected_tree(host: UmockdevHost) -> None:
    build_host(host)
    assert scan() == DeviceTree(
        {
            I915: {
                # The PF (card0, renderD128) is not advertised; its VFs are, on its NUMA node 0.
                "0000:4d:00.1": gpu(FLEX_VF1, 1, 129, numa=(0,), device_id="0x56c0", vf=True),
                "0000:4d:00.2": gpu(FLEX_VF2, 2, 130, numa=(0,), device_id="0x56c0", vf=True),
                "0000:00:02.0": gpu(IGPU_PCI, 4, 132, device_id="0x4680"),
            },
            XE: {"0000:03:00.0": gpu(BMG_PCI, 3, 131, numa=(1,), device_id="0xe20b", driver="xe")},
        }
    )


def test_an_sriov_pf_with_vfs_enabled_is_replaced_by_its_vfs(host: UmockdevHost) -> None:
    pf, vfs = add_intel_sriov_gpu(host, FLEX, card=0, render=128, vfs=3, numa_node=1)
    tree = scan()
    assert list(tree) == [I915]
    assert ids(tree, I915) == ["0000:4d:00.1", "0000:4d:00.2", "0000:4d:00.3"]
    vf3 = tree[I915]["0000:4d:00.3"]
    assert vf3 == gpu(vfs[2], 3, 131, numa=(1,), device_id="0x56c0", vf=True)
    assert vf3.nodes == (node("card3"), node("renderD131"))
    assert vf3.mounts == (link("0000:4d:00.3", "card"), link("0000:4d:00.3", "render"))
    # No id, node or source of the PF anywhere.
    for info in tree[I915].values():
        assert pf not in info.sources
        assert node("card0") not in info.nodes and node("renderD128") not in info.nodes


def test_an_sriov_capable_pf_without_vfs_is_an_ordinary_gpu(host: UmockdevHost) -> None:
    add_intel_gpu(
        host,
        FLEX,
        card=0,
        render=128,
        device_id="0x56c0",
        numa_node=1,
        extra_attributes={
            "sriov_numvfs": "0",
            "sriov_totalvfs": "7",
            "sriov_drivers_autoprobe": "1",
        },
    )
    expected = gpu(FLEX_PCI, 0, 128, numa=(1,), device_id="0x56c0", sriov=True)
    assert scan() == DeviceTree({I915: {FLEX: expected}})


@pytest.mark.parametrize(
    "sriov_files",
    [
        {},  # not SR-IOV capable at all
        {"sriov_totalvfs": "0", "sriov_drivers_autoprobe": "1"},
        # VFs would get no driver: Intel's DRA driver does not count it as SR-IOV either.
        {"sriov_totalvfs": "7", "sriov_drivers_autoprobe": "0"},
        {"sriov_totalvfs": "7"},
    ],
)
def test_sriov_is_false_unless_vfs_can_be_made_and_bound(
    host: UmockdevHost, sriov_files: dict[str, str]
) -> None:
    add_intel_gpu(host, FLEX, card=0, render=128, device_id="0x56c0", extra_attributes=sriov_files)
    assert scan()[I915][FLEX].attributes["sriov"] is False


def test_an_unhealthy_gpu_says_so_in_its_attributes(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    scanner = IntelGpuScanner()
    assert scanner.scan(UdevSource())[I915][BMG].attributes["health"] == "Healthy"
    host.set_node_present(f"{pci}/drm/card0", False)
    sick = scanner.scan(UdevSource())[I915][BMG]
    assert sick.health is Health.UNHEALTHY
    assert sick.attributes == intel(pci, healthy=False)
    host.set_node_present(f"{pci}/drm/card0", True)
    host.set_driver(pci, None)  # unbound: no driver to name
    unbound = scanner.scan(UdevSource())[I915][BMG]
    assert unbound.health is Health.UNHEALTHY
    expected = intel(pci, healthy=False)
    del expected["driver"]
    assert unbound.attributes == expected


def test_a_discrete_card_on_xe_with_numa_node_1(host: UmockdevHost) -> None:
    add_intel_gpu(host, BMG, card=1, render=129, device_id="0xe20b", driver="xe", numa_node=1)
    expected = DeviceInfo(
        health=Health.HEALTHY,
        nodes=(
            DeviceNode("/dev/dri/card1", "/dev/dri/card1", "rw"),
            DeviceNode("/dev/dri/renderD129", "/dev/dri/renderD129", "rw"),
        ),
        mounts=(
            Mount(
                "/dev/dri/by-path/pci-0000:03:00.0-card",
                "/dev/dri/by-path/pci-0000:03:00.0-card",
                read_only=True,
            ),
            Mount(
                "/dev/dri/by-path/pci-0000:03:00.0-render",
                "/dev/dri/by-path/pci-0000:03:00.0-render",
                read_only=True,
            ),
        ),
        numa_nodes=(1,),
        sources=(
            "/sys/devices/pci0000:03/0000:03:00.0",
            "/sys/devices/pci0000:03/0000:03:00.0/drm/card1",
            "/sys/devices/pci0000:03/0000:03:00.0/drm/renderD129",
        ),
        attributes={
            "model": "B580",
            "family": "Arc B-Series",
            "driver": "xe",
            "sriov": False,
            "type": "gpu",
            "pciId": "0xe20b",
            "health": "Healthy",
            "pciAddress": "0000:03:00.0",
            "pciRoot": "03",
        },
    )
    assert scan() == DeviceTree({XE: {"0000:03:00.0": expected}})


def test_an_integrated_gpu_without_numa_information_has_no_topology(host: UmockdevHost) -> None:
    add_intel_gpu(host, IGPU, card=0, render=128, device_id="0x4680", numa_node=-1)
    info = scan()[I915]["0000:00:02.0"]
    assert info.numa_nodes == ()
    assert info == gpu(IGPU_PCI, 0, 128, device_id="0x4680")


def test_numa_node_0_is_a_node_not_a_missing_one(host: UmockdevHost) -> None:
    add_intel_gpu(host, BMG, card=0, render=128, numa_node=0)
    assert scan()[I915][BMG].numa_nodes == (0,)


def test_a_gpu_without_a_render_node_gets_its_card_alone(host: UmockdevHost) -> None:
    add_intel_gpu(host, IGPU, card=0, render=None)
    assert scan() == DeviceTree({I915: {IGPU: gpu(IGPU_PCI, 0, None)}})


def test_a_non_intel_card_is_ignored(host: UmockdevHost) -> None:
    nvidia = add_pci_device(
        host, "0000:65:00.0", vendor="0x10de", device="0x2330", driver="nvidia", numa_node=0
    )
    add_drm_minors(host, nvidia, card=0, render=128, by_path="0000:65:00.0")
    amd = add_pci_device(host, "0000:66:00.0", vendor="0x1002", device="0x744c", driver="amdgpu")
    add_drm_minors(host, amd, card=1, render=129, by_path="0000:66:00.0")
    settings = IntelGpuSettings(monitoring=True)
    assert scan(settings) == DeviceTree()
    add_intel_gpu(host, BMG, card=2, render=130)
    tree = scan(settings)
    assert sorted(tree) == [I915, MONITORING_RESOURCE]
    assert ids(tree, I915) == [BMG]
    assert tree[MONITORING_RESOURCE][MONITORING_ID].nodes == (node("card2"), node("renderD130"))


def test_virtual_drm_devices_are_ignored(host: UmockdevHost) -> None:
    # vgem: a platform device (which even claims Intel's vendor id) with drm minors.
    vgem = host.add_device(
        "/sys/devices/platform/vgem", "platform", attributes={"vendor": "0x8086"}
    )
    add_drm_minors(host, vgem, card=0, render=128)
    # A card with no parent at all, below /sys/devices/virtual.
    host.add_device("/sys/devices/virtual/drm/card1", "drm", node=MockNode("dri/card1", 226, 1))
    settings = IntelGpuSettings(monitoring=True)
    assert scan(settings) == DeviceTree()
    add_intel_gpu(host, BMG, card=2, render=129)
    tree = scan(settings)
    assert tree == DeviceTree(
        {
            I915: {BMG: gpu(BMG_PCI, 2, 129)},
            MONITORING_RESOURCE: {
                MONITORING_ID: DeviceInfo(nodes=(node("card2"), node("renderD129")))
            },
        }
    )


def test_an_intel_pci_device_without_a_drm_card_is_not_a_gpu(host: UmockdevHost) -> None:
    add_pci_device(host, "0000:00:14.0", vendor="0x8086", device="0xa36d", driver="xhci_hcd")
    # An Intel GPU function bound to i915 with only a render node: no card, no GPU.
    render_only = add_pci_device(host, BMG, vendor="0x8086", device="0x56a0", driver="i915")
    host.add_device(
        f"{render_only}/drm/renderD128", "drm", node=MockNode("dri/renderD128", 226, 128)
    )
    assert scan() == DeviceTree()


def test_control_minors_are_left_out(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, IGPU, card=0, render=128)
    host.add_device(
        f"{pci}/drm/controlD64",
        "drm",
        properties={"DEVTYPE": "drm_minor"},
        node=MockNode("dri/controlD64", 226, 64),
    )
    tree = scan(IntelGpuSettings(monitoring=True))
    info = tree[I915][IGPU]
    assert info == gpu(IGPU_PCI, 0, 128)
    assert all("controlD" not in path for path in info.sources)
    assert tree[MONITORING_RESOURCE][MONITORING_ID].nodes == (node("card0"), node("renderD128"))


# ------------------------------------------------------------------------ ids and numbers


def test_ids_are_pci_addresses_stable_when_cards_renumber(host: UmockdevHost) -> None:
    first = add_intel_gpu(host, "0000:03:00.0", card=0, render=128)
    second = add_intel_gpu(host, "0000:04:00.0", card=1, render=129, driver="xe")
    scanner = IntelGpuScanner()
    before = scanner.scan(UdevSource())
    assert before == DeviceTree(
        {
            I915: {"0000:03:00.0": gpu(first, 0, 128)},
            XE: {"0000:04:00.0": gpu(second, 1, 129, driver="xe")},
        }
    )
    # Both drivers reload and the minors come back the other way round.
    for pci, card, render in ((first, 0, 128), (second, 1, 129)):
        host.remove_device(f"{pci}/drm/card{card}")
        host.remove_device(f"{pci}/drm/renderD{render}")
    add_drm_minors(host, first, card=1, render=129, by_path="0000:03:00.0")
    add_drm_minors(host, second, card=0, render=128, by_path="0000:04:00.0")
    expected = DeviceTree(
        {
            I915: {"0000:03:00.0": gpu(first, 1, 129)},
            XE: {"0000:04:00.0": gpu(second, 0, 128, driver="xe")},
        }
    )
    # The scanner that knew the old numbers: same ids, the new nodes, nothing "missing".
    assert scanner.scan(UdevSource()) == expected
    assert scanner.scan(UdevSource()) == expected
    # A scanner that never saw the old numbers agrees.
    assert scan() == expected


def test_a_gpu_in_a_five_digit_pci_domain_is_found_and_sorted_last(host: UmockdevHost) -> None:
    """Domains past ffff exist (Intel VMD puts devices in 10000+): the kernel prints them with
    more than four digits, and they are still GPUs, ordered after the lower domains."""
    vmd = add_intel_gpu(host, "10000:01:00.0", card=1, render=129)
    low = add_intel_gpu(host, "0000:03:00.0", card=0, render=128)
    tree = IntelGpuScanner.from_config({"shared_dev_num": 2}).scan(UdevSource())
    assert list(tree[I915]) == [
        "0000:03:00.0-0",
        "0000:03:00.0-1",
        "10000:01:00.0-0",
        "10000:01:00.0-1",
    ]
    assert tree[I915]["10000:01:00.0-0"].sources[0] == vmd
    assert tree[I915]["0000:03:00.0-1"].sources[0] == low


def test_renumbered_to_fresh_minors_the_gpu_stays_healthy(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128, numa_node=1)
    scanner = IntelGpuScanner()
    scanner.scan(UdevSource())
    host.remove_device(f"{pci}/drm/card0")
    host.remove_device(f"{pci}/drm/renderD128")
    add_drm_minors(host, pci, card=7, render=135, by_path=BMG)
    assert scanner.scan(UdevSource()) == DeviceTree({I915: {BMG: gpu(pci, 7, 135, numa=(1,))}})


def test_shared_dev_num_gives_each_gpu_that_many_ids(host: UmockdevHost) -> None:
    build_host(host)
    tree = scan(IntelGpuSettings(shared_dev_num=3))
    assert ids(tree, I915) == [
        "0000:00:02.0-0",
        "0000:00:02.0-1",
        "0000:00:02.0-2",
        "0000:4d:00.1-0",
        "0000:4d:00.1-1",
        "0000:4d:00.1-2",
        "0000:4d:00.2-0",
        "0000:4d:00.2-1",
        "0000:4d:00.2-2",
    ]
    assert ids(tree, XE) == ["0000:03:00.0-0", "0000:03:00.0-1", "0000:03:00.0-2"]
    # Every share of a GPU carries that GPU: its nodes, mounts, NUMA node and sources.
    for share in range(3):
        assert tree[XE][f"0000:03:00.0-{share}"] == gpu(
            BMG_PCI, 3, 131, numa=(1,), device_id="0xe20b", driver="xe"
        )
        assert tree[I915][f"0000:4d:00.2-{share}"] == gpu(
            FLEX_VF2, 2, 130, numa=(0,), device_id="0x56c0", vf=True
        )


def test_shared_dev_num_1_keeps_plain_addresses(host: UmockdevHost) -> None:
    add_intel_gpu(host, BMG, card=0, render=128)
    assert ids(scan(IntelGpuSettings(shared_dev_num=1)), I915) == [BMG]


def test_shared_dev_num_shares_are_unhealthy_together(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    add_intel_gpu(host, IGPU, card=1, render=129)
    scanner = IntelGpuScanner(IntelGpuSettings(shared_dev_num=2))
    scanner.scan(UdevSource())
    host.set_node_present(f"{pci}/drm/card0", False)
    tree = scanner.scan(UdevSource())
    assert {i: d.health for i, d in tree[I915].items()} == {
        f"{BMG}-0": Health.UNHEALTHY,
        f"{BMG}-1": Health.UNHEALTHY,
        f"{IGPU}-0": Health.HEALTHY,
        f"{IGPU}-1": Health.HEALTHY,
    }


# ------------------------------------------------------------------------------ by-path


def test_bypath_single_mounts_the_gpus_own_links(host: UmockdevHost) -> None:
    build_host(host)
    tree = scan(IntelGpuSettings(bypath="single"))
    assert tree[XE][BMG].mounts == (
        Mount(
            "/dev/dri/by-path/pci-0000:03:00.0-card",
            "/dev/dri/by-path/pci-0000:03:00.0-card",
            read_only=True,
        ),
        Mount(
            "/dev/dri/by-path/pci-0000:03:00.0-render",
            "/dev/dri/by-path/pci-0000:03:00.0-render",
            read_only=True,
        ),
    )
    assert tree[I915]["0000:4d:00.1"].mounts == (
        link("0000:4d:00.1", "card"),
        link("0000:4d:00.1", "render"),
    )
    assert tree == scan()  # single is the default


def test_bypath_single_mounts_only_links_that_exist(host: UmockdevHost) -> None:
    # No udev rules ran for this one: minors but no by-path links.
    bare = add_pci_device(host, BMG, vendor="0x8086", device="0x56a0", driver="i915")
    add_drm_minors(host, bare, card=0, render=128)
    add_intel_gpu(host, IGPU, card=1, render=None)
    tree = scan(IntelGpuSettings(bypath="single"))
    assert tree[I915][BMG].mounts == ()
    assert tree[I915][IGPU].mounts == (link(IGPU, "card"),)


def test_bypath_none_mounts_nothing(host: UmockdevHost) -> None:
    build_host(host)
    tree = scan(IntelGpuSettings(bypath="none"))
    assert ids(tree, I915) == ["0000:00:02.0", "0000:4d:00.1", "0000:4d:00.2"]
    assert [info.mounts for devices in tree.values() for info in devices.values()] == [()] * 4
    assert tree[XE][BMG] == gpu(
        BMG_PCI, 3, 131, numa=(1,), mounts=(), device_id="0xe20b", driver="xe"
    )


def test_bypath_all_mounts_the_whole_dir(host: UmockdevHost) -> None:
    build_host(host)
    tree = scan(IntelGpuSettings(bypath="all"))
    whole = (Mount("/dev/dri/by-path", "/dev/dri/by-path", read_only=True),)
    assert [info.mounts for devices in tree.values() for info in devices.values()] == [whole] * 4
    assert tree[XE][BMG] == gpu(
        BMG_PCI, 3, 131, numa=(1,), mounts=whole, device_id="0xe20b", driver="xe"
    )


def test_bypath_all_without_the_dir_mounts_nothing(host: UmockdevHost) -> None:
    # No udev by-path links at all: /dev/dri/by-path does not exist (the testbed hides the
    # real /dev/dri with its own).
    bare = add_pci_device(host, BMG, vendor="0x8086", device="0x56a0", driver="i915")
    add_drm_minors(host, bare, card=0, render=128)
    assert (host.root / "dev" / "dri").is_dir()
    assert not (host.root / "dev" / "dri" / "by-path").exists()
    tree = scan(IntelGpuSettings(bypath="all"))
    assert tree == DeviceTree({I915: {BMG: gpu(bare, 0, 128, mounts=())}})


# ----------------------------------------------------------------------- allow and deny


def three_models(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:03:00.0", card=0, render=128, device_id="0x56a0")
    add_intel_gpu(host, "0000:04:00.0", card=1, render=129, device_id="0x56a1")
    add_intel_gpu(host, "0000:00:02.0", card=2, render=130, device_id="0x4680")


def test_allow_ids_keep_only_those_models(host: UmockdevHost) -> None:
    three_models(host)
    tree = scan(IntelGpuSettings(allow_ids=("0x56a0", "0x4680")))
    assert ids(tree, I915) == ["0000:00:02.0", "0000:03:00.0"]
    # Written in upper case in the config, the ids still match.
    assert ids(scan(IntelGpuSettings(allow_ids=("0x56A1",))), I915) == ["0000:04:00.0"]


def test_deny_ids_drop_those_models(host: UmockdevHost) -> None:
    three_models(host)
    tree = scan(IntelGpuSettings(deny_ids=("0x56a0",)))
    assert ids(tree, I915) == ["0000:00:02.0", "0000:04:00.0"]
    assert scan(IntelGpuSettings(deny_ids=("0x1234",))) == scan()


def test_allow_ids_apply_to_vfs_by_their_own_device_id(host: UmockdevHost) -> None:
    add_intel_sriov_gpu(host, FLEX, card=0, render=128, vfs=2, device_id="0x56c0")
    add_intel_gpu(host, BMG, card=3, render=131, device_id="0x56a0")
    assert ids(scan(IntelGpuSettings(allow_ids=("0x56c0",))), I915) == [
        "0000:4d:00.1",
        "0000:4d:00.2",
    ]
    assert ids(scan(IntelGpuSettings(deny_ids=("0x56c0",))), I915) == [BMG]


# --------------------------------------------------------------------------- monitoring


def test_monitoring_carries_every_advertised_gpus_nodes(host: UmockdevHost) -> None:
    build_host(host)
    tree = scan(IntelGpuSettings(monitoring=True))
    assert list(tree[MONITORING_RESOURCE]) == [MONITORING_ID]
    monitor = tree[MONITORING_RESOURCE][MONITORING_ID]
    # VF1 card1/renderD129, VF2 card2/renderD130, BMG card3/renderD131, iGPU card4/renderD132;
    # not the PF's card0/renderD128, which is not advertised.
    assert monitor.nodes == (
        node("card1"),
        node("card2"),
        node("card3"),
        node("card4"),
        node("renderD129"),
        node("renderD130"),
        node("renderD131"),
        node("renderD132"),
    )
    assert monitor.health is Health.HEALTHY
    assert monitor.mounts == () and monitor.numa_nodes == ()
    # The GPUs themselves are as without monitoring.
    without = scan()
    assert {r: dict(d) for r, d in tree.items() if r != MONITORING_RESOURCE} == {
        r: dict(d) for r, d in without.items()
    }


def test_monitoring_nodes_sort_naturally(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:03:00.0", card=2, render=130)
    add_intel_gpu(host, "0000:04:00.0", card=10, render=138)
    monitor = scan(IntelGpuSettings(monitoring=True))[MONITORING_RESOURCE][MONITORING_ID]
    assert monitor.nodes == (node("card2"), node("card10"), node("renderD130"), node("renderD138"))


def test_no_monitoring_device_without_gpus_or_when_disabled(host: UmockdevHost) -> None:
    assert MONITORING_RESOURCE not in scan(IntelGpuSettings(monitoring=True))
    # Only a PF with VFs that are all denied: nothing advertised, nothing to monitor.
    add_intel_sriov_gpu(host, FLEX, card=0, render=128, vfs=1)
    assert scan(IntelGpuSettings(monitoring=True, deny_ids=("0x56c0",))) == DeviceTree()
    add_intel_gpu(host, BMG, card=2, render=130)
    assert MONITORING_RESOURCE not in scan(IntelGpuSettings(monitoring=False))
    assert MONITORING_RESOURCE not in scan()
    assert MONITORING_RESOURCE in scan(IntelGpuSettings(monitoring=True))


def test_monitoring_has_one_id_whatever_shared_dev_num(host: UmockdevHost) -> None:
    add_intel_gpu(host, BMG, card=0, render=128)
    tree = scan(IntelGpuSettings(monitoring=True, shared_dev_num=4))
    assert list(tree[MONITORING_RESOURCE]) == [MONITORING_ID]
    assert len(tree[I915]) == 4


# ------------------------------------------------------------------------------- health


def test_a_deleted_card_node_makes_the_gpu_unhealthy_until_restored(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128, numa_node=1)
    other = add_intel_gpu(host, IGPU, card=1, render=129)
    scanner = IntelGpuScanner(IntelGpuSettings(monitoring=True))
    healthy = scanner.scan(UdevSource())
    assert healthy[I915][BMG] == gpu(pci, 0, 128, numa=(1,))
    host.set_node_present(f"{pci}/drm/card0", False)
    for _ in range(2):  # the same answer at every scan while the node is gone
        tree = scanner.scan(UdevSource())
        sick = tree[I915][BMG]
        assert sick.health is Health.UNHEALTHY
        assert "/dev/dri/card0" in sick.health_reason and BMG in sick.health_reason
        assert "renderD128" not in sick.health_reason
        assert sick.numa_nodes == (1,)
        assert node("card0") not in sick.nodes
        assert tree[I915][IGPU] == gpu(other, 1, 129)
        monitor = tree[MONITORING_RESOURCE][MONITORING_ID]
        assert node("card0") not in monitor.nodes and node("renderD128") in monitor.nodes
    host.set_node_present(f"{pci}/drm/card0", True)
    assert scanner.scan(UdevSource()) == healthy


def test_a_deleted_render_node_makes_the_gpu_unhealthy_at_every_scan(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    scanner = IntelGpuScanner()
    healthy = scanner.scan(UdevSource())
    host.set_node_present(f"{pci}/drm/renderD128", False)
    for _ in range(3):
        sick = scanner.scan(UdevSource())[I915][BMG]
        assert sick.health is Health.UNHEALTHY
        assert "/dev/dri/renderD128" in sick.health_reason
        assert sick.nodes == (node("card0"),)
    host.set_node_present(f"{pci}/drm/renderD128", True)
    assert scanner.scan(UdevSource()) == healthy


def test_a_vf_whose_render_node_is_missing(host: UmockdevHost) -> None:
    _, (vf1, vf2) = add_intel_sriov_gpu(host, FLEX, card=0, render=128, vfs=2, numa_node=1)
    scanner = IntelGpuScanner()
    healthy = scanner.scan(UdevSource())
    host.set_node_present(f"{vf1}/drm/renderD129", False)
    for _ in range(2):
        tree = scanner.scan(UdevSource())
        assert ids(tree, I915) == ["0000:4d:00.1", "0000:4d:00.2"]  # still no PF
        sick = tree[I915]["0000:4d:00.1"]
        assert sick.health is Health.UNHEALTHY
        assert "/dev/dri/renderD129" in sick.health_reason and "0000:4d:00.1" in sick.health_reason
        assert sick.nodes == (node("card1"),)
        assert sick.numa_nodes == (1,)
        assert tree[I915]["0000:4d:00.2"] == gpu(
            vf2, 2, 130, numa=(1,), device_id="0x56c0", vf=True
        )
    host.set_node_present(f"{vf1}/drm/renderD129", True)
    assert scanner.scan(UdevSource()) == healthy


def test_an_unbound_driver_makes_the_gpu_unhealthy_until_rebound(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    scanner = IntelGpuScanner()
    healthy = scanner.scan(UdevSource())
    host.set_driver(pci, None)
    for _ in range(2):
        tree = scanner.scan(UdevSource())
        assert list(tree) == [I915]  # stays in its resource: no gpu.intel.com/<nothing>
        sick = tree[I915][BMG]
        assert sick.health is Health.UNHEALTHY
        assert sick.health_reason.startswith(f"no driver is bound to {BMG}")
    host.set_driver(pci, "i915")
    assert scanner.scan(UdevSource()) == healthy


def test_an_unbind_that_takes_the_minors_along(host: UmockdevHost) -> None:
    # What a real unbind does: the drm minors go with the driver.
    pci = add_intel_gpu(host, BMG, card=0, render=128, driver="xe")
    scanner = IntelGpuScanner()
    healthy = scanner.scan(UdevSource())
    host.remove_device(f"{pci}/drm/card0")
    host.remove_device(f"{pci}/drm/renderD128")
    host.set_driver(pci, None)
    sick = scanner.scan(UdevSource())[XE][BMG]
    assert sick.health is Health.UNHEALTHY
    assert sick.health_reason.startswith(f"no driver is bound to {BMG}")
    host.set_driver(pci, "xe")
    add_drm_minors(host, pci, card=0, render=128, by_path=BMG)
    assert scanner.scan(UdevSource()) == healthy


def test_a_bound_driver_without_a_card_leaves_the_gpu_unhealthy(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    scanner = IntelGpuScanner()
    healthy = scanner.scan(UdevSource())
    host.remove_device(f"{pci}/drm/card0")
    sick = scanner.scan(UdevSource())[I915][BMG]
    assert sick.health is Health.UNHEALTHY and BMG in sick.health_reason
    add_drm_minors(host, pci, card=0, render=None, by_path=BMG)
    assert scanner.scan(UdevSource()) == healthy


def test_a_gpu_rebound_to_vfio_pci_is_dropped(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    add_intel_gpu(host, IGPU, card=1, render=129)
    scanner = IntelGpuScanner(IntelGpuSettings(monitoring=True))
    scanner.scan(UdevSource())
    # Handed to a VM: i915 lets go (its minors go), vfio-pci binds.
    host.remove_device(f"{pci}/drm/card0")
    host.remove_device(f"{pci}/drm/renderD128")
    host.set_driver(pci, "vfio-pci")
    for _ in range(2):
        tree = scanner.scan(UdevSource())
        assert sorted(tree) == [I915, MONITORING_RESOURCE]
        assert ids(tree, I915) == [IGPU]
        assert tree[MONITORING_RESOURCE][MONITORING_ID].nodes == (
            node("card1"),
            node("renderD129"),
        )


def test_a_removed_pci_function_is_dropped(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    add_intel_gpu(host, IGPU, card=1, render=129)
    scanner = IntelGpuScanner()
    scanner.scan(UdevSource())
    host.set_node_present(f"{pci}/drm/card0", False)
    assert scanner.scan(UdevSource())[I915][BMG].health is Health.UNHEALTHY
    host.remove_device(pci)  # while unhealthy: it goes all the same
    assert ids(scanner.scan(UdevSource()), I915) == [IGPU]


def test_a_gpu_is_advertised_only_once_its_card_node_exists(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128, numa_node=1)
    host.set_node_present(f"{pci}/drm/card0", False)
    scanner = IntelGpuScanner(IntelGpuSettings(monitoring=True))
    for _ in range(2):
        assert scanner.scan(UdevSource()) == DeviceTree()
    host.set_node_present(f"{pci}/drm/card0", True)
    tree = scanner.scan(UdevSource())
    assert tree[I915] == {BMG: gpu(pci, 0, 128, numa=(1,))}


def test_an_unchanged_host_scans_the_same_twice_with_a_render_node_missing(
    host: UmockdevHost,
) -> None:
    # First sight with the card node but not the render node (udev still creating it).
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    host.set_node_present(f"{pci}/drm/renderD128", False)
    scanner = IntelGpuScanner()
    first = scanner.scan(UdevSource())
    assert ids(first, I915) == [BMG]
    # Nothing changed on the host: nothing may change in the answer.
    assert scanner.scan(UdevSource()) == first
    host.set_node_present(f"{pci}/drm/renderD128", True)
    assert scanner.scan(UdevSource()) == DeviceTree({I915: {BMG: gpu(pci, 0, 128)}})


def test_rebinding_i915_to_xe_moves_the_gpu(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128, device_id="0xe20b", numa_node=1)
    add_intel_gpu(host, IGPU, card=1, render=129)
    scanner = IntelGpuScanner()
    assert ids(scanner.scan(UdevSource()), I915) == [IGPU, BMG]
    host.set_driver(pci, "xe")
    tree = scanner.scan(UdevSource())
    assert tree == DeviceTree(
        {
            I915: {IGPU: gpu(IGPU_PCI, 1, 129)},
            XE: {BMG: gpu(pci, 0, 128, numa=(1,), device_id="0xe20b", driver="xe")},
        }
    )


def test_unhealthy_on_i915_then_rebound_to_xe_is_healthy_there(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, BMG, card=0, render=128)
    scanner = IntelGpuScanner()
    scanner.scan(UdevSource())
    host.set_driver(pci, None)
    assert scanner.scan(UdevSource())[I915][BMG].health is Health.UNHEALTHY
    host.set_driver(pci, "xe")
    assert scanner.scan(UdevSource()) == DeviceTree({XE: {BMG: gpu(pci, 0, 128, driver="xe")}})


@pytest.mark.parametrize("driver", ["i915", "xe"])
def test_the_resource_is_named_after_the_driver(host: UmockdevHost, driver: str) -> None:
    add_intel_gpu(host, BMG, card=0, render=128, driver=driver)
    assert list(scan()) == [f"gpu.intel.com/{driver}"]


def test_a_gpu_never_bound_is_not_advertised(host: UmockdevHost) -> None:
    add_intel_gpu(host, BMG, card=0, render=128, driver=None)
    assert scan(IntelGpuSettings(monitoring=True)) == DeviceTree()
