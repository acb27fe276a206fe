"""ListMessageBuilder: encoded ListAndWatch messages, byte for byte protobuf's, reusing each
device's entry, and the same message when the kubelet's view did not change; Allocate's
answers, encoded without building messages, byte for byte protobuf's too."""

from __future__ import annotations

import dataclasses
import random

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.kubelet.wire import (
    ListMessageBuilder,
    allocate_response,
    container_response,
    device_entry,
    device_message,
    list_message,
)
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode, DeviceTree, Health, Mount


def _encoded(devices: dict[str, DeviceInfo]) -> bytes:
    return list_message(devices).SerializeToString()


def test_messages_equal_fresh_ones_and_follow_what_the_kubelet_sees() -> None:
    builder = ListMessageBuilder()
    devices = {f"d{i}": DeviceInfo(numa_nodes=(i % 2,)) for i in range(5)}
    first = builder.build(devices)
    assert first == _encoded(devices)

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
        assert message == _encoded(changed)
        first = message


def test_order_follows_the_devices_mapping() -> None:
    builder = ListMessageBuilder()
    builder.build({"a": DeviceInfo(), "b": DeviceInfo()})
    message = pb.ListAndWatchResponse.FromString(
        builder.build({"b": DeviceInfo(), "a": DeviceInfo()})
    )
    assert [device.ID for device in message.devices] == ["b", "a"]


def test_an_entry_is_protobufs_encoding_of_the_device() -> None:
    for device_id in ("0", "x" * 63, "card-ü"):
        for numa in ((), (0,), (1,), (0, 3), (127, 128, 300), (2**40,)):
            for health in Health:
                info = DeviceInfo(health=health, numa_nodes=numa)
                alone = pb.ListAndWatchResponse(devices=[device_message(device_id, info)])
                assert device_entry(device_id, info) == alone.SerializeToString()


def _random_info(rng: random.Random) -> DeviceInfo:
    return DeviceInfo(
        health=rng.choice([Health.HEALTHY, Health.HEALTHY, Health.UNHEALTHY]),
        numa_nodes=rng.choice([(), (0,), (1,), (0, 1), (200,)]),
        health_reason=rng.choice(["", "a note"]),
    )


def test_edited_messages_equal_protobufs_through_random_walks() -> None:
    """Random walks of tree edits (re-reads, equal or not, removals, additions, several
    edits between builds, maps whose edit is unknown): every message the builder makes is
    byte for byte protobuf's SerializeToString of the same ListAndWatchResponse, and it is
    the very same object exactly when the kubelet's view did not change."""
    resource = "example.com/r"
    for seed in range(20):
        rng = random.Random(seed)
        builder = ListMessageBuilder()
        first = {str(i): _random_info(rng) for i in range(rng.randrange(1, 30))}
        tree = DeviceTree({resource: first})
        built = tree[resource]
        message = builder.build(built)
        assert message == _encoded(dict(built))
        for _ in range(150):
            devices = tree[resource]
            removed = [(resource, i) for i in devices if rng.random() < 0.1]
            added: dict[str, dict[str, DeviceInfo]] = {resource: {}}
            for _, i in removed:
                if rng.random() < 0.6:  # re-read
                    info = devices[i] if rng.random() < 0.3 else _random_info(rng)
                    added[resource][i] = info
            for _ in range(rng.choice([0, 0, 1, 3])):
                i = str(rng.randrange(60))
                if i not in devices or (resource, i) in removed:
                    added[resource].setdefault(i, _random_info(rng))
            new = tree.with_changes(removed, added)
            if resource not in new:
                new = DeviceTree({resource: {"0": DeviceInfo()}})
            edit = new.edit_since(resource, devices)
            chance = rng.random()
            if edit is not None and chance < 0.8:
                builder.edited(new[resource], edit)
            elif chance < 0.9:
                new = DeviceTree(new)  # a tree that knows no edit: a full pass
            tree = new
            if rng.random() < 0.4:
                continue  # the stream reads later: several edits to follow
            devices = tree[resource]
            again = builder.build(devices)
            assert again == _encoded(dict(devices))
            view = [(i, d.health, d.numa_nodes) for i, d in devices.items()]
            before = [(i, d.health, d.numa_nodes) for i, d in built.items()]
            assert (again is message) == (view == before)
            assert builder.build(devices) is again
            message, built = again, devices


def _random_answer(rng: random.Random) -> ContainerAllocation:
    def text(empty: bool = True) -> str:
        # Empty, short, non-ASCII, and past one length byte (128+ bytes).
        choices = ["a", "/dev/x1", "ü-é", "y" * rng.choice([127, 128, 300])]
        return rng.choice(choices + ([""] if empty else []))

    def mount() -> Mount:
        return Mount(f"/host/{text()}", f"/mnt/{text()}", read_only=rng.random() < 0.5)

    def node() -> DeviceNode:
        return DeviceNode(f"/dev/{text()}", rng.choice(["", "/dev/in"]), rng.choice(["rw", "rwm"]))

    env = {text(empty=False) + str(i): text() for i in range(rng.choice([0, 0, 1, 3]))}
    if env and rng.random() < 0.3:  # keys that prefix one another
        key = next(iter(env))
        env.update({key[:1]: text(), key + "x": text()})
    return ContainerAllocation(
        env=env,
        mounts=tuple(mount() for _ in range(rng.choice([0, 1, 2]))),
        nodes=tuple(node() for _ in range(rng.choice([0, 1, 1, 4]))),
        annotations={f"k{i}": text() for i in range(rng.choice([0, 0, 2]))},
        cdi_devices=tuple(f"example.com/r={text(empty=False)}" for _ in range(rng.choice([0, 1]))),
    )


def _keys_prefix_one_another(answers: list[ContainerAllocation]) -> bool:
    return any(
        a != b and b.startswith(a)
        for answer in answers
        for keys in (answer.env, answer.annotations)
        for a in keys
        for b in keys
    )


def test_allocate_answers_are_protobufs_encoding() -> None:
    """Random answers (empty fields, empty maps and values, non-ASCII, lengths past one
    varint byte, keys that prefix one another, up to four containers, empty ones too): the
    encoding parses back to the same AllocateResponse, and is byte for byte protobuf's
    deterministic SerializeToString of it but where map keys prefix one another (there
    protobuf's own order depends on its implementation: upb puts "ab" before "a")."""
    rng = random.Random(7)
    prefixed = 0
    for _ in range(2000):
        answers = [_random_answer(rng) for _ in range(rng.choice([1, 1, 2, 4]))]
        message = pb.AllocateResponse(container_responses=[container_response(a) for a in answers])
        encoded = allocate_response(answers)
        assert pb.AllocateResponse.FromString(encoded) == message
        assert len(encoded) == message.ByteSize()
        if _keys_prefix_one_another(answers):
            prefixed += 1
        else:
            assert encoded == message.SerializeToString(deterministic=True)
    assert prefixed > 100  # the case is exercised
    assert allocate_response([ContainerAllocation()]) == b"\x0a\x00"
