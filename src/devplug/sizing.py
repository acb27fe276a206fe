"""How big a ListAndWatch message gets, computed from the protobuf wire format.

The kubelet reads plugin messages with gRPC's default 4 MiB receive limit (its client sets no
option; proposals to raise it were closed unmerged). A bigger message fails the stream and the
resource's capacity drops to zero, so scanners that multiply devices (shares) check their lists
against this before advertising them. Pure arithmetic, so scanners can use it without importing
protobuf; a test compares it with the real encoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

KUBELET_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
# Warn when a list reaches this share of the limit: one more host change may push it over.
WARN_FRACTION = 0.8


def _varint_bytes(value: int) -> int:
    """Bytes of a protobuf varint; negative int64 values take the full ten."""
    if value < 0:
        return 10
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _field_bytes(payload: int) -> int:
    """A length-delimited field with a one-byte tag (field numbers below 16)."""
    return 1 + _varint_bytes(payload) + payload


def device_entry_bytes(device_id: str, health: str, numa_nodes: Sequence[int] = ()) -> int:
    """Bytes one device adds to a ListAndWatchResponse (the repeated field included).

    Device: ID = 1 (string), health = 2 (string), topology = 3 (TopologyInfo, whose nodes = 1
    are NUMANode messages with ID = 1 as int64, omitted when 0).
    """
    body = _field_bytes(len(device_id.encode("utf-8"))) + _field_bytes(len(health.encode()))
    if numa_nodes:
        nodes = sum(
            _field_bytes(0 if node == 0 else 1 + _varint_bytes(node)) for node in numa_nodes
        )
        body += _field_bytes(nodes)
    return _field_bytes(body)


def list_message_bytes(devices: Iterable[tuple[str, str, Sequence[int]]]) -> int:
    """Size of the ListAndWatchResponse for ``(id, health, numa nodes)`` triples."""
    return sum(device_entry_bytes(i, health, numa) for i, health, numa in devices)
