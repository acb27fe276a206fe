"""The ListAndWatch size arithmetic agrees with the real protobuf encoder, byte for byte."""

from __future__ import annotations

import random

import pytest

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.sizing import device_entry_bytes, list_message_bytes


def _message(devices: list[tuple[str, str, tuple[int, ...]]]) -> pb.ListAndWatchResponse:
    message = pb.ListAndWatchResponse()
    for device_id, health, numa in devices:
        device = message.devices.add(ID=device_id, health=health)
        if numa:
            device.topology.nodes.extend(pb.NUMANode(ID=n) for n in numa)
    return message


@pytest.mark.parametrize(
    ("device_id", "health", "numa"),
    [
        ("a", "Healthy", ()),
        ("0000:03:00.0-7", "Unhealthy", (0,)),
        ("0000:03:00.0", "Healthy", (1,)),
        ("x" * 63, "Healthy", (0, 1, 200, 70000)),
        ("gpu", "Healthy", (127, 128)),
    ],
)
def test_one_device_matches_the_encoder(device_id: str, health: str, numa: tuple[int, ...]) -> None:
    assert (
        device_entry_bytes(device_id, health, numa)
        == _message([(device_id, health, numa)]).ByteSize()
    )


def test_random_lists_match_the_encoder() -> None:
    rng = random.Random(7)
    for _ in range(50):
        devices = [
            (
                "d" * rng.randint(1, 63),
                rng.choice(["Healthy", "Unhealthy"]),
                tuple(sorted(rng.sample(range(300), rng.randint(0, 3)))),
            )
            for _ in range(rng.randint(0, 200))
        ]
        assert list_message_bytes(devices) == _message(devices).ByteSize()


def test_a_long_list_needs_multi_byte_lengths() -> None:
    # A device body past 127 bytes needs a two-byte length prefix.
    numa = tuple(range(1, 60))
    assert (
        device_entry_bytes("gpu", "Healthy", numa)
        == _message([("gpu", "Healthy", numa)]).ByteSize()
    )
