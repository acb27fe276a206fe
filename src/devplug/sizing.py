"""How big a ListAndWatch message gets, computed from the protobuf wire format.

The kubelet reads plugin messages with gRPC's default 4 MiB receive limit (its client sets no
option; proposals to raise it were closed unmerged). A bigger message fails the stream and the
resource's capacity drops to zero. The daemon's list limit (:mod:`devplug.hotplug.list_limit`)
keeps every list within it, and scanners whose settings multiply ids (shares) size those
settings with it. Pure arithmetic, so scanners can use it without importing protobuf; a test
compares it with the real encoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

KUBELET_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
# Warn when a list reaches this share of the limit: one more host change may push it over.
WARN_FRACTION = 0.8
# The longer of the two health words. A device is counted with it whatever its health, so a
# health change after a list was checked can never push that list over the limit.
LONGEST_HEALTH = "Unhealthy"


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


def counted_entry_bytes(device_id: str, numa_nodes: Sequence[int] = ()) -> int:
    """What one device is counted for against the limit: its entry at the longer health word
    (see LONGEST_HEALTH), so that the count holds whatever its health becomes."""
    return device_entry_bytes(device_id, LONGEST_HEALTH, numa_nodes)


def shared_ids_bytes(base_id: str, shares: int, numa_nodes: Sequence[int] = ()) -> int:
    """Upper bound of the bytes of one device advertised as ``shares`` ids: ``base_id`` alone,
    or ``<base_id>-0`` .. ``<base_id>-<shares-1>``, each counted at the longest of them."""
    suffix = f"-{shares - 1}" if shares > 1 else ""
    return shares * counted_entry_bytes(base_id + suffix, numa_nodes)


def most_shares(
    devices: int,
    base_id: str,
    numa_nodes: Sequence[int] = (),
    limit: int = KUBELET_MAX_RECEIVE_BYTES,
) -> int:
    """The largest number of shares per device with which ``devices`` devices (at least one),
    each with an id no longer than ``base_id``, surely fit ``limit`` (0 if not even one id
    each does). A binary search: :func:`shared_ids_bytes` grows with ``shares``."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if max(devices, 1) * shared_ids_bytes(base_id, middle, numa_nodes) <= limit:
            low = middle
        else:
            high = middle - 1
    return low
