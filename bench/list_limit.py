"""What the daemon-wide ListAndWatch limit costs per scan, next to building the message.

For one resource of N ids (61-character ids, one NUMA node each), medians of ``--runs``. Each
id is a unit of its own (its own DeviceInfo), as with the generic scanner without shares;
``--shares S`` groups them S to a DeviceInfo instead, as a GPU's shares are:

- floor: building the ListAndWatchResponse of the same devices with protobuf (what the
  servicer did for every changed list before it kept encoded entries) and taking its ByteSize;
- changed map: ``ListLimit.fit`` of a tree whose map is new to a limit that has seen nothing
  (the first scan, or the worst case of a changed resource): under 80 % of the limit an upper
  bound suffices; from 80 % every id is counted, and past the limit the ids are also grouped
  into units and sorted to pick who waits;
- one more unit: ``fit`` of the tree with one unit added, by a limit that saw the tree before
  (a rescan that found a device): what was advertised is not sorted again while it fits;
- same map: ``fit`` of the tree it saw last (a scan that left the resource alone).

The sizes span: far below the limit, near it (~85 %), and past it. Nothing is asserted.

    .venv/bin/python -m bench.list_limit [--sizes 10000 45000 60000] [--runs 7] [--shares 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import structlog

from devplug.hotplug.list_limit import ListLimit
from devplug.kubelet.wire import list_message
from devplug.model import DeviceInfo, DeviceNode, DeviceTree
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES

RESOURCE = "example.com/many"


def tree_of(count: int, shares: int = 1) -> DeviceTree:
    """``count`` ids, ``shares`` to a DeviceInfo object (one unit for the list limit)."""
    nodes = (DeviceNode("/dev/null"),)
    devices: dict[str, DeviceInfo] = {}
    for i in range(count):
        if i % shares == 0:
            info = DeviceInfo(nodes=nodes, numa_nodes=(0,))
        devices[f"{'d' * 54}-{i:06d}"] = info
    return DeviceTree({RESOURCE: devices})


def median_ms(action: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 45_000, 60_000])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--shares", type=int, default=1, help="ids per DeviceInfo (unit)")
    args = parser.parse_args()
    # The limit's warnings and errors are expected here; keep the figures readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    for count in args.sizes:
        print(measure(count, args.runs, args.shares))


def fresh_fit(tree: DeviceTree) -> None:
    """A limit that has not seen this map: every scan that changed the resource."""
    ListLimit().fit(tree)


def one_more_ms(count: int, shares: int, runs: int) -> float:
    """``fit`` of a tree with one unit more than the one the limit saw last."""
    before, after = tree_of(count, shares), tree_of(count + shares, shares)
    samples = []
    for _ in range(runs):
        limit = ListLimit()
        limit.fit(before)
        started = time.perf_counter()
        limit.fit(after)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def measure(count: int, runs: int, shares: int = 1) -> str:
    tree = tree_of(count, shares)
    devices = tree[RESOURCE]
    size = list_message(devices).ByteSize()
    floor = median_ms(lambda: list_message(devices).ByteSize(), runs)
    first = median_ms(lambda: fresh_fit(tree), runs)
    more = one_more_ms(count, shares, runs)
    limit = ListLimit()
    _, held = limit.fit(tree)
    same = median_ms(lambda: limit.fit(tree), runs)
    waiting = sum(len(ids) for ids in held.values())
    return (
        f"{count:>7,} ids ({shares} per unit), list {size:,} bytes "
        f"({size / KUBELET_MAX_RECEIVE_BYTES:.0%} of 4 MiB), {waiting:,} held back: "
        f"floor (build the message) {floor:.1f} ms; "
        f"fit, changed map {first:.1f} ms ({first / floor:.2f}x); "
        f"one more unit {more:.1f} ms ({more / floor:.2f}x); "
        f"same map {same:.3f} ms ({same / floor:.4f}x)"
    )


if __name__ == "__main__":
    main()
