"""What the Intel GPU scanner advertises for one GPU, and what it costs in the kubelet's list."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from devplug.model import DeviceInfo
from devplug.scanners.intel_gpu.settings import ResourceSize
from devplug.sizing import counted_entry_bytes


@dataclass(frozen=True, slots=True)
class GpuEntry:
    """One advertised GPU: its resource, ids (its shares) and what they carry.

    Its ids share the one ``info`` object: the daemon's list limit holds back a GPU's shares
    together, as one unit, because of that.
    """

    resource: str
    ids: tuple[str, ...]
    info: DeviceInfo
    monitor_nodes: frozenset[str]  # its nodes that exist, for the monitoring device
    # Nodes of minors it has had while sysfs still shows them: one of them missing now makes
    # the GPU unhealthy, at this scan and every later one until it is back.
    expected: frozenset[str] = frozenset()


def entry_sizes(entries: Iterable[GpuEntry]) -> dict[str, ResourceSize]:
    """resource -> its ListAndWatch bytes and GPUs, with every id counted as if Unhealthy (the
    longer word, as the daemon's list limit counts them)."""
    totals: dict[str, ResourceSize] = {}
    for entry in entries:
        size = sum(counted_entry_bytes(i, entry.info.numa_nodes) for i in entry.ids)
        before = totals.get(entry.resource, ResourceSize(0, 0))
        totals[entry.resource] = ResourceSize(before.bytes + size, before.gpus + 1)
    return totals
