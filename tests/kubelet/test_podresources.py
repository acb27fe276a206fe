"""The pod resources API: our proto's wire facts, the kubelet stand-in that serves it (fed by
its own Allocate calls, answering as server_v1.go does), and devplug's reader of it, over real
unix sockets with a real devplug daemon as the plugin."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from devplug._proto import podresources_v1_pb2 as pr
from devplug._proto import podresources_v1_pb2_grpc as pr_grpc
from devplug.kubelet.podresources import (
    ABSENT,
    NOT_ANSWERING,
    Holder,
    PodResourcesUnavailable,
    default_socket,
    read_pod_resources,
)
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.harness import DaemonStarter, StaticScanner
from devplug.testing.podresources import PodResourcesGates

SERIAL = "example.com/serial"
GPU = "example.com/gpu"


def scanner() -> StaticScanner:
    return StaticScanner(
        {
            SERIAL: {
                "tty0": DeviceInfo(nodes=(DeviceNode("/dev/null"),)),
                "tty1": DeviceInfo(nodes=(DeviceNode("/dev/null"),)),
                "tty2": DeviceInfo(health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/null"),)),
            },
            GPU: {
                "g0": DeviceInfo(nodes=(DeviceNode("/dev/zero"),), numa_nodes=(0,)),
                "g1": DeviceInfo(nodes=(DeviceNode("/dev/zero"),), numa_nodes=(0, 1)),
            },
        }
    )


async def registered(kubelet: KubeletSimulator, start_daemon: DaemonStarter) -> None:
    await start_daemon(daemon_settings(kubelet.directory), [scanner()])
    for resource in (SERIAL, GPU):
        await (await kubelet.wait_for_plugin(resource)).wait_for_update()


def channel_to(kubelet: KubeletSimulator) -> grpc.aio.Channel:
    assert kubelet.pod_resources_socket is not None
    return grpc.aio.insecure_channel(f"unix://{kubelet.pod_resources_socket}")


@pytest.fixture
async def lister(kubelet: KubeletSimulator) -> AsyncIterator[pr_grpc.PodResourcesListerAsyncStub]:
    async with channel_to(kubelet) as channel:
        yield pr_grpc.PodResourcesListerStub(channel)


def test_wire_facts_of_the_pod_resources_api() -> None:
    """k8s.io/kubelet pkg/apis/podresources/v1/api.proto: package, methods, field numbers."""
    f = descriptor_pb2.FieldDescriptorProto
    string, int64, message = f.TYPE_STRING, f.TYPE_INT64, f.TYPE_MESSAGE
    assert pr.DESCRIPTOR.package == "v1"
    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
        "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse"),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
    }

    def fields(name: str) -> dict[str, tuple[int, int, bool]]:
        described = pr.DESCRIPTOR.message_types_by_name[name]
        return {x.name: (x.number, x.type, x.is_repeated) for x in described.fields}

    assert fields("ListPodResourcesResponse") == {"pod_resources": (1, message, True)}
    assert fields("PodResources") == {
        "name": (1, string, False),
        "namespace": (2, string, False),
        "containers": (3, message, True),
    }
    assert fields("ContainerResources") == {
        "name": (1, string, False),
        "devices": (2, message, True),
        "cpu_ids": (3, int64, True),
        "memory": (4, message, True),
        "dynamic_resources": (5, message, True),
    }
    assert fields("ContainerDevices") == {
        "resource_name": (1, string, False),
        "device_ids": (2, string, True),
        "topology": (3, message, False),
    }
    assert fields("AllocatableResourcesResponse") == {
        "devices": (1, message, True),
        "cpu_ids": (2, int64, True),
        "memory": (3, message, True),
    }
    assert fields("NUMANode") == {"ID": (1, int64, False)}
    assert fields("GetPodResourcesRequest") == {
        "pod_name": (1, string, False),
        "pod_namespace": (2, string, False),
    }
    assert fields("DynamicResource") == {
        "claim_name": (2, string, False),
        "claim_namespace": (3, string, False),
        "claim_resources": (4, message, True),
    }


def test_the_socket_is_beside_the_device_plugin_dir() -> None:
    assert default_socket(Path("/var/lib/kubelet/device-plugins")) == Path(
        "/var/lib/kubelet/pod-resources/kubelet.sock"
    )


async def test_list_shows_each_container_with_its_devices_as_the_kubelet_does(
    kubelet: KubeletSimulator,
    start_daemon: DaemonStarter,
    lister: pr_grpc.PodResourcesListerAsyncStub,
) -> None:
    await registered(kubelet, start_daemon)
    made = await kubelet.allocate(GPU, ["g1"], pod="ml/train", container="worker")
    assert made.holder == Holder("ml", "train", "worker") and made.answer.nodes
    await kubelet.allocate(SERIAL, ["tty0"], pod="ml/train", container="worker")
    await kubelet.allocate(SERIAL, ["tty1"], pod="ml/train", container="sidecar")
    await kubelet.allocate(GPU, ["g0"])  # no pod named: a new one in default

    answer = await lister.List(pr.ListPodResourcesRequest())
    pods = [(p.namespace, p.name) for p in answer.pod_resources]
    assert pods == [("ml", "train"), ("default", "pod-1")]
    train = answer.pod_resources[0]
    assert [c.name for c in train.containers] == ["worker", "sidecar"]
    worker = train.containers[0]
    # One entry per device and NUMA node: g1 sits on nodes 0 and 1; tty0 has no topology.
    entries = [
        (d.resource_name, list(d.device_ids), [n.ID for n in d.topology.nodes])
        for d in worker.devices
    ]
    assert entries == [(GPU, ["g1"], [0]), (GPU, ["g1"], [1]), (SERIAL, ["tty0"], [])]
    assert not worker.devices[2].HasField("topology")
    assert [(d.resource_name, list(d.device_ids)) for d in train.containers[1].devices] == [
        (SERIAL, ["tty1"])
    ]
    assert answer.pod_resources[1].containers[0].name == "main"


async def test_allocatable_is_the_healthy_listed_devices_unless_pinned(
    kubelet: KubeletSimulator,
    start_daemon: DaemonStarter,
    lister: pr_grpc.PodResourcesListerAsyncStub,
) -> None:
    await registered(kubelet, start_daemon)
    await kubelet.allocate(SERIAL, ["tty0"])  # allocatable is capacity, not what is free

    def shape(answer: pr.AllocatableResourcesResponse) -> set[tuple[str, str, tuple[int, ...]]]:
        return {
            (d.resource_name, i, tuple(n.ID for n in d.topology.nodes))
            for d in answer.devices
            for i in d.device_ids
        }

    got = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
    assert shape(got) == {
        (SERIAL, "tty0", ()),
        (SERIAL, "tty1", ()),  # tty2 is unhealthy: not allocatable
        (GPU, "g0", (0,)),
        (GPU, "g1", (0,)),
        (GPU, "g1", (1,)),
    }
    kubelet.pin_allocatable(SERIAL, ["tty1", "ghost"])
    got = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
    assert {i for r, i, _ in shape(got) if r == SERIAL} == {"tty1", "ghost"}
    kubelet.pin_allocatable(SERIAL, None)
    got = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
    assert {i for r, i, _ in shape(got) if r == SERIAL} == {"tty0", "tty1"}


async def test_get_answers_one_pod_and_errors_for_an_unknown_one(
    kubelet: KubeletSimulator,
    start_daemon: DaemonStarter,
    lister: pr_grpc.PodResourcesListerAsyncStub,
) -> None:
    await registered(kubelet, start_daemon)
    await kubelet.allocate(SERIAL, ["tty1"], pod="web/front")
    got = await lister.Get(pr.GetPodResourcesRequest(pod_name="front", pod_namespace="web"))
    assert got.pod_resources.name == "front" and got.pod_resources.namespace == "web"
    assert list(got.pod_resources.containers[0].devices[0].device_ids) == ["tty1"]
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await lister.Get(pr.GetPodResourcesRequest(pod_name="back", pod_namespace="web"))
    assert unknown.value.code() == grpc.StatusCode.UNKNOWN
    assert unknown.value.details() == "pod back in namespace web not found"


async def test_gates_off_answer_as_a_kubelet_with_them_off(kubelet_dir: Path) -> None:
    gates = PodResourcesGates(get_allocatable=False, get=False)
    async with KubeletSimulator(kubelet_dir, gates=gates) as kubelet:
        async with channel_to(kubelet) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as allocatable:
                await stub.GetAllocatableResources(pr.AllocatableResourcesRequest())
            with pytest.raises(grpc.aio.AioRpcError) as get:
                await stub.Get(pr.GetPodResourcesRequest(pod_name="a", pod_namespace="b"))
            assert (await stub.List(pr.ListPodResourcesRequest())).pod_resources == []
        # The reader still knows the holders; only the allocatable set is unknown.
        assert kubelet.pod_resources_socket is not None
        view = await read_pod_resources(kubelet.pod_resources_socket)
    assert allocatable.value.code() == get.value.code() == grpc.StatusCode.UNKNOWN
    assert allocatable.value.details() == "Pod Resources API GetAllocatableResources disabled"
    assert get.value.details() == "PodResources API Get method disabled"
    assert view.allocatable is None and view.held == {}
    assert view.allocatable_error == "UNKNOWN: Pod Resources API GetAllocatableResources disabled"


async def test_the_stand_in_hands_a_device_to_one_container_at_a_time(
    kubelet: KubeletSimulator, start_daemon: DaemonStarter
) -> None:
    await registered(kubelet, start_daemon)
    await kubelet.allocate(SERIAL, ["tty0"], pod="a/one")
    with pytest.raises(ValueError, match=r"tty0 is in use by a/one/main"):
        await kubelet.allocate(SERIAL, ["tty0"], pod="b/two")
    with pytest.raises(ValueError, match="pod name 'Bad_Name' must be a DNS-1123 subdomain"):
        await kubelet.allocate(SERIAL, ["tty1"], pod="ns/Bad_Name")
    with pytest.raises(LookupError, match=r"example\.com/none is not registered"):
        await kubelet.allocate("example.com/none", ["x"])
    assert kubelet.release("a/one") == {SERIAL: ["tty0"]}
    with pytest.raises(LookupError, match="no pod a/one holds devices"):
        kubelet.release("a/one")
    made = await kubelet.allocate(SERIAL, ["tty0"], pod="b/two")  # free again
    assert str(made.holder) == "b/two/main"


async def test_allocations_outlive_a_restart_and_a_plugin_gone_has_nothing_allocatable(
    kubelet: KubeletSimulator,
) -> None:
    async with running_daemon(daemon_settings(kubelet.directory), [scanner()]):
        await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
        await kubelet.allocate(SERIAL, ["tty0"], pod="a/one")
        await kubelet.restart()  # the kubelet keeps its checkpoint, so the holders stay
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        assert kubelet.pod_resources_socket is not None
        served = await read_pod_resources(kubelet.pod_resources_socket, resources=[SERIAL])
    await session.stream_ended.wait()  # the daemon stopped: its stream ended
    after = await read_pod_resources(kubelet.pod_resources_socket, resources=[SERIAL])
    assert served.holders(SERIAL, "tty0") == after.holders(SERIAL, "tty0")
    assert served.holders(SERIAL, "tty0") == (Holder("a", "one", "main"),)
    assert served.allocatable == {SERIAL: frozenset({"tty0", "tty1"})}
    assert after.allocatable == {}


async def test_the_reader_gives_holders_and_allocatable_of_the_resources_asked(
    kubelet: KubeletSimulator, start_daemon: DaemonStarter
) -> None:
    await registered(kubelet, start_daemon)
    await kubelet.allocate(GPU, ["g1"], pod="ml/train", container="worker")
    await kubelet.allocate(SERIAL, ["tty0", "tty1"], pod="web/front")
    assert kubelet.pod_resources_socket is not None
    view = await read_pod_resources(kubelet.pod_resources_socket, resources=[GPU])
    # g1 is listed twice (two NUMA nodes), and held once.
    assert view.held == {GPU: {"g1": (Holder("ml", "train", "worker"),)}}
    assert view.allocatable == {GPU: frozenset({"g0", "g1"})}
    assert (view.pods, view.containers) == (2, 2)
    everything = await read_pod_resources(kubelet.pod_resources_socket)
    assert everything.holders(SERIAL, "tty1") == (Holder("web", "front", "main"),)


async def test_an_absent_or_dead_socket_is_unavailable_with_the_reason(short_dir: Path) -> None:
    missing_dir = short_dir / "pod-resources" / "kubelet.sock"
    with pytest.raises(PodResourcesUnavailable) as no_dir:
        await read_pod_resources(missing_dir)
    assert no_dir.value.state == ABSENT
    assert no_dir.value.reason == f"no {missing_dir.parent}"
    missing_dir.parent.mkdir()
    with pytest.raises(PodResourcesUnavailable) as no_socket:
        await read_pod_resources(missing_dir)
    assert no_socket.value.state == ABSENT
    assert no_socket.value.reason == f"no kubelet.sock in {missing_dir.parent}"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(missing_dir))  # a socket file nobody listens on: a kubelet that died
    dead.close()
    with pytest.raises(PodResourcesUnavailable) as refused:
        await read_pod_resources(missing_dir, timeout=5)
    assert refused.value.state == NOT_ANSWERING
    assert refused.value.reason.startswith("UNAVAILABLE")


async def test_a_stand_in_without_the_api_serves_no_socket(kubelet_dir: Path) -> None:
    async with KubeletSimulator(kubelet_dir, pod_resources=False) as kubelet:
        assert kubelet.pod_resources_socket is None
        with pytest.raises(PodResourcesUnavailable) as absent:
            await read_pod_resources(default_socket(kubelet_dir))
    assert absent.value.state == ABSENT
