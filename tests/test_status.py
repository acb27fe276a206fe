"""``devplug status`` against a running daemon, another vendor's plugin and a dead socket."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.cli.status import resource_of_socket
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner


class VendorPlugin(pb_grpc.DevicePluginServicer):
    """Another vendor's plugin: three devices on NUMA node 1, one of them unhealthy."""

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Any
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=True)

    async def ListAndWatch(
        self, request: pb.Empty, context: Any
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])
        yield pb.ListAndWatchResponse(
            devices=[
                pb.Device(ID="a", health="Healthy", topology=topology),
                pb.Device(ID="b", health="Healthy", topology=topology),
                pb.Device(ID="c", health="Unhealthy", topology=topology),
            ]
        )
        await asyncio.Event().wait()  # keep the stream open, as plugins do

    # The rest of the service, which status never calls.
    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        raise NotImplementedError

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        raise NotImplementedError

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        raise NotImplementedError


async def devplug_status(*args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug",
        "status",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


def test_resource_names_are_read_from_devplug_socket_names() -> None:
    assert resource_of_socket("devplug-gpu.intel.com_i915.sock") == "gpu.intel.com/i915"
    assert resource_of_socket("devplug-example.com_serial-usb.sock") == "example.com/serial-usb"
    assert resource_of_socket("nvidia-gpu.sock") is None
    assert resource_of_socket("devplug-0123456789abcdef.sock") is None  # hashed long names


async def test_status_lists_devplug_and_other_plugins(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    vendor = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(VendorPlugin(), vendor)
    vendor.add_insecure_port(f"unix://{kubelet_dir / 'vendor.sock'}")
    await vendor.start()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(kubelet_dir / "stale.sock"))  # a socket file nobody listens on
    dead.close()
    scanner = StaticScanner(
        {
            "example.com/serial": {
                "dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),), numa_nodes=(0,)),
                "dev1": DeviceInfo(
                    health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/zero"),), numa_nodes=(0,)
                ),
            }
        }
    )
    try:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            await (await kubelet.wait_for_plugin("example.com/serial")).wait_for_update()
            document = json.loads(
                await devplug_status("--kubelet-dir", str(kubelet_dir), "-o", "json")
            )
            table = await devplug_status("--kubelet-dir", str(kubelet_dir))
    finally:
        await vendor.stop(None)
    plugins = {p["socket"]: p for p in document["plugins"]}
    assert sorted(plugins) == ["devplug-example.com_serial.sock", "stale.sock", "vendor.sock"]
    ours = plugins["devplug-example.com_serial.sock"]
    assert ours["resource"] == "example.com/serial"
    assert (ours["healthy"], ours["unhealthy"], ours["numa_nodes"]) == (1, 1, [0])
    assert ours["preferred_allocation"] is True and ours["error"] is None
    theirs = plugins["vendor.sock"]
    assert theirs["resource"] is None and (theirs["healthy"], theirs["unhealthy"]) == (2, 1)
    assert theirs["pre_start"] is True and theirs["numa_nodes"] == [1]
    assert plugins["stale.sock"]["error"].startswith("UNAVAILABLE")

    rows = [line.split() for line in table.splitlines()]
    assert rows[0] == ["SOCKET", "RESOURCE", "HEALTHY", "UNHEALTHY", "NUMA", "STATUS"]
    assert [
        "devplug-example.com_serial.sock",
        "example.com/serial",
        "1",
        "1",
        "0",
        "serving",
    ] in rows
    assert ["vendor.sock", "-", "2", "1", "1", "serving"] in rows


async def test_an_empty_dir_says_so(kubelet_dir: Path) -> None:
    assert (await devplug_status("--kubelet-dir", str(kubelet_dir))).startswith(
        "no device plugin sockets in"
    )
