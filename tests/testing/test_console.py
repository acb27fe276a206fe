"""``python -m devplug.testing kubelet DIR``: the kubelet stand-in a user runs beside
``devplug run``. A real child process, driven through its stdin, sees an in-process daemon
register, list, answer Allocate, re-register after a restart, and stops on ``quit``; it reads
lines of any length, and prints what a hostile plugin sends escaped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.podresources import Holder, read_pod_resources
from devplug.kubelet.registration import API_VERSION
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner

SERIAL = "example.com/serial"


def scanner() -> StaticScanner:
    return StaticScanner(
        {
            SERIAL: {
                "ttyUSB0": DeviceInfo(nodes=(DeviceNode("/dev/null"),), numa_nodes=(0,)),
                "ttyUSB1": DeviceInfo(health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/zero"),)),
            }
        }
    )


class Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(30):  # a bound on a hang, not a latency assertion
            raw = await self.process.stdout.readline()
        assert raw, "the console exited"
        return raw.decode().rstrip("\n")

    async def line_starting(self, prefix: str) -> str:
        while not (line := await self.line()).startswith(prefix):
            pass
        return line

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()


@pytest.fixture
async def console(kubelet_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Child]:
    output, *options = getattr(request, "param", "text").split()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug.testing",
        "kubelet",
        str(kubelet_dir),
        "-o",
        output,
        *options,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield Child(process)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await process.wait()


async def test_registrations_lists_allocate_restart_and_quit(
    console: Child, kubelet_dir: Path
) -> None:
    assert (await console.line()).startswith(f"kubelet: serving {kubelet_dir / 'kubelet.sock'}")
    async with running_daemon(daemon_settings(kubelet_dir), [scanner()]):
        assert await console.line_starting("registered") == (
            f"registered {SERIAL} (devplug-example.com_serial.sock; preferred allocation: yes, "
            "pre-start: no)"
        )
        assert await console.line_starting(SERIAL) == (
            f"{SERIAL}: 2 devices: ttyUSB0 Healthy, ttyUSB1 Unhealthy"
        )
        await console.send(f"allocate {SERIAL} ttyUSB0")
        answer = await console.line_starting(f"{SERIAL}: allocated")
        assert "nodes /dev/null:rw" in answer
        await console.send(f"allocate {SERIAL} ttyUSB1")
        assert (await console.line_starting("error")).startswith("error: INVALID_ARGUMENT")
        await console.send("allocate example.com/none x")
        assert "example.com/none is not registered" in await console.line_starting("error")
        await console.send("restart")
        await console.line_starting("kubelet restarted")
        assert (await console.line_starting("registered")).startswith(f"registered {SERIAL}")
    # The daemon stopped: the kubelet sees its stream end.
    await console.line_starting(f"{SERIAL}: ListAndWatch ended")
    await console.send("quit")
    assert await console.process.wait() == 0
    assert not (kubelet_dir / "kubelet.sock").exists()


@pytest.mark.parametrize("console", ["json"], indirect=True)
async def test_json_lines_for_programs(console: Child, kubelet_dir: Path) -> None:
    assert json.loads(await console.line())["event"] == "serving"
    async with running_daemon(daemon_settings(kubelet_dir), [scanner()]):
        registered = json.loads(await console.line_starting('{"event": "register.accepted"'))
        assert registered["resource"] == SERIAL and registered["preferred_allocation"] is True
        listed = json.loads(await console.line_starting('{"event": "list"'))
        assert [d["id"] for d in listed["devices"]] == ["ttyUSB0", "ttyUSB1"]
        await console.send(f"allocate {SERIAL} ttyUSB0")
        answer = json.loads(await console.line_starting('{"event": "allocate"'))
        assert answer["nodes"][0]["host_path"] == "/dev/null"
        holder = (answer["namespace"], answer["pod"], answer["container"])
        assert holder == ("default", "pod-1", "main")
    console.process.send_signal(signal.SIGINT)
    assert await console.process.wait() == 0


async def test_lines_of_any_length_are_read_and_quit_still_works(console: Child) -> None:
    await console.line_starting("kubelet: serving")
    # Longer than asyncio's 64 KiB readline limit, and than one read of stdin.
    ids = " ".join(f"gpu{index}" for index in range(40_000))  # ~300 KB
    await console.send(f"allocate example.com/none {ids}")
    assert (await console.line()).startswith("error: example.com/none is not registered")
    await console.send("x" * 200_000)
    assert (await console.line()).startswith("commands: allocate RESOURCE")
    await console.send("quit")
    async with asyncio.timeout(30):  # a bound on a hang, not a latency assertion
        assert await console.process.wait() == 0


# What a hostile or broken plugin may send: line breaks that would start a forged line of the
# console's own, and terminal escapes.
FORGED = "\nregistered example.com/fake (fake.sock; preferred allocation: yes, pre-start: no)"
ESC = "\x1b[2J\x1b[31m"
PREFERRED = f"p0\r{ESC}"
HOSTILE = "example.com/hostile"


class HostilePlugin(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"d0{FORGED}", health=f"Healthy{ESC}")])
        await asyncio.Event().wait()  # the stream stays open until the console goes

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        if list(request.container_requests[0].devices_ids) == ["fail"]:
            await context.abort(grpc.StatusCode.INTERNAL, f"broken{FORGED}")
        answer = pb.ContainerAllocateResponse(
            envs={"X": f"1{FORGED}"},
            devices=[
                pb.DeviceSpec(host_path=f"/dev/x{ESC}", container_path="/dev/x", permissions="rw")
            ],
        )
        return pb.AllocateResponse(container_responses=[answer])

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ],
    ) -> pb.PreferredAllocationResponse:
        answer = pb.ContainerPreferredAllocationResponse(deviceIDs=[PREFERRED])
        return pb.PreferredAllocationResponse(container_responses=[answer])

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[
            pb.PreStartContainerRequest, pb.PreStartContainerResponse
        ],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


async def register(kubelet_dir: Path, resource: str, endpoint: str) -> None:
    """A raw Register call; the console prints the verdict either way."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_dir / 'kubelet.sock'}") as channel:
        request = pb.RegisterRequest(version=API_VERSION, endpoint=endpoint, resource_name=resource)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=10)


def shown(text: str) -> str:
    """How the console prints plugin text: escaped, as in a Python literal."""
    return (
        text.replace("\\", "\\\\")
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\x1b", "\\x1b")
    )


async def test_plugin_text_is_printed_escaped(console: Child, kubelet_dir: Path) -> None:
    await console.line_starting("kubelet: serving")
    seen: list[str] = []

    async def next_line() -> str:
        seen.append(await console.line())
        return seen[-1]

    # A refused name: the simulator's verdict quotes it.
    await register(kubelet_dir, f"example.com/x{FORGED}", "none.sock")
    refused = await next_line()
    assert refused.startswith(f"refused {shown('example.com/x' + FORGED)}: ")

    endpoint = f"p{ESC}.sock"
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(HostilePlugin(), server)
    server.add_insecure_port(f"unix://{kubelet_dir / endpoint}")
    await server.start()
    try:
        await register(kubelet_dir, HOSTILE, endpoint)
        assert await next_line() == (
            f"registered {HOSTILE} ({shown(endpoint)}; preferred allocation: yes, pre-start: no)"
        )
        assert await next_line() == (
            f"{HOSTILE}: 1 devices: {shown('d0' + FORGED)} {shown('Healthy' + ESC)}"
        )
        await console.send(f"allocate {HOSTILE} fail")
        assert await next_line() == f"error: INTERNAL: {shown('broken' + FORGED)}"
        await console.send(f"allocate {HOSTILE} d0")
        assert await next_line() == (
            f"{HOSTILE}: allocated to default/pod-1/main; nodes {shown('/dev/x' + ESC)}:rw; "
            f"env X={shown('1' + FORGED)}"
        )
        await console.send(f"preferred {HOSTILE} 1")
        assert await next_line() == f"{HOSTILE}: preferred {shown(PREFERRED)}"
        await console.send("quit")
        assert await console.process.wait() == 0
    finally:
        await server.stop(None)
    assert not any(line.startswith("registered example.com/fake") for line in seen)
    assert not any(char in line for line in seen for char in "\x1b\r")


async def test_pods_are_allocated_listed_pinned_and_released_through_the_api(
    console: Child, kubelet_dir: Path
) -> None:
    pod_socket = kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    assert (await console.line()).startswith(
        f"kubelet: serving {kubelet_dir / 'kubelet.sock'} and {pod_socket}; waiting for plugins"
    )
    async with running_daemon(daemon_settings(kubelet_dir), [scanner()]):
        await console.line_starting(f"{SERIAL}: 2 devices")
        await console.send(f"allocate {SERIAL} ttyUSB0 --pod web/front --container=app")
        assert (await console.line_starting(f"{SERIAL}: allocated")).startswith(
            f"{SERIAL}: allocated to web/front/app; nodes /dev/null:rw"
        )
        view = await read_pod_resources(pod_socket)
        assert view.holders(SERIAL, "ttyUSB0") == (Holder("web", "front", "app"),)
        assert view.allocatable == {SERIAL: frozenset({"ttyUSB0"})}  # ttyUSB1 is unhealthy
        await console.send(f"allocate {SERIAL} ttyUSB0")
        assert "ttyUSB0 is in use by web/front/app" in await console.line_starting("error")
        await console.send(f"allocate {SERIAL} ttyUSB0 --pod")
        assert await console.line_starting("error") == "error: --pod needs a value"
        await console.send("pods")
        assert await console.line_starting("web/") == f"web/front/app: {SERIAL} ttyUSB0"
        await console.send(f"pin {SERIAL}")
        assert await console.line_starting(f"{SERIAL}: allocatable") == (
            f"{SERIAL}: allocatable pinned to none"
        )
        assert (await read_pod_resources(pod_socket)).allocatable == {}  # none: no entry
        await console.send(f"unpin {SERIAL}")
        await console.line_starting(f"{SERIAL}: allocatable follows its lists again")
        await console.send("release web/front")
        assert await console.line_starting("released") == f"released web/front ({SERIAL}: ttyUSB0)"
        assert (await read_pod_resources(pod_socket)).held == {}
        await console.send("pods")
        assert await console.line_starting("pods") == "pods: none hold devices"


@pytest.mark.parametrize("console", ["json --no-pod-resources"], indirect=True)
async def test_without_the_pod_resources_api_no_socket_is_served(
    console: Child, kubelet_dir: Path
) -> None:
    serving = json.loads(await console.line())
    assert serving["event"] == "serving" and serving["pod_resources_socket"] is None
    assert not (kubelet_dir.parent / "pod-resources").exists()
