"""From a resource's advertised devices to its CDI spec (pure: no files)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from devplug.cdi.names import cdi_device_name
from devplug.cdi.spec import (
    ContainerEdits,
    DeviceNodeEdit,
    HookEdit,
    MountEdit,
    Spec,
    SpecDevice,
    assemble_spec_json,
    compact_json,
    device_document,
    device_problems,
    device_version,
    head_problems,
    head_version,
    later_version,
)
from devplug.errors import CdiSpecError
from devplug.model import DeviceInfo
from devplug.naming import natural_key


def device_edits(info: DeviceInfo) -> ContainerEdits:
    """What a container gets for one device from its spec: nodes, mounts and CDI-only edits."""
    nodes = tuple(
        DeviceNodeEdit(
            path=node.container_path,
            # Left out when equal, so the spec needs no newer cdiVersion than it must.
            host_path=None if node.host_path == node.container_path else node.host_path,
            permissions=node.permissions,
        )
        for node in info.nodes
    )
    mounts = tuple(
        MountEdit(
            host_path=mount.host_path,
            container_path=mount.container_path,
            options=("ro" if mount.read_only else "rw", "nosuid", "nodev", "bind"),
        )
        for mount in info.mounts
    )
    hooks: tuple[HookEdit, ...] = ()
    gids: tuple[int, ...] = ()
    if info.cdi_edits is not None:
        hooks = tuple(
            HookEdit(h.hook_name, h.path, h.args, h.env, h.timeout) for h in info.cdi_edits.hooks
        )
        gids = info.cdi_edits.additional_gids
    # No env: Allocate carries it. The kubelet merges the env of all of a container's devices
    # (KubeVirt's PCI_RESOURCE_* lists every group), while CDI injection sets each device's
    # variables in turn, so the last device's value would win over the merged one.
    return ContainerEdits(
        device_nodes=nodes,
        mounts=mounts,
        hooks=hooks,
        additional_gids=gids,
    )


def resource_spec(kind: str, devices: Mapping[str, DeviceInfo]) -> Spec | None:
    """The spec of ``devices`` under ``kind`` as a model, or None when no device has anything
    to put in a container (the CDI library refuses devices with empty edits and specs
    without devices). Built by :class:`SpecRenderer`, the one spec builder.

    The spec carries nothing but its devices: no annotations of devplug's own, which would
    raise its cdiVersion to 0.6.0, a version CDI libraries before 0.6 (Debian 12's podman,
    containerd 1.7, CRI-O 1.27) refuse whole. Ownership is kept in
    :mod:`devplug.cdi.ownership` instead."""
    rendered = SpecRenderer(kind).render(devices)
    return None if rendered is None else Spec(kind=kind, devices=rendered.devices)


@dataclass(frozen=True, slots=True)
class RenderedSpec:
    data: bytes  # the file's bytes: spec_json() of the same devices gives exactly these
    devices: tuple[SpecDevice, ...]  # in file order

    @property
    def names(self) -> frozenset[str]:
        """The device names the spec defines."""
        return frozenset(device.name for device in self.devices)


class _Made(NamedTuple):
    """One device as the renderer last made it."""

    info: DeviceInfo  # the object it was made from: reused while the tree shares it
    device: SpecDevice | None  # None: nothing to put in a container
    fragment: bytes  # compact_json(device_document(device)); empty when device is None
    version: str  # the lowest cdiVersion the device needs


class SpecRenderer:
    """Renders one resource's spec file, reusing each unchanged device's validated JSON.

    Devices are listed in natural id order, so the file is stable; devices with nothing to put
    in a container are left out. A hotplug event changes one device of thousands; rebuilding,
    validating and serialising all of them on every change cost tens of milliseconds of CPU
    that competed with the RPCs. A device's fragment is kept while its DeviceInfo is the same
    object (trees share unchanged devices' objects). Not thread-safe: one renderer per
    resource, used by one thread at a time.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        problems = head_problems(kind, {}, None)
        if problems:
            raise CdiSpecError(f"invalid CDI spec for kind {kind!r}: {'; '.join(problems)}")
        self._head_version = head_version(kind, {}, None)
        self._made: dict[str, _Made] = {}
        # The ids of the last render in file order: reused while the set of ids is the same
        # (a natural sort of 10,000 ids costs ~20 ms).
        self._order: list[str] = []

    def render(self, devices: Mapping[str, DeviceInfo]) -> RenderedSpec | None:
        """The spec of ``devices``, or None when no device has anything to give."""
        made: dict[str, _Made] = {}
        edits_of: dict[int, ContainerEdits] = {}  # shares of one device have one DeviceInfo
        listed: list[SpecDevice] = []
        fragments: list[bytes] = []
        versions = {self._head_version}
        if len(self._order) != len(devices) or not all(i in devices for i in self._order):
            self._order = sorted(devices, key=natural_key)
        for device_id in self._order:
            info = devices[device_id]
            cached = self._made.get(device_id)
            if cached is None or cached.info is not info:
                cached = self._make(device_id, info, edits_of)
            made[device_id] = cached
            if cached.device is not None:
                listed.append(cached.device)
                fragments.append(cached.fragment)
                versions.add(cached.version)
        self._made = made
        if not fragments:
            return None
        version = later_version(*versions)
        data = assemble_spec_json(self.kind, {}, version, fragments)
        return RenderedSpec(data, tuple(listed))

    @staticmethod
    def _make(device_id: str, info: DeviceInfo, edits_of: dict[int, ContainerEdits]) -> _Made:
        edits = edits_of.get(id(info))
        if edits is None:
            edits = edits_of[id(info)] = device_edits(info)
        if edits.empty:
            return _Made(info, None, b"", "")
        device = SpecDevice(cdi_device_name(device_id), edits)
        problems = device_problems(device)
        if problems:
            raise CdiSpecError(f"invalid CDI device {device_id!r}: {'; '.join(problems)}")
        return _Made(info, device, compact_json(device_document(device)), device_version(device))
