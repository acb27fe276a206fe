"""From advertised devices to CDI specs: device_edits, resource_spec, tree_specs, specs_text."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from devplug.cdi import render
from devplug.cdi.generate import ResourceSpec, specs_text, tree_specs
from devplug.cdi.render import HostAccess, device_edits, host_access, resource_spec
from devplug.cdi.spec import (
    ContainerEdits,
    DeviceNodeEdit,
    HookEdit,
    MountEdit,
    Spec,
    SpecDevice,
    minimum_version,
    spec_document,
    spec_json,
    spec_problems,
)
from devplug.errors import CdiSpecError
from devplug.model import CdiEdits, CdiHook, DeviceInfo, DeviceNode, DeviceTree, Health, Mount

BIND_RO = ("ro", "nosuid", "nodev", "bind")
BIND_RW = ("rw", "nosuid", "nodev", "bind")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="mknod needs root")


def node_info(path: str) -> DeviceInfo:
    """A device of one node. Tests that compare whole edits use paths no machine has (no
    driver names its nodes ttyX<n> or xaccel<n>): a real node's mode and group would be in
    the edits."""
    return DeviceInfo(nodes=(DeviceNode(path),))


def intel_gpu(pci: str, card: int) -> DeviceInfo:
    return DeviceInfo(
        nodes=(DeviceNode(f"/dev/dri/card{card}"), DeviceNode(f"/dev/dri/renderD{128 + card}")),
        mounts=(
            Mount(f"/dev/dri/by-path/pci-{pci}-card"),
            Mount(f"/dev/dri/by-path/pci-{pci}-render"),
        ),
    )


# ------------------------------------------------------------------------- device_edits


def test_device_without_anything_to_give_has_empty_edits() -> None:
    edits = device_edits(
        DeviceInfo(
            annotations={"a": "b"},
            numa_nodes=(0,),
            health=Health.UNHEALTHY,
            cdi_edits=CdiEdits(),
            sources=("/sys/x",),
        )
    )
    assert edits == ContainerEdits()
    assert edits.empty


def test_host_path_is_left_out_when_it_equals_the_container_path() -> None:
    edits = device_edits(DeviceInfo(nodes=(DeviceNode("/dev/ttyX0", permissions="rw"),)))
    assert edits == ContainerEdits(
        device_nodes=(DeviceNodeEdit("/dev/ttyX0", host_path=None, permissions="rw"),)
    )
    s = Spec("example.com/serial", (SpecDevice("ttyX0", edits),))
    assert minimum_version(s) == "0.3.0"
    assert spec_document(s)["devices"][0]["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/ttyX0", "permissions": "rw"}]
    }


def test_host_path_is_kept_when_it_differs_and_needs_0_5_0() -> None:
    info = DeviceInfo(nodes=(DeviceNode("/dev/ttyX3", "/dev/ttyX0", permissions="r"),))
    edits = device_edits(info)
    assert edits.device_nodes == (
        DeviceNodeEdit("/dev/ttyX0", host_path="/dev/ttyX3", permissions="r"),
    )
    s = Spec("example.com/serial", (SpecDevice("ttyX3", edits),))
    assert spec_problems(s) == []
    assert minimum_version(s) == "0.5.0"


@pytest.mark.parametrize("permissions", ["r", "w", "m", "rw", "rwm"])
def test_node_permissions_are_carried(permissions: str) -> None:
    info = DeviceInfo(nodes=(DeviceNode("/dev/x", permissions=permissions),))
    assert device_edits(info).device_nodes[0].permissions == permissions


def test_nodes_keep_their_order_and_carry_no_type_or_numbers() -> None:
    info = DeviceInfo(nodes=(DeviceNode("/dev/b"), DeviceNode("/dev/a")))
    assert device_edits(info).device_nodes == (
        DeviceNodeEdit("/dev/b", permissions="rw"),
        DeviceNodeEdit("/dev/a", permissions="rw"),
    )


def test_mounts_become_bind_mounts() -> None:
    info = DeviceInfo(
        mounts=(
            Mount("/usr/lib/fw"),
            Mount("/var/lib/data", "/data", read_only=False),
            Mount("/etc/x", "/opt/x", read_only=True),
        )
    )
    assert device_edits(info).mounts == (
        MountEdit("/usr/lib/fw", "/usr/lib/fw", BIND_RO),
        MountEdit("/var/lib/data", "/data", BIND_RW),
        MountEdit("/etc/x", "/opt/x", BIND_RO),
    )
    # No mount type: the spec stays at the lowest version.
    assert all(m.type is None for m in device_edits(info).mounts)


def test_env_stays_out_of_the_spec() -> None:
    # Allocate carries env: the kubelet merges several devices' values for one container,
    # where CDI injection would let the last device's value win.
    info = DeviceInfo(env={"ZED": "1", "ALPHA": "a=b"}, nodes=(DeviceNode("/dev/x0"),))
    assert device_edits(info).env == ()
    assert device_edits(DeviceInfo(env={"A": "1"})).empty


def test_cdi_only_edits_are_carried() -> None:
    info = DeviceInfo(
        cdi_edits=CdiEdits(
            hooks=(
                CdiHook("createContainer", "/usr/bin/hook", ("hook", "-v"), ("X=1",), 5),
                CdiHook("poststop", "/usr/bin/clean"),
            ),
            additional_gids=(44, 107),
        )
    )
    edits = device_edits(info)
    assert edits == ContainerEdits(
        hooks=(
            HookEdit("createContainer", "/usr/bin/hook", ("hook", "-v"), ("X=1",), 5),
            HookEdit("poststop", "/usr/bin/clean", (), (), None),
        ),
        additional_gids=(44, 107),
    )
    s = Spec("example.com/xx", (SpecDevice("d0", edits),))
    assert minimum_version(s) == "0.7.0"  # additionalGids


def test_everything_together() -> None:
    info = DeviceInfo(
        nodes=(DeviceNode("/dev/xaccel0", permissions="rwm"),),
        mounts=(Mount("/usr/share/accel"),),
        env={"ACCEL": "0"},
        cdi_edits=CdiEdits(hooks=(CdiHook("createContainer", "/bin/h"),), additional_gids=(5,)),
    )
    assert device_edits(info) == ContainerEdits(
        device_nodes=(DeviceNodeEdit("/dev/xaccel0", permissions="rwm"),),
        mounts=(MountEdit("/usr/share/accel", "/usr/share/accel", BIND_RO),),
        hooks=(HookEdit("createContainer", "/bin/h"),),
        additional_gids=(5,),
    )


# ------------------------------------------------------------------------- host node access


def make_node(path: Path, mode: int, gid: int = 0, kind: int = stat.S_IFCHR) -> Path:
    """A real device node (the null device's numbers: nothing here opens it)."""
    os.mknod(path, kind | mode, os.makedev(1, 3))
    os.chmod(path, mode)  # mknod's mode went through the umask
    os.chown(path, 0, gid)
    return path


@needs_root
@pytest.mark.parametrize(
    ("mode", "gid", "kind"),
    [
        (0o600, 0, stat.S_IFCHR),
        (0o644, 0, stat.S_IFCHR),
        (0o660, 4242, stat.S_IFCHR),  # a root:render render node, say
        (0o640, 6, stat.S_IFBLK),
        (0o000, 0, stat.S_IFCHR),  # no access at all is a mode too, not "unknown"
    ],
    ids=["0600", "0644", "0660-group", "block-0640", "0000"],
)
def test_a_node_carries_the_host_nodes_mode_and_group_but_no_owner(
    tmp_path: Path, mode: int, gid: int, kind: int
) -> None:
    host = make_node(tmp_path / "node", mode, gid, kind)
    info = DeviceInfo(nodes=(DeviceNode(str(host), "/dev/node", permissions="rw"),))
    assert device_edits(info).device_nodes == (
        DeviceNodeEdit(
            "/dev/node", host_path=str(host), permissions="rw", file_mode=mode, gid=gid, uid=None
        ),
    )
    s = resource_spec("example.com/modes", {"n0": info})
    assert s is not None
    (node,) = json.loads(spec_json(s))["devices"][0]["containerEdits"]["deviceNodes"]
    assert node == {
        "path": "/dev/node",
        "hostPath": str(host),
        "fileMode": mode,
        "permissions": "rw",
        "gid": gid,
    }


@needs_root
def test_the_mode_is_the_hosts_when_the_device_is_rendered(tmp_path: Path) -> None:
    host = make_node(tmp_path / "node", 0o666)
    info = DeviceInfo(nodes=(DeviceNode(str(host), "/dev/node"),))
    os.chmod(host, 0o600)  # a udev rule's chmod after the scan
    assert device_edits(info).device_nodes[0].file_mode == 0o600


@needs_root
def test_a_node_gone_between_scan_and_render_is_rendered_without_mode_or_group(
    tmp_path: Path,
) -> None:
    host = make_node(tmp_path / "node", 0o600)
    info = DeviceInfo(nodes=(DeviceNode(str(host), "/dev/node"),))
    host.unlink()  # the device went away after the scan
    (edit,) = device_edits(info).device_nodes
    assert (edit.file_mode, edit.gid, edit.uid) == (None, None, None)
    s = resource_spec("example.com/gone", {"n0": info})
    assert s is not None and spec_problems(s) == []  # still a valid spec; no crash


def test_what_is_not_a_device_node_has_no_access(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"")
    regular.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to("/dev/null")  # a device, but behind a link the runtime will not follow
    for path in (regular, link, tmp_path, tmp_path / "missing"):
        assert host_access(str(path)) is None, path
        info = DeviceInfo(nodes=(DeviceNode(str(path), "/dev/node"),))
        assert device_edits(info).device_nodes[0].file_mode is None, path


def test_a_real_device_node_of_this_machine_has_its_access() -> None:
    # /dev/null is on every Linux machine: no root needed to see a mode carried.
    info = os.stat("/dev/null")
    assert host_access("/dev/null") == HostAccess(stat.S_IMODE(info.st_mode), info.st_gid)
    (edit,) = device_edits(node_info("/dev/null")).device_nodes
    assert (edit.file_mode, edit.gid, edit.uid) == (stat.S_IMODE(info.st_mode), info.st_gid, None)


# ------------------------------------------------------------------------- resource_spec


def test_resource_spec_lists_devices_in_natural_id_order() -> None:
    devices = {i: node_info(f"/dev/{i}") for i in ("gpu10", "gpu2", "gpu1", "gpu0", "card0")}
    s = resource_spec("example.com/gpu", devices)
    assert s is not None
    assert [d.name for d in s.devices] == ["card0", "gpu0", "gpu1", "gpu2", "gpu10"]


def test_resource_spec_shape_carries_no_annotations() -> None:
    devices = {"ttyX1": node_info("/dev/ttyX1"), "ttyX0": node_info("/dev/ttyX0")}
    s = resource_spec("vendor.io/tty", devices)
    assert s == Spec(
        kind="vendor.io/tty",
        devices=(
            SpecDevice(
                "ttyX0",
                ContainerEdits(device_nodes=(DeviceNodeEdit("/dev/ttyX0", permissions="rw"),)),
            ),
            SpecDevice(
                "ttyX1",
                ContainerEdits(device_nodes=(DeviceNodeEdit("/dev/ttyX1", permissions="rw"),)),
            ),
        ),
        edits=None,
    )
    assert spec_problems(s) == []
    # Nothing of devplug's own raises the version: plain nodes need nothing past 0.3.0, which
    # every CDI library accepts (Debian 12's podman 4.3 refused devplug's 0.6.0 specs whole).
    assert minimum_version(s) == "0.3.0"


def test_shares_of_one_device_info_are_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[DeviceInfo] = []
    real = render.device_edits

    def counting(info: DeviceInfo) -> ContainerEdits:
        calls.append(info)
        return real(info)

    monkeypatch.setattr(render, "device_edits", counting)
    gpu = intel_gpu("0000:03:00.0", 0)
    other = node_info("/dev/x")
    devices = {"card0-0": gpu, "card0-1": gpu, "card0-2": gpu, "x": other}
    s = resource_spec("gpu.intel.com/i915", devices)
    assert s is not None
    assert [d.name for d in s.devices] == ["card0-0", "card0-1", "card0-2", "x"]
    assert s.devices[0].edits == s.devices[1].edits == s.devices[2].edits == real(gpu)
    assert s.devices[3].edits == real(other)
    assert len(calls) == 2 and calls[0] is gpu and calls[1] is other


def test_equal_but_distinct_device_infos_each_get_their_edits() -> None:
    devices = {"a": node_info("/dev/a"), "b": node_info("/dev/b")}
    s = resource_spec("example.com/xx", devices)
    assert s is not None
    assert [d.edits.device_nodes[0].path for d in s.devices] == ["/dev/a", "/dev/b"]


def test_devices_with_nothing_to_give_are_left_out() -> None:
    devices = {
        "d0": DeviceInfo(),
        "d1": node_info("/dev/d1"),
        "d2": DeviceInfo(annotations={"k": "v"}, cdi_edits=CdiEdits()),
        "d3": DeviceInfo(env={"A": "1"}),  # env alone: nothing for the spec
    }
    s = resource_spec("example.com/xx", devices)
    assert s is not None
    assert [d.name for d in s.devices] == ["d1"]


def test_no_spec_when_no_device_has_anything_to_give() -> None:
    devices = {"d0": DeviceInfo(), "d1": DeviceInfo(annotations={"k": "v"})}
    assert resource_spec("example.com/xx", devices) is None
    assert resource_spec("example.com/xx", {}) is None


def test_resource_spec_refuses_ids_that_are_not_cdi_names() -> None:
    with pytest.raises(CdiSpecError, match="'bad id' is not a CDI device name"):
        resource_spec("example.com/xx", {"bad id": node_info("/dev/x")})


def test_resource_spec_order_does_not_depend_on_insertion_order() -> None:
    a, b = node_info("/dev/a"), node_info("/dev/b")
    one = resource_spec("example.com/xx", {"gpu01": a, "gpu1": b})
    two = resource_spec("example.com/xx", {"gpu1": b, "gpu01": a})
    assert one is not None and two is not None
    assert spec_json(one) == spec_json(two)


def test_intel_gpu_like_spec() -> None:
    devices = {
        "0000:4d:00.0": intel_gpu("0000:4d:00.0", 1),
        "0000:03:00.0": intel_gpu("0000:03:00.0", 0),
    }
    s = resource_spec("gpu.intel.com/i915", devices)
    assert s is not None
    assert spec_problems(s) == []
    assert minimum_version(s) == "0.5.0"  # device names that start with a digit
    assert json.loads(spec_json(s)) == {
        "cdiVersion": "0.5.0",
        "kind": "gpu.intel.com/i915",
        "devices": [
            {
                "name": "0000:03:00.0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/dri/card0", "permissions": "rw"},
                        {"path": "/dev/dri/renderD128", "permissions": "rw"},
                    ],
                    "mounts": [
                        {
                            "hostPath": "/dev/dri/by-path/pci-0000:03:00.0-card",
                            "containerPath": "/dev/dri/by-path/pci-0000:03:00.0-card",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        },
                        {
                            "hostPath": "/dev/dri/by-path/pci-0000:03:00.0-render",
                            "containerPath": "/dev/dri/by-path/pci-0000:03:00.0-render",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        },
                    ],
                },
            },
            {
                "name": "0000:4d:00.0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/dri/card1", "permissions": "rw"},
                        {"path": "/dev/dri/renderD129", "permissions": "rw"},
                    ],
                    "mounts": [
                        {
                            "hostPath": "/dev/dri/by-path/pci-0000:4d:00.0-card",
                            "containerPath": "/dev/dri/by-path/pci-0000:4d:00.0-card",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        },
                        {
                            "hostPath": "/dev/dri/by-path/pci-0000:4d:00.0-render",
                            "containerPath": "/dev/dri/by-path/pci-0000:4d:00.0-render",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        },
                    ],
                },
            },
        ],
    }


# ------------------------------------------------------------------------- tree_specs


def sample_tree() -> DeviceTree:
    return DeviceTree(
        {
            "gpu.intel.com/i915": {"0000:03:00.0": intel_gpu("0000:03:00.0", 0)},
            "example.com/serial": {
                "ttyUSB0": node_info("/dev/ttyUSB0"),
                "ttyUSB1": node_info("/dev/ttyUSB1"),
            },
            "example.com/nothing": {"d0": DeviceInfo(), "d1": DeviceInfo(env={})},
            "3d.example.com/cam": {"video0": node_info("/dev/video0")},
        }
    )


def test_tree_specs_one_spec_per_resource_with_something_to_give() -> None:
    tree = sample_tree()
    specs = tree_specs(tree, {})
    assert sorted(specs) == [
        "example.com-serial.json",
        "gpu.intel.com-i915.json",
        "x3d.example.com-cam.json",
    ]
    for name, resource, kind in (
        ("example.com-serial.json", "example.com/serial", "example.com/serial"),
        ("gpu.intel.com-i915.json", "gpu.intel.com/i915", "gpu.intel.com/i915"),
        ("x3d.example.com-cam.json", "3d.example.com/cam", "x3d.example.com/cam"),
    ):
        assert specs[name] == (resource, resource_spec(kind, tree[resource]))
    assert [d.name for d in specs["example.com-serial.json"].spec.devices] == [
        "ttyUSB0",
        "ttyUSB1",
    ]


def test_tree_specs_of_an_empty_tree() -> None:
    assert tree_specs(DeviceTree(), {}) == {}


def test_tree_specs_kinds_override_the_default() -> None:
    kinds = {"example.com/serial": "vendor.io/tty", "example.com/unused": "vendor.io/unused"}
    specs = tree_specs(sample_tree(), kinds)
    assert sorted(specs) == [
        "gpu.intel.com-i915.json",
        "vendor.io-tty.json",
        "x3d.example.com-cam.json",
    ]
    assert specs["vendor.io-tty.json"].spec.kind == "vendor.io/tty"
    assert specs["vendor.io-tty.json"].resource == "example.com/serial"


def test_tree_specs_empty_kind_means_the_default() -> None:
    specs = tree_specs(sample_tree(), {"example.com/serial": ""})
    assert specs["example.com-serial.json"].spec.kind == "example.com/serial"


def test_two_resources_on_one_file_by_default_kinds() -> None:
    # Different kinds, same "<vendor>-<class>.json".
    tree = DeviceTree(
        {"a.io/bb-cc": {"d0": node_info("/dev/d0")}, "a.io-bb/cc": {"d0": node_info("/dev/d0")}}
    )
    with pytest.raises(CdiSpecError) as caught:
        tree_specs(tree, {})
    message = str(caught.value)
    assert "a.io/bb-cc" in message and "a.io-bb/cc" in message and "a.io-bb-cc.json" in message
    assert "cdi.kinds" in message


def test_two_resources_on_one_file_by_the_x_prefix() -> None:
    tree = DeviceTree(
        {
            "3d.example.com/cam": {"v0": node_info("/dev/video0")},
            "x3d.example.com/cam": {"v1": node_info("/dev/video1")},
        }
    )
    with pytest.raises(CdiSpecError, match=r"x3d\.example\.com-cam\.json") as caught:
        tree_specs(tree, {})
    assert "3d.example.com/cam and x3d.example.com/cam" in str(caught.value)
    # Giving one of them its own kind resolves it.
    specs = tree_specs(tree, {"3d.example.com/cam": "example.com/cam3d"})
    assert sorted(specs) == ["example.com-cam3d.json", "x3d.example.com-cam.json"]


def test_two_resources_on_one_file_by_configured_kinds() -> None:
    tree = DeviceTree(
        {"example.com/a": {"d0": node_info("/dev/a")}, "example.com/b": {"d0": node_info("/dev/b")}}
    )
    kinds = {"example.com/a": "example.com/xx", "example.com/b": "example.com/xx"}
    with pytest.raises(CdiSpecError) as caught:
        tree_specs(tree, kinds)
    assert "example.com/a and example.com/b would share the spec file example.com-xx.json" in str(
        caught.value
    )


@pytest.mark.parametrize(
    "kind", ["serial", "1vendor.com/serial", "example.com/se:rial", "ab/cd/ef"]
)
def test_tree_specs_refuses_an_invalid_kind(kind: str) -> None:
    with pytest.raises(CdiSpecError, match="invalid kind") as caught:
        tree_specs(sample_tree(), {"example.com/serial": kind})
    assert repr(kind) in str(caught.value)


# ------------------------------------------------------------------------- specs_text


def test_specs_text_maps_file_names_to_spec_documents() -> None:
    specs = tree_specs(sample_tree(), {})
    text = specs_text(specs)
    assert text.endswith("}\n") and not text.endswith("\n\n")
    document = json.loads(text)
    assert list(document) == [
        "example.com-serial.json",
        "gpu.intel.com-i915.json",
        "x3d.example.com-cam.json",
    ]
    assert document["example.com-serial.json"] == {
        "cdiVersion": "0.3.0",
        "kind": "example.com/serial",
        "devices": [
            {
                "name": "ttyUSB0",
                "containerEdits": {"deviceNodes": [{"path": "/dev/ttyUSB0", "permissions": "rw"}]},
            },
            {
                "name": "ttyUSB1",
                "containerEdits": {"deviceNodes": [{"path": "/dev/ttyUSB1", "permissions": "rw"}]},
            },
        ],
    }
    for name, (_, spec) in specs.items():
        assert document[name] == json.loads(spec_json(spec))


def test_specs_text_of_no_specs() -> None:
    assert json.loads(specs_text({})) == {}


def test_specs_text_refuses_an_invalid_spec() -> None:
    # The builder validates each device as it makes it: the bad hook never reaches a spec.
    bad_hook = DeviceInfo(cdi_edits=CdiEdits(hooks=(CdiHook("preStart", "/bin/h"),)))
    with pytest.raises(CdiSpecError, match="invalid hook name 'preStart'"):
        tree_specs(DeviceTree({"example.com/xx": {"d0": bad_hook}}), {})
    bad_spec = Spec("example.com/xx", (SpecDevice("d0", device_edits(bad_hook)),))
    with pytest.raises(CdiSpecError, match="invalid hook name 'preStart'"):
        specs_text({"example.com-xx.json": ResourceSpec("example.com/xx", bad_spec)})
    with pytest.raises(CdiSpecError, match="no devices"):
        specs_text(
            {"example.com-xx.json": ResourceSpec("example.com/xx", Spec("example.com/xx", ()))}
        )
