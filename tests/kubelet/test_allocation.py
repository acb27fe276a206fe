"""The default Allocate answer and preferred-allocation policy, as pure functions."""

from __future__ import annotations

import pytest

from devplug.errors import AllocationError
from devplug.kubelet.allocation import (
    check_request,
    check_size,
    default_allocation,
    default_preferred,
)
from devplug.model import DeviceInfo, DeviceNode, Health, Mount


def numa(node: int | None, health: Health = Health.HEALTHY) -> DeviceInfo:
    return DeviceInfo(health=health, numa_nodes=() if node is None else (node,))


def test_check_request_names_unknown_and_unhealthy_ids() -> None:
    devices = {"a": numa(0), "b": numa(0, Health.UNHEALTHY)}
    check_request("r/x", [["a"]], devices)
    with pytest.raises(AllocationError, match="unknown device ids: 'zz'") as unknown:
        check_request("r/x", [["a"], ["zz"]], devices)
    assert unknown.value.kind == "not_found" and unknown.value.device_ids == ("zz",)
    with pytest.raises(AllocationError, match="unhealthy device ids: 'b'") as sick:
        check_request("r/x", [["a", "b"]], devices)
    assert sick.value.kind == "invalid"
    with pytest.raises(AllocationError, match="twice"):
        check_request("r/x", [["a", "a"]], devices)


def test_containers_together_may_name_no_more_ids_than_are_advertised() -> None:
    """Each container under the bound, the request over it: 1,000 containers of 400 known ids
    each held the event loop 2 s per request. The kubelet sends one container per call."""
    devices = {f"d{i}": numa(0) for i in range(4)}
    check_size("r/x", [["d0", "d1"], ["d2", "d3"]], devices)  # every device once: answered
    with pytest.raises(AllocationError) as refused:
        check_size("r/x", [["d0", "d1", "d2"]] * 2, devices)
    assert refused.value.kind == "invalid" and refused.value.device_ids == ("d0", "d1", "d2")
    assert str(refused.value) == (
        "r/x: device ids requested twice in one request: 'd0', 'd1', 'd2' (the request names "
        "6 ids in 2 containers, 4 devices are advertised; a device goes to one container)"
    )
    with pytest.raises(AllocationError) as unknown:
        check_size("r/x", [["d0", "d1", "d2"], ["d3", "ghost"]], devices)
    assert unknown.value.kind == "not_found" and unknown.value.device_ids == ("ghost",)


def test_error_messages_stay_short_for_huge_requests() -> None:
    ids = [f"bogus-{i}" * 20 for i in range(10_000)]
    with pytest.raises(AllocationError) as exc:
        check_request("r/x", [ids], {})
    assert len(str(exc.value)) < 2000 and "9990 more" in str(exc.value)


def test_default_allocation_merges_and_deduplicates() -> None:
    shared = DeviceNode("/dev/dri/card0")
    devices = {
        "g0-0": DeviceInfo(nodes=(shared,), env={"VISIBLE": "0"}, mounts=(Mount("/opt/x"),)),
        "g0-1": DeviceInfo(nodes=(shared,), env={"VISIBLE": "0"}, mounts=(Mount("/opt/x"),)),
        "g1-0": DeviceInfo(
            nodes=(DeviceNode("/dev/dri/card1"),), env={"VISIBLE": "1"}, annotations={"k": "v"}
        ),
    }
    answer = default_allocation(["g0-0", "g0-1", "g1-0"], devices)
    assert [n.host_path for n in answer.nodes] == ["/dev/dri/card0", "/dev/dri/card1"]
    assert [m.host_path for m in answer.mounts] == ["/opt/x"]
    assert dict(answer.env) == {"VISIBLE": "0,1"}
    assert dict(answer.annotations) == {"k": "v"}


def test_preferred_includes_must_include_first_then_its_numa_node() -> None:
    devices = {"a0": numa(0), "a1": numa(0), "b0": numa(1), "b1": numa(1), "b2": numa(1)}
    got = default_preferred(list(devices), ["b0"], 2, devices)
    assert got[0] == "b0" and set(got) <= {"b0", "b1", "b2"} and len(got) == 2


def test_preferred_without_must_include_packs_into_one_node_that_fits() -> None:
    devices = {"a0": numa(0), "a1": numa(0), "b0": numa(1), "b1": numa(1), "b2": numa(1)}
    assert default_preferred(list(devices), [], 2, devices) == ["a0", "a1"]  # tightest fit
    assert sorted(default_preferred(list(devices), [], 3, devices)) == ["b0", "b1", "b2"]
    four = default_preferred(list(devices), [], 4, devices)
    assert len(four) == 4 and {"b0", "b1", "b2"} <= set(four)  # biggest node first


def test_preferred_never_fails_and_skips_unhealthy() -> None:
    devices = {"a0": numa(0), "a1": numa(0, Health.UNHEALTHY)}
    assert default_preferred(["a0", "a1"], [], 5, devices) == ["a0"]
    assert default_preferred(["a0"], ["a0", "x"], 1, devices) == ["a0", "x"]
    assert default_preferred(["a0"], [], 0, devices) == []
    assert default_preferred(["a0"], [], -3, devices) == []


def test_preferred_keeps_ids_it_does_not_know_and_lists_everything_in_id_order() -> None:
    # Offered ids missing from the devices are the kubelet's business: kept, as NUMA-less.
    devices = {"b0": numa(1), "a1": numa(0), "a10": numa(0), "a2": numa(0)}
    offered = ["a10", "b0", "a2", "stale", "a1"]
    assert default_preferred(offered, [], 2, devices) == ["a1", "a2"]
    # An answer taking every usable id lists them in natural order, not node by node.
    assert default_preferred(offered, [], 9, devices) == ["a1", "a2", "a10", "b0", "stale"]
    assert default_preferred(offered, ["b0"], 9, devices) == ["b0", "a1", "a2", "a10", "stale"]
    # Not all of them: drawn node by node (b0's node has nothing else; then the biggest).
    assert default_preferred(offered, ["b0"], 4, devices) == ["b0", "a1", "a2", "a10"]
