"""The pool builder: wire form, slicing, the empty pool, health, attributes (devplug's, PCI,
NUMA, a scanner's) and one odd device never failing the pool."""

from __future__ import annotations

from typing import Any

import pytest
from dra_schemas import VERSIONS, all_schema_errors, schema_errors
from kubernetes_validate import utils as kubernetes_validate

from devplug.dra.attributes import PCI_BUS_ID, PCIE_ROOT, pci_attributes
from devplug.dra.naming import device_name
from devplug.dra.slices import build_pool, resource_problem
from devplug.dra.validate import validate_resource_slice
from devplug.errors import InvalidNameError
from devplug.model import DeviceInfo, DeviceTree, Health

NODE, DRIVER, GPU = "node1", "gpu.example.com", "gpu.example.com/gpu"


def gpu_path(address: str, root: str = "pci0000:00") -> str:
    return f"/sys/devices/{root}/0000:00:01.0/{address}"


def pci_tree(count: int, resource: str = GPU) -> DeviceTree:
    devices = {}
    for n in range(count):
        address = f"0000:{n // 32:02x}:{n % 32:02x}.0"
        devices[address] = DeviceInfo(numa_nodes=(n % 2,), sources=(gpu_path(address),))
    return DeviceTree({resource: devices})


def devices_of(slices: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices", [])]


def attributes(pool_slices: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    return next(d["attributes"] for d in devices_of(pool_slices) if d["name"] == name)


def test_dra_schemas_agree_with_kubernetes_validate() -> None:
    """The cached schema helper judges as kubernetes_validate.utils.validate does."""
    good = build_pool(pci_tree(2), node_name=NODE, driver=DRIVER, generation=1).slices[0]
    unknown_field = {**good, "spec": {**good["spec"], "colour": "red"}}
    wrong_type = {
        **good,
        "spec": {**good["spec"], "pool": {**good["spec"]["pool"], "generation": "1"}},
    }
    for version in VERSIONS:
        assert schema_errors(good, version) == []
        kubernetes_validate.validate(good, version, strict=True)
        for bad in (unknown_field, wrong_type):
            assert schema_errors(bad, version)
            with pytest.raises(kubernetes_validate.ValidationError):
                kubernetes_validate.validate(bad, version, strict=True)


def test_dra_wire_form_of_one_device() -> None:
    address = "0000:03:00.0"
    info = DeviceInfo(
        numa_nodes=(1,),
        sources=(gpu_path(address, "pci0000:02"), gpu_path(address, "pci0000:02") + "/drm/card1"),
        attributes={"model": "A770", "sriov": True, "tiles": 2},
    )
    pool = build_pool(
        DeviceTree({GPU: {address: info}}),
        node_name=NODE,
        driver=DRIVER,
        generation=7,
        node_uid="u-1",
    )
    assert pool.slices == (
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": "node1-gpu.example.com-0",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": NODE,
                        "uid": "u-1",
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": DRIVER,
                "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1},
                "nodeName": NODE,
                "devices": [
                    {
                        "name": "0000-03-00-0",
                        "attributes": {
                            "id": {"string": address},
                            "model": {"string": "A770"},
                            "numaNode": {"int": 1},
                            "resource": {"string": GPU},
                            PCI_BUS_ID: {"string": address},
                            PCIE_ROOT: {"string": "pci0000:02"},
                            "sriov": {"bool": True},
                            "tiles": {"int": 2},
                        },
                    }
                ],
            },
        },
    )
    assert pool.omitted == ()
    assert {n: (d.resource, d.device_id) for n, d in pool.devices.items()} == {
        "0000-03-00-0": (GPU, address)
    }
    assert all_schema_errors(pool.slices[0]) == {} and validate_resource_slice(pool.slices[0]) == []


@pytest.mark.parametrize(("count", "sizes"), [(128, [128]), (129, [128, 1]), (300, [128, 128, 44])])
def test_dra_at_most_128_devices_per_slice_and_the_count_in_every_slice(
    count: int, sizes: list[int]
) -> None:
    pool = build_pool(pci_tree(count), node_name=NODE, driver=DRIVER, generation=3)
    assert [len(s["spec"]["devices"]) for s in pool.slices] == sizes
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in pool.slices} == {len(sizes)}
    assert {s["spec"]["pool"]["generation"] for s in pool.slices} == {3}
    assert [s["metadata"]["name"] for s in pool.slices] == [
        f"node1-gpu.example.com-{i}" for i in range(len(sizes))
    ]
    for s in pool.slices:
        assert validate_resource_slice(s) == []


def test_dra_the_empty_pool_is_one_slice_without_devices() -> None:
    for tree in (DeviceTree(), DeviceTree({GPU: {"gpu0": DeviceInfo(health=Health.UNHEALTHY)}})):
        pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=0)
        assert len(pool.slices) == 1
        spec = pool.slices[0]["spec"]
        assert "devices" not in spec  # as the API server returns it (omitempty)
        assert spec["pool"] == {"name": NODE, "generation": 0, "resourceSliceCount": 1}
        assert (
            validate_resource_slice(pool.slices[0]) == []
            and all_schema_errors(pool.slices[0]) == {}
        )


def test_dra_unhealthy_devices_leave_the_pool() -> None:
    tree = DeviceTree(
        {
            GPU: {
                "gpu0": DeviceInfo(),
                "gpu1": DeviceInfo(health=Health.UNHEALTHY, health_reason="gone"),
            }
        }
    )
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert [d["name"] for d in devices_of(pool.slices)] == ["gpu0"]
    assert set(pool.devices) == {"gpu0"} and pool.omitted == ()


def test_dra_only_the_dra_resources() -> None:
    tree = DeviceTree({GPU: {"gpu0": DeviceInfo()}, "example.com/nic": {"nic0": DeviceInfo()}})
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1, resources=[GPU])
    assert [d["attributes"]["resource"] for d in devices_of(pool.slices)] == [{"string": GPU}]


def test_dra_order_is_resource_then_natural_id_whatever_the_tree_order() -> None:
    ids = ["gpu10", "gpu2", "gpu1", "0000:0a:00.0", "0000:09:00.0"]
    one = DeviceTree({GPU: {i: DeviceInfo() for i in ids}, "example.com/a": {"x": DeviceInfo()}})
    other = DeviceTree(
        {"example.com/a": {"x": DeviceInfo()}, GPU: {i: DeviceInfo() for i in reversed(ids)}}
    )
    first = build_pool(one, node_name=NODE, driver=DRIVER, generation=1)
    assert first == build_pool(other, node_name=NODE, driver=DRIVER, generation=1)
    assert [d["attributes"]["id"]["string"] for d in devices_of(first.slices)] == [
        "x",
        "0000:09:00.0",
        "0000:0a:00.0",
        "gpu1",
        "gpu2",
        "gpu10",
    ]


def test_dra_one_odd_device_loses_only_what_is_invalid() -> None:
    odd = DeviceInfo(
        attributes={
            "model": "A770",
            "serial": "s" * 65,  # too long
            "9lives": 1,  # not a C identifier
            "a" * 33: 1,  # name too long
            "huge": 2**63,  # outside int64
            "resource": "mine",  # devplug's own
            f"{DRIVER}/id": "mine",  # devplug's own, under the driver's domain
            f"{DRIVER}/model": "B580",  # the same attribute as the bare "model"
            "other.example.com/model": "C1",  # another domain: its own attribute
            "wide": "é" * 33,  # 66 bytes
        }
    )
    tree = DeviceTree({GPU: {"gpu0": odd, "gpu1": DeviceInfo(attributes={"model": "A770"})}})
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert [d["name"] for d in devices_of(pool.slices)] == ["gpu0", "gpu1"]
    published = attributes(pool.slices, "gpu0")
    assert published["model"] == {"string": "A770"} and published["resource"] == {"string": GPU}
    assert published["id"] == {"string": "gpu0"}
    assert published["other.example.com/model"] == {"string": "C1"}
    assert {o.attribute for o in pool.omitted} == {
        "serial",
        "9lives",
        "a" * 33,
        "huge",
        "resource",
        f"{DRIVER}/id",
        f"{DRIVER}/model",
        "wide",
    }
    assert {o.device_id for o in pool.omitted} == {"gpu0"}
    assert all(o.reason for o in pool.omitted)
    assert validate_resource_slice(pool.slices[0]) == [] and all_schema_errors(pool.slices[0]) == {}


def test_dra_at_most_32_attributes_per_device_scanner_ones_in_name_order() -> None:
    extras = {f"x{i:02d}": i for i in range(40)}
    pool = build_pool(
        DeviceTree({GPU: {"gpu0": DeviceInfo(attributes=extras)}}),
        node_name=NODE,
        driver=DRIVER,
        generation=1,
    )
    published = attributes(pool.slices, "gpu0")
    assert len(published) == 32  # resource, id and the first 30 extras
    assert {f"x{i:02d}" for i in range(30)} <= published.keys()
    assert sorted(o.attribute for o in pool.omitted) == [f"x{i:02d}" for i in range(30, 40)]
    assert validate_resource_slice(pool.slices[0]) == []


def test_dra_devices_whose_names_collide_all_leave() -> None:
    # Two resources of one driver with the same id: one name, two devices.
    tree = DeviceTree(
        {
            GPU: {"gpu0": DeviceInfo(), "gpu1": DeviceInfo()},
            "gpu.example.com/vf": {"gpu0": DeviceInfo()},
        }
    )
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert [d["name"] for d in devices_of(pool.slices)] == ["gpu1"]
    assert sorted((o.resource, o.device_id, o.attribute) for o in pool.omitted) == [
        (GPU, "gpu0", ""),
        ("gpu.example.com/vf", "gpu0", ""),
    ]
    assert all("'gpu0'" in o.reason for o in pool.omitted)


def test_dra_a_resource_too_long_for_its_attribute_leaves_with_a_reason() -> None:
    long_resource = "example.com/" + "r" * 60
    assert resource_problem(long_resource) is not None and resource_problem(GPU) is None
    tree = DeviceTree({long_resource: {"d0": DeviceInfo()}, GPU: {"gpu0": DeviceInfo()}})
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert [d["name"] for d in devices_of(pool.slices)] == ["gpu0"]
    assert [(o.resource, o.device_id, o.attribute) for o in pool.omitted] == [
        (long_resource, "d0", "")
    ]


def test_dra_numa_node_only_for_exactly_one() -> None:
    tree = DeviceTree(
        {
            GPU: {
                "a": DeviceInfo(numa_nodes=(0,)),
                "b": DeviceInfo(numa_nodes=(0, 1)),
                "c": DeviceInfo(),
            }
        }
    )
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
    assert attributes(pool.slices, "a")["numaNode"] == {"int": 0}
    assert "numaNode" not in attributes(pool.slices, "b")
    assert "numaNode" not in attributes(pool.slices, "c")


@pytest.mark.parametrize(
    ("device_id", "sources", "expected"),
    [
        # A GPU: the function, then its drm minor.
        (
            "0000:03:00.0",
            [gpu_path("0000:03:00.0"), gpu_path("0000:03:00.0") + "/drm/card0"],
            {PCI_BUS_ID: "0000:03:00.0", PCIE_ROOT: "pci0000:00"},
        ),
        # An Intel share of it.
        (
            "0000:03:00.0-2",
            [gpu_path("0000:03:00.0")],
            {PCI_BUS_ID: "0000:03:00.0", PCIE_ROOT: "pci0000:00"},
        ),
        # A VFIO group: a bridge first, the group's id is its lowest endpoint.
        (
            "0000:05:00.0",
            [
                gpu_path("0000:04:00.0", "pci0000:40"),
                gpu_path("0000:05:00.0", "pci0000:40"),
                gpu_path("0000:05:00.1", "pci0000:40"),
            ],
            {PCI_BUS_ID: "0000:05:00.0", PCIE_ROOT: "pci0000:40"},
        ),
        # Several functions, none in the id, one root: the root alone.
        (
            "group-12",
            [gpu_path("0000:05:00.0"), gpu_path("0000:05:00.1")],
            {PCIE_ROOT: "pci0000:00"},
        ),
        # Several roots: nothing to say.
        ("group-13", [gpu_path("0000:05:00.0"), gpu_path("0000:85:00.0", "pci0000:80")], {}),
        # Not PCI, a 5-digit domain (outside the upstream BDF pattern), or outside /sys/devices.
        ("ttyUSB0", ["/sys/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/ttyUSB0"], {}),
        ("10000:01:00.0", ["/sys/devices/pci10000:00/10000:01:00.0"], {}),
        ("0000:03:00.0", ["/sys/bus/pci/devices/0000:03:00.0"], {}),
        ("0000:03:00.0", ["/sys/devices/platform/0000:03:00.0"], {}),
    ],
)
def test_dra_pci_attributes_from_the_sysfs_sources(
    device_id: str, sources: list[str], expected: dict[str, str]
) -> None:
    assert pci_attributes(device_id, sources) == expected


def test_dra_bad_configuration_raises_not_a_device() -> None:
    with pytest.raises(InvalidNameError, match="node name"):
        build_pool(DeviceTree(), node_name="Node_1", driver=DRIVER, generation=0)
    with pytest.raises(InvalidNameError, match="driver"):
        build_pool(DeviceTree(), node_name=NODE, driver="Not A Driver", generation=0)
    with pytest.raises(ValueError, match="generation"):
        build_pool(DeviceTree(), node_name=NODE, driver=DRIVER, generation=-1)


def test_dra_published_names_are_the_ids_names() -> None:
    tree = DeviceTree({GPU: {"GPU_0": DeviceInfo(), "0000:03:00.0-1": DeviceInfo()}})
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=0)
    assert {n: d.device_id for n, d in pool.devices.items()} == {
        device_name("GPU_0"): "GPU_0",
        "0000-03-00-0-1": "0000:03:00.0-1",
    }
