"""Keeping every resource's ListAndWatch message within the kubelet's receive limit.

The kubelet reads a plugin's lists with gRPC's 4 MiB limit; one byte more fails the stream and
the resource's capacity drops to zero until the plugin restarts (see ANCHORS, and
:mod:`devplug.sizing`). This guard covers every scanner, a plugin author's included: a
generic entry with ``shares: 1000`` matching a few hundred devices is enough to overflow. The
Intel GPU scanner also keeps its own lists in bounds (whole GPUs, not single shares, wait, and
a host too big at start-up is refused), so for its resources this guard never has to act.

When a resource's list would not fit, the devices it already advertised keep their place and
newcomers wait, taken in id order, so capacity never shrinks under pods that hold devices. The
ones held back are logged (once per change), counted in a metric and shown by ``devplug scan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import structlog

from devplug.model import DeviceInfo, DeviceTree, Health
from devplug.naming import natural_key
from devplug.sizing import KUBELET_MAX_RECEIVE_BYTES, WARN_FRACTION, device_entry_bytes

log = structlog.get_logger("devplug.list_limit")

# Upper bounds of one device's bytes in a list, to skip the exact count for lists far below the
# limit: a 63-byte id (the longest valid one) with "Unhealthy" takes 78 bytes, and each NUMA
# node at most 13 more (an int64 varint in two nested messages) plus the topology header.
_MOST_BYTES_PER_DEVICE = 96
_MOST_BYTES_PER_NUMA_NODE = 16
_SHOWN_IDS = 10

DeviceMap = Mapping[str, DeviceInfo]


def _upper_bound(devices: DeviceMap) -> int:
    numa_nodes = sum(len(info.numa_nodes) for info in devices.values())
    return len(devices) * _MOST_BYTES_PER_DEVICE + numa_nodes * _MOST_BYTES_PER_NUMA_NODE


def _entry_bytes(device_id: str, info: DeviceInfo) -> int:
    # Counted as Unhealthy, the longer word: the health gate and health flips change a
    # device's health after this check, and must never push an advertised list over.
    return device_entry_bytes(device_id, str(Health.UNHEALTHY), info.numa_nodes)


class ListLimit:
    """Trims each resource of a tree to what fits in one ListAndWatch message.

    Not thread-safe: one scan at a time calls :meth:`fit` (the ScanRunner's worker thread).
    """

    def __init__(self, limit: int = KUBELET_MAX_RECEIVE_BYTES) -> None:
        self.limit = limit
        # resource -> (the scanners' map last seen, what was advertised of it, the ids held)
        self._last: dict[str, tuple[DeviceMap, DeviceMap, tuple[str, ...]]] = {}
        self._near: set[str] = set()

    def fit(self, tree: DeviceTree) -> tuple[DeviceTree, dict[str, tuple[str, ...]]]:
        """``tree`` without the devices that do not fit, and resource -> the ids held back.

        A resource whose map is the one seen last time (scans share unchanged resources'
        maps) gets the same verdict and the same trimmed map, without being counted again.
        """
        verdicts: dict[str, tuple[DeviceMap, DeviceMap, tuple[str, ...]]] = {}
        trimmed: dict[str, DeviceMap] = {}
        for resource, devices in tree.items():
            last = self._last.get(resource)
            if last is not None and last[0] is devices:
                verdict = last
            else:
                advertised, held_before = (last[1], last[2]) if last is not None else ({}, ())
                waiting = self._check(resource, devices, advertised, held_before)
                kept = devices
                if waiting:
                    left_out = set(waiting)
                    kept = MappingProxyType(
                        {i: info for i, info in devices.items() if i not in left_out}
                    )
                verdict = (devices, kept, waiting)
            verdicts[resource] = verdict
            if verdict[2]:
                trimmed[resource] = verdict[1]
        self._last = verdicts
        self._near &= set(tree)
        fitted = tree.narrowed(trimmed) if trimmed else tree
        return fitted, {
            resource: waiting for resource, (_, _, waiting) in verdicts.items() if waiting
        }

    def _check(
        self,
        resource: str,
        devices: DeviceMap,
        advertised: DeviceMap,
        held_before: tuple[str, ...],
    ) -> tuple[str, ...]:
        """The ids of ``devices`` that must wait (none when the whole list fits)."""
        if _upper_bound(devices) < WARN_FRACTION * self.limit:
            self._near.discard(resource)
            total = None
        else:
            sizes = {i: _entry_bytes(i, info) for i, info in devices.items()}
            total = sum(sizes.values())
            self._warn_if_near(resource, total)
        if total is None or total <= self.limit:
            if held_before:
                log.info("list_limit.all_advertised", resource=resource, count=len(devices))
            return ()
        # Those advertised before first, then newcomers, each in id order.
        order = sorted((i for i in advertised if i in sizes), key=natural_key)
        known = set(order)
        order += sorted((i for i in sizes if i not in known), key=natural_key)
        room = self.limit
        cut = len(order)
        for index, device_id in enumerate(order):
            room -= sizes[device_id]
            if room < 0:
                cut = index
                break
        waiting = tuple(order[cut:])
        if waiting != held_before:
            log.error(
                "list_limit.devices_held_back",
                resource=resource,
                bytes=total,
                limit=self.limit,
                count=len(waiting),
                held_back=list(waiting[:_SHOWN_IDS]),
                reason=(
                    f"{len(devices):,} devices make a {total:,}-byte ListAndWatch message, over "
                    f"the kubelet's {self.limit:,}-byte receive limit; {len(waiting):,} wait "
                    "until there is room"
                ),
                fix="advertise fewer ids for this resource (lower shares, or narrow the match)",
            )
        return waiting

    def _warn_if_near(self, resource: str, total: int) -> None:
        near = total >= WARN_FRACTION * self.limit
        if near and resource not in self._near:
            log.warning(
                "list_limit.near",
                resource=resource,
                bytes=total,
                limit=self.limit,
                hint="one more change of the host may not fit; advertise fewer ids",
            )
        if near:
            self._near.add(resource)
        else:
            self._near.discard(resource)
