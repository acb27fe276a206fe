"""Real pyudev against testbeds built by devplug.testing.umockdev.

Run the process under ``umockdev-wrapper`` (it preloads libumockdev-preload.so.0); the tests
that need the preload in-process are skipped otherwise, the file-layout ones always run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pyudev

import devplug
from devplug.testing.umockdev import (
    MockNode,
    UeventQueueFullError,
    UmockdevHost,
    add_intel_gpu,
    add_pci_device,
    add_usb_serial,
    encode_udev_message,
    preload_active,
)

GPU0 = "/sys/devices/pci0000:00/0000:00:02.0"
GPU1 = "/sys/devices/pci0000:00/0000:00:03.0"

needs_preload = pytest.mark.skipif(
    not preload_active(), reason="needs libumockdev-preload: run under umockdev-wrapper"
)


@pytest.fixture
def host(tmp_path: Path) -> UmockdevHost:
    return UmockdevHost(tmp_path / "testbed")


@pytest.fixture
def active(host: UmockdevHost) -> Iterator[UmockdevHost]:
    if not preload_active():
        pytest.skip("needs libumockdev-preload: run under umockdev-wrapper")
    with host.activated():
        yield host


def _two_gpus(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128, numa_node=0, iommu_group=5)
    add_intel_gpu(host, "0000:00:03.0", card=1, render=None, device_id="0x56a1", numa_node=1)


class _Collector:
    """Reads a started pyudev Monitor from the event loop, as the daemon does."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor
        self.events: list[tuple[str, str, dict[str, str]]] = []
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._loop.add_reader(monitor.fileno(), self._drain)

    def _drain(self) -> None:
        while (device := self.monitor.poll(timeout=0)) is not None:
            self.events.append((device.action, device.sys_path, dict(device.properties)))
        self._changed.set()

    async def wait_for(self, count: int, timeout: float = 2.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.events) < count:
                self._changed.clear()
                await self._changed.wait()

    def close(self) -> None:
        self._loop.remove_reader(self.monitor.fileno())


def _monitor(source: str, subsystem: str | None = None, tag: str | None = None) -> Any:
    monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
    if subsystem is not None:
        monitor.filter_by(subsystem)
    if tag is not None:
        monitor.filter_by_tag(tag)
    monitor.start()
    return monitor


# --------------------------------------------------------------------- enumeration


def test_enumerate_by_subsystem_with_properties_and_attributes(active: UmockdevHost) -> None:
    _two_gpus(active)
    tty = add_usb_serial(active, index=0, serial="FT1")
    context = pyudev.Context()

    drm = {d.sys_name: d for d in context.list_devices(subsystem="drm")}
    assert sorted(drm) == ["card0", "card1", "renderD128"]
    card0 = drm["card0"]
    assert card0.device_node == "/dev/dri/card0"
    assert card0.device_type == "drm_minor"
    assert card0.properties["MAJOR"] == "226"
    assert drm["renderD128"].properties["MINOR"] == "128"

    pci = {d.sys_name: d for d in context.list_devices(subsystem="pci")}
    gpu = pci["0000:00:02.0"]
    assert gpu.sys_path == GPU0
    assert gpu.driver == "i915"
    assert gpu.properties["PCI_ID"] == "8086:56A0"
    assert gpu.properties["PCI_SLOT_NAME"] == "0000:00:02.0"
    assert gpu.properties["MODALIAS"].startswith("pci:v00008086d000056A0")
    assert gpu.attributes.asstring("vendor") == "0x8086"
    assert gpu.attributes.asstring("class") == "0x030000"
    assert pci["0000:00:03.0"].attributes.asstring("device") == "0x56a1"

    (serial,) = context.list_devices(subsystem="tty")
    assert serial.sys_path == tty
    assert serial.device_node == "/dev/ttyUSB0"
    assert serial.properties["ID_VENDOR_ID"] == "0403"
    assert serial.properties["ID_SERIAL_SHORT"] == "FT1"
    usb = serial.find_parent("usb", "usb_device")
    assert usb is not None
    assert usb.attributes.asstring("idProduct") == "6001"


def test_find_parent_pci_from_drm_child(active: UmockdevHost) -> None:
    _two_gpus(active)
    card1 = pyudev.Devices.from_sys_path(pyudev.Context(), f"{GPU1}/drm/card1")
    parent = card1.find_parent("pci")
    assert parent is not None
    assert parent.sys_path == GPU1
    assert parent.attributes.asint("numa_node") == 1
    assert parent.attributes.asstring("device") == "0x56a1"
    assert parent.properties["DRIVER"] == "i915"


def test_node_stat_reports_char_and_block_devices(active: UmockdevHost) -> None:
    _two_gpus(active)
    active.add_device(
        "/sys/devices/virtual/block/loop7",
        "block",
        properties={"DEVTYPE": "disk"},
        node=MockNode("/dev/loop7", 7, 7, "b"),
    )
    render = os.stat("/dev/dri/renderD128")
    assert stat.S_ISCHR(render.st_mode)
    assert (os.major(render.st_rdev), os.minor(render.st_rdev)) == (226, 128)
    card1 = os.stat("/dev/dri/card1")
    assert (os.major(card1.st_rdev), os.minor(card1.st_rdev)) == (226, 1)
    loop = os.stat("/dev/loop7")
    assert stat.S_ISBLK(loop.st_mode)
    assert (os.major(loop.st_rdev), os.minor(loop.st_rdev)) == (7, 7)


def test_devices_from_device_file(active: UmockdevHost) -> None:
    _two_gpus(active)
    context = pyudev.Context()
    device = pyudev.Devices.from_device_file(context, "/dev/dri/renderD128")
    assert device.sys_path == f"{GPU0}/drm/renderD128"
    assert device.find_parent("pci").sys_path == GPU0


def test_iommu_group_link_basename(active: UmockdevHost) -> None:
    _two_gpus(active)
    assert os.path.basename(os.readlink(f"{GPU0}/iommu_group")) == "5"
    assert not os.path.lexists(f"{GPU1}/iommu_group")
    gpu = pyudev.Devices.from_sys_path(pyudev.Context(), GPU0)
    assert "iommu_group" in gpu.attributes.available_attributes


def test_devlinks_resolve_to_the_node(active: UmockdevHost) -> None:
    _two_gpus(active)
    link = "/dev/dri/by-path/pci-0000:00:02.0-render"
    assert os.path.islink(link)
    assert os.path.realpath(link) == "/dev/dri/renderD128"
    st = os.stat(link)  # follows the link; the preload needs a .node entry for its name
    assert stat.S_ISCHR(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (226, 128)
    device = pyudev.Devices.from_device_file(pyudev.Context(), link)
    assert device.sys_name == "renderD128"
    assert device.properties["DEVLINKS"] == link


def test_set_attribute_and_property_seen_by_fresh_enumeration(active: UmockdevHost) -> None:
    _two_gpus(active)
    active.set_attribute(GPU0, "sriov_numvfs", "3")
    active.set_attribute(GPU0, "numa_node", b"1\n")
    active.set_property(f"{GPU0}/drm/card0", "ID_PATH", "pci-0000:00:02.0")
    active.set_property(GPU0, "PCI_SLOT_NAME", None)
    gpu = pyudev.Devices.from_sys_path(pyudev.Context(), GPU0)
    assert gpu.attributes.asint("sriov_numvfs") == 3
    assert gpu.attributes.asstring("numa_node").strip() == "1"
    assert "PCI_SLOT_NAME" not in gpu.properties
    card = pyudev.Devices.from_sys_path(pyudev.Context(), f"{GPU0}/drm/card0")
    assert card.properties["ID_PATH"] == "pci-0000:00:02.0"


def test_set_driver_rebinds(active: UmockdevHost) -> None:
    _two_gpus(active)
    active.set_driver(GPU1, "vfio-pci")
    gpu = pyudev.Devices.from_sys_path(pyudev.Context(), GPU1)
    assert gpu.driver == "vfio-pci"
    assert gpu.properties["DRIVER"] == "vfio-pci"
    assert os.path.basename(os.readlink(f"{GPU1}/driver")) == "vfio-pci"
    active.set_driver(GPU1, None)
    gpu = pyudev.Devices.from_sys_path(pyudev.Context(), GPU1)
    assert gpu.driver is None
    assert "DRIVER" not in gpu.properties


def test_remove_device_vanishes_with_children_and_nodes(active: UmockdevHost) -> None:
    _two_gpus(active)
    removed = active.remove_device(GPU0)
    assert removed[-1] == GPU0
    assert set(removed[:-1]) == {f"{GPU0}/drm/card0", f"{GPU0}/drm/renderD128"}
    context = pyudev.Context()
    assert [d.sys_name for d in context.list_devices(subsystem="drm")] == ["card1"]
    assert [d.sys_name for d in context.list_devices(subsystem="pci")] == ["0000:00:03.0"]
    with pytest.raises(pyudev.DeviceNotFoundAtPathError):
        pyudev.Devices.from_sys_path(context, f"{GPU0}/drm/card0")
    # A missing /dev path falls through to the real /dev, so check the testbed itself.
    dev = active.root / "dev"
    assert not (dev / "dri" / "card0").exists()
    assert not (dev / "dri" / "renderD128").exists()
    assert not (dev / "dri" / "by-path" / "pci-0000:00:02.0-card").is_symlink()
    assert not (dev / ".node" / "dri_card0").is_symlink()
    assert (dev / "dri" / "card1").exists()
    assert not active.has_device(GPU0)
    active.remove_device(GPU1)
    # dev/dri stays, so /dev/dri keeps showing the (now empty) mock, not the host's.
    assert [n for n in os.listdir("/dev/dri") if n != "by-path"] == []


def test_removal_order_is_children_first_and_removes_nothing(active: UmockdevHost) -> None:
    _two_gpus(active)
    order = active.removal_order(GPU0)
    assert order[-1] == GPU0
    assert set(order[:-1]) == {f"{GPU0}/drm/card0", f"{GPU0}/drm/renderD128"}
    assert active.removal_order(f"{GPU0}/drm/card0") == [f"{GPU0}/drm/card0"]
    assert all(active.has_device(path) for path in order)


def test_add_dev_dir_hides_the_host_directory(active: UmockdevHost) -> None:
    active.add_dev_dir("/dev/input")
    assert os.listdir("/dev/input") == []


# --------------------------------------------------------------------- events


async def test_monitor_receives_emitted_events(active: UmockdevHost) -> None:
    _two_gpus(active)
    collectors = [_Collector(_monitor("udev")), _Collector(_monitor("kernel"))]
    card = f"{GPU0}/drm/card0"
    try:
        sent = [
            ("add", card),
            ("change", card),
            ("unbind", GPU0),
            ("bind", GPU0),
        ]
        for action, path in sent:
            assert active.emit(action, path) == 2
        for path in active.remove_device(GPU0):
            assert active.emit("remove", path) == 2
            sent.append(("remove", path))
        for collector in collectors:
            await collector.wait_for(len(sent))
            assert [(a, p) for a, p, _ in collector.events] == sent
            props = collector.events[0][2]
            assert props["DEVNAME"] == "/dev/dri/card0"
            assert props["SUBSYSTEM"] == "drm"
            assert props["DEVTYPE"] == "drm_minor"
            assert collector.events[2][2]["DRIVER"] == "i915"
            assert collector.events[4][2]["DEVNAME"].startswith("/dev/dri/")  # removed device
            seqnums = [int(props["SEQNUM"]) for _, _, props in collector.events]
            assert seqnums == sorted(seqnums)
            assert len(set(seqnums)) == len(seqnums)
    finally:
        for collector in collectors:
            collector.close()


async def test_unplug_sends_each_event_before_its_device_leaves_sysfs(
    active: UmockdevHost,
) -> None:
    """The kernel's order: children first; a device's node goes before its event, a bound
    driver's ``unbind`` comes before ``remove``, and the sysfs dir goes after the event (here
    only after ``linger_s``, so that what a reader finds meanwhile can be checked)."""
    _two_gpus(active)
    collector = _Collector(_monitor("kernel"))
    order = active.removal_order(GPU0)
    unplugging = asyncio.create_task(active.unplug(GPU0, linger_s=3600))
    try:
        await collector.wait_for(4)
        assert [(a, p) for a, p, _ in collector.events] == [
            ("remove", order[0]),
            ("remove", order[1]),
            ("unbind", GPU0),
            ("remove", GPU0),
        ]
        assert "DRIVER" not in collector.events[3][2]
        # Every event is out, and sysfs still shows every device...
        assert all(os.path.isfile(f"{path}/uevent") for path in order)
        # ...but their nodes went before their events, as devtmpfs deletes them first.
        dev = active.root / "dev"
        assert not (dev / "dri" / "card0").exists()
        assert not (dev / "dri" / "renderD128").exists()
        assert (dev / "dri" / "card1").exists()
    finally:
        unplugging.cancel()
        collector.close()
    with pytest.raises(asyncio.CancelledError):
        await unplugging
    assert active.remove_device(GPU0) == order


async def test_unplug_leaves_no_trace_of_the_device(active: UmockdevHost) -> None:
    _two_gpus(active)
    collector = _Collector(_monitor("udev"))
    try:
        order = await active.unplug(GPU0)
        await collector.wait_for(4)
    finally:
        collector.close()
    assert [a for a, _, _ in collector.events] == ["remove", "remove", "unbind", "remove"]
    assert order[-1] == GPU0
    assert not any(active.has_device(path) or os.path.exists(path) for path in order)
    assert [d.sys_name for d in pyudev.Context().list_devices(subsystem="drm")] == ["card1"]
    assert not (active.root / "dev" / "dri" / "by-path" / "pci-0000:00:02.0-card").is_symlink()


async def test_monitor_filters_match_the_header_hashes(active: UmockdevHost) -> None:
    _two_gpus(active)
    tty = add_usb_serial(active, index=1)
    by_subsystem = _Collector(_monitor("udev", subsystem="drm"))
    by_tag = _Collector(_monitor("udev", tag="uaccess"))
    try:
        active.emit("change", GPU0)
        active.emit("change", tty)
        active.emit("change", f"{GPU0}/drm/card0")
        active.emit("change", tty, {"TAGS": ":seat:uaccess:"})
        await by_subsystem.wait_for(1)
        await by_tag.wait_for(1)
        await asyncio.sleep(0.05)  # anything filtered wrongly would have arrived by now
        assert [p for _, p, _ in by_subsystem.events] == [f"{GPU0}/drm/card0"]
        assert [p for _, p, _ in by_tag.events] == [tty]
    finally:
        by_subsystem.close()
        by_tag.close()


async def test_emit_async_burst_loses_nothing(active: UmockdevHost) -> None:
    _two_gpus(active)
    collector = _Collector(_monitor("udev"))
    card = f"{GPU0}/drm/card0"
    try:
        # 30 > the 11 datagrams an undrained socket holds: emit_async must wait for the loop.
        for i in range(30):
            assert await active.emit_async("change", card, {"DEVPLUG_I": str(i)}) == 1
        await collector.wait_for(30)
        assert [props["DEVPLUG_I"] for _, _, props in collector.events] == [
            str(i) for i in range(30)
        ]
    finally:
        collector.close()


def test_emit_to_full_queue_raises_instead_of_aborting(active: UmockdevHost) -> None:
    _two_gpus(active)
    monitor = _monitor("udev")
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    for _ in range(qlen + 1):
        assert active.emit("change", GPU0) == 1
    with pytest.raises(UeventQueueFullError, match="queue full") as excinfo:
        active.emit("change", GPU0)
    assert excinfo.value.delivered == 0
    assert len(excinfo.value.sockets) == 1
    received = 0
    while monitor.poll(timeout=0) is not None:
        received += 1
    assert received == qlen + 1


def test_closed_monitor_socket_is_skipped(active: UmockdevHost) -> None:
    _two_gpus(active)
    monitor = _monitor("udev")
    assert len(active.event_sockets()) == 1
    del monitor  # closes the fd; the socket file stays behind
    assert active.emit("change", GPU0) == 0
    assert active.event_sockets() == []


# --------------------------------------------------------------------- activation


def test_symlinked_root_is_resolved(tmp_path: Path) -> None:
    if not preload_active():
        pytest.skip("needs libumockdev-preload: run under umockdev-wrapper")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    host = UmockdevHost(tmp_path / "link" / "testbed")
    assert host.root == tmp_path.resolve() / "real" / "testbed"
    add_intel_gpu(host, "0000:00:02.0", card=0, render=None)
    with host.activated():
        assert [d.sys_name for d in pyudev.Context().list_devices(subsystem="drm")] == ["card0"]


def test_activated_restores_environment(
    host: UmockdevHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not preload_active():
        pytest.skip("needs libumockdev-preload: run under umockdev-wrapper")
    only_in_testbed = host.add_device("/sys/devices/virtual/devplug_test/mock0", "devplug_test")
    monkeypatch.setenv("UMOCKDEV_DIR", str(host.root / "previous"))
    with host.activated():
        assert os.environ["UMOCKDEV_DIR"] == str(host.root)
        assert os.path.exists(only_in_testbed)
    assert os.environ["UMOCKDEV_DIR"] == str(host.root / "previous")

    monkeypatch.delenv("UMOCKDEV_DIR")
    with pytest.raises(LookupError), host.activated():
        raise LookupError
    assert "UMOCKDEV_DIR" not in os.environ
    assert not os.path.exists(only_in_testbed)


def _subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "UMOCKDEV_DIR")}
    env["PYTHONPATH"] = str(Path(devplug.__file__).parents[1])
    env.update(extra)
    return env


def test_activated_without_preload_raises_clear_error(host: UmockdevHost) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from devplug.testing.umockdev import UmockdevHost\n"
        "try:\n"
        "    with UmockdevHost(Path(sys.argv[1])).activated(): pass\n"
        "except RuntimeError as exc: print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(host.root.parent / "other")],
        env=_subprocess_env({}),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert "umockdev-wrapper" in result.stdout


@pytest.mark.skipif(shutil.which("umockdev-wrapper") is None, reason="umockdev not installed")
def test_env_makes_a_subprocess_see_the_testbed(host: UmockdevHost) -> None:
    _two_gpus(host)
    code = (
        "import os, pyudev\n"
        "names = sorted(d.sys_name for d in pyudev.Context().list_devices(subsystem='drm'))\n"
        "st = os.stat('/dev/dri/card1')\n"
        "print(','.join(names), os.major(st.st_rdev), os.minor(st.st_rdev))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=_subprocess_env(host.env()),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert result.stdout.split() == ["card0,card1,renderD128", "226", "1"]


# --------------------------------------------------------------------- layout and guards


def test_node_metadata_layout(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    host.add_device("devices/virtual/block/loop3", "block", node=MockNode("loop3", 7, 3, kind="b"))
    node_dir = host.root / "dev" / ".node"
    assert os.readlink(node_dir / "dri_renderD128") == "226:128"
    assert os.readlink(node_dir / "loop3") == "7:3"
    assert (host.root / "dev" / "loop3").stat().st_mode & stat.S_ISVTX
    assert not (host.root / "dev" / "dri" / "card0").stat().st_mode & stat.S_ISVTX
    assert os.readlink(host.root / "sys" / "dev" / "block" / "7:3") == (
        "../../devices/virtual/block/loop3"
    )
    uevent = (host.root / "sys" / "devices/pci0000:00/0000:00:02.0/drm/card0/uevent").read_text()
    assert "DEVNAME=dri/card0\n" in uevent


def test_add_device_guards_raise_value_error(host: UmockdevHost) -> None:
    with pytest.raises(ValueError, match="parent"):
        host.add_device(f"{GPU0}/drm/card0", "drm")
    assert not (host.root / "sys" / GPU0[5:]).exists()
    add_pci_device(host, vendor="0x8086", device="0x56a0", driver=None)
    with pytest.raises(ValueError, match="already exists"):
        add_pci_device(host, vendor="0x8086", device="0x56a0", driver=None)
    with pytest.raises(ValueError, match="clashes"):
        host.add_device(f"{GPU0}/x", "misc", attributes={"a": "1"}, links={"a": "../b"})
    with pytest.raises(ValueError, match="reserved"):
        host.set_attribute(GPU0, "uevent", "x")
    with pytest.raises(ValueError, match="node"):
        host.add_device(f"{GPU0}/y", "misc", devlinks=["y"])
    with pytest.raises(ValueError, match="below /sys/devices"):
        host.add_device("/sys/class/drm/card9", "drm")
    add_intel_gpu(host, "0000:00:03.0", card=1, render=None)
    with pytest.raises(ValueError, match="already exists in the testbed"):
        add_intel_gpu(host, "0000:00:04.0", card=1, render=None)  # /dev/dri/card1 taken
    assert not host.has_device("/sys/devices/pci0000:00/0000:00:04.0/drm/card1")
    with pytest.raises(ValueError, match="too long"):
        UmockdevHost(host.root.parent / ("x" * 100))
    with pytest.raises(ValueError, match="below /dev"):
        UmockdevHost(Path("/dev/shm/devplug-testbed"))


def test_encode_udev_message_layout() -> None:
    props = {"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "drm", "SEQNUM": "7"}
    message = encode_udev_message({**props, "DEVTYPE": "drm_minor"})
    assert message[:8] == b"libudev\0"
    (magic,) = struct.unpack_from(">I", message, 8)
    header_size, offset, length = struct.unpack_from("=III", message, 12)
    subsystem_hash, devtype_hash, bloom_hi, bloom_lo = struct.unpack_from(">IIII", message, 24)
    assert (magic, header_size, offset) == (0xFEEDCAFE, 40, 40)
    assert message[offset : offset + length].split(b"\0")[:-1] == [
        b"ACTION=add",
        b"DEVPATH=/devices/x",
        b"SUBSYSTEM=drm",
        b"SEQNUM=7",
        b"DEVTYPE=drm_minor",
    ]
    assert subsystem_hash != 0
    assert devtype_hash != 0
    assert bloom_hi == bloom_lo == 0
    with pytest.raises(ValueError, match="SEQNUM"):
        encode_udev_message({**props, "SEQNUM": ""})
