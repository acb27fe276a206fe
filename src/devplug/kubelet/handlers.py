"""How the DevicePlugin servicer is served on a grpc.aio server.

As the generated registration does, except that ListAndWatch's and Allocate's responses are
bytes already (protobuf's encoding of a ListAndWatchResponse or an AllocateResponse, which
clients decode as usual), and Allocate's request keeps its bytes beside the message (the
answer cache's key).
"""

from __future__ import annotations

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.kubelet.servicer import SERVICE, DevicePluginServicer


def _as_they_are(message: bytes) -> bytes:
    """ListAndWatch's and Allocate's response serializer: the servicer's messages are encoded."""
    return message


def allocate_request(raw: bytes) -> tuple[bytes, pb.AllocateRequest]:
    """Allocate's request deserializer: the message with its bytes (the answer cache's key).
    Bytes that do not parse raise here, in gRPC's deserializer, as with any other RPC."""
    return raw, pb.AllocateRequest.FromString(raw)


def add_to_server(servicer: DevicePluginServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` on ``server``."""
    handlers = {
        "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
            servicer.GetDevicePluginOptions,
            request_deserializer=pb.Empty.FromString,
            response_serializer=pb.DevicePluginOptions.SerializeToString,
        ),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            servicer.ListAndWatch,
            request_deserializer=pb.Empty.FromString,
            response_serializer=_as_they_are,
        ),
        "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
            servicer.GetPreferredAllocation,
            request_deserializer=pb.PreferredAllocationRequest.FromString,
            response_serializer=pb.PreferredAllocationResponse.SerializeToString,
        ),
        "Allocate": grpc.unary_unary_rpc_method_handler(
            servicer.Allocate,
            request_deserializer=allocate_request,
            response_serializer=_as_they_are,
        ),
        "PreStartContainer": grpc.unary_unary_rpc_method_handler(
            servicer.PreStartContainer,
            request_deserializer=pb.PreStartContainerRequest.FromString,
            response_serializer=pb.PreStartContainerResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
