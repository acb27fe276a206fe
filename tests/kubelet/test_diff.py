from __future__ import annotations

from devplug.kubelet.diff import TreeDiff, diff
from devplug.model import DeviceInfo, DeviceTree, Health


def tree(**resources: dict[str, DeviceInfo]) -> DeviceTree:
    return DeviceTree({f"example.com/{k}": v for k, v in resources.items()})


def test_diff_reports_added_removed_changed() -> None:
    old = tree(a={"0": DeviceInfo()}, b={"0": DeviceInfo()}, c={"0": DeviceInfo()})
    new = tree(
        a={"0": DeviceInfo()}, b={"0": DeviceInfo(health=Health.UNHEALTHY)}, d={"0": DeviceInfo()}
    )
    assert diff(old, new) == TreeDiff(
        added=frozenset({"example.com/d"}),
        removed=frozenset({"example.com/c"}),
        changed=frozenset({"example.com/b"}),
    )


def test_diff_of_equal_trees_is_empty_and_falsy() -> None:
    a = tree(a={"0": DeviceInfo(), "1": DeviceInfo()})
    b = tree(a={"1": DeviceInfo(), "0": DeviceInfo()})
    assert not diff(a, b)
    assert diff(a, b) == TreeDiff()


def test_a_device_added_to_a_resource_is_a_change() -> None:
    change = diff(tree(a={"0": DeviceInfo()}), tree(a={"0": DeviceInfo(), "1": DeviceInfo()}))
    assert change.changed == {"example.com/a"} and not change.added and not change.removed
