"""One node's pool of devices as ``resource.k8s.io/v1`` ResourceSlice objects: a pure function.

:func:`build_pool` turns the DRA resources of a DeviceTree into the JSON the API server takes
(wire form: camelCase, ``apiVersion``/``kind``/``metadata``/``spec``), so that the publisher
only compares and sends, and tests check it against the official schemas as it is.

- **One pool per node**, named after the node; every slice has ``nodeName`` set and the same
  ``pool.generation`` and ``pool.resourceSliceCount`` (the publisher bumps the generation
  whenever anything in the pool changes, as the ``ResourcePool`` contract asks).
- **At most 128 devices per slice** (``ResourceSliceMaxDevices``; no taints or counters here).
- **Deterministic**: devices in (resource, natural id) order, slices named
  ``<node>-<driver>-<index>`` (:func:`~devplug.dra.naming.slice_name` says why), attributes
  and keys in a fixed order: an unchanged tree gives equal objects, so nothing is written.
- **The empty pool is one slice with no devices**, not no slice: "'Empty pool' is different
  from 'no pool'" (d-r-a ``resourceslice.Pool``). ``devices`` is left out when empty, as the
  API server returns it (``omitempty``), so a comparison with what it stored holds.
- **Unhealthy devices leave the pool** (taints need ``DRADeviceTaints``, on only from 1.36).
- **One odd device never fails the pool**: an attribute the API server would refuse is left
  out (:mod:`.attributes`); a device is left out when its resource's name is too long for the
  ``resource`` attribute (at most 64 bytes) or when its name is also another device's (ids
  whose names collide, see :mod:`.naming`: both go, so that a name never changes device).
  Each is in :attr:`Pool.omitted`, for the caller to log.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from devplug.dra.attributes import RESOURCE, device_attributes, wire_attributes
from devplug.dra.naming import device_name, pool_name, slice_name, validate_driver_name
from devplug.dra.validate import MAX_DEVICES
from devplug.dra.validate_device import attribute_value_errors
from devplug.model import DeviceInfo
from devplug.naming import natural_key

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"


@dataclass(frozen=True, slots=True)
class Omission:
    """Something a device lost on its way into the pool: the whole device (``attribute`` is
    empty) or one of its attributes, and why."""

    resource: str
    device_id: str
    reason: str
    attribute: str = ""


@dataclass(frozen=True, slots=True)
class PoolDevice:
    """Which devplug device a pool device name stands for."""

    resource: str
    device_id: str


@dataclass(frozen=True, slots=True)
class Pool:
    """A node's pool at one generation: its slices (JSON-ready dicts), the devices they
    publish by name (how Prepare maps an allocated device back to devplug's), and what was
    left out."""

    name: str
    generation: int
    slices: tuple[dict[str, Any], ...]
    devices: Mapping[str, PoolDevice] = field(default_factory=dict)
    omitted: tuple[Omission, ...] = ()


def resource_problem(resource: str) -> str | None:
    """Why ``resource`` cannot be published as the ``resource`` attribute, or None (a config
    check can refuse such a DRA resource up front)."""
    errors = attribute_value_errors({"string": resource}, "attributes[resource]")
    return "; ".join(str(error) for error in errors) or None


def build_pool(
    tree: Mapping[str, Mapping[str, DeviceInfo]],
    *,
    node_name: str,
    driver: str,
    generation: int,
    resources: Collection[str] | None = None,
    node_uid: str | None = None,
) -> Pool:
    """The pool of ``tree``'s healthy devices of ``resources`` (all when None) on ``node_name``.

    ``node_uid``, when known, makes the Node the slices' owner (controller), so that they go
    with it. An invalid node or driver name raises InvalidNameError (a configuration error);
    nothing about a device raises.
    """
    pool = pool_name(node_name)
    validate_driver_name(driver)
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"pool generation must be an integer >= 0, got {generation!r}")
    omitted: list[Omission] = []
    entries: list[_Entry] = []
    for resource in sorted(r for r in tree if resources is None or r in resources):
        devices = tree[resource]
        problem = resource_problem(resource)
        for device_id in sorted(devices, key=natural_key):
            info = devices[device_id]
            if not info.healthy:
                continue
            if problem is not None:
                why = f"the resource name cannot be its {RESOURCE!r} attribute: {problem}"
                omitted.append(Omission(resource, device_id, why))
                continue
            name = device_name(device_id)
            built = device_attributes(resource, device_id, info, driver)
            omitted.extend(
                Omission(resource, device_id, why, attribute)
                for attribute, why in built.omitted.items()
            )
            device = {"name": name, "attributes": wire_attributes(built.attributes)}
            entries.append(_Entry(name, resource, device_id, device))
    kept, published = _unique_names(entries, omitted)
    chunks = [kept[i : i + MAX_DEVICES] for i in range(0, len(kept), MAX_DEVICES)] or [[]]
    slices = tuple(
        _slice(
            slice_name(node_name, driver, number),
            driver,
            pool,
            node_name,
            generation,
            len(chunks),
            chunk,
            node_uid,
        )
        for number, chunk in enumerate(chunks)
    )
    return Pool(pool, generation, slices, published, tuple(omitted))


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    resource: str
    device_id: str
    device: dict[str, Any]  # the wire form


def _unique_names(
    entries: list[_Entry], omitted: list[Omission]
) -> tuple[list[dict[str, Any]], dict[str, PoolDevice]]:
    """The devices whose name no other device has; of a shared name, every holder is left
    out (keeping one would let the name pass from device to device as others come and go)."""
    holders: dict[str, list[_Entry]] = defaultdict(list)
    for entry in entries:
        holders[entry.name].append(entry)
    kept: list[dict[str, Any]] = []
    published: dict[str, PoolDevice] = {}
    for entry in entries:
        sharing = holders[entry.name]
        if len(sharing) > 1:
            others = ", ".join(f"{o.resource} {o.device_id!r}" for o in sharing if o is not entry)
            reason = (
                f"its device name {entry.name!r} is also that of {others}; "
                "give the ids distinct names"
            )
            omitted.append(Omission(entry.resource, entry.device_id, reason))
            continue
        kept.append(entry.device)
        published[entry.name] = PoolDevice(entry.resource, entry.device_id)
    return kept, published


def _slice(
    name: str,
    driver: str,
    pool: str,
    node_name: str,
    generation: int,
    count: int,
    devices: list[dict[str, Any]],
    node_uid: str | None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if node_uid is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node_name,
                "uid": node_uid,
                "controller": True,
            }
        ]
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        "nodeName": node_name,
    }
    if devices:
        spec["devices"] = devices
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}
