"""The floor for Allocate: a grpc.aio server whose only RPC does nothing.

Started as its own process by bench/allocate.py, on a unix socket like the daemon's, so the
two are measured with the same transport, the same client and the same process layout.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb

METHOD = "/devplug.bench.Floor/Empty"


async def empty(
    request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.Empty]
) -> pb.Empty:
    return pb.Empty()


async def serve(path: str) -> None:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "devplug.bench.Floor",
        {
            "Empty": grpc.unary_unary_rpc_method_handler(
                empty,
                request_deserializer=pb.Empty.FromString,
                response_serializer=pb.Empty.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
