"""What the Intel GPU scanner advertises for one GPU, and what it costs in the kubelet's list."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from devplug.model import DeviceInfo


@dataclass(frozen=True, slots=True)
class GpuEntry:
    """One advertised GPU: its resource, ids, what they carry and what they cost in bytes."""

    resource: str
    ids: tuple[str, ...]
    info: DeviceInfo
    monitor_nodes: frozenset[str]  # its nodes that exist, for the monitoring device
    # Its ids' bytes in a ListAndWatch message, counted as if Unhealthy (the longer word), so
    # that a change of health can never decide whether a list fits.
    list_bytes: int
    # Nodes of minors it has had while sysfs still shows them: one of them missing now makes
    # the GPU unhealthy, at this scan and every later one until it is back.
    expected: frozenset[str] = frozenset()


def entry_totals(entries: Iterable[GpuEntry]) -> dict[str, tuple[int, int]]:
    """resource -> (ListAndWatch bytes, GPUs) of ``entries``."""
    totals: dict[str, tuple[int, int]] = {}
    for entry in entries:
        size, gpus = totals.get(entry.resource, (0, 0))
        totals[entry.resource] = (size + entry.list_bytes, gpus + 1)
    return totals
