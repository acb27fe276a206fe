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


def test_diff_through_edits_matches_a_full_comparison() -> None:
    """A random walk of edits (re-reads giving equal devices included): the diff that
    compares only the edited ids says what comparing every device says."""
    import random

    rng = random.Random(16)
    names = [f"example.com/r{i}" for i in range(3)]
    old = DeviceTree({r: {"0": DeviceInfo()} for r in names})
    for _ in range(300):
        removed = [(r, i) for r in old for i in old[r] if rng.random() < 0.15]
        added: dict[str, dict[str, DeviceInfo]] = {}
        for r, i in removed:
            if rng.random() < 0.6:  # re-read: equal, or with another health
                health = rng.choice([Health.HEALTHY, Health.HEALTHY, Health.UNHEALTHY])
                added.setdefault(r, {})[i] = DeviceInfo(health=health)
        if rng.random() < 0.3:
            r, i = rng.choice(names), str(rng.randrange(8))
            if i not in old.get(r, {}) or (r, i) in removed:
                added.setdefault(r, {}).setdefault(i, DeviceInfo())
        new = old.with_changes(removed, added)
        assert diff(old, new) == diff(DeviceTree(old), DeviceTree(new))
        old = new
