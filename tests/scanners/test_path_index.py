"""PathIndex (kept sorted across rescans) answers like TouchedPaths (sorted per batch)."""

from __future__ import annotations

import random

from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.incremental import PathIndex, SourceIndex, TouchedPaths, TreeEdit


def random_path(rng: random.Random) -> str:
    parts = [rng.choice(["a", "b", "bc", "c"]) for _ in range(rng.randint(1, 4))]
    return "/sys/devices/" + "/".join(parts)


def test_touched_by_agrees_with_touched_paths_through_adds_and_discards() -> None:
    rng = random.Random(11)
    index = PathIndex()
    members: set[str] = set()
    for _ in range(400):
        path = random_path(rng)
        if rng.random() < 0.6:
            index.add(path)
            members.add(path)
        else:
            index.discard(path)
            members.discard(path)
        events = [random_path(rng) for _ in range(rng.randint(0, 3))]
        assert index.touched_by(events) == TouchedPaths(events).touched_sources(members)
        assert len(index) == len(members)
        assert all(member in index for member in members)


def test_siblings_with_a_common_name_prefix_are_not_touched() -> None:
    index = PathIndex(["/sys/devices/a/b", "/sys/devices/a/bc", "/sys/devices/a/b/c/d"])
    assert index.touched_by(["/sys/devices/a/b"]) == {"/sys/devices/a/b", "/sys/devices/a/b/c/d"}
    assert index.touched_by(["/sys/devices/a/bc/x"]) == {"/sys/devices/a/bc"}
    assert index.touched_by(["/sys/devices/a"]) == {
        "/sys/devices/a/b",
        "/sys/devices/a/bc",
        "/sys/devices/a/b/c/d",
    }
    index.discard("/sys/devices/a/b")
    assert index.touched_by(["/sys/devices/a/b"]) == {"/sys/devices/a/b/c/d"}
    index.discard("/sys/devices/nothing")  # absent: no error
    assert len(index) == 2


def _index_state(index: SourceIndex) -> tuple[dict[str, set[tuple[str, str]]], list[str]]:
    assert len(index.paths) == len(index.by_source)
    return index.by_source, index.paths._sorted


def test_a_kept_source_index_matches_a_fresh_one_through_random_edits() -> None:
    """A random walk of tree edits (devices of one or several sources, shared sources, ids
    re-read with other sources, resources coming and going, edits of trees the index does
    not know): TreeEdit with the kept index touches what TreeEdit indexing the previous tree
    afresh touches, builds the same tree, and leaves the index equal to a fresh one."""
    resources = ["example.com/a", "example.com/b"]
    for seed in range(10):
        rng = random.Random(seed)
        kept = SourceIndex()

        def info(rng: random.Random = rng) -> DeviceInfo:
            return DeviceInfo(sources=tuple({random_path(rng) for _ in range(rng.randint(0, 3))}))

        tree = DeviceTree()
        for _ in range(200):
            touched = TouchedPaths(random_path(rng) for _ in range(rng.randint(0, 3)))
            if rng.random() < 0.05:
                tree = DeviceTree(tree)  # a tree the kept index does not know
            with_kept = TreeEdit(tree, touched, kept)
            fresh = TreeEdit(tree, touched)
            assert with_kept.stale_sources == fresh.stale_sources
            assert with_kept.removed == fresh.removed
            step = rng.random()
            for edit in (with_kept, fresh):
                readd = random.Random(step)  # the same re-reads and additions for both
                for resource, device_id in sorted(edit.removed):
                    if readd.random() < 0.5:
                        edit.add(resource, device_id, info(readd))
                for _ in range(readd.choice([0, 1, 2])):
                    resource, device_id = readd.choice(resources), str(readd.randrange(20))
                    if (resource, device_id) not in edit:
                        edit.add(resource, device_id, info(readd))
            tree = with_kept.build()
            assert tree == fresh.build()
            assert kept.tree is tree
            assert _index_state(kept) == _index_state(SourceIndex(tree))
