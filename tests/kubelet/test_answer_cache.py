"""Allocate's encoded-answer cache never serves an answer the current state would not give.

The servicer keeps each default answer, encoded, under its request's bytes, for one device
snapshot and one extension generation. These tests change the tree (the same ids with other
nodes, health or presence), the extension's state and the hooks between identical requests,
and a random walk checks every answer against the answer worked out afresh.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from devplug._kits.values import LatestValue
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.errors import AllocationError
from devplug.kubelet.allocation import check_request, check_size, default_allocation
from devplug.kubelet.handlers import add_to_server
from devplug.kubelet.servicer import DevicePluginServicer
from devplug.kubelet.wire import container_response
from devplug.model import ContainerAllocation, DeviceInfo, DeviceMap, DeviceNode, Health
from devplug.testing import StaticScanner, daemon_settings, running_daemon
from devplug.testing.simulator import KubeletSimulator, SimulatorRpcError

RESOURCE = "example.com/serial"
CODES = {"not_found": grpc.StatusCode.NOT_FOUND, "invalid": grpc.StatusCode.INVALID_ARGUMENT}


def device(node: str, health: Health = Health.HEALTHY, env: str = "") -> DeviceInfo:
    return DeviceInfo(health=health, nodes=(DeviceNode(node),), env={"TAG": env} if env else {})


async def test_a_changed_device_gets_a_fresh_answer_from_the_daemon(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """The same request before and after a rescan changed dev0 under the same id: the answer
    follows the new tree; turned unhealthy or gone, dev0 is refused."""
    scanner = StaticScanner({RESOURCE: {"dev0": device("/dev/ttyA"), "dev1": device("/dev/ttyB")}})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(RESOURCE)
        await session.wait_for_update()
        for _ in range(2):  # the second one is answered from the cache
            (answer,) = await session.allocate(["dev0"])
            assert [n.host_path for n in answer.nodes] == ["/dev/ttyA"]

        scanner.set(
            {RESOURCE: {"dev0": device("/dev/ttyC", env="new"), "dev1": device("/dev/ttyB")}}
        )
        await daemon.rescan()
        (answer,) = await session.allocate(["dev0"])
        assert [n.host_path for n in answer.nodes] == ["/dev/ttyC"]
        assert dict(answer.env) == {"TAG": "new"}

        scanner.set(
            {RESOURCE: {"dev0": device("/dev/ttyC", Health.UNHEALTHY), "dev1": device("/dev/ttyB")}}
        )
        await daemon.rescan()
        await session.wait_for_update(lambda d: d["dev0"].health == "Unhealthy")
        with pytest.raises(SimulatorRpcError) as sick:
            await session.allocate(["dev0"])
        assert sick.value.code == "INVALID_ARGUMENT" and "'dev0'" in sick.value.details

        scanner.set({RESOURCE: {"dev1": device("/dev/ttyB")}})
        await daemon.rescan()
        await session.wait_for_update(lambda d: "dev0" not in d)
        with pytest.raises(SimulatorRpcError) as gone:
            await session.allocate(["dev0"])
        assert gone.value.code == "NOT_FOUND"
        (answer,) = await session.allocate(["dev1"])  # still serving
        assert [n.host_path for n in answer.nodes] == ["/dev/ttyB"]


class Annotating:
    """An answer extension whose additions change with its generation (as CDI names do when a
    spec is written or removed)."""

    def __init__(self) -> None:
        self.generation = 0

    def confirm(self, resource: str) -> None:
        pass

    def extend(
        self,
        resource: str,
        ids: Sequence[str],
        answer: ContainerAllocation,
        devices: Mapping[str, DeviceInfo],
    ) -> ContainerAllocation:
        if not self.generation % 2:
            return answer
        names = tuple(f"example.com/serial={i}@{self.generation}" for i in ids)
        return ContainerAllocation(
            env=answer.env, mounts=answer.mounts, nodes=answer.nodes, cdi_devices=names
        )


class Renaming:
    """An Allocator hook (its answers are never cached)."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(
        self, resource: str, requests: Sequence[Sequence[str]], devices: DeviceMap
    ) -> list[ContainerAllocation]:
        self.calls += 1
        return [ContainerAllocation(env={"CALL": str(self.calls)}) for _ in requests]


@pytest.fixture
async def served(
    short_dir: Path,
) -> AsyncIterator[tuple[DevicePluginServicer, Any]]:
    servicer = DevicePluginServicer(RESOURCE, LatestValue({}), None, Annotating())
    server = grpc.aio.server()
    add_to_server(servicer, server)
    server.add_insecure_port(f"unix://{short_dir / 'plugin.sock'}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{short_dir / 'plugin.sock'}") as channel:
            yield servicer, pb_grpc.DevicePluginStub(channel)
    finally:
        await server.stop(None)


def expected(
    servicer: DevicePluginServicer, request: pb.AllocateRequest
) -> pb.AllocateResponse | grpc.StatusCode:
    """The answer worked out afresh (no cache): the response, or the refusal's status."""
    devices = servicer.devices.value
    requests = [list(c.devices_ids) for c in request.container_requests]
    try:
        check_size(RESOURCE, requests, devices)
        check_request(RESOURCE, requests, devices)
    except AllocationError as exc:
        return CODES[exc.kind]
    assert servicer.extension is not None
    return pb.AllocateResponse(
        container_responses=[
            container_response(
                servicer.extension.extend(RESOURCE, ids, default_allocation(ids, devices), devices)
            )
            for ids in requests
        ]
    )


async def answer(stub: Any, request: pb.AllocateRequest) -> pb.AllocateResponse | grpc.StatusCode:
    try:
        response: pb.AllocateResponse = await stub.Allocate(request)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return response


async def test_a_new_extension_generation_or_hook_gets_a_fresh_answer(
    served: tuple[DevicePluginServicer, Any],
) -> None:
    servicer, stub = served
    servicer.devices.set({"dev0": device("/dev/ttyA")})
    extension = servicer.extension
    assert isinstance(extension, Annotating)
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["dev0"])]
    )
    first = await answer(stub, request)
    assert isinstance(first, pb.AllocateResponse) and first == expected(servicer, request)
    assert not first.container_responses[0].cdi_devices
    extension.generation = 1
    named = await answer(stub, request)
    assert isinstance(named, pb.AllocateResponse) and named == expected(servicer, request)
    assert [d.name for d in named.container_responses[0].cdi_devices] == [
        "example.com/serial=dev0@1"
    ]
    hook = Renaming()
    servicer.bind(hook)
    for call in (1, 2):  # a hook's answer is asked for every time
        hooked = await answer(stub, request)
        assert isinstance(hooked, pb.AllocateResponse)
        assert dict(hooked.container_responses[0].envs) == {"CALL": str(call)}
    servicer.bind(None)
    assert await answer(stub, request) == expected(servicer, request)


async def test_random_walk_of_trees_generations_and_requests(
    served: tuple[DevicePluginServicer, Any],
) -> None:
    """Requests drawn from a few ids (so many repeat, and hit the cache) between random edits:
    a device's node, env or health changed, a device removed or added, the extension's
    generation bumped, or nothing. Every answer equals the one worked out afresh."""
    servicer, stub = served
    extension = servicer.extension
    assert isinstance(extension, Annotating)
    rng = random.Random(16)
    ids = [f"dev{i}" for i in range(6)]
    tree = {i: device(f"/dev/{i}") for i in ids[:4]}
    servicer.devices.set(dict(tree))
    hits = 0
    for step in range(600):
        roll = rng.random()
        if roll < 0.04:
            target = rng.choice(ids)
            tree[target] = device(
                f"/dev/{target}-{step}",
                rng.choice([Health.HEALTHY, Health.HEALTHY, Health.UNHEALTHY]),
                env=rng.choice(["", "a", "b"]),
            )
            servicer.devices.set(dict(tree))
        elif roll < 0.06 and tree:
            del tree[rng.choice(sorted(tree))]
            servicer.devices.set(dict(tree))
        elif roll < 0.08:
            extension.generation += 1
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=rng.sample(ids, rng.choice([1, 1, 1, 2])))
                for _ in range(rng.choice([1, 1, 1, 2]))
            ]
        )
        hits += roll >= 0.08 and request.SerializeToString() in servicer.answer_cache.entries
        assert await answer(stub, request) == expected(servicer, request), f"step {step}"
    assert hits > 60, f"the walk must exercise the cache: {hits} hits"
