"""The monitoring device (``gpu.intel.com/monitoring``, id ``all``): every GPU's nodes.

Kept up to date node by node, so that an event about one GPU costs a bisect, not a rebuild of
a device with every node of the host (20,000 nodes on 10,000 GPUs took ~100 ms to rebuild).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable

from devplug.model import DeviceInfo, DeviceNode
from devplug.naming import NaturalKey, natural_key

MONITORING_RESOURCE = "gpu.intel.com/monitoring"
MONITORING_ID = "all"


class MonitorNodes:
    """A counted, naturally sorted set of node paths with their DeviceNodes made once."""

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._counts: Counter[str] = Counter()
        self._order: list[NaturalKey] = []  # (parts, path), sorted
        self._nodes: dict[str, DeviceNode] = {}
        for path in paths:
            self.add(path)

    def add(self, path: str) -> None:
        self._counts[path] += 1
        if self._counts[path] == 1:
            bisect.insort(self._order, natural_key(path))
            self._nodes[path] = DeviceNode(path)

    def discard(self, path: str) -> None:
        if self._counts[path] <= 0:
            del self._counts[path]
            return
        self._counts[path] -= 1
        if self._counts[path] == 0:
            del self._counts[path]
            del self._order[bisect.bisect_left(self._order, natural_key(path))]
            del self._nodes[path]

    def device(self) -> DeviceInfo:
        return DeviceInfo(nodes=tuple(self._nodes[path] for _, path in self._order))
