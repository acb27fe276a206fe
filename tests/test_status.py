"""``devplug status`` against a running daemon, another vendor's plugin and a dead socket."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from helpers import run_devplug

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.cli.dra_status import DraDriverStatus, dra_table
from devplug.cli.holders import DeviceRow, PodsStatus, devices_table
from devplug.cli.status import resource_of_socket
from devplug.dra.checkpoint import PreparedClaim
from devplug.kubelet.podresources import Holder
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import KubeletSimulator, daemon_process, daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner
from devplug.testing.umockdev import UmockdevHost, add_usb_serial


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


async def devplug_status(*args: str, expect: int = 0, cwd: Path | None = None) -> str:
    code, out, err = await run_devplug("status", *args, cwd=cwd)
    assert code == expect, err
    return out


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
            # stale.sock does not answer: exit status 1, for scripts and probes.
            document = json.loads(
                await devplug_status("--kubelet-dir", str(kubelet_dir), "-o", "json", expect=1)
            )
            as_yaml = yaml.safe_load(
                await devplug_status("--kubelet-dir", str(kubelet_dir), "-o", "yaml", expect=1)
            )
            table = await devplug_status("--kubelet-dir", str(kubelet_dir), expect=1)
    finally:
        await vendor.stop(None)
    assert as_yaml == document
    plugins = {p["socket"]: p for p in document["plugins"]}
    assert sorted(plugins) == ["devplug-example.com_serial.sock", "stale.sock", "vendor.sock"]
    ours = plugins["devplug-example.com_serial.sock"]
    assert ours["resource"] == "example.com/serial"
    assert (ours["healthy"], ours["unhealthy"], ours["numa_nodes"]) == (1, 1, [0])
    assert ours["preferred_allocation"] is True and ours["error"] is None
    theirs = plugins["vendor.sock"]
    assert theirs["resource"] is None and (theirs["healthy"], theirs["unhealthy"]) == (2, 1)
    assert theirs["pre_start"] is True and theirs["numa_nodes"] == [1]
    stale = plugins["stale.sock"]
    assert stale["error"].startswith("UNAVAILABLE") and stale["state"] == "not answering"
    # Nobody answered: what it holds is unknown, not zero.
    assert (stale["healthy"], stale["unhealthy"], stale["numa_nodes"]) == (None, None, None)
    assert ours["state"] == theirs["state"] == "serving"
    assert document["kubelet"] == {
        "socket": str(kubelet_dir / "kubelet.sock"),
        "state": "listening",
        "error": None,
    }

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
    assert ["stale.sock", "-", "unknown", "unknown", "unknown", "UNAVAILABLE:"] in [
        row[:6] for row in rows
    ]
    assert table.splitlines()[-1] == f"kubelet: listening on {kubelet_dir / 'kubelet.sock'}"


async def test_an_empty_dir_says_so_and_that_there_is_no_kubelet(kubelet_dir: Path) -> None:
    out = await devplug_status("--kubelet-dir", str(kubelet_dir))
    assert out.splitlines() == [
        f"no device plugin sockets in {kubelet_dir}",
        f"kubelet: no kubelet.sock in {kubelet_dir}: plugins register once it starts "
        "(devplug creates its sockets then)",
    ]


async def test_a_file_in_the_kubelets_place_is_not_a_socket(kubelet_dir: Path) -> None:
    kubelet_dir.mkdir(exist_ok=True)
    (kubelet_dir / "kubelet.sock").write_text("")  # not the kubelet down: nothing to wait for
    out = await devplug_status("--kubelet-dir", str(kubelet_dir))
    assert out.splitlines()[-1] == f"kubelet: {kubelet_dir / 'kubelet.sock'} is not a socket"


async def serving_vendor_plugin(path: Path) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(VendorPlugin(), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


async def test_a_plugin_serving_without_a_kubelet_is_waiting_for_it(kubelet_dir: Path) -> None:
    """No kubelet.sock, then one nobody listens on (a kubelet down): the plugin answers, but
    it cannot be registered, and status says so rather than 'serving'."""
    vendor = await serving_vendor_plugin(kubelet_dir / "vendor.sock")
    try:
        absent = json.loads(await devplug_status("--kubelet-dir", str(kubelet_dir), "-o", "json"))
        gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        gone.bind(str(kubelet_dir / "kubelet.sock"))
        gone.close()
        down = json.loads(await devplug_status("--kubelet-dir", str(kubelet_dir), "-o", "json"))
        table = await devplug_status("--kubelet-dir", str(kubelet_dir))
    finally:
        await vendor.stop(None)
    assert absent["kubelet"]["state"] == "absent"
    assert down["kubelet"]["state"] == "not answering" and down["kubelet"]["error"]
    for document in (absent, down):
        (plugin,) = document["plugins"]
        assert plugin["state"] == "serving, waiting for the kubelet"
        assert (plugin["healthy"], plugin["unhealthy"]) == (2, 1)
    row = table.splitlines()[1]
    assert row.split()[:5] == ["vendor.sock", "-", "2", "1", "1"]
    assert row.endswith("serving, waiting for the kubelet")
    assert table.splitlines()[-1].startswith(f"kubelet: {kubelet_dir / 'kubelet.sock'} does not")


def serial_scanner() -> StaticScanner:
    info = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
    return StaticScanner({"example.com/serial": {"dev0": info}})


async def test_a_relative_kubelet_dir_flag_or_variable_works(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [serial_scanner()]):
        await (await kubelet.wait_for_plugin("example.com/serial")).wait_for_update()
        flag = await run_devplug(
            "status", "--kubelet-dir", kubelet_dir.name, cwd=kubelet_dir.parent
        )
        variable = await run_devplug(
            "status", cwd=kubelet_dir.parent, env={"DEVPLUG_KUBELET_DIR": kubelet_dir.name}
        )
    for code, out, err in (flag, variable):
        assert (code, err) == (0, "")
        assert out.splitlines()[1].split()[-1] == "serving"


async def test_all_serving_exits_0_and_a_dead_plugin_exits_1(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [serial_scanner()]):
        await (await kubelet.wait_for_plugin("example.com/serial")).wait_for_update()
        assert (await run_devplug("status", "--kubelet-dir", str(kubelet_dir)))[0] == 0
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(kubelet_dir / "dead.sock"))
        dead.close()
        code, out, _ = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    assert code == 1
    assert "UNAVAILABLE" in out and "serving" in out


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
async def test_a_timeout_that_is_not_a_positive_number_is_refused(
    kubelet_dir: Path, timeout: str
) -> None:
    code, out, err = await run_devplug(
        "status", "--kubelet-dir", str(kubelet_dir), "--timeout", timeout
    )
    assert (code, out) == (2, "")
    assert "--timeout" in err


async def test_a_kubelet_dir_that_is_a_file_is_not_a_directory(short_dir: Path) -> None:
    file = short_dir / "file"
    file.write_text("")
    code, _, err = await run_devplug("status", "--kubelet-dir", str(file))
    assert code == 2
    assert err == f"devplug: --kubelet-dir: {file} is not a directory\n"


async def test_a_socket_left_by_a_killed_devplug_is_cleaned_at_its_next_start(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    add_usb_serial(host, index=0)
    config = short_dir / "config.yaml"
    config.write_text(
        "scanners:\n  generic:\n    - resource: example.com/serial\n"
        "      match: {subsystem: tty, devnode: /dev/ttyUSB*}\n"
    )
    socket_path = kubelet_dir / "devplug-example.com_serial.sock"
    async with daemon_process(config, kubelet_dir, env=host.env()) as process:
        first = await kubelet.wait_for_plugin("example.com/serial", timeout=30)
        await first.wait_for_update()
        process.send_signal(signal.SIGKILL)
        await process.wait()
    assert socket_path.exists()  # left behind: nothing listens on it
    code, out, _ = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    assert code == 1 and "UNAVAILABLE" in out
    async with daemon_process(config, kubelet_dir, env=host.env()):
        again = await kubelet.wait_for_plugin("example.com/serial", replacing=first, timeout=30)
        await again.wait_for_update()
        code, out, err = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, out + err
    assert out.splitlines()[1].split()[-1] == "serving"


# What a hostile plugin or kubelet could send to forge a row, recolour or retitle the terminal.
FORGED = (
    "ok\x1b[31m\rdevplug-example.com_serial.sock  example.com/serial  9  0  0  serving"
    "\x1b]0;pwned\x07"
)


class HostilePlugin(VendorPlugin):
    """A plugin whose every answer is an error made of terminal escapes and a carriage return."""

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: Any
    ) -> pb.DevicePluginOptions:
        await context.abort(grpc.StatusCode.INTERNAL, FORGED)
        raise AssertionError("abort raises")


async def test_plugin_supplied_text_is_printed_escaped(kubelet_dir: Path) -> None:
    """Issue 25 review (/tmp/review25/evilplugin.py): status printed another plugin's error
    details raw, so `devplug status | cat -v` showed a forged 'serving' row. Now the socket's
    name and the error are escaped as the kubelet stand-in escapes plugin text: one row,
    no control character, the forged text visible as escapes."""
    name = "evil\x1b[2J.sock"
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(HostilePlugin(), server)
    server.add_insecure_port(f"unix://{kubelet_dir / name}")
    await server.start()
    try:
        code, table, _ = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
        _, document, _ = await run_devplug(
            "status", "--kubelet-dir", str(kubelet_dir), "-o", "json"
        )
    finally:
        await server.stop(None)
    assert code == 1  # the plugin did not answer
    assert not any(char in table for char in "\x1b\r\x07")
    header, row, kubelet_line = table.splitlines()  # no forged row
    assert header.startswith("SOCKET") and kubelet_line.startswith("kubelet: ")
    assert row.split()[:5] == ["evil\\x1b[2J.sock", "-", "unknown", "unknown", "unknown"]
    assert row.endswith(
        "INTERNAL: ok\\x1b[31m\\rdevplug-example.com_serial.sock  "
        "example.com/serial  9  0  0  serving\\x1b]0;pwned\\x07"
    )
    (plugin,) = json.loads(document)["plugins"]  # JSON escapes by itself: the text as sent
    assert plugin["socket"] == name and plugin["error"] == f"INTERNAL: {FORGED}"


def test_pod_and_container_names_from_the_kubelet_are_printed_escaped() -> None:
    """``status --pods``: pod and container names (the kubelet's) and device ids and health
    (a plugin's) are foreign text too."""
    holder = Holder("default", "pod\x1b[2K\rforged", "main\n")
    row = DeviceRow("example.com/serial", "d0\x1b[31m", "Healthy\r", (), (holder,))
    status = PodsStatus(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"), "available", None, None, 1, (row,), {}
    )
    table = devices_table(status)
    assert not any(char in table for char in "\x1b\r")
    header, line, last = table.splitlines()
    assert header.split() == ["RESOURCE", "DEVICE", "HEALTH", "HELD", "BY"]
    assert line.split() == [
        "example.com/serial",
        "d0\\x1b[31m",
        "Healthy\\r",
        "default/pod\\x1b[2K\\rforged/main\\n",
    ]
    assert last.startswith("pod resources: 1 pods")


def test_dra_driver_text_is_printed_escaped() -> None:
    """The DRA table: another driver's name (its GetInfo answer), its socket's name, its error
    and a claim's names are printed escaped too."""
    claim = PreparedClaim("default", "claim\r\x1b[2K", "uid-1", ())
    driver = DraDriverStatus(
        "/var/lib/kubelet/plugins_registry/x\x1b]0;t\x07.sock",
        "evil.example.com\x1b[31m",
        error=f"UNAVAILABLE: {FORGED}",
    )
    mine = DraDriverStatus("/r/devplug.sock", "devplug.example.com", claims={"uid-1": claim})
    table = dra_table([driver, mine])
    assert not any(char in table for char in "\x1b\r\x07")
    lines = table.splitlines()
    assert len(lines) == 4  # the header, two drivers, one claim: nothing forged
    assert lines[1].startswith("evil.example.com\\x1b[31m  /var/lib/kubelet/plugins_registry/x")
    assert lines[3] == "devplug.example.com: default/claim\\r\\x1b[2K holds"
