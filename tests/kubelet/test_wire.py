"""ListMessageBuilder: reused device messages, and the same message when the kubelet's view
did not change."""

from __future__ import annotations

import dataclasses

from devplug.kubelet.wire import ListMessageBuilder, list_message
from devplug.model import DeviceInfo, Health


def test_messages_equal_fresh_ones_and_follow_what_the_kubelet_sees() -> None:
    builder = ListMessageBuilder()
    devices = {f"d{i}": DeviceInfo(numa_nodes=(i % 2,)) for i in range(5)}
    first = builder.build(devices)
    assert first == list_message(devices)

    # Only a reason changed: nothing the kubelet sees, so the very same message.
    quiet = dict(devices, d1=dataclasses.replace(devices["d1"], health_reason="just a note"))
    assert builder.build(quiet) is first

    for changed in (
        dict(devices, d1=DeviceInfo(health=Health.UNHEALTHY, numa_nodes=(1,))),
        dict(devices, d1=DeviceInfo(numa_nodes=(0,))),
        {k: v for k, v in devices.items() if k != "d3"},
        dict(devices, d9=DeviceInfo()),
    ):
        message = builder.build(changed)
        assert message is not first
        assert message == list_message(changed)
        first = message


def test_order_follows_the_devices_mapping() -> None:
    builder = ListMessageBuilder()
    builder.build({"a": DeviceInfo(), "b": DeviceInfo()})
    message = builder.build({"b": DeviceInfo(), "a": DeviceInfo()})
    assert [device.ID for device in message.devices] == ["b", "a"]
