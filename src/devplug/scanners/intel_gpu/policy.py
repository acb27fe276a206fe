"""GetPreferredAllocation policies for shared GPUs: pure functions over device ids.

Intel's semantics, on ids in PCI address order, then share number:

- ``none``: spread: one share from each distinct GPU first, then fill in order;
- ``balanced``: repeatedly take a share from the GPU with the most free shares (ties: the
  first GPU in order);
- ``packed``: fill GPUs in order.

Unlike Intel's plugin, every policy takes the kubelet's ``must_include`` ids first (Intel
ignores them, so a restarted init container's devices could be dropped), counts the GPUs they
use as already used, and keeps the answer on one NUMA node when one can hold it: the must-include
devices' node if they have one, else the node the policy prefers (packed: the fullest node that
still fits; none and balanced: the node with the most free shares). Never raises: a request
that cannot be met gets the best partial answer, since an error fails the pod's admission.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from devplug.scanners.intel_gpu.settings import AllocationPolicy


def share_order(device_id: str) -> tuple[str, int]:
    """Sort key for GPU ids: by PCI address, then by share number ("-2" before "-10").

    The kernel writes the domain as %04x (four digits or more) and the rest fixed-width, so
    with the domain padded to eight digits plain string order is bus order.
    """
    head, sep, tail = device_id.rpartition("-")
    share = int(tail) if sep and tail.isdigit() else -1
    if share < 0:
        head = device_id
    domain, colon, rest = head.partition(":")
    return (domain.rjust(8, "0") + colon + rest if colon else head), share


def _spread(
    candidates: Sequence[str], count: int, gpu: Callable[[str], str], used: set[str]
) -> list[str]:
    picks: list[str] = []
    seen = set(used)
    for device_id in candidates:
        if len(picks) == count:
            return picks
        if gpu(device_id) not in seen:
            seen.add(gpu(device_id))
            picks.append(device_id)
    chosen = set(picks)
    picks.extend(i for i in candidates if i not in chosen)
    return picks[:count]


def _balanced(candidates: Sequence[str], count: int, gpu: Callable[[str], str]) -> list[str]:
    shares: dict[str, list[str]] = {}
    for device_id in candidates:
        shares.setdefault(gpu(device_id), []).append(device_id)
    # (-free shares, position of the GPU in order): the most free first, ties in order.
    heap = [(-len(ids), position, key) for position, (key, ids) in enumerate(shares.items())]
    heapq.heapify(heap)
    taken = dict.fromkeys(shares, 0)
    picks: list[str] = []
    while heap and len(picks) < count:
        free, position, key = heapq.heappop(heap)
        picks.append(shares[key][taken[key]])
        taken[key] += 1
        if free + 1 < 0:
            heapq.heappush(heap, (free + 1, position, key))
    return picks


def _packed(
    candidates: Sequence[str], count: int, gpu: Callable[[str], str], used: set[str]
) -> list[str]:
    # GPUs that already hold must-include shares first: packing fills them before new ones.
    ordered = sorted(candidates, key=lambda i: gpu(i) not in used)
    return list(ordered[:count])


def pick(
    policy: AllocationPolicy,
    candidates: Sequence[str],
    count: int,
    gpu: Callable[[str], str],
    used: set[str],
) -> list[str]:
    """``count`` ids from ``candidates`` (in :func:`share_order`) by ``policy``."""
    if policy == "packed":
        return _packed(candidates, count, gpu, used)
    if policy == "balanced":
        return _balanced(candidates, count, gpu)
    return _spread(candidates, count, gpu, used)


def preferred_shares(
    policy: AllocationPolicy,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpu_of: Mapping[str, str],
    numa_of: Mapping[str, tuple[int, ...]],
) -> list[str]:
    """The preferred ids: ``must_include`` first, then ``size`` in all, by policy and NUMA.

    ``gpu_of`` maps an id to its GPU (ids missing there count as a GPU of their own);
    ``numa_of`` to its NUMA nodes.
    """

    def gpu(device_id: str) -> str:
        return gpu_of.get(device_id, device_id)

    chosen = list(dict.fromkeys(must_include))
    remaining = size - len(chosen)
    if remaining <= 0:
        return chosen
    taken = set(chosen)
    candidates = sorted((i for i in dict.fromkeys(available) if i not in taken), key=share_order)
    used = {gpu(i) for i in chosen}
    groups: dict[tuple[int, ...], list[str]] = {}
    for device_id in candidates:
        groups.setdefault(numa_of.get(device_id, ()), []).append(device_id)
    for key in _numa_order(
        policy, groups, remaining, {n for i in chosen for n in numa_of.get(i, ())}
    ):
        picks = pick(policy, groups[key], remaining, gpu, used)
        chosen.extend(picks)
        used.update(gpu(i) for i in picks)
        remaining -= len(picks)
        if remaining <= 0:
            break
    return chosen


def _numa_order(
    policy: AllocationPolicy,
    groups: Mapping[tuple[int, ...], list[str]],
    remaining: int,
    anchor: set[int],
) -> list[tuple[int, ...]]:
    """The order to draw NUMA groups in: one that can hold the rest first, then the biggest."""

    def order(key: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        size = len(groups[key])
        if anchor:
            return (0 if anchor & set(key) else 1, -size, key)
        if size >= remaining:
            # Packing keeps big nodes free for big requests; spreading takes the roomiest.
            return (0, size if policy == "packed" else -size, key)
        return (1, -size, key)

    return sorted(groups, key=order)
