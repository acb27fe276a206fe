"""Keeping every resource's ListAndWatch message within the kubelet's receive limit.

The kubelet reads a plugin's lists with gRPC's 4 MiB limit; one byte more fails the stream and
the resource's capacity drops to zero until the plugin restarts (see :mod:`devplug.sizing`).
This is the one guard for every scanner, a plugin author's included: a generic entry with
``shares: 1000`` matching a few hundred devices is enough to overflow, and so are Intel GPUs
with a large ``shared_dev_num``.

What waits is a unit: the ids of a resource that share one :class:`DeviceInfo` object, such as
the shares ``<address>-0`` .. ``<address>-<N-1>`` of one GPU or the ``shares`` of one generic
device. A unit is advertised whole or not at all, since half a GPU's shares would let the
kubelet schedule on a GPU the list only partly describes. (A scanner that gave every device of
a resource the same object would make the resource one unit.)

When a resource's list would not fit, the units it already advertised keep their place and
newcomers wait, taken in the natural order of their first id, so capacity never shrinks under
pods that hold devices and no unit overtakes one that waits longer. The ids held back are
logged (once per change), counted in a metric and shown by ``devplug scan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import structlog

from devplug._kits.problems import ProblemLog
from devplug.model import DeviceMap, DeviceTree
from devplug.naming import NaturalKey, natural_key
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, WARN_FRACTION, counted_entry_bytes

log = structlog.get_logger(__name__)

# Upper bounds of one device's bytes in a list, to skip the exact count for lists far below the
# limit: a 63-byte id (the longest valid one) with "Unhealthy" takes 78 bytes, and each NUMA
# node at most 13 more (an int64 varint in two nested messages) plus the topology header.
_MOST_BYTES_PER_DEVICE = 96
_MOST_BYTES_PER_NUMA_NODE = 16
# Units named in the held-back error; the count says how many there are in all.
_SHOWN_UNITS = 10


class Fitted(NamedTuple):
    """What :meth:`ListLimit.fit` gives back."""

    tree: DeviceTree  # the tree without what waits
    held_back: dict[str, tuple[str, ...]]  # resource -> the ids that wait (only those with any)


class _Verdict(NamedTuple):
    """The limit's answer for one resource's map, kept until the next scan."""

    devices: DeviceMap  # the scanners' map it was given
    advertised: DeviceMap  # what of it is advertised (``devices`` itself when all fit)
    waiting: tuple[str, ...]  # the ids held back, unit by unit in the order they wait
    numa_nodes: int  # NUMA nodes of all of ``devices`` (for the upper bound)


# A unit: the ids of one resource that share a DeviceInfo object, in the map's order.
Unit = list[str]


def _numa_nodes(devices: DeviceMap, tree: DeviceTree, resource: str, last: _Verdict | None) -> int:
    """The NUMA nodes of all of ``devices`` (``tree[resource]``): from the last verdict's
    count and the tree's edit when it knows one (O(changed)), else counted."""
    edit = tree.edit_since(resource, last.devices) if last is not None else None
    if last is None or edit is None:
        return sum(len(info.numa_nodes) for info in devices.values())
    before = edit.base
    return (
        last.numa_nodes
        - sum(len(before[i].numa_nodes) for i in edit.removed)
        + sum(len(devices[i].numa_nodes) for i in edit.added)
    )


def _upper_bound(devices: DeviceMap, numa_nodes: int) -> int:
    return len(devices) * _MOST_BYTES_PER_DEVICE + numa_nodes * _MOST_BYTES_PER_NUMA_NODE


def _units(devices: DeviceMap) -> list[Unit]:
    """``devices`` grouped by DeviceInfo object: identity, not equality (two devices may well
    carry equal infos, and DeviceInfo is not hashable)."""
    grouped: dict[int, Unit] = {}
    for device_id, info in devices.items():
        # The map holds every info alive for this call, so id() cannot be reused meanwhile.
        grouped.setdefault(id(info), []).append(device_id)
    return list(grouped.values())


def _first_key(unit: Unit) -> NaturalKey:
    """The key of the unit's first id in natural order: units wait in that order."""
    if len(unit) == 1:  # most devices are a unit of one: spare them min()
        return natural_key(unit[0])
    return min(map(natural_key, unit))


def _first_id(unit: Unit) -> str:
    return _first_key(unit)[1]  # a NaturalKey ends with the text itself


class ListLimit:
    """Trims each resource of a tree to what fits in one ListAndWatch message.

    Not thread-safe: one scan at a time calls :meth:`fit` (the ScanRunner's worker thread).
    """

    def __init__(self, limit: int = KUBELET_MAX_RECEIVE_BYTES) -> None:
        self.limit = limit
        self._last: dict[str, _Verdict] = {}
        # The resources whose list is near the limit, warned about once until it is not.
        self._near = ProblemLog()

    def fit(self, tree: DeviceTree) -> Fitted:
        """``tree`` without the units that do not fit, and resource -> the ids held back.

        A resource whose map is the one seen last time (scans share unchanged resources'
        maps) gets the same verdict and the same trimmed map, without being counted again.
        """
        verdicts: dict[str, _Verdict] = {}
        trimmed: dict[str, DeviceMap] = {}
        for resource, devices in tree.items():
            last = self._last.get(resource)
            if last is not None and last.devices is devices:
                verdict = last
            else:
                numa_nodes = _numa_nodes(devices, tree, resource, last)
                verdict = self._check(resource, devices, last, numa_nodes)
            verdicts[resource] = verdict
            if verdict.waiting:
                trimmed[resource] = verdict.advertised
        self._last = verdicts
        for gone in [r for r in self._near.unsolved() if r not in tree]:
            self._near.solved(gone)
        fitted = tree.narrowed(trimmed) if trimmed else tree
        held = {resource: v.waiting for resource, v in verdicts.items() if v.waiting}
        return Fitted(fitted, held)

    def _check(
        self, resource: str, devices: DeviceMap, last: _Verdict | None, numa_nodes: int
    ) -> _Verdict:
        """The verdict on ``devices`` (with ``numa_nodes`` in all), given the last one on
        this resource."""
        held_before = last.waiting if last is not None else ()
        if _upper_bound(devices, numa_nodes) < WARN_FRACTION * self.limit:
            self._near.solved(resource)
            total = None
        else:
            sizes = {i: counted_entry_bytes(i, info.numa_nodes) for i, info in devices.items()}
            total = sum(sizes.values())
            self._warn_if_near(resource, total)
        if total is None or total <= self.limit:
            if held_before:
                log.info("list_limit.all_advertised", resource=resource, count=len(devices))
            return _Verdict(devices, devices, (), numa_nodes)
        advertised = last.advertised if last is not None else {}
        waiting = self._waiting(_units(devices), sizes, advertised)
        ids = tuple(i for unit in waiting for i in unit)
        if ids != held_before:
            log.error(
                "list_limit.devices_held_back",
                resource=resource,
                bytes=total,
                limit=self.limit,
                count=len(ids),
                units=len(waiting),
                held_back=[_first_id(unit) for unit in waiting[:_SHOWN_UNITS]],
                reason=(
                    f"{len(devices):,} devices make a {total:,}-byte ListAndWatch message, over "
                    f"the kubelet's {self.limit:,}-byte receive limit; {len(ids):,} wait, in "
                    f"{len(waiting):,} whole units (ids that share one device's info), until "
                    "there is room"
                ),
                fix=(
                    "advertise fewer ids for this resource (fewer shares per device, such as "
                    "shares or shared_dev_num, or match fewer devices)"
                ),
            )
        left_out = set(ids)
        kept = MappingProxyType({i: info for i, info in devices.items() if i not in left_out})
        return _Verdict(devices, kept, ids, numa_nodes)

    def _waiting(
        self, units: list[Unit], sizes: Mapping[str, int], advertised: DeviceMap
    ) -> list[Unit]:
        """The units that wait: the units advertised before come first, then newcomers, each
        in the natural order of their first id; the first unit that does not fit waits, and so
        does every one after it (none overtakes a unit that waits longer)."""
        before: list[Unit] = []
        newcomers: list[Unit] = []
        if advertised:
            seen = advertised.keys()
            for unit in units:
                # Any of its ids advertised: the kubelet may have handed the unit out.
                (newcomers if seen.isdisjoint(unit) else before).append(unit)
        else:
            newcomers = units
        room = self.limit - sum(sizes[i] for unit in before for i in unit)
        if room >= 0:
            # The usual case: what was advertised still fits, so its order does not matter;
            # only the newcomers (often a few) need sorting.
            order = sorted(newcomers, key=_first_key)
        else:
            order = sorted(before, key=_first_key) + sorted(newcomers, key=_first_key)
            room = self.limit
        for index, unit in enumerate(order):
            room -= sizes[unit[0]] if len(unit) == 1 else sum(map(sizes.__getitem__, unit))
            if room < 0:
                return order[index:]
        return []

    def _warn_if_near(self, resource: str, total: int) -> None:
        if total < WARN_FRACTION * self.limit:
            self._near.solved(resource)
            return
        self._near.report(
            log,
            "list_limit.near",
            "one more change of the host may not fit; advertise fewer ids",
            key=resource,
            level="warning",
            field="hint",
            resource=resource,
            bytes=total,
            limit=self.limit,
        )
