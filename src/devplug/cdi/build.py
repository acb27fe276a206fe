"""From a resource's advertised devices to its CDI spec (pure: no files)."""

from __future__ import annotations

from collections.abc import Mapping

from devplug.cdi.names import cdi_device_name
from devplug.cdi.spec import ContainerEdits, DeviceNodeEdit, HookEdit, MountEdit, Spec, SpecDevice
from devplug.model import DeviceInfo
from devplug.naming import natural_key

# Marks a spec file as devplug's: only marked files are ever replaced or deleted.
OWNER_ANNOTATION = "devplug.io/managed-by"
OWNER_VALUE = "devplug"
RESOURCE_ANNOTATION = "devplug.io/resource"


def device_edits(info: DeviceInfo) -> ContainerEdits:
    """What a container gets for one device: its nodes, mounts, env and CDI-only edits."""
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
    return ContainerEdits(
        env=tuple(f"{key}={value}" for key, value in sorted(info.env.items())),
        device_nodes=nodes,
        mounts=mounts,
        hooks=hooks,
        additional_gids=gids,
    )


def resource_spec(resource: str, kind: str, devices: Mapping[str, DeviceInfo]) -> Spec | None:
    """The spec of ``resource``'s devices under ``kind``, or None when no device has anything
    to put in a container (the CDI library refuses devices with empty edits and specs
    without devices). Devices are listed in natural id order, so the file is stable."""
    entries = []
    edits_of: dict[int, ContainerEdits] = {}  # shares of one device have one DeviceInfo
    for device_id in sorted(devices, key=natural_key):
        info = devices[device_id]
        edits = edits_of.get(id(info))
        if edits is None:
            edits = edits_of[id(info)] = device_edits(info)
        if not edits.empty:
            entries.append(SpecDevice(cdi_device_name(device_id), edits))
    if not entries:
        return None
    return Spec(
        kind=kind,
        devices=tuple(entries),
        annotations={OWNER_ANNOTATION: OWNER_VALUE, RESOURCE_ANNOTATION: resource},
    )
