from __future__ import annotations

import pytest

from devplug.errors import InvalidNameError
from devplug.model import (
    DeviceInfo,
    DeviceNode,
    DeviceTree,
    DeviceTreeBuilder,
    Health,
    Mount,
)


def test_device_node_defaults_and_normalises() -> None:
    node = DeviceNode("/dev//dri/card0")
    assert node.host_path == "/dev/dri/card0"
    assert node.container_path == "/dev/dri/card0"
    assert node.permissions == "rw"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"host_path": "dev/x"},
        {"host_path": "/dev/../etc/shadow"},
        {"host_path": "/dev/x\0"},
        {"host_path": "/dev/x", "container_path": "rel"},
        {"host_path": "/dev/x", "permissions": "rwx"},
        {"host_path": "/dev/x", "permissions": ""},
    ],
)
def test_device_node_refuses_unsafe_values(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message varies by rule
        DeviceNode(**kwargs)


def test_mount_is_read_only_by_default() -> None:
    assert Mount("/usr/lib/x").read_only


def test_device_info_is_frozen_and_compares_by_value() -> None:
    a = DeviceInfo(env={"A": "1"}, numa_nodes=(1, 0, 1))
    b = DeviceInfo(env={"A": "1"}, numa_nodes=(0, 1))
    assert a == b
    assert a.numa_nodes == (0, 1)
    with pytest.raises(AttributeError):
        a.health = Health.UNHEALTHY  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.env["B"] = "2"  # type: ignore[index]
    assert DeviceInfo(health="Unhealthy").health is Health.UNHEALTHY  # type: ignore[arg-type]


def test_device_info_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="numa"):
        DeviceInfo(numa_nodes=(-1,))
    with pytest.raises(ValueError, match="env"):
        DeviceInfo(env={"A=B": "1"})


def test_tree_validates_names_and_drops_empty_resources() -> None:
    tree = DeviceTree({"example.com/a": {"d0": DeviceInfo()}, "example.com/b": {}})
    assert list(tree) == ["example.com/a"]
    with pytest.raises(InvalidNameError):
        DeviceTree({"no-slash": {"d0": DeviceInfo()}})
    with pytest.raises(InvalidNameError):
        DeviceTree({"example.com/a": {"../d0": DeviceInfo()}})


def test_tree_equality_and_merge() -> None:
    a = DeviceTree({"example.com/a": {"d0": DeviceInfo()}})
    assert a == DeviceTree({"example.com/a": {"d0": DeviceInfo()}})
    assert a != DeviceTree({"example.com/a": {"d0": DeviceInfo(health=Health.UNHEALTHY)}})
    b = DeviceTree({"example.com/b": {"d1": DeviceInfo()}})
    assert set(a.merged(b)) == {"example.com/a", "example.com/b"}
    with pytest.raises(ValueError, match="twice"):
        a.merged(a)


def test_builder_refuses_duplicate_ids() -> None:
    builder = DeviceTreeBuilder()
    builder.add("example.com/a", "d0", DeviceInfo())
    assert ("example.com/a", "d0") in builder
    with pytest.raises(ValueError, match="duplicate"):
        builder.add("example.com/a", "d0", DeviceInfo())
    assert builder.build().device_count() == 1


def test_with_changes_removes_adds_and_validates_only_the_change() -> None:
    tree = DeviceTree({"example.com/a": {"x": DeviceInfo(), "y": DeviceInfo()}})
    changed = tree.with_changes(
        [("example.com/a", "x"), ("example.com/a", "gone-already")],
        {"example.com/b": {"z": DeviceInfo()}},
    )
    assert changed == DeviceTree(
        {"example.com/a": {"y": DeviceInfo()}, "example.com/b": {"z": DeviceInfo()}}
    )
    assert set(tree["example.com/a"]) == {"x", "y"}  # the original is untouched
    emptied = changed.with_changes([("example.com/a", "y")], {})
    assert "example.com/a" not in emptied  # an emptied resource is not kept
    with pytest.raises(ValueError, match="duplicate device id"):
        tree.with_changes([], {"example.com/a": {"y": DeviceInfo()}})
    with pytest.raises(InvalidNameError):
        tree.with_changes([], {"example.com/a": {"bad id/": DeviceInfo()}})
    # A removal from a resource the tree does not have is a no-op, not a new empty resource.
    assert "example.com/c" not in tree.with_changes([("example.com/c", "x")], {})


def test_with_changes_shares_the_resources_it_does_not_touch() -> None:
    tree = DeviceTree({"example.com/a": {"x": DeviceInfo()}, "example.com/b": {"y": DeviceInfo()}})
    changed = tree.with_changes([("example.com/b", "y")], {"example.com/b": {"z": DeviceInfo()}})
    assert changed["example.com/a"] is tree["example.com/a"]
    assert changed["example.com/b"] is not tree["example.com/b"]
    assert set(tree["example.com/b"]) == {"y"} and set(changed["example.com/b"]) == {"z"}


def test_merged_shares_the_resources_maps() -> None:
    a = DeviceTree({"example.com/a": {"x": DeviceInfo()}})
    b = DeviceTree({"example.com/b": {"y": DeviceInfo()}})
    merged = a.merged(b)
    assert merged["example.com/a"] is a["example.com/a"]
    assert merged["example.com/b"] is b["example.com/b"]


def test_narrowed_keeps_subsets_only_and_drops_emptied_resources() -> None:
    info = DeviceInfo()
    tree = DeviceTree({"example.com/a": {"x": info, "y": info}, "example.com/b": {"z": info}})
    narrowed = tree.narrowed({"example.com/a": {"y": info}, "example.com/b": {}})
    assert narrowed == DeviceTree({"example.com/a": {"y": info}})
    assert tree == DeviceTree(
        {"example.com/a": {"x": info, "y": info}, "example.com/b": {"z": info}}
    )
    with pytest.raises(ValueError, match="not a subset"):
        tree.narrowed({"example.com/a": {"new": info}})  # an id never validated
    with pytest.raises(ValueError, match="not a subset"):
        tree.narrowed({"example.com/c": {"x": info}})
    given = {"y": info}
    copied = tree.narrowed({"example.com/a": given})
    given["x"] = info  # the caller's dict changes: the tree does not
    assert set(copied["example.com/a"]) == {"y"}


def test_edit_since_tells_what_with_changes_changed_and_only_for_its_base() -> None:
    a, b = "example.com/a", "example.com/b"
    tree = DeviceTree({a: {"x": DeviceInfo(), "y": DeviceInfo()}, b: {"z": DeviceInfo()}})
    changed = tree.with_changes(
        [(a, "x"), (a, "gone")], {a: {"x": DeviceInfo(), "w": DeviceInfo()}}
    )
    edit = changed.edit_since(a, tree[a])
    assert edit is not None and edit.base is tree[a]
    assert edit.removed == {"x"} and edit.added == {"x", "w"}
    assert changed.edit_since(b, tree[b]) is None  # not changed: the map is shared
    assert changed.edit_since(a, changed[a]) is None  # not its base
    assert DeviceTree(changed).edit_since(a, tree[a]) is None  # a fresh tree knows no edit
    # Merging keeps the edits of the maps it shares; narrowing drops the narrowed one's.
    merged = DeviceTree().merged(changed)
    assert merged.edit_since(a, tree[a]) == edit
    assert changed.narrowed({a: {"y": changed[a]["y"]}}).edit_since(a, tree[a]) is None
    # A resource the edit creates, or empties, has no edit.
    new = tree.with_changes([(b, "z")], {"example.com/c": {"q": DeviceInfo()}})
    assert new.edit_since("example.com/c", tree[a]) is None and b not in new


def test_a_further_change_keeps_the_edits_of_the_maps_it_does_not_touch() -> None:
    """A health gate overrides a few devices of one resource in a tree the scanners edited:
    the other resources' maps are the very same, so their edits must survive, or everything
    kept per device of them (the ListAndWatch message) is redone from scratch."""
    a, b = "example.com/a", "example.com/b"
    tree = DeviceTree({a: {"x": DeviceInfo()}, b: {"z": DeviceInfo()}})
    scanned = tree.with_changes([(b, "z")], {b: {"z": DeviceInfo(), "q": DeviceInfo()}})
    gated = scanned.with_changes([(a, "x")], {a: {"x": DeviceInfo(health=Health.UNHEALTHY)}})
    edit = gated.edit_since(b, tree[b])
    assert edit is not None and edit == scanned.edit_since(b, tree[b])
    # The touched map's edit is the new one (from ``scanned``'s map, the same as tree's here).
    touched = gated.edit_since(a, scanned[a])
    assert touched is not None and touched.removed == {"x"} and touched.added == {"x"}
    # A map the change empties and fills again from nothing keeps no stale edit.
    emptied = scanned.with_changes([(b, "z"), (b, "q")], {})
    refilled = emptied.with_changes([], {b: {"z": DeviceInfo()}})
    assert refilled.edit_since(b, tree[b]) is None


def test_with_maps_of_takes_the_named_maps_and_their_edits() -> None:
    a, b, c = "example.com/a", "example.com/b", "example.com/c"
    tree = DeviceTree({a: {"x": DeviceInfo()}, b: {"y": DeviceInfo()}, c: {"w": DeviceInfo()}})
    scanned = tree.with_changes([(a, "x")], {a: {"x": DeviceInfo()}, b: {"v": DeviceInfo()}})
    other = tree.with_changes([(b, "y"), (c, "w")], {b: {"y": DeviceInfo(health=Health.UNHEALTHY)}})
    mixed = scanned.with_maps_of(other, [b, c])
    assert mixed[a] is scanned[a] and mixed.edit_since(a, tree[a]) == scanned.edit_since(a, tree[a])
    assert mixed[b] is other[b] and mixed.edit_since(b, tree[b]) == other.edit_since(b, tree[b])
    assert mixed.edit_since(b, tree[b]) is not None
    assert c not in mixed  # ``other`` has no map for it
