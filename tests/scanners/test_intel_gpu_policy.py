"""Intel GPU GetPreferredAllocation: the none, balanced and packed policies, by hand.

Every expected answer below is written out from the semantics in ``policy.py``'s docstring,
and checked through :func:`policy_over_maps` (the scanner's policy set-ups applied by
``devplug.preferred_ids`` to plain ids, GPUs and NUMA nodes given as maps), through
``IntelGpuScanner.preferred_allocation`` (which learns each share's GPU from
``info.sources[0]`` and its NUMA node from ``info.numa_nodes``), and through
``preferred_gpu_shares``, the same policies over the devices, which must answer exactly as
the scanner does. The mechanism itself is tested in ``tests/test_preferred.py``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import get_args

import pytest

from devplug.model import DeviceInfo, Health
from devplug.preferred import preferred_ids
from devplug.scanners.intel_gpu import MONITORING_RESOURCE, IntelGpuScanner, IntelGpuSettings
from devplug.scanners.intel_gpu.policy import POLICIES as SETUPS
from devplug.scanners.intel_gpu.policy import preferred_gpu_shares, share_order
from devplug.scanners.intel_gpu.settings import AllocationPolicy

FIELD = "scanners.intel_gpu"
RESOURCE = "gpu.intel.com/i915"
POLICIES: tuple[AllocationPolicy, ...] = get_args(AllocationPolicy)
SYS = "/sys/devices/pci0000:00"

A, B, C = "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"
LETTERS = {"a": A, "b": B, "c": C}


def ids(names: str) -> list[str]:
    """``"a0 b1"`` -> ``["0000:01:00.0-0", "0000:02:00.0-1"]``."""
    return [f"{LETTERS[name[0]]}-{name[1:]}" for name in names.split()]


@dataclass
class Host:
    """GPUs with their shares: share id -> GPU address, NUMA nodes and health."""

    gpu_of: dict[str, str] = field(default_factory=dict)
    numa_of: dict[str, tuple[int, ...]] = field(default_factory=dict)
    unhealthy: set[str] = field(default_factory=set)

    def add(self, address: str, shares: int, numa: int | None = None) -> Host:
        for index in range(shares):
            share = f"{address}-{index}" if shares > 1 else address
            self.gpu_of[share] = address
            self.numa_of[share] = () if numa is None else (numa,)
        return self

    @property
    def all_ids(self) -> list[str]:
        return list(self.gpu_of)

    def devices(self) -> dict[str, DeviceInfo]:
        return {
            share: DeviceInfo(
                health=Health.UNHEALTHY if share in self.unhealthy else Health.HEALTHY,
                numa_nodes=self.numa_of[share],
                sources=(f"{SYS}/{address}", f"{SYS}/{address}/drm/card0"),
            )
            for share, address in self.gpu_of.items()
        }


def policy_over_maps(
    policy: AllocationPolicy,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpu_of: Mapping[str, str],
    numa_of: Mapping[str, tuple[int, ...]],
) -> list[str]:
    """``policy`` over plain ids: every id in ``available`` may be picked; ``gpu_of`` maps an
    id to its GPU (an id missing there is a GPU of its own), ``numa_of`` to its NUMA nodes."""
    setup = SETUPS[policy]
    return preferred_ids(
        available,
        must_include,
        size,
        fill=setup.fill,
        nodes=setup.nodes,
        numa_of=lambda device_id: numa_of.get(device_id, ()),
        unit_of=lambda device_id: gpu_of.get(device_id, device_id),
        key=share_order,
    )


def scanner(policy: AllocationPolicy) -> IntelGpuScanner:
    return IntelGpuScanner(IntelGpuSettings.from_raw({"allocation_policy": policy}, FIELD))


def now(answer: object) -> list[str]:
    """An answer preferred_allocation gave inline (not as an awaitable)."""
    assert isinstance(answer, list), f"expected a list, got {answer!r}"
    return [str(device_id) for device_id in answer]


def allocate(
    policy: AllocationPolicy,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Mapping[str, DeviceInfo],
) -> list[str]:
    answer = now(
        scanner(policy).preferred_allocation(RESOURCE, available, must_include, size, devices)
    )
    assert preferred_gpu_shares(policy, available, must_include, size, devices) == answer
    return answer


def both(
    policy: AllocationPolicy,
    host: Host,
    size: int,
    must: str = "",
    available: Sequence[str] | None = None,
) -> list[str]:
    """The pure function's answer, after checking the scanner gives the same one."""
    pool = host.all_ids if available is None else list(available)
    must_include = ids(must) if must else []
    pure = policy_over_maps(policy, pool, must_include, size, host.gpu_of, host.numa_of)
    assert allocate(policy, pool, must_include, size, host.devices()) == pure
    return pure


def flat() -> Host:
    """Three GPUs of three shares each, no NUMA information."""
    return Host().add(A, 3).add(B, 3).add(C, 3)


# ---------------------------------------------------------------------------------- none


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, "a0"),
        (2, "a0 b0"),
        (3, "a0 b0 c0"),
        (4, "a0 b0 c0 a1"),
        (9, "a0 b0 c0 a1 a2 b1 b2 c1 c2"),
    ],
)
def test_none_spreads_one_share_per_gpu_then_fills_in_order(size: int, expected: str) -> None:
    assert both("none", flat(), size) == ids(expected)


@pytest.mark.parametrize(
    ("must", "size", "expected"),
    [
        ("b1", 3, "b1 a0 c0"),  # B is used by the must-include share: A and C come next
        ("b1", 5, "b1 a0 c0 a1 a2"),  # then fill in order, skipping the taken b1
        ("a0 c2", 4, "a0 c2 b0 a1"),
        ("c0", 2, "c0 a0"),
    ],
)
def test_none_counts_must_include_gpus_as_used(must: str, size: int, expected: str) -> None:
    assert both("none", flat(), size, must) == ids(expected)


def test_none_with_partial_availability_spreads_over_what_is_free() -> None:
    available = ids("a2 b0 b1 b2 c1")
    assert both("none", flat(), 3, available=available) == ids("a2 b0 c1")
    assert both("none", flat(), 4, available=available) == ids("a2 b0 c1 b1")


# ------------------------------------------------------------------------------ balanced


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, "b0"),  # B has the most free shares (3)
        (2, "b0 b1"),  # B (2 left) ties C (2): B is first in order
        (3, "b0 b1 c0"),
        (4, "b0 b1 c0 a2"),  # all three have one left: A first
        (6, "b0 b1 c0 a2 b2 c1"),
        (7, "b0 b1 c0 a2 b2 c1"),  # everything there is
    ],
)
def test_balanced_takes_from_the_gpu_with_most_free_shares(size: int, expected: str) -> None:
    available = ids("a2 b0 b1 b2 c0 c1")  # free shares: A 1, B 3, C 2
    assert both("balanced", flat(), size, available=available) == ids(expected)


def test_balanced_ties_go_to_the_first_gpu_in_order() -> None:
    # Offered in reverse: order comes from the ids, not from the kubelet's list.
    available = list(reversed(flat().all_ids))
    assert both("balanced", flat(), 4, available=available) == ids("a0 b0 c0 a1")


@pytest.mark.parametrize(
    ("must", "available", "size", "expected"),
    [
        # Free after c0 is taken: A 2, B 3, C 2.
        ("c0", "a0 a1 b0 b1 b2 c1 c2", 4, "c0 b0 a0 b1"),
        # Free after b0: A 3, B 2, C 3.
        ("b0", "a0 a1 a2 b0 b1 b2 c0 c1 c2", 4, "b0 a0 c0 a1"),
    ],
)
def test_balanced_with_must_include(must: str, available: str, size: int, expected: str) -> None:
    assert both("balanced", flat(), size, must, ids(available)) == ids(expected)


# -------------------------------------------------------------------------------- packed


@pytest.mark.parametrize(
    ("available", "size", "expected"),
    [
        (None, 1, "a0"),
        (None, 4, "a0 a1 a2 b0"),
        ("a2 b0 b1 b2 c0 c1", 3, "a2 b0 b1"),
        ("c1 b2 a2 c0 b1 b0", 6, "a2 b0 b1 b2 c0 c1"),
    ],
)
def test_packed_fills_gpus_in_order(available: str | None, size: int, expected: str) -> None:
    pool = None if available is None else ids(available)
    assert both("packed", flat(), size, available=pool) == ids(expected)


@pytest.mark.parametrize(
    ("must", "size", "expected"),
    [
        ("c1", 4, "c1 c0 c2 a0"),  # C's other shares before A's
        ("b2", 3, "b2 b0 b1"),
        ("a1 c1", 4, "a1 c1 a0 a2"),  # both used GPUs before B, in order
        ("a1 c1", 5, "a1 c1 a0 a2 c0"),
    ],
)
def test_packed_fills_the_must_include_gpu_first(must: str, size: int, expected: str) -> None:
    assert both("packed", flat(), size, must) == ids(expected)


# ---------------------------------------------------------------------- must_include


@pytest.mark.parametrize("policy", POLICIES)
def test_must_include_comes_first_and_is_kept_even_past_size(policy: AllocationPolicy) -> None:
    assert both(policy, flat(), 1, "c2 a0 c2") == ids("c2 a0")  # deduplicated, order kept
    assert both(policy, flat(), 0, "b1") == ids("b1")
    assert both(policy, flat(), 2, "b1 a2") == ids("b1 a2")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("none", "a1 b0"), ("balanced", "a1 b0"), ("packed", "a1 a0")],
)
def test_must_include_also_offered_as_available_is_not_repeated(
    policy: AllocationPolicy, expected: str
) -> None:
    assert both(policy, flat(), 2, "a1") == ids(expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_must_include_that_is_not_available_is_still_kept(policy: AllocationPolicy) -> None:
    host = flat()
    got = policy_over_maps(policy, ids("a0 b0"), ["elsewhere"], 2, host.gpu_of, host.numa_of)
    assert got == ["elsewhere", ids("a0")[0]]
    # The scanner does not know "elsewhere" either, yet keeps it: the kubelet asked for it.
    assert allocate(policy, ids("a0 b0"), ["elsewhere"], 2, host.devices()) == got


# ---------------------------------------------------------------------------------- NUMA


def roomy_second() -> Host:
    """NUMA 0: A (3 shares); NUMA 1: B and C (6 shares)."""
    return Host().add(A, 3, numa=0).add(B, 3, numa=1).add(C, 3, numa=1)


def tight_second() -> Host:
    """NUMA 0: A and B (6 shares); NUMA 1: C (3 shares)."""
    return Host().add(A, 3, numa=0).add(B, 3, numa=0).add(C, 3, numa=1)


@pytest.mark.parametrize(
    ("policy", "size", "expected"),
    [
        # Both nodes hold 2: spreading takes the roomiest node, packing the tightest.
        ("none", 2, "b0 c0"),
        ("balanced", 2, "b0 c0"),
        ("packed", 2, "a0 a1"),
        # Only NUMA 1 holds 4.
        ("none", 4, "b0 c0 b1 b2"),
        ("balanced", 4, "b0 c0 b1 c1"),
        ("packed", 4, "b0 b1 b2 c0"),
        # No node holds 8: the bigger node first, then spill over.
        ("none", 8, "b0 c0 b1 b2 c1 c2 a0 a1"),
        ("balanced", 8, "b0 c0 b1 c1 b2 c2 a0 a1"),
        ("packed", 8, "b0 b1 b2 c0 c1 c2 a0 a1"),
    ],
)
def test_numa_one_node_when_it_fits_else_spill(
    policy: AllocationPolicy, size: int, expected: str
) -> None:
    assert both(policy, roomy_second(), size) == ids(expected)


@pytest.mark.parametrize(
    ("policy", "size", "expected"),
    [
        ("packed", 2, "c0 c1"),  # the tightest node that fits, though C is last in order
        ("packed", 3, "c0 c1 c2"),
        ("packed", 4, "a0 a1 a2 b0"),  # NUMA 1 no longer fits
        ("none", 2, "a0 b0"),  # the roomiest node
        ("none", 3, "a0 b0 a1"),
        ("balanced", 3, "a0 b0 a1"),
    ],
)
def test_numa_packed_takes_the_tightest_fit_spreading_the_roomiest(
    policy: AllocationPolicy, size: int, expected: str
) -> None:
    assert both(policy, tight_second(), size) == ids(expected)


@pytest.mark.parametrize(
    ("policy", "must", "size", "expected"),
    [
        # The must-include node first, even for spreading policies and a smaller node.
        ("none", "a0", 2, "a0 a1"),
        ("balanced", "a0", 2, "a0 a1"),
        ("packed", "a0", 2, "a0 a1"),
        # Its node cannot hold the rest: spill over to the other one.
        ("none", "a0", 4, "a0 a1 a2 b0"),
        ("balanced", "a0", 4, "a0 a1 a2 b0"),
        ("packed", "a0", 4, "a0 a1 a2 b0"),
        ("none", "a1", 5, "a1 a0 a2 b0 c0"),
        # Within the must-include node, each policy still does its own thing.
        ("none", "c2", 3, "c2 b0 b1"),
        ("balanced", "c2", 3, "c2 b0 b1"),
        ("packed", "c2", 3, "c2 c0 c1"),
    ],
)
def test_numa_must_include_node_first(
    policy: AllocationPolicy, must: str, size: int, expected: str
) -> None:
    assert both(policy, roomy_second(), size, must) == ids(expected)


def test_numa_must_include_on_the_tight_node_keeps_the_answer_there() -> None:
    # Without must_include, none would pick NUMA 0 (roomiest); c1 anchors NUMA 1.
    assert both("none", tight_second(), 3, "c1") == ids("c1 c0 c2")


@pytest.mark.parametrize("policy", POLICIES)
def test_numa_must_include_spills_to_the_biggest_other_node(policy: AllocationPolicy) -> None:
    # NUMA 0: A (2 shares), NUMA 1: B (2), NUMA 2: C (3); a0 anchors the request on NUMA 0.
    host = Host().add(A, 2, numa=0).add(B, 2, numa=1).add(C, 3, numa=2)
    assert both(policy, host, 4, "a0") == ids("a0 a1 c0 c1")


def test_numa_spill_skips_nothing_and_repeats_nothing() -> None:
    host = roomy_second()
    for policy in POLICIES:
        got = both(policy, host, 20)
        assert sorted(got) == sorted(host.all_ids) and len(got) == 9


# ---------------------------------------------------------------------- never raises


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("none", "a0 b0 c0 a1 a2 b1 b2 c1 c2"),
        ("balanced", "a0 b0 c0 a1 b1 c1 a2 b2 c2"),
        ("packed", "a0 a1 a2 b0 b1 b2 c0 c1 c2"),
    ],
)
def test_size_above_available_gives_everything_in_policy_order(
    policy: AllocationPolicy, expected: str
) -> None:
    assert both(policy, flat(), 50) == ids(expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_and_degenerate_requests(policy: AllocationPolicy) -> None:
    host = flat()
    assert both(policy, host, 3, available=[]) == []
    assert both(policy, host, 3, "b2", available=[]) == ids("b2")
    assert both(policy, host, 0) == []
    assert both(policy, host, -1) == []
    assert both(policy, host, -1, "a0") == ids("a0")
    assert policy_over_maps(policy, [], [], 5, {}, {}) == []


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("none", [*ids("a0 b0"), "zz"]),  # zz is a GPU not used yet
        ("balanced", ids("a0 b0 a1")),  # free: A 2, B 2, zz 1
        ("packed", ids("a0 a1 b0")),
    ],
)
def test_ids_without_a_gpu_count_as_a_gpu_of_their_own(
    policy: AllocationPolicy, expected: list[str]
) -> None:
    # policy_over_maps itself: "zz" is in neither map; it is its own one-share GPU.
    host = Host().add(A, 2).add(B, 2)
    available = [*ids("b1 a1 b0 a0"), "zz"]
    assert policy_over_maps(policy, available, [], 3, host.gpu_of, host.numa_of) == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("none", "a1 b1 c0"), ("balanced", "c0 a1 b1"), ("packed", "a1 a2 b1")],
)
def test_unhealthy_devices_are_not_picked(policy: AllocationPolicy, expected: str) -> None:
    host = flat()
    host.unhealthy = set(ids("a0 b0"))
    got = allocate(policy, host.all_ids, [], 3, host.devices())
    assert got == ids(expected)
    # Everything healthy is handed out, never an unhealthy share.
    everything = allocate(policy, host.all_ids, [], 50, host.devices())
    assert sorted(everything) == sorted(set(host.all_ids) - host.unhealthy)


@pytest.mark.parametrize("policy", POLICIES)
def test_unhealthy_must_include_is_kept_first(policy: AllocationPolicy) -> None:
    host = flat()
    host.unhealthy = set(ids("a0 b0"))
    got = allocate(policy, host.all_ids, ids("b0"), 1, host.devices())
    assert got == ids("b0")


@pytest.mark.parametrize("policy", POLICIES)
def test_unknown_available_ids_are_left_to_the_kubelet(policy: AllocationPolicy) -> None:
    host = Host().add(A, 1).add(B, 1)
    got = allocate(policy, ["0000:09:00.0", A, "stale-id", B], [], 4, host.devices())
    assert got == [A, B]
    assert allocate(policy, ["stale-id"], [], 1, host.devices()) == []
    assert allocate(policy, [A], [], 1, {}) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_all_unhealthy_gives_an_empty_answer(policy: AllocationPolicy) -> None:
    host = flat()
    host.unhealthy = set(host.all_ids)
    assert allocate(policy, host.all_ids, [], 2, host.devices()) == []


def test_the_scanner_learns_the_gpu_from_the_first_source_not_the_id() -> None:
    # x0 and x1 live on one GPU, y0 on another; the ids say nothing about it.
    devices = {
        "x0": DeviceInfo(sources=(f"{SYS}/{A}",)),
        "x1": DeviceInfo(sources=(f"{SYS}/{A}", f"{SYS}/{B}")),
        "y0": DeviceInfo(sources=(f"{SYS}/{B}",)),
        "y1": DeviceInfo(sources=(f"{SYS}/{B}", f"{SYS}/{B}/drm/card1")),
        "z0": DeviceInfo(),  # no sources: a GPU of its own
    }
    assert allocate("none", ["x0", "x1", "y0"], [], 2, devices) == ["x0", "y0"]
    assert allocate("none", ["x0", "x1", "y0", "z0"], [], 3, devices) == ["x0", "y0", "z0"]
    assert allocate("none", ["x0", "x1", "y0"], ["x0"], 2, devices) == ["x0", "y0"]
    # B (y0, y1) has more free shares than A (x0).
    assert allocate("balanced", ["x0", "y0", "y1"], [], 1, devices) == ["y0"]
    # y0's GPU holds y1 too: packing takes it before x0.
    assert allocate("packed", ["x0", "x1", "y0", "y1"], ["y0"], 2, devices) == ["y0", "y1"]


# ------------------------------------------------------------------------- natural order


@pytest.mark.parametrize("policy", POLICIES)
def test_share_suffixes_sort_numerically(policy: AllocationPolicy) -> None:
    host = Host().add(A, 12)
    offered = sorted(host.all_ids)  # string order: -0 -1 -10 -11 -2 ...
    assert both(policy, host, 3, available=offered) == [f"{A}-0", f"{A}-1", f"{A}-2"]
    assert both(policy, host, 12, available=offered) == [f"{A}-{i}" for i in range(12)]


def test_share_suffixes_sort_numerically_across_gpus() -> None:
    host = Host().add(A, 11).add(B, 11)
    offered = sorted(host.all_ids, reverse=True)
    assert both("none", host, 4, available=offered) == [f"{A}-0", f"{B}-0", f"{A}-1", f"{A}-2"]
    assert both("packed", host, 12, available=offered)[-2:] == [f"{A}-10", f"{B}-0"]


def test_pci_domain_sorts_before_bus() -> None:
    host = Host().add("0001:00:00.0", 1).add("0000:10:00.0", 1).add("0000:0a:00.0", 1)
    assert both("packed", host, 3) == ["0000:0a:00.0", "0000:10:00.0", "0001:00:00.0"]


@pytest.mark.parametrize("policy", POLICIES)
def test_pci_buses_sort_in_bus_order(policy: AllocationPolicy) -> None:
    host = Host().add("0000:0a:00.0", 1).add("0000:02:00.0", 1)
    assert both(policy, host, 1) == ["0000:02:00.0"]
    assert both(policy, host, 2) == ["0000:02:00.0", "0000:0a:00.0"]
    shared = Host().add("0000:0a:00.0", 2).add("0000:02:00.0", 2)
    assert both("packed", shared, 2) == ["0000:02:00.0-0", "0000:02:00.0-1"]


# ---------------------------------------------------------------------------- monitoring


def test_monitoring_returns_must_include_then_available_truncated() -> None:
    unknown: dict[str, DeviceInfo] = {}
    monitor = scanner("packed")
    assert now(monitor.preferred_allocation(MONITORING_RESOURCE, ["all"], [], 1, unknown)) == [
        "all"
    ]
    assert now(monitor.preferred_allocation(MONITORING_RESOURCE, ["all"], ["all"], 1, unknown)) == [
        "all"
    ]
    # No policy, no sorting, no health or device lookups: just the kubelet's ids.
    got = monitor.preferred_allocation(MONITORING_RESOURCE, ["b", "a", "c"], ["c"], 2, unknown)
    assert now(got) == ["c", "b"]
    got = monitor.preferred_allocation(MONITORING_RESOURCE, ["b", "a"], ["c", "a"], 0, unknown)
    assert now(got) == ["c", "a"]
    got = monitor.preferred_allocation(MONITORING_RESOURCE, ["b", "a"], [], 5, unknown)
    assert now(got) == ["b", "a"]


def test_monitoring_answer_length_counts_must_include_once() -> None:
    got = scanner("none").preferred_allocation(MONITORING_RESOURCE, ["a", "b"], ["c", "c"], 1, {})
    assert now(got) == ["c"]


# ------------------------------------------------------------------------- random inputs


def random_host(rng: random.Random) -> Host:
    host = Host()
    for gpu in range(rng.randint(0, 6)):
        numa = rng.choice([None, 0, 1, 2])
        host.add(f"0000:{gpu + 1:02x}:00.0", rng.randint(1, 4), numa)
    host.unhealthy = {i for i in host.all_ids if rng.random() < 0.2}
    return host


def check_answer(
    got: Sequence[str], pool: Sequence[str], must_include: Sequence[str], size: int
) -> None:
    must = list(dict.fromkeys(must_include))
    universe = set(pool) | set(must)
    assert list(got[: len(must)]) == must
    assert len(set(got)) == len(got)
    assert set(got) <= universe
    assert len(got) == max(min(size, len(universe)), len(must))


@pytest.mark.parametrize("seed", range(300))
def test_random_requests_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    host = random_host(rng)
    everything = [*host.all_ids, "stray-0", "stray-1"]
    available = [i for i in everything if rng.random() < 0.7]
    available += rng.sample(available, min(len(available), rng.randint(0, 2)))  # repeats
    rng.shuffle(available)
    must_include = rng.sample(everything, rng.randint(0, min(3, len(everything))))
    if must_include and rng.random() < 0.3:
        must_include.append(must_include[0])
    size = rng.randint(-1, len(everything) + 2)
    devices = host.devices()
    healthy = [i for i in available if i in devices and devices[i].healthy]
    for policy in POLICIES:
        pure = policy_over_maps(policy, available, must_include, size, host.gpu_of, host.numa_of)
        check_answer(pure, available, must_include, size)
        if not must_include and size > 0:
            # One NUMA group that can hold the request: the whole answer comes from one group.
            groups: dict[tuple[int, ...], int] = {}
            for device_id in set(available):
                key = host.numa_of.get(device_id, ())
                groups[key] = groups.get(key, 0) + 1
            if any(count >= size for count in groups.values()):
                assert len({host.numa_of.get(i, ()) for i in pure}) == 1, (policy, pure)
        got = allocate(policy, available, must_include, size, devices)
        check_answer(got, healthy, must_include, size)


# ----------------------------------------------------------------------- large requests


def big_host(shares: int) -> Host:
    """Three GPUs: A and B on NUMA 0, C on NUMA 1, ``shares`` shares each."""
    return Host().add(A, shares, numa=0).add(B, shares, numa=0).add(C, shares, numa=1)


@pytest.mark.parametrize(
    ("policy", "must", "expected"),
    [
        ("none", [], [f"{A}-0", f"{B}-0", f"{A}-1"]),
        ("packed", [], [f"{C}-0", f"{C}-1", f"{C}-2"]),  # NUMA 1 is the tightest fit
        # Free on NUMA 0: A 667, B 666 -> A; then A 666 ties B 666 -> A again.
        ("balanced", [f"{B}-5"], [f"{B}-5", f"{A}-0", f"{A}-1"]),
        ("packed", [f"{C}-600"], [f"{C}-600", f"{C}-0", f"{C}-1"]),
    ],
)
def test_the_hook_answers_as_a_plain_function_whatever_the_size(
    policy: AllocationPolicy, must: list[str], expected: list[str]
) -> None:
    """Where a big request is worked out is the daemon's one decision (by the whole request:
    devplug.kubelet.preferring, tested in tests/reliability/test_local_client.py); the hook
    itself only computes, so a thread it ran in would not start another."""
    host = big_host(667)  # 2001 ids
    offered = list(reversed(host.all_ids))
    answer = scanner(policy).preferred_allocation(RESOURCE, offered, must, 3, host.devices())
    assert now(answer) == expected


def test_large_answer_matches_the_pure_function_and_keeps_invariants() -> None:
    host = big_host(1000)
    host.unhealthy = {f"{A}-{i}" for i in range(0, 1000, 3)}
    must = [f"{A}-0", f"{C}-999"]
    offered = host.all_ids
    healthy = [i for i in offered if i not in host.unhealthy]
    for policy in POLICIES:
        answer = scanner(policy).preferred_allocation(RESOURCE, offered, must, 1500, host.devices())
        got = now(answer)
        check_answer(got, healthy, must, 1500)
        assert got == policy_over_maps(policy, healthy, must, 1500, host.gpu_of, host.numa_of)
        assert got == preferred_gpu_shares(policy, offered, must, 1500, host.devices())
