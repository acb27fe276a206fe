"""The device model: what scanners produce and servers advertise. Frozen and pure.

A :class:`DeviceTree` maps resource name -> device id -> :class:`DeviceInfo`. It is built once
per scan (with :class:`DeviceTreeBuilder`), never mutated, and compared with ``==`` by the
kubelet front's diff (:mod:`devplug.kubelet.diff`), so every field is an immutable value.
"""

from __future__ import annotations

import enum
import os
import posixpath
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from devplug.naming import validate_device_id, validate_resource_name

# A value a scanner gives a device attribute (published through DRA as string, int or bool).
AttributeValue = str | int | bool

_EMPTY: Mapping[str, str] = MappingProxyType({})
_NO_ATTRIBUTES: Mapping[str, AttributeValue] = MappingProxyType({})
_NO_EDITS: Mapping[str, MapEdit] = MappingProxyType({})


class Health(enum.StrEnum):
    """Device health as the kubelet spells it."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


def _clean_path(value: str, what: str) -> str:
    """Refuse paths that are relative, contain NUL or "..", or are not normalised."""
    if not value.startswith("/"):
        raise ValueError(f"{what} must be an absolute path, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{what} must not contain NUL")
    if ".." in value.split("/"):
        raise ValueError(f"{what} must not contain '..': {value!r}")
    normal = posixpath.normpath(value)
    # normpath keeps a leading "//"; treat it like "/".
    return "/" + normal.lstrip("/")


def _frozen_map(value: Mapping[str, str], what: str) -> Mapping[str, str]:
    for key, val in value.items():
        if not isinstance(key, str) or not isinstance(val, str):
            raise TypeError(f"{what} keys and values must be str, got {key!r}: {val!r}")
        if not key or "\0" in key or "\0" in val:
            raise ValueError(f"{what} keys must be non-empty and free of NUL: {key!r}")
    return MappingProxyType(dict(value)) if value else _EMPTY


def _frozen_attributes(value: Mapping[str, AttributeValue]) -> Mapping[str, AttributeValue]:
    """Types only: the names and lengths the API server allows are the DRA front's to check,
    device by device, so that one odd attribute never stops a scan."""
    for key, val in value.items():
        if not isinstance(key, str) or not key or not isinstance(val, str | int | bool):
            raise TypeError(
                f"attributes map non-empty names to str, int or bool, got {key!r}: {val!r}"
            )
    return MappingProxyType(dict(value)) if value else _NO_ATTRIBUTES


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node to create in the container.

    ``container_path`` defaults to ``host_path``; ``permissions`` are cgroup permissions, any
    of ``r``, ``w``, ``m``.
    """

    host_path: str
    container_path: str = ""
    permissions: str = "rw"

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_path", _clean_path(self.host_path, "host_path"))
        target = self.container_path or self.host_path
        object.__setattr__(self, "container_path", _clean_path(target, "container_path"))
        if not self.permissions or set(self.permissions) - set("rwm"):
            raise ValueError(f"permissions must be made of 'r', 'w', 'm', got {self.permissions!r}")


@dataclass(frozen=True, slots=True)
class Mount:
    """A host path bind-mounted into the container (read-only unless said otherwise)."""

    host_path: str
    container_path: str = ""
    read_only: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_path", _clean_path(self.host_path, "host_path"))
        target = self.container_path or self.host_path
        object.__setattr__(self, "container_path", _clean_path(target, "container_path"))


@dataclass(frozen=True, slots=True)
class CdiHook:
    """An OCI hook a CDI spec attaches to a device (createContainer, startContainer, ...)."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _clean_path(self.path, "hook path"))


@dataclass(frozen=True, slots=True)
class CdiEdits:
    """Container edits that only the CDI spec carries, beyond the device's nodes, mounts and env.

    The CDI front (:mod:`devplug.cdi`) writes them into the device's entry of the resource's
    spec (``containerEdits.hooks``, ``containerEdits.additionalGids``); Allocate's answer
    cannot carry them.
    """

    hooks: tuple[CdiHook, ...] = ()
    additional_gids: tuple[int, ...] = ()


# How the health reason of a device the operator cordoned (``devplug cordon``) starts: the
# fronts tell a cordon (a device taken out of service on purpose) from a fault by it.
CORDON_REASON_PREFIX = "cordoned: "


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Everything devplug knows about one advertised device.

    ``sources`` are the sysfs paths the device was built from; they tie udev events back to
    devices and appear in ``devplug scan``. ``health_reason`` says why a device is unhealthy.
    ``attributes`` are facts a scanner publishes as DRA device attributes (``model``,
    ``pciId``, ...); the DRA front adds the resource, id, NUMA node and PCI ones itself.
    """

    health: Health = Health.HEALTHY
    nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    numa_nodes: tuple[int, ...] = ()
    health_reason: str = ""
    cdi_edits: CdiEdits | None = None
    sources: tuple[str, ...] = ()
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: _NO_ATTRIBUTES)

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", Health(self.health))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "mounts", tuple(self.mounts))
        object.__setattr__(self, "env", _frozen_map(self.env, "env"))
        object.__setattr__(self, "annotations", _frozen_map(self.annotations, "annotations"))
        object.__setattr__(self, "numa_nodes", tuple(sorted(set(self.numa_nodes))))
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "attributes", _frozen_attributes(self.attributes))
        if any(n < 0 for n in self.numa_nodes):
            raise ValueError(f"numa_nodes must be >= 0 (leave -1 out), got {self.numa_nodes}")
        if any("=" in key for key in self.env):
            raise ValueError(f"env names must not contain '=': {sorted(self.env)}")

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    @property
    def cordoned(self) -> bool:
        """Unhealthy because the operator cordoned it (whatever else ails it)."""
        return not self.healthy and self.health_reason.startswith(CORDON_REASON_PREFIX)


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container gets from an Allocate call: devplug's view of the kubelet's answer."""

    env: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    mounts: tuple[Mount, ...] = ()
    nodes: tuple[DeviceNode, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    cdi_devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", _frozen_map(self.env, "env"))
        object.__setattr__(self, "annotations", _frozen_map(self.annotations, "annotations"))
        object.__setattr__(self, "mounts", tuple(self.mounts))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "cdi_devices", tuple(self.cdi_devices))


# One resource's devices: device id -> DeviceInfo.
DeviceMap = Mapping[str, DeviceInfo]


@dataclass(frozen=True, slots=True)
class MapEdit:
    """How one resource's device map was made from an earlier one by
    :meth:`DeviceTree.with_changes`: the ids taken out of ``base`` and the ids put in (an id
    re-read is in both). Every other id maps to the very same DeviceInfo object in both maps,
    so whoever keeps something per device of ``base`` can update it for these ids only."""

    base: Mapping[str, DeviceInfo]
    removed: frozenset[str]
    added: frozenset[str]


class DeviceTree(Mapping[str, Mapping[str, DeviceInfo]]):
    """resource name -> device id -> DeviceInfo. Immutable; equal when contents are equal.

    Resources with no devices are not kept: a tree holds exactly the resources to advertise.
    A tree made by :meth:`with_changes` remembers, per resource it changed, the edit
    (:meth:`edit_since`), so that what is kept per device map (metrics, the diff) costs
    O(changed) on a hotplug event instead of a pass over every device.
    """

    __slots__ = ("_edits", "_resources")

    def __init__(self, resources: Mapping[str, Mapping[str, DeviceInfo]] | None = None) -> None:
        frozen: dict[str, Mapping[str, DeviceInfo]] = {}
        for resource, devices in (resources or {}).items():
            validate_resource_name(resource)
            if not devices:
                continue
            for device_id, info in devices.items():
                validate_device_id(device_id)
                if not isinstance(info, DeviceInfo):
                    raise TypeError(f"{resource}/{device_id}: expected DeviceInfo, got {info!r}")
            frozen[resource] = MappingProxyType(dict(devices))
        self._resources: Mapping[str, Mapping[str, DeviceInfo]] = MappingProxyType(frozen)
        self._edits: Mapping[str, MapEdit] = _NO_EDITS

    def __getitem__(self, resource: str) -> Mapping[str, DeviceInfo]:
        return self._resources[resource]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resources)

    def __len__(self) -> int:
        return len(self._resources)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceTree):
            return NotImplemented
        return dict(self._resources) == dict(other._resources)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}: {len(devs)}" for name, devs in sorted(self.items()))
        return f"DeviceTree({{{counts}}})"

    def device_count(self) -> int:
        return sum(len(devices) for devices in self._resources.values())

    def edit_since(self, resource: str, base: Mapping[str, DeviceInfo]) -> MapEdit | None:
        """How ``resource``'s map was made from ``base`` (a map of an earlier tree) by one
        :meth:`with_changes`, or None when this tree does not know (compare the maps)."""
        edit = self._edits.get(resource)
        if edit is None or edit.base is not base or self._resources.get(resource) is None:
            return None
        return edit

    def with_changes(
        self,
        removed: Iterable[tuple[str, str]],
        added: Mapping[str, Mapping[str, DeviceInfo]],
    ) -> DeviceTree:
        """This tree without the ``removed`` (resource, id) pairs, plus ``added`` devices.

        Only the added devices are validated (the rest were when this tree was built).
        Resources neither removed from nor added to are shared with this tree as they are; the
        changed ones are copied, which is cheap next to re-validating them. An added id that is
        already present (and not removed) raises ValueError.
        """
        removed = list(removed)
        # Only the resources that change are copied; the others keep their frozen mapping.
        # ``MappingProxyType.copy()`` copies the dict beneath at C speed (``dict(proxy)``
        # goes key by key: ~5x slower, milliseconds for 10,000 devices).
        touched = {resource for resource, _ in removed} | set(added)
        changed: dict[str, dict[str, DeviceInfo]] = {
            name: self._resources[name].copy()  # type: ignore[attr-defined]
            for name in touched
            if name in self._resources
        }
        for resource, device_id in removed:
            changed.get(resource, {}).pop(device_id, None)
        for resource, devices in added.items():
            validate_resource_name(resource)
            target = changed.setdefault(resource, {})
            for device_id, info in devices.items():
                validate_device_id(device_id)
                if not isinstance(info, DeviceInfo):
                    raise TypeError(f"{resource}/{device_id}: expected DeviceInfo, got {info!r}")
                if device_id in target:
                    raise ValueError(f"duplicate device id {device_id!r} in resource {resource!r}")
                target[device_id] = info
        resources = dict(self._resources)
        edits: dict[str, MapEdit] = {}
        removed_ids: dict[str, set[str]] = {}
        for resource, device_id in removed:
            removed_ids.setdefault(resource, set()).add(device_id)
        for name, devices in changed.items():
            if devices:
                resources[name] = MappingProxyType(devices)
                base = self._resources.get(name)
                if base is not None:
                    edits[name] = MapEdit(
                        base,
                        frozenset(i for i in removed_ids.get(name, ()) if i in base),
                        frozenset(added.get(name, ())),
                    )
            else:
                resources.pop(name, None)
        # An untouched map is this tree's very map: the edit this tree knows of it still holds.
        kept = {name: edit for name, edit in self._edits.items() if name not in touched}
        return self._of(resources, {**kept, **edits})

    def with_maps_of(self, other: DeviceTree, names: Iterable[str]) -> DeviceTree:
        """This tree with the maps of the resources ``names`` taken from ``other`` (dropped
        where ``other`` has none), each with the edit ``other`` knows of it.

        For a tree whose few resources were rebuilt from another tree than this one (a health
        gate rebuilds the maps with held-down devices from what it published last, so that
        their edits lead from there) while the rest stay this tree's very maps and edits.
        """
        resources = dict(self._resources)
        edits = dict(self._edits)
        for name in names:
            edits.pop(name, None)
            devices = other._resources.get(name)
            if devices is None:
                resources.pop(name, None)
                continue
            resources[name] = devices
            edit = other._edits.get(name)
            if edit is not None:
                edits[name] = edit
        return self._of(resources, edits)

    def merged(self, other: DeviceTree) -> DeviceTree:
        """This tree plus ``other``'s resources; a resource in both raises ValueError.

        The resources' maps are shared, not copied (both trees were validated): a scan merges
        every scanner's tree, and an unchanged resource must stay the same object so that
        what is cached per map (list limit, metrics, ListAndWatch message) is reused.
        """
        clash = set(self) & set(other)
        if clash:
            raise ValueError(f"resources produced twice: {sorted(clash)}")
        return self._of({**self._resources, **other._resources}, {**self._edits, **other._edits})

    def narrowed(self, kept: Mapping[str, Mapping[str, DeviceInfo]]) -> DeviceTree:
        """This tree with the resources of ``kept`` replaced by those maps, each a subset of
        the resource's devices (ValueError otherwise); an empty one removes the resource.
        Read-only views are used as they are (the caller must not change what is beneath);
        other maps are copied."""
        resources = dict(self._resources)
        for resource, devices in kept.items():
            if resource not in resources or not devices.keys() <= resources[resource].keys():
                raise ValueError(f"{resource}: not a subset of the tree's devices")
            if not devices:
                del resources[resource]
            elif isinstance(devices, MappingProxyType):
                resources[resource] = devices
            else:
                resources[resource] = MappingProxyType(dict(devices))
        # A narrowed resource's map is not the edited one: its edit no longer applies.
        edits = {k: v for k, v in self._edits.items() if k not in kept}
        return self._of(resources, edits)

    @classmethod
    def _of(
        cls,
        resources: dict[str, Mapping[str, DeviceInfo]],
        edits: Mapping[str, MapEdit] | None = None,
    ) -> DeviceTree:
        """A tree of maps already validated (no copy, no checks). ``edits`` are kept only for
        maps still the edited ones (edit_since checks the base; the map is checked here)."""
        tree = cls.__new__(cls)
        tree._resources = MappingProxyType(resources)
        tree._edits = _NO_EDITS
        if edits:
            tree._edits = MappingProxyType(
                {name: edit for name, edit in edits.items() if name in resources}
            )
        return tree


class DeviceTreeBuilder:
    """Collects devices during a scan, then freezes them into a DeviceTree."""

    def __init__(self) -> None:
        self._resources: dict[str, dict[str, DeviceInfo]] = {}

    def add(self, resource: str, device_id: str, info: DeviceInfo) -> None:
        """Add one device; the same id twice in a resource raises ValueError."""
        devices = self._resources.setdefault(resource, {})
        if device_id in devices:
            raise ValueError(f"duplicate device id {device_id!r} in resource {resource!r}")
        devices[device_id] = info

    def __contains__(self, key: tuple[str, str]) -> bool:
        resource, device_id = key
        return device_id in self._resources.get(resource, {})

    def build(self) -> DeviceTree:
        return DeviceTree(self._resources)


def is_device_node_path(path: str) -> bool:
    """True for an absolute, normalised path under /dev (what a node path from sysfs must be)."""
    return path.startswith("/dev/") and "\0" not in path and os.path.normpath(path) == path
