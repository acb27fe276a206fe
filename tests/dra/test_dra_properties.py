"""Property tests: random DeviceTrees (0 to about 1,000 devices; odd ids and attributes; PCI
and non-PCI) give pools whose every slice passes the strict official schemas of Kubernetes
1.34 to 1.37 and the API server's semantic rules, that lose nothing silently, and whose
device names stay with their devices whatever else the pool holds."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from dra_schemas import all_schema_errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devplug.dra.attributes import wire_value
from devplug.dra.naming import device_name
from devplug.dra.slices import Pool, build_pool
from devplug.dra.validate import MAX_DEVICES, validate_resource_slice
from devplug.model import AttributeValue, DeviceInfo, DeviceTree, Health
from devplug.naming import DEVICE_ID

NODE, DRIVER = "node-7.example.com", "gpu.example.com"
RESOURCES = ["gpu.example.com/gpu", "gpu.example.com/vf", "example.com/" + "r" * 60]

# Each example checks every slice against four schemas; 25 keep a run near half a minute.
PROPERTY_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

pci_ids = st.builds(
    lambda domain, bus, dev, fn, share: (
        f"{domain}:{bus:02x}:{dev:02x}.{fn}" + ("" if share is None else f"-{share}")
    ),
    st.sampled_from(["0000", "0001", "10000"]),
    st.integers(0, 255),
    st.integers(0, 31),
    st.integers(0, 7),
    st.none() | st.integers(0, 9),
)
odd_ids = st.sampled_from(
    [
        "gpu0",
        "gpu-0",
        "gpu_0",
        "gpu.0",
        "gpu:0",
        "GPU-0",
        "0000-03-00-0",
        "0000_03_00_0",
        "deadbeef00",
        "gpu-deadbeef00",
        "x" * 63,
        "X" * 63,
        "a" + "_" * 61 + "b",
    ]
)
devplug_ids = st.one_of(
    pci_ids,
    odd_ids,
    st.from_regex(DEVICE_ID, fullmatch=True).filter(lambda i: len(i) <= 63),
)
attribute_names = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True),
    st.sampled_from(
        [
            "model",
            "9lives",
            "has-dash",
            "/x",
            "x/",
            "a/b/c",
            "resource",
            "id",
            "numaNode",
            f"{DRIVER}/model",
            f"{DRIVER}/resource",
            "other.example.com/model",
            "Bad_Domain/x",
            "d" * 64 + "/x",
            "x" * 32,
            "x" * 33,
        ]
    ),
    st.text(min_size=1, max_size=12),
)
attribute_values = st.one_of(
    st.text(max_size=70),
    st.text(alphabet="é€𝄞", max_size=40),  # multi-byte: 64 bytes come before 64 characters
    st.integers(-(2**64), 2**64),
    st.booleans(),
)


@st.composite
def device_infos(draw: st.DrawFn, device_id: str) -> DeviceInfo:
    address = device_id.split("-")[0] if ":" in device_id else None
    sources: tuple[str, ...] = ()
    if address is not None and draw(st.booleans()):
        root = f"pci{address.split(':')[0]}:{draw(st.sampled_from(['00', '40']))}"
        sources = (f"/sys/devices/{root}/0000:00:01.0/{address}",)
    elif draw(st.booleans()):
        sources = ("/sys/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/ttyUSB0",)
    return DeviceInfo(
        health=draw(st.sampled_from([Health.HEALTHY, Health.HEALTHY, Health.UNHEALTHY])),
        numa_nodes=tuple(draw(st.lists(st.integers(0, 3), max_size=2))),
        sources=sources,
        attributes=draw(st.dictionaries(attribute_names, attribute_values, max_size=36)),
    )


@st.composite
def odd_devices(draw: st.DrawFn) -> dict[str, dict[str, DeviceInfo]]:
    tree: dict[str, dict[str, DeviceInfo]] = {}
    for _ in range(draw(st.integers(0, 25))):
        resource = draw(st.sampled_from(RESOURCES))
        device_id = draw(devplug_ids)
        tree.setdefault(resource, {})[device_id] = draw(device_infos(device_id))
    return tree


def bulk_devices(count: int, seed: int) -> dict[str, DeviceInfo]:
    """``count`` plain GPUs on PCI, made without Hypothesis (a thousand drawn devices would
    overflow its example buffer); a few unhealthy, some on two NUMA nodes."""
    chooser = random.Random(seed)
    devices = {}
    for n in range(count):
        address = f"0000:{0x80 + n // 32:02x}:{n % 32:02x}.{chooser.randrange(8)}"
        devices[address] = DeviceInfo(
            health=Health.UNHEALTHY if chooser.random() < 0.05 else Health.HEALTHY,
            numa_nodes=tuple(chooser.sample(range(4), chooser.choice([0, 1, 1, 2]))),
            sources=(f"/sys/devices/pci0000:80/0000:80:01.0/{address}",),
            attributes={"model": chooser.choice(["A770", "B580", "Max 1550"]), "tiles": n % 3},
        )
    return devices


@st.composite
def trees(draw: st.DrawFn) -> DeviceTree:
    devices = draw(odd_devices())
    count = draw(
        st.one_of(
            st.integers(0, 300), st.integers(0, 1000), st.sampled_from([127, 128, 129, 256, 257])
        )
    )
    bulk = bulk_devices(count, draw(st.integers(0, 2**32)))
    merged = dict(devices.get(RESOURCES[0], {}))
    merged.update({i: info for i, info in bulk.items() if i not in merged})
    return DeviceTree({**devices, RESOURCES[0]: merged})


def published_devices(pool: Pool) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in pool.slices for d in s["spec"].get("devices", [])}


def check_pool(tree: Mapping[str, Mapping[str, DeviceInfo]], pool: Pool, generation: int) -> None:
    count = len(pool.slices)
    assert count >= 1
    names = [s["metadata"]["name"] for s in pool.slices]
    assert len(set(names)) == count
    for resource_slice in pool.slices:
        assert all_schema_errors(resource_slice) == {}, resource_slice["metadata"]
        assert validate_resource_slice(resource_slice) == [], resource_slice["metadata"]
        spec = resource_slice["spec"]
        assert spec["pool"] == {"name": NODE, "generation": generation, "resourceSliceCount": count}
        assert spec["nodeName"] == NODE and spec["driver"] == DRIVER
        assert len(spec.get("devices", [])) <= MAX_DEVICES
    published = published_devices(pool)
    all_names = [d["name"] for s in pool.slices for d in s["spec"].get("devices", [])]
    assert len(all_names) == len(set(all_names)), "a device name twice in the pool"
    assert published.keys() == pool.devices.keys()
    # Nothing lost silently: every healthy device is published or left out with a reason.
    left_out = {(o.resource, o.device_id) for o in pool.omitted if not o.attribute}
    healthy = {(r, i) for r, devices in tree.items() for i, info in devices.items() if info.healthy}
    shown = {(d.resource, d.device_id) for d in pool.devices.values()}
    assert shown | left_out == healthy
    assert shown.isdisjoint(left_out)
    for name, where in pool.devices.items():
        assert device_name(where.device_id) == name
        device = published[name]
        assert device["attributes"]["id"] == {"string": where.device_id}
        assert device["attributes"]["resource"] == {"string": where.resource}
        extras: Mapping[str, AttributeValue] = tree[where.resource][where.device_id].attributes
        lost = {
            o.attribute
            for o in pool.omitted
            if (o.resource, o.device_id) == (where.resource, where.device_id)
        }
        for attribute, value in extras.items():
            assert attribute in lost or device["attributes"].get(attribute) == wire_value(value), (
                attribute
            )


@PROPERTY_SETTINGS
@given(trees(), st.integers(0, 2**40))
def test_dra_random_trees_give_pools_the_api_server_accepts(
    tree: DeviceTree, generation: int
) -> None:
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=generation)
    check_pool(tree, pool, generation)


@PROPERTY_SETTINGS
@given(trees(), st.randoms(use_true_random=False))
def test_dra_pools_do_not_depend_on_tree_order(tree: DeviceTree, chooser: random.Random) -> None:
    shuffled: dict[str, dict[str, DeviceInfo]] = {}
    for resource in chooser.sample(list(tree), len(tree)):
        ids = list(tree[resource])
        chooser.shuffle(ids)
        shuffled[resource] = {i: tree[resource][i] for i in ids}
    first = build_pool(tree, node_name=NODE, driver=DRIVER, generation=5)
    assert build_pool(DeviceTree(shuffled), node_name=NODE, driver=DRIVER, generation=5) == first
    assert build_pool(tree, node_name=NODE, driver=DRIVER, generation=5) == first


@PROPERTY_SETTINGS
@given(odd_devices(), odd_devices(), st.integers(0, 400))
def test_dra_a_device_keeps_its_name_whatever_else_is_in_the_pool(
    mine: dict[str, dict[str, DeviceInfo]], others: dict[str, dict[str, DeviceInfo]], bulk: int
) -> None:
    alone = build_pool(DeviceTree(mine), node_name=NODE, driver=DRIVER, generation=1)
    crowded_tree: dict[str, dict[str, DeviceInfo]] = {r: dict(d) for r, d in others.items()}
    crowded_tree.setdefault(RESOURCES[1], {}).update(bulk_devices(bulk, bulk))
    for resource, devices in mine.items():
        crowded_tree.setdefault(resource, {}).update(devices)
    crowded = build_pool(DeviceTree(crowded_tree), node_name=NODE, driver=DRIVER, generation=1)
    for name, where in alone.devices.items():
        if name in crowded.devices:
            # A published name always means the same device.
            assert crowded.devices[name] == where
        else:
            # Only a collision with a device of the crowd takes it out, and that is said.
            assert any(
                (o.resource, o.device_id) == (where.resource, where.device_id) and not o.attribute
                for o in crowded.omitted
            )
    for name, where in crowded.devices.items():
        assert device_name(where.device_id) == name


def test_dra_a_thousand_devices() -> None:
    tree = DeviceTree({RESOURCES[0]: bulk_devices(1000, 1)})
    pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=9)
    healthy = sum(info.healthy for info in tree[RESOURCES[0]].values())
    assert len(pool.devices) == healthy and len(pool.slices) == -(-healthy // MAX_DEVICES)
    check_pool(tree, pool, 9)
