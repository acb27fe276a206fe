"""The generic scanner: devices matched by config, one device (or ``shares`` ids) per node.

Each entry of ``scanners.generic`` names a resource and a udev match. Every device that
matches and has a device node becomes a device of that resource, advertised only once its node
exists. Ids come from the node path below /dev ("ttyUSB0", "dri_card0"), or from a udev
property named by ``id_property`` (e.g. ``ID_PATH``, stable across renumbering), sanitised to
the id alphabet; with ``shares: N`` each device gets the ids ``<id>-0`` .. ``<id>-<N-1>``.

Health: a device already advertised whose node disappears while its sysfs entry stays is
reported Unhealthy ("device node ... is missing") until the node is back; a device whose sysfs
entry goes, or that no longer matches (e.g. its DRIVER changed), leaves the list. Deleting a
node sends no uevent, so that is noticed at the device's next event or the periodic resync.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import structlog
from pydantic import Field, ValidationError, field_validator, model_validator

from devplug.config import StrictModel, config_error
from devplug.errors import ConfigError
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, DeviceTreeBuilder, Health
from devplug.naming import MAX_DEVICE_ID, sanitize_device_id, validate_resource_name
from devplug.scanners.incremental import RemovedPaths, SourceIndex, TouchedPaths, TreeEdit
from devplug.scanners.udev import UdevDevice, UdevEvent, UdevSource, sub_path_problem

log = structlog.get_logger(__name__)

MAX_SHARES = 1000


class GenericMatch(StrictModel):
    subsystem: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:+-]*$")
    devnode: str | None = Field(default=None, description="glob over the /dev path")
    properties: dict[str, str] = Field(default_factory=dict, description="udev properties, globs")
    attributes: dict[str, str] = Field(default_factory=dict, description="sysfs attributes, globs")

    @field_validator("devnode")
    @classmethod
    def _under_dev(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/dev/"):
            raise ValueError(
                f"must be a glob of paths under /dev/, e.g. /dev/ttyUSB*; got {value!r}"
            )
        return value

    @field_validator("attributes")
    @classmethod
    def _sub_paths(cls, value: dict[str, str]) -> dict[str, str]:
        # The rule UdevDevice.attribute applies when the scan reads them, checked here so a
        # bad name is a config error at start, not a failed scan.
        for name in value:
            problem = sub_path_problem(name)
            if problem is not None:
                raise ValueError(
                    "attribute names are paths relative to the device's sysfs dir, such as "
                    f"'vendor', 'queue/rotational' or 'device/vendor'; got {name!r}: {problem}"
                )
        return value

    @model_validator(mode="after")
    def _something_to_match(self) -> GenericMatch:
        if self.subsystem is None and self.devnode is None:
            raise ValueError("give at least 'subsystem' or 'devnode'")
        return self


class GenericEntry(StrictModel):
    resource: str
    match: GenericMatch
    shares: int = Field(default=1, ge=1, le=MAX_SHARES)
    permissions: str = "rw"
    id_property: str | None = None

    @field_validator("resource")
    @classmethod
    def _kubelet_name(cls, value: str) -> str:
        return validate_resource_name(value)

    @field_validator("permissions")
    @classmethod
    def _cgroup_permissions(cls, value: str) -> str:
        if not value or set(value) - set("rwm") or len(set(value)) != len(value):
            raise ValueError(
                f"must be 'r', 'w' and 'm', each at most once (e.g. rw); got {value!r}"
            )
        return value


def _enumeration(entry: GenericEntry) -> tuple[str | None, frozenset[tuple[str, str]]]:
    """What ``entry`` enumerates: its subsystem, or with none, every device with its
    exact-match properties (pushed down to libudev; globs are checked on each device)."""
    if entry.match.subsystem is not None:
        return entry.match.subsystem, frozenset()
    exact = {k: v for k, v in entry.match.properties.items() if not any(c in v for c in "*?[")}
    return None, frozenset(exact.items())


def _matches(device: UdevDevice, node: str, match: GenericMatch) -> bool:
    if match.devnode is not None and not fnmatch.fnmatchcase(node, match.devnode):
        return False
    for key, pattern in match.properties.items():
        value = device.property(key)
        if value is None or not fnmatch.fnmatchcase(value, pattern):
            return False
    for name, pattern in match.attributes.items():
        value = device.attribute(name)
        if value is None or not fnmatch.fnmatchcase(value, pattern):
            return False
    return True


class GenericScanner:
    """Scanner for ``scanners.generic``: a list of resource entries."""

    name = "generic"

    def __init__(self, entries: Sequence[GenericEntry]) -> None:
        self.entries = tuple(entries)
        # The last tree: a device in it whose node vanishes is reported unhealthy rather than
        # silently dropped, which tells the kubelet why.
        self._advertised = DeviceTree()
        # Two devices mapped to one id in the last scan: incremental rescans are not exact then.
        self._duplicates = False
        # The sources of the last tree, built by a full scan and edited by each rescan.
        self._index = SourceIndex()

    @classmethod
    def from_config(cls, raw: Any, field: str = "scanners.generic") -> GenericScanner:
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise ConfigError(field, "must be a list of entries with 'resource' and 'match'")
        entries = []
        for index, item in enumerate(raw):
            try:
                entries.append(GenericEntry.model_validate(item))
            except ValidationError as exc:
                raise config_error(exc, f"{field}[{index}]", GenericEntry) from None
        seen: set[str] = set()
        for index, entry in enumerate(entries):
            if entry.resource in seen:
                raise ConfigError(
                    f"{field}[{index}].resource",
                    f"{entry.resource!r} is configured twice; merge the matches into one entry",
                )
            seen.add(entry.resource)
        return cls(entries)

    def adopt(self, previous: DeviceTree) -> None:
        """Carry on from the tree the scanner this one replaces (a reload) advertised: a
        device in it whose node is missing stays Unhealthy, rather than being dropped as if
        never seen (which would also forget its health hold-down)."""
        self._advertised = previous

    @property
    def subsystems(self) -> frozenset[str] | None:
        """Subsystems whose events matter; None (everything) if an entry matches by node only."""
        names = {entry.match.subsystem for entry in self.entries}
        if None in names:
            return None
        return frozenset(name for name in names if name is not None)

    def makes_resource(self, resource: str) -> bool:
        return any(entry.resource == resource for entry in self.entries)

    def scan(self, source: UdevSource) -> DeviceTree:
        builder = DeviceTreeBuilder()
        self._duplicates = False
        # Each subsystem is enumerated once, whatever the number of entries naming it (200
        # entries over one subsystem would otherwise open its devices 200 times); every entry
        # is matched against each of its devices, entry by entry as configured. An entry
        # without a subsystem enumerates every device: its exact-match properties are pushed
        # down to libudev, so only entries with the same ones share an enumeration. The
        # enumeration is read as it comes, for the first entry of its group; the later ones
        # keep only the devices they match (a list of a whole subsystem held ~30 MiB more at
        # 10,000 GPUs).
        groups: dict[tuple[str | None, frozenset[tuple[str, str]]], list[int]] = {}
        for index, entry in enumerate(self.entries):
            groups.setdefault(_enumeration(entry), []).append(index)
        kept: dict[int, list[UdevDevice]] = {}  # a later entry of a group -> its devices
        for index, entry in enumerate(self.entries):
            if index in kept:
                for device in kept.pop(index):
                    self._add_device(source, entry, device, builder)
                continue
            subsystem, exact = _enumeration(entry)
            later = [(i, self.entries[i]) for i in groups[(subsystem, exact)] if i > index]
            for i, _ in later:
                kept[i] = []
            for device in source.devices(subsystem, dict(exact)):
                self._add_device(source, entry, device, builder)
                node = device.device_node if later else None
                for i, other in later:
                    if node is not None and _matches(device, node, other.match):
                        kept[i].append(device)
        tree = builder.build()
        self._advertised = tree
        self._index.reset(tree)
        return tree

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        """Re-read the devices the events name (and those built from touched paths); what a
        ``remove`` event names is gone without a look."""
        if self._duplicates:
            # Which of two devices with one id wins depends on the order of a full scan; when
            # ids clash (a misconfiguration, logged), only a full scan gives the same answer.
            return None
        if any(event.action == "move" for event in events):
            # A moved device's children moved with it, without events of their own.
            return None
        touched = TouchedPaths(event.sys_path for event in events)
        removed = RemovedPaths(events)
        edit = TreeEdit(previous, touched, self._index)
        self._advertised = previous
        for path in sorted(touched.paths | edit.stale_sources):
            # A removed device is gone even while sysfs still shows it (see RemovedPaths).
            device = None if removed.covers(path) else source.device(path)
            if device is None:
                continue  # gone: its devices stay out of the tree
            subsystem = device.subsystem
            for entry in self.entries:
                if entry.match.subsystem in (None, subsystem):
                    self._add_device(source, entry, device, edit)
        if self._duplicates:
            return None
        tree = edit.build()
        self._advertised = tree
        return tree

    def _add_device(
        self,
        source: UdevSource,
        entry: GenericEntry,
        device: UdevDevice,
        builder: DeviceTreeBuilder | TreeEdit,
    ) -> None:
        node = device.device_node
        if node is None or not _matches(device, node, entry.match):
            return
        suffix = len(str(entry.shares - 1)) + 1 if entry.shares > 1 else 0
        base = self._base_id(device, node, entry, MAX_DEVICE_ID - suffix)
        ids = [base] if entry.shares == 1 else [f"{base}-{i}" for i in range(entry.shares)]
        if (entry.resource, ids[0]) in builder:
            log.warning("generic.duplicate_id", resource=entry.resource, device_id=base, node=node)
            self._duplicates = True
            return
        health, reason = Health.HEALTHY, ""
        if not source.node_exists(node):
            if ids[0] not in self._advertised.get(entry.resource, {}):
                # Never advertise a device before its node exists.
                log.debug("generic.node_missing", resource=entry.resource, node=node)
                return
            # Known, still in sysfs, but its node is gone: unhealthy until the node is back.
            health, reason = Health.UNHEALTHY, f"device node {node} is missing"
        numa = source.numa_node(device)
        info = DeviceInfo(
            health=health,
            health_reason=reason,
            nodes=(DeviceNode(node, node, entry.permissions),),
            numa_nodes=() if numa is None else (numa,),
            sources=(device.sys_path,),
        )
        for device_id in ids:
            builder.add(entry.resource, device_id, info)

    @staticmethod
    def _base_id(device: UdevDevice, node: str, entry: GenericEntry, max_length: int) -> str:
        if entry.id_property is not None:
            value = device.property(entry.id_property)
            if value:
                return sanitize_device_id(value, max_length)
        return sanitize_device_id(node.removeprefix("/dev/"), max_length)
