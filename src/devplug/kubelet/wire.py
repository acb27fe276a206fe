"""Conversions between devplug's model and the v1beta1 protobuf messages.

Protobuf types do not leave ``devplug.daemon`` (and the kubelet simulator in
``devplug.testing``); everything else speaks the model. ListAndWatch messages are the
exception to building protobuf objects: they are encoded here, device entry by device entry
(:func:`device_entry`), so that a hotplug event re-encodes only the devices it changed; so are
Allocate's answers (:func:`allocate_response`), a few times faster than building the messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Reversible
from typing import cast

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode, MapEdit, Mount


def device_message(device_id: str, info: DeviceInfo) -> pb.Device:
    message = pb.Device(ID=device_id, health=str(info.health))
    if info.numa_nodes:
        message.topology.nodes.extend(pb.NUMANode(ID=node) for node in info.numa_nodes)
    return message


def list_message(devices: Mapping[str, DeviceInfo]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[device_message(device_id, info) for device_id, info in devices.items()]
    )


def _varint(value: int) -> bytes:
    """A protobuf varint of a value >= 0 (devplug's NUMA nodes and lengths are)."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field whose tag fits one byte (field numbers below 16)."""
    return bytes((tag,)) + _varint(len(payload)) + payload


# The wire format, field by field (numbers from proto/): ListAndWatchResponse.devices = 1;
# Device.ID = 1, health = 2, topology = 3; TopologyInfo.nodes = 1; NUMANode.ID = 1 (int64,
# left out when 0, as proto3 does). Tags: (number << 3) | 2 for length-delimited, | 0 varint.
_LIST_DEVICES = 0x0A
_DEVICE_ID, _DEVICE_HEALTH, _DEVICE_TOPOLOGY = 0x0A, 0x12, 0x1A
_TOPOLOGY_NODES = 0x0A
_NUMA_ID = 0x08
_numa_nodes: dict[int, bytes] = {}


def _numa_node(node: int) -> bytes:
    encoded = _numa_nodes.get(node)
    if encoded is None:
        body = b"" if node == 0 else bytes((_NUMA_ID,)) + _varint(node)
        encoded = _numa_nodes[node] = _field(_TOPOLOGY_NODES, body)
    return encoded


def device_entry(device_id: str, info: DeviceInfo) -> bytes:
    """One device as it appears in an encoded ListAndWatchResponse: the ``devices`` field
    holding :func:`device_message`'s encoding, byte for byte what protobuf writes (a
    message is the concatenation of its repeated field's entries)."""
    ident = device_id.encode()
    body = _field(_DEVICE_ID, ident) if ident else b""
    body += _field(_DEVICE_HEALTH, str(info.health).encode())
    if info.numa_nodes:
        body += _field(_DEVICE_TOPOLOGY, b"".join(map(_numa_node, info.numa_nodes)))
    return _field(_LIST_DEVICES, body)


class ListMessageBuilder:
    """Builds ListAndWatch messages as bytes, keeping each device's encoded entry.

    The message of a map is the join of its devices' entries (:func:`device_entry`), in the
    map's order. Told how a map was made from the previous one (:meth:`edited`, from
    :meth:`~devplug.model.DeviceTree.edit_since`), the builder re-encodes only the ids the
    edit names; otherwise it re-encodes the devices whose health or topology changed. Either
    way the join of n entries is the one O(n) step left: the kubelet wants the whole list.
    """

    # Edits kept for a build to follow; a map reached by more (no stream read meanwhile) is
    # encoded afresh.
    MAX_PENDING_EDITS = 16

    def __init__(self) -> None:
        self._map: Mapping[str, DeviceInfo] | None = None
        self._entries: dict[str, bytes] = {}
        self._data = b""
        # (map, how it was made from an earlier map), oldest first.
        self._edits: list[tuple[Mapping[str, DeviceInfo], MapEdit]] = []

    def edited(self, devices: Mapping[str, DeviceInfo], edit: MapEdit) -> None:
        """``devices`` was made from ``edit.base`` by ``edit``; a later build may use it."""
        self._edits.append((devices, edit))
        if len(self._edits) > self.MAX_PENDING_EDITS:
            del self._edits[0]

    def build(self, devices: Mapping[str, DeviceInfo]) -> bytes:
        """The encoded ListAndWatchResponse for ``devices``; the very same object as last time
        if nothing the kubelet sees (ids, their order, health, topology) changed, so callers
        can skip re-sending it."""
        if self._map is not None and devices is self._map:
            return self._data
        steps = self._steps_to(devices)
        if steps is None:
            self._encode_all(devices)
        else:
            entries = self._entries
            for edit, tail in steps:
                for device_id in edit.removed:
                    entries.pop(device_id, None)
                for device_id, info in tail:
                    entries[device_id] = device_entry(device_id, info)
        data = b"".join(self._entries.values())
        if self._map is not None and data == self._data:
            data = self._data
        self._map, self._data = devices, data
        return data

    def _steps_to(
        self, devices: Mapping[str, DeviceInfo]
    ) -> list[tuple[MapEdit, list[tuple[str, DeviceInfo]]]] | None:
        """The edits leading from the last map built to ``devices``, each with its added
        devices in the map's order; None if there is no such chain (encode afresh). The edits
        used (and any older ones) are dropped."""
        current = self._map
        steps: list[tuple[MapEdit, list[tuple[str, DeviceInfo]]]] = []
        for index, (made, edit) in enumerate(self._edits):
            if current is None or edit.base is not current:
                continue
            # with_changes appends the added ids: they are the map's last ones, in its order.
            try:
                last = reversed(cast("Reversible[str]", made))
            except TypeError:  # a mapping that cannot iterate backwards
                break
            tail = [(i, made[i]) for i in itertools.islice(last, len(edit.added))]
            tail.reverse()
            if {device_id for device_id, _ in tail} != edit.added:
                break
            steps.append((edit, tail))
            current = made
            if made is devices:
                del self._edits[: index + 1]
                return steps
        return None

    def _encode_all(self, devices: Mapping[str, DeviceInfo]) -> None:
        """Every device's entry, reusing the last ones whose health and topology are equal."""
        before = self._map if self._map is not None else {}
        entries = self._entries
        fresh: dict[str, bytes] = {}
        for device_id, info in devices.items():
            old = before.get(device_id)
            entry = entries.get(device_id)
            if (
                entry is None
                or old is None
                or (
                    old is not info
                    and (old.health is not info.health or old.numa_nodes != info.numa_nodes)
                )
            ):
                entry = device_entry(device_id, info)
            fresh[device_id] = entry
        self._entries = fresh
        self._edits.clear()


def container_response(answer: ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=dict(answer.env),
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in answer.mounts
        ],
        devices=[
            pb.DeviceSpec(
                container_path=n.container_path, host_path=n.host_path, permissions=n.permissions
            )
            for n in answer.nodes
        ],
        annotations=dict(answer.annotations),
        cdi_devices=[pb.CDIDevice(name=name) for name in answer.cdi_devices],
    )


# AllocateResponse.container_responses = 1; ContainerAllocateResponse: envs = 1 (map),
# mounts = 2, devices = 3, annotations = 4 (map), cdi_devices = 5; a map entry: key = 1,
# value = 2; Mount: container_path = 1, host_path = 2, read_only = 3 (bool, left out when
# false); DeviceSpec: container_path = 1, host_path = 2, permissions = 3; CDIDevice.name = 1.
_ALLOCATE_CONTAINERS = 0x0A
_ENVS, _MOUNTS, _DEVICES, _ANNOTATIONS, _CDI_DEVICES = 0x0A, 0x12, 0x1A, 0x22, 0x2A
_KEY, _VALUE = 0x0A, 0x12
_FIRST, _SECOND, _THIRD = 0x0A, 0x12, 0x1A
_READ_ONLY = b"\x18\x01"


def _short(tag: int, payload: bytes) -> bytes:
    """:func:`_field`, its one-byte-length case first (an answer's fields are short)."""
    if len(payload) < 0x80:
        return bytes((tag, len(payload))) + payload
    return _field(tag, payload)


def _text(tag: int, value: str) -> bytes:
    encoded = value.encode()
    return _short(tag, encoded) if encoded else b""


def _entries(tag: int, mapping: Mapping[str, str]) -> list[bytes]:
    # Key and value written even when empty, as protobuf writes map entries; sorted by key, so
    # that one answer is always the same bytes. (Protobuf's deterministic serialization sorts
    # too, but its order is not canonical: upb puts "ab" before "a", pure Python after.)
    return [
        _short(tag, _short(_KEY, key.encode()) + _short(_VALUE, mapping[key].encode()))
        for key in sorted(mapping)
    ]


def container_entry(answer: ContainerAllocation) -> bytes:
    """One container's answer as it appears in an encoded AllocateResponse: the
    ``container_responses`` field holding :func:`container_response`'s encoding, without
    building the message: it parses to the same message, in the bytes protobuf's deterministic
    serialization writes but for the order of map entries whose keys prefix one another."""
    parts = _entries(_ENVS, answer.env)
    parts += [
        _short(
            _MOUNTS,
            _text(_FIRST, m.container_path)
            + _text(_SECOND, m.host_path)
            + (_READ_ONLY if m.read_only else b""),
        )
        for m in answer.mounts
    ]
    parts += [
        _short(
            _DEVICES,
            _text(_FIRST, n.container_path)
            + _text(_SECOND, n.host_path)
            + _text(_THIRD, n.permissions),
        )
        for n in answer.nodes
    ]
    parts += _entries(_ANNOTATIONS, answer.annotations)
    parts += [_short(_CDI_DEVICES, _text(_FIRST, name)) for name in answer.cdi_devices]
    return _short(_ALLOCATE_CONTAINERS, b"".join(parts))


def allocate_response(answers: Iterable[ContainerAllocation]) -> bytes:
    """An encoded AllocateResponse of ``answers``, one per container in request order (a
    message is the concatenation of its repeated field's entries)."""
    return b"".join(map(container_entry, answers))


def container_allocation(message: pb.ContainerAllocateResponse) -> ContainerAllocation:
    """The reverse of :func:`container_response`, for clients such as the kubelet simulator."""
    return ContainerAllocation(
        env=dict(message.envs),
        mounts=tuple(Mount(m.host_path, m.container_path, m.read_only) for m in message.mounts),
        nodes=tuple(
            DeviceNode(d.host_path, d.container_path, d.permissions) for d in message.devices
        ),
        annotations=dict(message.annotations),
        cdi_devices=tuple(d.name for d in message.cdi_devices),
    )
