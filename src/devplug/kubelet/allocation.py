"""The default Allocate and GetPreferredAllocation logic: pure functions over the model.

Kept free of gRPC so hooks, tests and benchmarks can call them directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

from devplug.errors import AllocationError
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode, Mount
from devplug.preferred import PreferredPolicy

# Error messages list at most this many ids, so a huge bogus request cannot produce a huge reply.
MAX_IDS_IN_MESSAGE = 10
# The ids' part of a message, in ASCII characters: the message travels percent-encoded in a
# gRPC trailer, and one past 8 KiB makes a C-core client see RESOURCE_EXHAUSTED instead.
MAX_ID_LIST_CHARS = 1200
# Of an unhealthy device's reason (a cordon's, a scanner's), what a refusal quotes.
MAX_REASON_IN_MESSAGE = 120


def _id_list(ids: Sequence[str], reasons_of: Mapping[str, DeviceInfo] | None = None) -> str:
    """The first ids, quoted; with ``reasons_of``, each with its health reason (why it is
    unhealthy: "cordoned: ...", a scanner's), which the operator of the failed pod needs."""
    # ascii(): escapes non-ASCII, so the size in bytes is the size in characters.
    shown = ", ".join(ascii(i[:80]) + _reason(reasons_of, i) for i in ids[:MAX_IDS_IN_MESSAGE])
    if len(shown) > MAX_ID_LIST_CHARS:
        shown = shown[:MAX_ID_LIST_CHARS] + "..."
    more = len(ids) - MAX_IDS_IN_MESSAGE
    return shown + (f" and {more} more" if more > 0 else "")


def _reason(devices: Mapping[str, DeviceInfo] | None, device_id: str) -> str:
    info = None if devices is None else devices.get(device_id)
    if info is None or not info.health_reason:
        return ""
    text = info.health_reason[:MAX_REASON_IN_MESSAGE]
    return f" ({text.encode('ascii', 'backslashreplace').decode()})"


# Containers in one Allocate: the kubelet sends one per call, and a pod has at most dozens.
MAX_CONTAINERS = 1024


def check_size(
    resource: str, requests: Sequence[Sequence[str]], devices: Mapping[str, DeviceInfo]
) -> None:
    """Raise AllocationError when a container names more ids than the resource advertises,
    the containers together do (a device goes to one container), or a request has more than
    MAX_CONTAINERS containers: no kubelet sends that (it sends one container per call), and
    answering it would cost memory and loop time in proportion to what the client sent
    (1,000 containers of 400 ids each held the loop for 2 s). ``requests`` may be the message's
    own repeated fields: nothing is copied, and the walk that names offending ids stops after
    a few of them (it meets one within the first ``len(devices) + 1`` ids)."""
    if len(requests) > MAX_CONTAINERS:
        raise AllocationError(
            "invalid",
            f"{resource}: the request has {len(requests)} containers; at most "
            f"{MAX_CONTAINERS} are answered",
        )
    for ids in requests:
        if len(ids) > len(devices):
            summary = f"the request names {len(ids)} ids, {len(devices)} devices are advertised"
            _refuse_offenders(resource, [ids], devices, "for one container", summary)
    total = sum(len(ids) for ids in requests)
    if total > len(devices):
        summary = (
            f"the request names {total} ids in {len(requests)} containers, "
            f"{len(devices)} devices are advertised; a device goes to one container"
        )
        _refuse_offenders(resource, requests, devices, "in one request", summary)


def _refuse_offenders(
    resource: str,
    requests: Sequence[Sequence[str]],
    devices: Mapping[str, DeviceInfo],
    where: str,
    summary: str,
) -> NoReturn:
    """Raise AllocationError naming the first few ids of ``requests`` that are unknown or
    named again; called when they name more ids than ``devices`` holds, so it meets one
    within the first ``len(devices) + 1``."""
    unknown: list[str] = []
    twice: list[str] = []
    seen: set[str] = set()
    for device_id in (i for ids in requests for i in ids):
        if device_id not in devices:
            unknown.append(device_id)
        elif device_id in seen:
            twice.append(device_id)
        else:
            seen.add(device_id)
        if len(unknown) + len(twice) >= MAX_IDS_IN_MESSAGE:
            break
    if twice:
        raise AllocationError(
            "invalid",
            f"{resource}: device ids requested twice {where}: {_id_list(twice)} ({summary})",
            tuple(twice),
        )
    raise AllocationError(
        "not_found",
        f"{resource}: unknown device ids: {_id_list(unknown)} ({summary})",
        tuple(unknown),
    )


def check_request(
    resource: str, requests: Sequence[Sequence[str]], devices: Mapping[str, DeviceInfo]
) -> None:
    """Raise AllocationError unless every id is advertised, healthy and named once per container."""
    unknown: list[str] = []
    unhealthy: list[str] = []
    for ids in requests:
        if len(set(ids)) != len(ids):
            duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
            raise AllocationError(
                "invalid",
                f"{resource}: device ids requested twice for one container: {_id_list(duplicates)}",
                tuple(duplicates),
            )
        for device_id in ids:
            info = devices.get(device_id)
            if info is None:
                unknown.append(device_id)
            elif not info.healthy:
                unhealthy.append(device_id)
    if unknown:
        unknown = list(dict.fromkeys(unknown))
        raise AllocationError(
            "not_found", f"{resource}: unknown device ids: {_id_list(unknown)}", tuple(unknown)
        )
    if unhealthy:
        unhealthy = list(dict.fromkeys(unhealthy))
        raise AllocationError(
            "invalid",
            f"{resource}: unhealthy device ids: {_id_list(unhealthy, devices)}",
            tuple(unhealthy),
        )


def _merge_maps(maps: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """Merge string maps; a key set to different values gets them comma-joined, in order."""
    values: dict[str, list[str]] = {}
    for mapping in maps:
        for key, value in mapping.items():
            seen = values.setdefault(key, [])
            if value not in seen:
                seen.append(value)
    return {key: ",".join(vals) for key, vals in values.items()}


def default_allocation(
    ids: Sequence[str], devices: Mapping[str, DeviceInfo]
) -> ContainerAllocation:
    """The answer for one container: the union of its devices' nodes, mounts, env, annotations.

    Nodes and mounts are deduplicated by container path (first one wins), so shares of one
    physical device yield its nodes once.
    """
    infos = [devices[i] for i in ids]
    nodes: dict[str, DeviceNode] = {}
    mounts: dict[str, Mount] = {}
    for info in infos:
        for node in info.nodes:
            nodes.setdefault(node.container_path, node)
        for mount in info.mounts:
            mounts.setdefault(mount.container_path, mount)
    return ContainerAllocation(
        env=_merge_maps(info.env for info in infos),
        mounts=tuple(mounts.values()),
        nodes=tuple(nodes.values()),
        annotations=_merge_maps(info.annotations for info in infos),
    )


# The daemon's default: every id a unit of its own, packed into the tightest NUMA node that
# fits; an answer that takes every usable id lists them in id order.
DEFAULT_PREFERRED = PreferredPolicy(all_in_key_order=True)


def default_preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Mapping[str, DeviceInfo],
) -> list[str]:
    """Must-include ids first, then fill from their NUMA node(s), else from one node that fits
    (the tightest), skipping unhealthy ids (see :mod:`devplug.preferred`).

    Never raises: an unsatisfiable request gets the best partial answer (the kubelet fills or
    refuses by itself; an error here would fail pod admission).
    """
    return DEFAULT_PREFERRED(available, must_include, size, devices)
