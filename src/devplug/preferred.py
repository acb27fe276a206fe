"""NUMA-aware GetPreferredAllocation: one mechanism, configured per policy.

The kubelet asks a plugin which ``size`` ids it would rather hand to a container, out of the
ids it offers (``available``), always including ``must_include`` (devices the container holds
already, e.g. after a restart). Every answer here is built the same way:

1. ``must_include`` first, deduplicated, even past ``size`` (the kubelet insists on them);
2. the other offered ids that are ``usable``, deduplicated, in ``key`` order;
3. grouped by NUMA node set, and drawn group by group: first the groups sharing a node with
   the must-include ids; without those, one group that can hold the whole rest (``nodes``:
   the tightest such group, keeping roomy nodes for big requests, or the roomiest);
   then the biggest groups first, so the answer spans as few nodes as it can;
4. within a group, ids are taken by ``fill``, over *units*: ids that stand for one thing, such
   as the shares of one GPU. ``packed`` fills the units already used (by must-include ids or
   earlier groups) first, then the rest in order; ``spread`` takes one id from each unit not
   used yet, then fills in order; ``balanced`` keeps taking an id from the unit with the most
   free ids (ties: the first in order).

Nothing raises: a request that cannot be met gets the best partial answer, since an error in
GetPreferredAllocation fails the pod's admission and the kubelet fills or refuses by itself.

Cost: one ``key`` call and one sort over the offered ids, a few lookups per id, and a heap over
units for ``balanced``. Pure and synchronous: a hook calls it as it is. The daemon decides where
the work runs: a request offering more than 2,000 ids in all containers together reaches a
plain-function hook in a worker thread (:mod:`devplug.kubelet.preferring`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from devplug.model import DeviceInfo
from devplug.naming import natural_key

Fill = Literal["packed", "spread", "balanced"]
NodeChoice = Literal["tightest", "roomiest"]
NumaNodes = tuple[int, ...]


def _no_numa(device_id: str) -> NumaNodes:
    return ()


def preferred_ids(
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
    *,
    fill: Fill = "packed",
    nodes: NodeChoice = "tightest",
    numa_of: Callable[[str], NumaNodes] = _no_numa,
    unit_of: Callable[[str], Hashable] | None = None,
    usable: Callable[[str], bool] | None = None,
    key: Callable[[str], Any] = natural_key,
    all_in_key_order: bool = False,
) -> list[str]:
    """The preferred ids: ``must_include`` first, then up to ``size`` in all (see the module).

    ``numa_of`` gives an id's NUMA nodes (``()``: none known); ``unit_of`` its unit (None:
    every id is a unit of its own, which makes every ``fill`` take ids in ``key`` order);
    ``usable`` says whether an offered id may be picked (None: all). With
    ``all_in_key_order``, an answer that takes every usable id lists them in ``key`` order
    instead of drawing them group by group (the kubelet reads the answer as a set).
    """
    chosen = list(dict.fromkeys(must_include))
    remaining = size - len(chosen)
    if remaining <= 0:
        return chosen
    taken = set(chosen)
    candidates = [
        i for i in dict.fromkeys(available) if i not in taken and (usable is None or usable(i))
    ]
    candidates.sort(key=key)
    if all_in_key_order and len(candidates) <= remaining:
        return chosen + candidates
    groups: dict[NumaNodes, list[str]] = {}
    for device_id in candidates:
        groups.setdefault(numa_of(device_id), []).append(device_id)
    anchor = {node for device_id in chosen for node in numa_of(device_id)}
    used = set() if unit_of is None else {unit_of(i) for i in chosen}
    for group in _group_order(groups, remaining, anchor, nodes):
        if unit_of is None:
            # Each id its own unit, none used yet: every fill comes down to id order.
            picks = groups[group][:remaining]
        else:
            picks = _fill(fill, groups[group], remaining, unit_of, used)
            used.update(unit_of(i) for i in picks)
        chosen.extend(picks)
        remaining -= len(picks)
        if remaining <= 0:
            break
    return chosen


def _group_order(
    groups: Mapping[NumaNodes, list[str]], remaining: int, anchor: set[int], nodes: NodeChoice
) -> list[NumaNodes]:
    """The order to draw NUMA groups in: one that can hold the rest first, then the biggest."""

    def order(group: NumaNodes) -> tuple[int, int, NumaNodes]:
        size = len(groups[group])
        if anchor:
            return (0 if anchor.intersection(group) else 1, -size, group)
        if size >= remaining:
            # Packing keeps big nodes free for big requests; spreading takes the roomiest.
            return (0, size if nodes == "tightest" else -size, group)
        return (1, -size, group)

    return sorted(groups, key=order)


def _fill(
    fill: Fill,
    candidates: Sequence[str],
    count: int,
    unit_of: Callable[[str], Hashable],
    used: set[Hashable],
) -> list[str]:
    """``count`` ids from one group's ``candidates`` (in key order) by ``fill``."""
    if fill == "balanced":
        return _balanced(candidates, count, unit_of)
    if fill == "spread":
        return _spread(candidates, count, unit_of, used)
    if not used:
        return list(candidates[:count])
    # Units already used first (a stable sort keeps id order within each side).
    return sorted(candidates, key=lambda i: unit_of(i) not in used)[:count]


def _spread(
    candidates: Sequence[str], count: int, unit_of: Callable[[str], Hashable], used: set[Hashable]
) -> list[str]:
    picks: list[str] = []
    seen = set(used)
    for device_id in candidates:
        if len(picks) == count:
            return picks
        unit = unit_of(device_id)
        if unit not in seen:
            seen.add(unit)
            picks.append(device_id)
    chosen = set(picks)
    picks.extend(i for i in candidates if i not in chosen)
    return picks[:count]


def _balanced(
    candidates: Sequence[str], count: int, unit_of: Callable[[str], Hashable]
) -> list[str]:
    ids_of: dict[Hashable, list[str]] = {}
    for device_id in candidates:
        ids_of.setdefault(unit_of(device_id), []).append(device_id)
    units = list(ids_of.values())
    # (-free ids, position of the unit in order): the most free first, ties in order.
    heap = [(-len(ids), position) for position, ids in enumerate(units)]
    heapq.heapify(heap)
    taken = [0] * len(units)
    picks: list[str] = []
    while heap and len(picks) < count:
        free, position = heapq.heappop(heap)
        picks.append(units[position][taken[position]])
        taken[position] += 1
        if free + 1 < 0:
            heapq.heappush(heap, (free + 1, position))
    return picks


# ------------------------------------------------------------------------ over devices


def by_info(device_id: str, info: DeviceInfo) -> Hashable:
    """Unit: the ids that share one ``DeviceInfo`` object (the shares a scanner made of one
    device by adding the same info under several ids)."""
    return id(info)


def by_first_source(device_id: str, info: DeviceInfo) -> Hashable:
    """Unit: the ids built from the same first sysfs path (the Intel GPU scanner's shares of
    one GPU); an id without sources is a unit of its own."""
    return info.sources[0] if info.sources else device_id


@dataclass(frozen=True, slots=True)
class PreferredPolicy:
    """A GetPreferredAllocation policy over a resource's devices, as hooks receive them.

    Call it with the hook's ``available``, ``must_include``, ``size`` and ``devices``. NUMA
    nodes come from ``DeviceInfo.numa_nodes``; unhealthy offered ids are never picked.
    ``unit`` groups ids into units (:func:`by_info`, :func:`by_first_source` or your own;
    None: each id is one). Offered ids missing from ``devices`` (the kubelet's view lags a
    removal) are picked as healthy, NUMA-less units of their own with ``keep_unknown``, else
    dropped. The other fields are :func:`preferred_ids`'s.
    """

    fill: Fill = "packed"
    nodes: NodeChoice = "tightest"
    unit: Callable[[str, DeviceInfo], Hashable] | None = None
    key: Callable[[str], Any] = natural_key
    keep_unknown: bool = True
    all_in_key_order: bool = False

    def __call__(
        self,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> list[str]:
        def numa_of(device_id: str) -> NumaNodes:
            info = devices.get(device_id)
            return () if info is None else info.numa_nodes

        keep_unknown = self.keep_unknown

        def usable(device_id: str) -> bool:
            info = devices.get(device_id)
            return keep_unknown if info is None else info.healthy

        unit = self.unit
        unit_of: Callable[[str], Hashable] | None = None
        if unit is not None:

            def unit_of(device_id: str) -> Hashable:
                info = devices.get(device_id)
                return device_id if info is None else unit(device_id, info)

        return preferred_ids(
            available,
            must_include,
            size,
            fill=self.fill,
            nodes=self.nodes,
            numa_of=numa_of,
            unit_of=unit_of,
            usable=usable,
            key=self.key,
            all_in_key_order=self.all_in_key_order,
        )
