"""The committed stubs match proto/, and proto/ matches the kubelet's wire facts: the device
plugin API v1beta1, the DRA plugin API v1 and v1beta1, plugin registration."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FileDescriptor

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug._proto import (
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_v1_pb2,
    podresources_v1_pb2,
)

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
STUBS: dict[str, FileDescriptor] = {
    "deviceplugin_v1beta1": pb.DESCRIPTOR,
    "dra_v1": dra_v1_pb2.DESCRIPTOR,
    "dra_v1beta1": dra_v1beta1_pb2.DESCRIPTOR,
    "pluginregistration_v1": pluginregistration_v1_pb2.DESCRIPTOR,
    "podresources_v1": podresources_v1_pb2.DESCRIPTOR,
}


def test_every_proto_file_has_a_committed_stub() -> None:
    assert sorted(p.stem for p in PROTO_DIR.glob("*.proto")) == sorted(STUBS)


@pytest.mark.parametrize("name", sorted(STUBS))
def test_committed_stubs_match_the_proto_file(tmp_path: Path, name: str) -> None:
    """Compile proto/ afresh and compare the descriptor with the one in the committed stub."""
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--descriptor_set_out={out}",
            f"{name}.proto",
        ],
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _drop_json_names(fresh.message_type)  # protoc adds them to descriptor sets, not to stubs
    committed = descriptor_pb2.FileDescriptorProto.FromString(STUBS[name].serialized_pb)
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


def _fields_of(descriptor: FileDescriptor, message: str) -> dict[str, tuple[int, int, bool, str]]:
    """name -> (number, type, repeated, message type) of a message's fields."""
    return _fields_of_message(descriptor.message_types_by_name[message])


def _fields_of_message(message: Descriptor) -> dict[str, tuple[int, int, bool, str]]:
    return {
        f.name: (
            f.number,
            f.type,
            f.is_repeated,
            f.message_type.full_name if f.message_type else "",
        )
        for f in message.fields
    }


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_wire_facts_of_the_kubelet_dra_api(version: str) -> None:
    """k8s.io/kubelet pkg/apis/dra/<version>/api.proto: package, methods, field numbers;
    v1's Device has ``optional string share_id = 5``, v1beta1's has not."""
    descriptor = STUBS[f"dra_{version}"]
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    string, message = (
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        (descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE),
    )
    one, many = False, True
    assert descriptor.package == package
    service = descriptor.services_by_name["DRAPlugin"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        "NodeUnprepareResources": (
            "NodeUnprepareResourcesRequest",
            "NodeUnprepareResourcesResponse",
        ),
    }
    claim = f"{package}.Claim"
    assert _fields_of(descriptor, "Claim") == {
        "namespace": (1, string, one, ""),
        "uid": (2, string, one, ""),
        "name": (3, string, one, ""),
    }
    assert _fields_of(descriptor, "NodePrepareResourcesRequest") == {
        "claims": (1, message, many, claim)
    }
    assert _fields_of(descriptor, "NodeUnprepareResourcesRequest") == {
        "claims": (1, message, many, claim)
    }
    for response, entry in (
        ("NodePrepareResourcesResponse", "NodePrepareResourceResponse"),
        ("NodeUnprepareResourcesResponse", "NodeUnprepareResourceResponse"),
    ):
        claims = descriptor.message_types_by_name[response].fields_by_name["claims"]
        map_entry = claims.message_type
        assert map_entry is not None and map_entry.GetOptions().map_entry
        assert claims.number == 1
        assert _fields_of_message(map_entry) == {
            "key": (1, string, one, ""),
            "value": (2, message, one, f"{package}.{entry}"),
        }
    assert _fields_of(descriptor, "NodePrepareResourceResponse") == {
        "devices": (1, message, many, f"{package}.Device"),
        "error": (2, string, one, ""),
    }
    assert _fields_of(descriptor, "NodeUnprepareResourceResponse") == {
        "error": (1, string, one, "")
    }
    device = {
        "request_names": (1, string, many, ""),
        "pool_name": (2, string, one, ""),
        "device_name": (3, string, one, ""),
        "cdi_device_ids": (4, string, many, ""),
    }
    if version == "v1":
        device["share_id"] = (5, string, one, "")
        assert descriptor.message_types_by_name["Device"].fields_by_name["share_id"].has_presence
    assert _fields_of(descriptor, "Device") == device


def test_wire_facts_of_the_kubelet_plugin_registration_api() -> None:
    """k8s.io/kubelet pkg/apis/pluginregistration/v1/api.proto (package "pluginregistration")."""
    descriptor = STUBS["pluginregistration_v1"]
    f = descriptor_pb2.FieldDescriptorProto
    assert descriptor.package == "pluginregistration"
    service = descriptor.services_by_name["Registration"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "GetInfo": ("InfoRequest", "PluginInfo"),
        "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse"),
    }
    assert _fields_of(descriptor, "PluginInfo") == {
        "type": (1, f.TYPE_STRING, False, ""),
        "name": (2, f.TYPE_STRING, False, ""),
        "endpoint": (3, f.TYPE_STRING, False, ""),
        "supported_versions": (4, f.TYPE_STRING, True, ""),
    }
    assert _fields_of(descriptor, "RegistrationStatus") == {
        "plugin_registered": (1, f.TYPE_BOOL, False, ""),
        "error": (2, f.TYPE_STRING, False, ""),
    }
    assert _fields_of(descriptor, "InfoRequest") == {}
    assert _fields_of(descriptor, "RegistrationStatusResponse") == {}


def test_proto_file_names_are_unique_in_the_descriptor_pool() -> None:
    """Upstream names every file api.proto; the pool keys on file names, so ours differ."""
    names = [d.name for d in STUBS.values()]
    assert len(set(names)) == len(names) and "api.proto" not in names
