"""What the daemon-wide ListAndWatch limit costs per scan, next to building the message.

For one resource of N ids (61-character ids, one NUMA node each), medians of ``--runs``:

- floor: building the ListAndWatchResponse of the same devices with protobuf (what the
  servicer does for every changed list) and taking its ByteSize;
- changed map: ``ListLimit.fit`` of a tree whose map is new (a scan that changed the
  resource): under 80 % of the limit an upper bound suffices; from 80 % every id is counted,
  and past the limit the ids are also sorted to pick who waits;
- same map: ``fit`` of the tree it saw last (a scan that left the resource alone).

The sizes span: far below the limit, near it (~85 %), and past it. Nothing is asserted.

    .venv/bin/python -m bench.list_limit [--sizes 10000 45000 60000] [--runs 7]
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


def tree_of(count: int) -> DeviceTree:
    info = DeviceInfo(nodes=(DeviceNode("/dev/null"),), numa_nodes=(0,))
    return DeviceTree({RESOURCE: {f"{'d' * 54}-{i:06d}": info for i in range(count)}})


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
    args = parser.parse_args()
    # The limit's warnings and errors are expected here; keep the figures readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    for count in args.sizes:
        print(measure(count, args.runs))


def fresh_fit(tree: DeviceTree) -> None:
    """A limit that has not seen this map: every scan that changed the resource."""
    ListLimit().fit(tree)


def measure(count: int, runs: int) -> str:
    tree = tree_of(count)
    devices = tree[RESOURCE]
    size = list_message(devices).ByteSize()
    floor = median_ms(lambda: list_message(devices).ByteSize(), runs)
    first = median_ms(lambda: fresh_fit(tree), runs)
    limit = ListLimit()
    _, held = limit.fit(tree)
    same = median_ms(lambda: limit.fit(tree), runs)
    waiting = sum(len(ids) for ids in held.values())
    return (
        f"{count:>7,} ids, list {size:,} bytes ({size / KUBELET_MAX_RECEIVE_BYTES:.0%} of "
        f"4 MiB), {waiting:,} held back: floor (build the message) {floor:.1f} ms; "
        f"fit, changed map {first:.1f} ms ({first / floor:.2f}x); "
        f"same map {same:.3f} ms ({same / floor:.4f}x)"
    )


if __name__ == "__main__":
    main()
