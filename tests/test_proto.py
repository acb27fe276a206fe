"""The committed stubs match proto/, and proto/ matches the kubelet's v1beta1 wire facts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "deviceplugin_v1beta1.proto"


def test_committed_stubs_match_the_proto_file(tmp_path: Path) -> None:
    """Compile proto/ afresh and compare the descriptor with the one in the committed stub."""
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO.parent}",
            f"--descriptor_set_out={out}",
            PROTO.name,
        ],
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _drop_json_names(fresh.message_type)  # protoc adds them to descriptor sets, not to stubs
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "stubs are stale: run `python scripts/gen_proto.py`"


def _drop_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_generated_grpc_module_serves_every_rpc() -> None:
    for name in (
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ):
        assert hasattr(pb_grpc.DevicePluginServicer, name)
    assert hasattr(pb_grpc.RegistrationServicer, "Register")


def _fields(message: str) -> dict[str, tuple[int, int, bool, str]]:
    """name -> (number, type, repeated, message type) of a message's fields."""
    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    return {
        f.name: (
            f.number,
            f.type,
            f.is_repeated,
            f.message_type.full_name if f.message_type else "",
        )
        for f in descriptor.fields
    }


def test_wire_facts_of_the_kubelet_api() -> None:
    """Names, numbers and types the kubelet's api.proto defines (k8s.io/kubelet v1beta1)."""
    f = descriptor_pb2.FieldDescriptorProto
    string, boolean, int32, int64, message = (
        f.TYPE_STRING,
        f.TYPE_BOOL,
        f.TYPE_INT32,
        f.TYPE_INT64,
        f.TYPE_MESSAGE,
    )
    one, many = False, True
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert _fields("RegisterRequest") == {
        "version": (1, string, one, ""),
        "endpoint": (2, string, one, ""),
        "resource_name": (3, string, one, ""),
        "options": (4, message, one, "v1beta1.DevicePluginOptions"),
    }
    assert _fields("DevicePluginOptions") == {
        "pre_start_required": (1, boolean, one, ""),
        "get_preferred_allocation_available": (2, boolean, one, ""),
    }
    assert _fields("Device") == {
        "ID": (1, string, one, ""),
        "health": (2, string, one, ""),
        "topology": (3, message, one, "v1beta1.TopologyInfo"),
    }
    assert _fields("NUMANode") == {"ID": (1, int64, one, "")}
    assert _fields("ContainerPreferredAllocationRequest") == {
        "available_deviceIDs": (1, string, many, ""),
        "must_include_deviceIDs": (2, string, many, ""),
        "allocation_size": (3, int32, one, ""),
    }
    response = _fields("ContainerAllocateResponse")
    assert response["envs"][:2] == (1, message)
    assert response["mounts"] == (2, message, many, "v1beta1.Mount")
    assert response["devices"] == (3, message, many, "v1beta1.DeviceSpec")
    assert response["annotations"][:2] == (4, message)
    assert response["cdi_devices"] == (5, message, many, "v1beta1.CDIDevice")
    assert _fields("CDIDevice") == {"name": (1, string, one, "")}
    assert _fields("Mount") == {
        "container_path": (1, string, one, ""),
        "host_path": (2, string, one, ""),
        "read_only": (3, boolean, one, ""),
    }
    assert _fields("DeviceSpec") == {
        "container_path": (1, string, one, ""),
        "host_path": (2, string, one, ""),
        "permissions": (3, string, one, ""),
    }
    plugin = pb.DESCRIPTOR.services_by_name["DevicePlugin"]
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in plugin.methods}
    assert methods == {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions"),
        "ListAndWatch": ("Empty", "ListAndWatchResponse"),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse"),
        "Allocate": ("AllocateRequest", "AllocateResponse"),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse"),
    }
    streaming = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    (service,) = [s for s in streaming.service if s.name == "DevicePlugin"]
    assert [m.name for m in service.method if m.server_streaming] == ["ListAndWatch"]
    assert not any(m.client_streaming for m in service.method)
    registration = pb.DESCRIPTOR.services_by_name["Registration"]
    assert [m.name for m in registration.methods] == ["Register"]
