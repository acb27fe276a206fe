"""devplug.preferred: the one NUMA preferred-allocation mechanism, by hand and by invariants.

Its two configurations in devplug have their own tests: the daemon's default in
``tests/kubelet/test_allocation.py``, Intel's three GPU policies in
``tests/scanners/test_intel_gpu_policy.py``.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import get_args

import pytest

import devplug
from devplug import preferred
from devplug.model import DeviceInfo, Health
from devplug.preferred import (
    Fill,
    NodeChoice,
    PreferredPolicy,
    by_first_source,
    by_info,
    preferred_ids,
)

FILLS: tuple[Fill, ...] = get_args(Fill)
NODES: tuple[NodeChoice, ...] = get_args(NodeChoice)


def shares(devices: str) -> dict[str, DeviceInfo]:
    """``"a:3:0 b:2:1 c:1:-"``: device a with 3 shares on NUMA 0, b with 2 on NUMA 1, c with
    one and no NUMA node. Shares of one device share one DeviceInfo, as scanners build them;
    ids are ``a0``, ``a1``, ...."""
    built: dict[str, DeviceInfo] = {}
    for spec in devices.split():
        name, count, numa = spec.split(":")
        info = DeviceInfo(numa_nodes=() if numa == "-" else (int(numa),), sources=(f"/sys/{name}",))
        for index in range(int(count)):
            built[f"{name}{index}"] = info
    return built


def ids(text: str) -> list[str]:
    return text.split()


def policy(fill: Fill = "packed", nodes: NodeChoice = "tightest") -> PreferredPolicy:
    return PreferredPolicy(fill=fill, nodes=nodes, unit=by_info)


def test_the_public_names_are_exported_from_devplug() -> None:
    for name in ("PreferredPolicy", "preferred_ids", "by_info", "by_first_source"):
        assert name in devplug.__all__
        assert getattr(devplug, name) is getattr(preferred, name)


def test_the_module_is_pure() -> None:
    """Only the standard library and devplug's model below it: no gRPC, protobuf, pyudev or
    pydantic, no I/O, so hooks, tests and benchmarks can call it anywhere."""
    tree = ast.parse(Path(preferred.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    allowed = {"__future__", "collections.abc", "dataclasses", "heapq", "typing"}
    assert imported <= allowed | {"devplug.model", "devplug.naming", "devplug.errors"}, imported
    code = (
        "import sys, devplug.preferred\n"
        "heavy = ('grpc', 'google.protobuf', 'pydantic', 'yaml')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.splitlines() == ["[]"]


# ------------------------------------------------------------------------ must_include


@pytest.mark.parametrize("fill", FILLS)
def test_must_include_first_deduplicated_and_kept_past_size(fill: Fill) -> None:
    devices = shares("a:3:0 b:3:1")
    choose = policy(fill)
    assert choose(list(devices), ids("b2 a0 b2"), 1, devices) == ids("b2 a0")
    assert choose(list(devices), ids("b1"), 0, devices) == ids("b1")
    assert choose(list(devices), ids("b1"), -5, devices) == ids("b1")
    assert choose(list(devices), [], 0, devices) == []
    assert choose([], ids("zz"), 3, devices) == ids("zz")  # unknown, not offered: still kept
    got = choose(list(devices), ids("a1"), 3, devices)
    assert got[0] == "a1" and len(set(got)) == 3  # offered too, not repeated


def test_unhealthy_must_include_is_kept_and_still_anchors_its_node() -> None:
    devices = shares("a:2:0 b:3:1")
    devices["b0"] = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(1,))
    assert policy()(list(devices), ids("b0"), 3, devices) == ids("b0 b1 b2")


# ------------------------------------------------------------------------ fills


@pytest.mark.parametrize(
    ("fill", "must", "size", "expected"),
    [
        ("packed", "", 4, "a0 a1 a2 b0"),
        ("packed", "c1", 3, "c1 c0 c2"),  # the must-include device's other shares first
        ("packed", "a1 c1", 5, "a1 c1 a0 a2 c0"),
        ("spread", "", 4, "a0 b0 c0 a1"),
        ("spread", "b1", 3, "b1 a0 c0"),  # b counts as used
        ("spread", "", 9, "a0 b0 c0 a1 a2 b1 b2 c1 c2"),
        ("balanced", "", 4, "a0 b0 c0 a1"),
        ("balanced", "c0", 4, "c0 a0 b0 a1"),  # free: a 3, b 3, c 2
    ],
)
def test_fills_over_units(fill: Fill, must: str, size: int, expected: str) -> None:
    devices = shares("a:3:- b:3:- c:3:-")
    assert policy(fill)(list(devices), ids(must), size, devices) == ids(expected)


def test_balanced_takes_from_the_unit_with_the_most_free_ids() -> None:
    devices = shares("a:3:- b:3:- c:3:-")
    available = ids("a2 b0 b1 b2 c0 c1")  # free: a 1, b 3, c 2
    assert policy("balanced")(available, [], 4, devices) == ids("b0 b1 c0 a2")
    assert policy("balanced")(available, [], 9, devices) == ids("b0 b1 c0 a2 b2 c1")


@pytest.mark.parametrize("fill", FILLS)
def test_without_units_every_fill_takes_ids_in_order(fill: Fill) -> None:
    devices = shares("a:3:- b:3:-")
    offered = list(reversed(devices))
    plain = PreferredPolicy(fill=fill)
    assert plain(offered, ids("b1"), 4, devices) == ids("b1 a0 a1 a2")
    assert preferred_ids(offered, [], 2, fill=fill) == ids("a0 a1")


def test_units_by_first_source_and_by_info() -> None:
    gpu = DeviceInfo(sources=("/sys/gpu0",))
    same_gpu = DeviceInfo(sources=("/sys/gpu0", "/sys/gpu0/drm/card1"))
    other = DeviceInfo(sources=("/sys/gpu1",))
    devices = {"x0": gpu, "x1": same_gpu, "y0": other, "z0": DeviceInfo()}
    assert by_first_source("x1", same_gpu) == by_first_source("x0", gpu) == "/sys/gpu0"
    assert by_first_source("z0", devices["z0"]) == "z0"  # no sources: a unit of its own
    assert by_info("x0", gpu) != by_info("x1", same_gpu)  # equal or not, two objects
    spread = PreferredPolicy(fill="spread", unit=by_first_source)
    assert spread(list(devices), [], 3, devices) == ids("x0 y0 z0")
    assert PreferredPolicy(fill="spread", unit=by_info)(list(devices), [], 2, devices) == ids(
        "x0 x1"
    )


def test_a_unit_of_your_own() -> None:
    # Units by device node: ids whose infos name the same node are one unit.
    devices = {
        f"{node}-{share}": DeviceInfo(sources=(f"/sys/{node}-{share}",))
        for node in "pq"
        for share in range(2)
    }
    by_node = PreferredPolicy(fill="spread", unit=lambda device_id, info: device_id[0])
    assert by_node(list(devices), [], 2, devices) == ids("p-0 q-0")


# ------------------------------------------------------------------------ NUMA nodes


@pytest.mark.parametrize(
    ("nodes", "size", "expected"),
    [
        ("tightest", 2, "a0 a1"),  # both nodes hold 2: the tighter (3 ids)
        ("roomiest", 2, "b0 b1"),  # the roomier (5 ids)
        ("tightest", 4, "b0 b1 b2 b3"),  # only node 1 holds 4
        ("roomiest", 4, "b0 b1 b2 b3"),
        ("tightest", 7, "b0 b1 b2 b3 b4 a0 a1"),  # none holds 7: the biggest first
    ],
)
def test_one_node_when_one_can_hold_the_request(
    nodes: NodeChoice, size: int, expected: str
) -> None:
    devices = shares("a:3:0 b:5:1")
    assert policy("packed", nodes)(list(devices), [], size, devices) == ids(expected)


@pytest.mark.parametrize("nodes", NODES)
def test_the_must_include_node_comes_first_then_the_biggest_other(nodes: NodeChoice) -> None:
    devices = shares("a:2:0 b:2:1 c:3:2")
    assert policy("packed", nodes)(list(devices), ids("a0"), 2, devices) == ids("a0 a1")
    assert policy("packed", nodes)(list(devices), ids("a0"), 4, devices) == ids("a0 a1 c0 c1")


def test_devices_on_several_nodes_share_them() -> None:
    devices = {
        "wide0": DeviceInfo(numa_nodes=(0, 1)),
        "near0": DeviceInfo(numa_nodes=(1,)),
        "far0": DeviceInfo(numa_nodes=(2,)),
        "far1": DeviceInfo(numa_nodes=(2,)),
    }
    # wide0 touches node 1: near0's group is drawn before the bigger node 2.
    assert PreferredPolicy()(list(devices), ids("wide0"), 2, devices) == ids("wide0 near0")


def test_ids_without_numa_nodes_form_a_group_of_their_own() -> None:
    devices = shares("a:2:- b:3:0")
    assert PreferredPolicy()(list(devices), [], 2, devices) == ids("a0 a1")  # tightest fit


# ------------------------------------------------------------------------ what is usable


def test_unhealthy_offered_ids_are_never_picked() -> None:
    devices = shares("a:3:0")
    devices["a1"] = DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(0,))
    assert PreferredPolicy()(list(devices), [], 3, devices) == ids("a0 a2")


def test_unknown_offered_ids_are_kept_or_dropped() -> None:
    devices = shares("a:2:0")
    offered = ["stale", *devices]
    assert PreferredPolicy()(offered, [], 3, devices) == ids("a0 a1 stale")
    assert PreferredPolicy(keep_unknown=False)(offered, [], 3, devices) == ids("a0 a1")
    assert PreferredPolicy(keep_unknown=False)(offered, ids("gone"), 2, {}) == ids("gone")


def test_ids_in_natural_order_by_default_or_by_your_key() -> None:
    devices = {f"dev{i}": DeviceInfo() for i in (10, 2, 1)}
    assert PreferredPolicy()(list(devices), [], 2, devices) == ids("dev1 dev2")
    assert PreferredPolicy(key=str)(list(devices), [], 2, devices) == ids("dev1 dev10")


def test_all_in_key_order_when_everything_is_taken() -> None:
    devices = shares("b:1:0 a:1:1 c:2:1")
    everything = list(devices)
    # Drawn by group (node 1 is bigger), or listed in id order.
    assert PreferredPolicy()(everything, [], 9, devices) == ids("a0 c0 c1 b0")
    in_order = PreferredPolicy(all_in_key_order=True)
    assert in_order(everything, [], 9, devices) == ids("a0 b0 c0 c1")
    assert in_order(everything, [], 2, devices) == ids("a0 c0")  # not everything: by group


def test_preferred_ids_over_plain_maps_matches_the_policy_over_devices() -> None:
    devices = shares("a:3:0 b:2:1 c:2:1")
    numa = {i: info.numa_nodes for i, info in devices.items()}
    unit = {i: info.sources[0] for i, info in devices.items()}
    for fill in FILLS:
        for nodes in NODES:
            over_devices = PreferredPolicy(fill=fill, nodes=nodes, unit=by_first_source)
            for size in range(8):
                got = preferred_ids(
                    devices,
                    ids("b1"),
                    size,
                    fill=fill,
                    nodes=nodes,
                    numa_of=numa.__getitem__,
                    unit_of=unit.__getitem__,
                )
                assert got == over_devices(list(devices), ids("b1"), size, devices)


# ------------------------------------------------------------------------ invariants


def random_devices(rng: random.Random) -> dict[str, DeviceInfo]:
    devices: dict[str, DeviceInfo] = {}
    for device in range(rng.randint(0, 6)):
        numa = rng.choice([(), (0,), (1,), (2,), (0, 1)])
        health = Health.UNHEALTHY if rng.random() < 0.15 else Health.HEALTHY
        info = DeviceInfo(health=health, numa_nodes=numa, sources=(f"/sys/d{device}",))
        for share in range(rng.randint(1, 4)):
            devices[f"d{device}-{share}"] = info
    return devices


@pytest.mark.parametrize("seed", range(200))
def test_random_requests_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    devices = random_devices(rng)
    everything = [*devices, "stray-0", "stray-1"]
    available = [i for i in everything if rng.random() < 0.7]
    available += rng.sample(available, min(len(available), 2))  # repeats
    rng.shuffle(available)
    must = rng.sample(everything, rng.randint(0, min(3, len(everything))))
    size = rng.randint(-1, len(everything) + 2)
    usable = [
        i
        for i in dict.fromkeys(available)
        if i not in must and (i not in devices or devices[i].healthy)
    ]
    for fill in FILLS:
        for nodes in NODES:
            for unit in (None, by_info, by_first_source):
                got = PreferredPolicy(fill=fill, nodes=nodes, unit=unit)(
                    available, must, size, devices
                )
                check(got, must, usable, size)
                if not must and size > 0:
                    # A NUMA group that can hold the request: the answer stays in one group.
                    count: dict[tuple[int, ...], int] = {}
                    for device_id in usable:
                        numa = devices[device_id].numa_nodes if device_id in devices else ()
                        count[numa] = count.get(numa, 0) + 1
                    if any(n >= size for n in count.values()):
                        groups = {devices[i].numa_nodes if i in devices else () for i in got}
                        assert len(groups) == 1, (fill, nodes, got)


def check(got: Sequence[str], must: Sequence[str], usable: Sequence[str], size: int) -> None:
    required = list(dict.fromkeys(must))
    assert got[: len(required)] == required
    assert len(set(got)) == len(got)
    assert set(got[len(required) :]) <= set(usable)
    assert len(got) == max(len(required), min(size, len(required) + len(usable)))


# ------------------------------------------------------------------------ cost


@pytest.mark.parametrize("fill", FILLS)
def test_work_grows_linearly_with_the_offered_ids(fill: Fill) -> None:
    """One key per offered id and a bounded number of NUMA and unit lookups per id, whatever
    the request: the daemon answers the default on its event loop (issue 15)."""
    count = 20_000
    devices = {f"g{i % 50}-{i}": DeviceInfo(numa_nodes=(i % 3,)) for i in range(count)}
    calls = {"key": 0, "numa": 0, "unit": 0}

    def key(device_id: str) -> str:
        calls["key"] += 1
        return device_id

    def numa_of(device_id: str) -> tuple[int, ...]:
        calls["numa"] += 1
        return devices[device_id].numa_nodes

    def unit_of(device_id: str) -> Hashable:
        calls["unit"] += 1
        return device_id.partition("-")[0]

    must = ["g7-7", "g8-8"]
    for size in (3, count // 2, count):
        calls.update(key=0, numa=0, unit=0)
        got = preferred_ids(
            devices, must, size, fill=fill, numa_of=numa_of, unit_of=unit_of, key=key
        )
        assert len(got) == size
        assert calls["key"] == count - len(must)
        assert calls["numa"] <= count
        assert calls["unit"] <= 3 * count
