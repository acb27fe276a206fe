"""PathIndex (kept sorted across rescans) answers like TouchedPaths (sorted per batch)."""

from __future__ import annotations

import random

from devplug.scanners.incremental import PathIndex, TouchedPaths


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
