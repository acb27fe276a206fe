"""The floor of one hotplug update: build the ListAndWatch message with protobuf and send it.

Started as its own process by bench/hotplug_stages.py, on a unix socket like the daemon's and
under the same preload. It serves only ListAndWatch: for each line ``<count>`` read on stdin
it builds a fresh ``ListAndWatchResponse`` of ``count`` devices (ids, health and NUMA node as
the daemon advertises the mock GPUs' render nodes), from scratch, the plain way, and yields
it on the open stream. For each message it prints ``<started> <built> <serialized>`` on the
shared monotonic clock (``time.perf_counter``); the bench stops the clock when its client has
the message.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import grpc

from bench.common import RENDER_MINOR_BASE
from devplug._proto import deviceplugin_v1beta1_pb2 as pb


def build(count: int) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=f"dri_renderD{RENDER_MINOR_BASE + index}",
                health="Healthy",
                topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=index % 2)]),
            )
            for index in range(count)
        ]
    )


class Floor:
    def __init__(self) -> None:
        self.requests: asyncio.Queue[int] = asyncio.Queue()
        self.serialized = 0.0

    async def ListAndWatch(
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse],
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        while True:
            count = await self.requests.get()
            started = time.perf_counter()
            message = build(count)
            built = time.perf_counter()
            yield message
            print(f"{started} {built} {self.serialized}", flush=True)


async def serve(path: str) -> None:
    floor = Floor()

    def serialize(message: pb.ListAndWatchResponse) -> bytes:
        data = message.SerializeToString()
        floor.serialized = time.perf_counter()
        return data

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "v1beta1.DevicePlugin",
        {
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                floor.ListAndWatch,
                request_deserializer=pb.Empty.FromString,
                response_serializer=serialize,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        floor.requests.put_nowait(int(line))
    await server.stop(None)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
