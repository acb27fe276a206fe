"""The floors for Allocate: a grpc.aio server in its own process, on a unix socket like the
daemon's, so floor and daemon are measured with the same transport, client and process layout.

It serves these methods, each a step closer to the daemon's Allocate (the bench calls each
in a process of its own, so that each one's CPU time is its own):

- ``Floor/Empty`` (:data:`METHOD`): does nothing and answers an empty message. Issue 16's goal
  is measured against this one.
- ``Floor/Sized`` (:data:`SIZED_METHOD`): parses an AllocateRequest and answers the same
  AllocateResponse the bench daemon sends (a device spec and a CDI name per requested render
  node, 96 bytes for one), built with protobuf on every call: the response-size part of the
  gap, with no devplug code at all.
- ``v1beta1.DevicePlugin/Allocate``, with ``--devices N``: devplug's own servicer (registered
  as the daemon registers it, :func:`~devplug.kubelet.handlers.add_to_server`) over N render
  nodes like the bench daemon's, without the daemon around it (no metrics, no CDI names, logs
  at warning): what is left between this and the daemon is the process (logging, metrics, the
  rest of its loop). Without ``--devices`` the process stays bare (no devplug imports, no
  device objects for the collector to walk).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb

if TYPE_CHECKING:
    from devplug.model import DeviceMap

METHOD = "/devplug.bench.Floor/Empty"
SIZED_METHOD = "/devplug.bench.Floor/Sized"
# Render nodes as the bench daemon serves them (bench.common's RENDER_MINOR_BASE), and its
# resource, which is also its CDI kind.
RENDER_MINOR_BASE = 100_000
CDI_KIND = "example.com/render"


async def empty(
    request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.Empty]
) -> pb.Empty:
    return pb.Empty()


async def sized(
    request: pb.AllocateRequest,
    context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
) -> pb.AllocateResponse:
    # The bench daemon's answer for render node ids "dri_renderD<minor>": each one's node,
    # path for path, and its CDI name.
    return pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                devices=[
                    pb.DeviceSpec(
                        container_path=f"/dev/dri/{i[4:]}",
                        host_path=f"/dev/dri/{i[4:]}",
                        permissions="rw",
                    )
                    for i in container.devices_ids
                ],
                cdi_devices=[pb.CDIDevice(name=f"{CDI_KIND}={i}") for i in container.devices_ids],
            )
            for container in request.container_requests
        ]
    )


def render_tree(count: int) -> DeviceMap:
    """``count`` render nodes as the bench daemon's generic scanner finds them (imported here:
    the empty floor's process needs none of devplug)."""
    from devplug.model import DeviceInfo, DeviceNode

    return {
        f"dri_renderD{minor}": DeviceInfo(
            nodes=(DeviceNode(f"/dev/dri/renderD{minor}"),), numa_nodes=(index % 2,)
        )
        for index, minor in enumerate(range(RENDER_MINOR_BASE, RENDER_MINOR_BASE + count))
    }


def add_servicer(server: grpc.aio.Server, devices: int) -> None:
    """devplug's servicer over ``devices`` render nodes."""
    from devplug import logconfig
    from devplug._kits.values import LatestValue
    from devplug.kubelet.handlers import add_to_server
    from devplug.kubelet.servicer import DevicePluginServicer

    # Logs on stderr, and only problems: stdout is the "ready" pipe nobody drains after.
    logconfig.configure("json", "warning")
    tree = LatestValue(render_tree(devices))
    add_to_server(DevicePluginServicer(CDI_KIND, tree, None), server)


async def serve(path: str, devices: int) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "devplug.bench.Floor",
        {
            "Empty": grpc.unary_unary_rpc_method_handler(
                empty,
                request_deserializer=pb.Empty.FromString,
                response_serializer=pb.Empty.SerializeToString,
            ),
            "Sized": grpc.unary_unary_rpc_method_handler(
                sized,
                request_deserializer=pb.AllocateRequest.FromString,
                response_serializer=pb.AllocateResponse.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    if devices:
        add_servicer(server, devices)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("socket")
    parser.add_argument("--devices", type=int, default=0, help="also serve devplug's servicer")
    args = parser.parse_args()
    asyncio.run(serve(args.socket, args.devices))
