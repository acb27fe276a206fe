"""Faults a node throws at the daemon: vanishing devices, garbage sysfs, dirs deleted under it,
SIGKILL and SIGTERM at awkward moments.

Every test checks three things: a clear log line says what happened (captured with
``structlog.testing.capture_logs`` in-process, parsed from the JSON log of a ``devplug run``
process), service continues or recovers, and nothing is written in the test's directory
outside the kubelet dir and the CDI dir (a listing before and after). CI repeats each fault a
few times; DEVPLUG_RELIABILITY_LONG=1 many more.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from helpers import UEVENTS

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.cdi.ownership import STATE_DIR
from devplug.cdi.sync import TEMP_FILE_MIN_AGE_S
from devplug.daemon import Daemon
from devplug.kubelet.registration import CHECKPOINT_FILE, KUBELET_SOCKET
from devplug.kubelet.server import socket_path_for
from devplug.model import DeviceInfo, DeviceNode, DeviceTree
from devplug.naming import TEMP_PREFIX
from devplug.ops.control import CONTROL_DIR
from devplug.scanners.base import Scanner
from devplug.scanners.generic import GenericScanner
from devplug.scanners.intel_gpu import IntelGpuScanner
from devplug.scanners.udev import MAX_ATTRIBUTE_BYTES, UdevDevice, UdevEvent, UdevSource
from devplug.testing import (
    KubeletSimulator,
    SimulatorRpcError,
    StaticScanner,
    daemon_process,
    daemon_settings,
    eventually,
    running_daemon,
)
from devplug.testing.harness import in_process_daemon
from devplug.testing.simulator import ListedDevice
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial

SERIAL = "example.com/serial"
SERIAL_SPEC = "example.com-serial.json"
RENDER = "example.com/render"
LABELLED = "example.com/labelled"
I915 = "gpu.intel.com/i915"
SERIAL_ENTRY: dict[str, Any] = {
    "resource": SERIAL,
    "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"},
}
RENDER_ENTRY: dict[str, Any] = {
    "resource": RENDER,
    "match": {"subsystem": "drm", "devnode": "/dev/dri/renderD*"},
}
LABELLED_ENTRY: dict[str, Any] = {
    "resource": LABELLED,
    "match": {"subsystem": "drm", "devnode": "/dev/dri/renderD*", "attributes": {"label": "gpu*"}},
}
USB_HUB = "/sys/devices/pci0000:00/0000:00:14.0/usb1"
PROCESS_CONFIG = """
hotplug: {source: none, poll_s: 3600, resync_s: 3600}
scanners:
  generic:
    - {resource: example.com/serial, match: {subsystem: tty, devnode: "/dev/ttyUSB*"}}
"""
WAIT_S = 30.0  # generous: a loaded 2-core CI machine, and process start-up
# A process must stop well before a Register call in flight would time out (10 s).
PROMPT_EXIT_S = 5.0
TROUBLE_EVENTS = frozenset({"scan.failed", "scan.incremental.failed", "cdi.sync.failed"})


def visible(cdi_dir: Path) -> list[str]:
    """What a runtime sees in the CDI dir: everything but devplug's state dir."""
    return sorted(n for n in os.listdir(cdi_dir) if n != STATE_DIR)


LogEntry = Mapping[str, Any]


def named(logs: Sequence[LogEntry], event: str) -> list[LogEntry]:
    return [entry for entry in logs if entry["event"] == event]


async def logged_more(logs: Sequence[LogEntry], event: str, than: int) -> None:
    """Wait until ``event`` has been logged more than ``than`` times."""
    await eventually(lambda: len(named(logs, event)) > than, timeout=WAIT_S)


def trouble(logs: Sequence[LogEntry]) -> list[LogEntry]:
    """Log entries that mean something broke inside the daemon (not a fault it handled)."""
    return [
        entry
        for entry in logs
        if entry["event"] in TROUBLE_EVENTS
        or entry["log_level"] in ("error", "critical")
        or "exc_info" in entry
        or "exception" in entry
    ]


# ----------------------------------------------------------------------------- dir listings


def listing(root: Path, skip: Collection[Path]) -> dict[str, str]:
    """Every entry below ``root`` (but ``skip``) with its type, and size and mtime for files.

    umockdev's event sockets (``event<fd>``, made by the preload when a monitor opens) are left
    out: they are the mock's plumbing, not something the daemon wrote.
    """
    skipped = {str(path) for path in skip}
    found: dict[str, str] = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in skipped]
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            if path in skipped:
                continue
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # removed by the test while walking
            mode = info.st_mode
            if stat.S_ISSOCK(mode) and re.fullmatch(r"event[0-9]+", name):
                continue
            if stat.S_ISDIR(mode):
                kind = "dir"
            elif stat.S_ISLNK(mode):
                kind = f"link -> {os.readlink(path)}"
            elif stat.S_ISREG(mode):
                kind = f"file {info.st_size} {info.st_mtime_ns}"
            elif stat.S_ISSOCK(mode):
                kind = "socket"
            else:
                kind = "other"
            found[os.path.relpath(path, root)] = kind
    return found


@pytest.fixture
def outside(short_dir: Path, kubelet_dir: Path) -> Callable[[], dict[str, str]]:
    """The test dir's listing without the kubelet dir and the CDI dir (the daemon's dirs)."""
    return lambda: listing(short_dir, (kubelet_dir, short_dir / "cdi"))


def added_or_changed(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """Entries new or changed in ``after`` (an empty dict when only removals happened)."""
    return {path: kind for path, kind in after.items() if before.get(path) != kind}


def outside_testbed(entries: Mapping[str, str]) -> dict[str, str]:
    return {p: k for p, k in entries.items() if p.split(os.sep)[0] != "testbed"}


# ----------------------------------------------------------------------------- vanishing devices


class Trap:
    """Devices to remove from the testbed the moment a scan meets them (set by the test)."""

    def __init__(self, host: UmockdevHost) -> None:
        self.host = host
        self.victims: dict[str, str] = {}  # sys path a scan meets -> what to remove then
        self.moment = "listed"
        self.removed: list[str] = []

    def arm(self, victims: Mapping[str, str], moment: str) -> None:
        self.victims, self.moment, self.removed = dict(victims), moment, []

    def spring(self, sys_path: str) -> None:
        top = self.victims.pop(sys_path, None)
        if top is not None:
            self.removed += self.host.remove_device(top)

    def source(self, given: UdevSource) -> UdevSource:
        """The source for a scan: made in the scanning thread (libudev contexts are per
        thread), and only while something is still to be removed. Scans are serialised, so
        whichever scan meets a victim first is the one that sees it vanish."""
        return VanishingSource(self) if self.victims else given


class VanishingSource(UdevSource):
    """The real udev source, except that the trap's devices are removed from the testbed right
    after the scanner got them: after ``devices()`` listed one (``listed``), or after
    ``device()`` opened it (``opened``), before any of its attributes is read."""

    def __init__(self, trap: Trap) -> None:
        super().__init__()
        self.trap = trap

    def devices(
        self,
        subsystem: str | None = None,
        properties: Mapping[str, str] | None = None,
        sys_name: str | re.Pattern[str] | None = None,
    ) -> Iterator[UdevDevice]:
        for device in super().devices(subsystem, properties, sys_name):
            if self.trap.moment == "listed":
                self.trap.spring(device.sys_path)
            yield device

    def device(self, sys_path: str) -> UdevDevice | None:
        found = super().device(sys_path)
        if self.trap.moment == "opened":
            self.trap.spring(sys_path)
        return found


class TrappedGeneric(GenericScanner):
    trap: Trap

    def scan(self, source: UdevSource) -> DeviceTree:
        return super().scan(self.trap.source(source))

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        return super().rescan(self.trap.source(source), previous, events)


class TrappedIntelGpu(IntelGpuScanner):
    trap: Trap

    def scan(self, source: UdevSource) -> DeviceTree:
        return super().scan(self.trap.source(source))

    def rescan(
        self, source: UdevSource, previous: DeviceTree, events: Sequence[UdevEvent]
    ) -> DeviceTree | None:
        return super().rescan(self.trap.source(source), previous, events)


def daemon_task_alive() -> bool:
    """The daemon's task (running_daemon's) is still running: nothing escaped the daemon."""
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "devplug-daemon"]
    return len(tasks) == 1 and not tasks[0].done()


def not_healthy(device_id: str) -> Callable[[dict[str, ListedDevice]], bool]:
    return lambda listed: device_id not in listed or listed[device_id].health == "Unhealthy"


@pytest.mark.parametrize("moment", ["listed", "opened"])
@pytest.mark.parametrize("scanner_name", ["generic", "intel_gpu"])
async def test_a_device_vanishing_between_enumeration_and_reads(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    outside: Callable[[], dict[str, str]],
    scaled: Callable[[int, int], int],
    scanner_name: str,
    moment: str,
) -> None:
    """``listed``: a full scan enumerates the device, then it goes. ``opened``: a uevent makes
    the incremental rescan open it, then it goes. Either way the scan ends without an error,
    the device is no longer offered as Healthy, and the rest is served as before."""
    rounds = scaled(2, 15)
    trap = Trap(host)
    scanner: Scanner
    resource: str
    # device id -> (what the scan meets, what to remove, where a uevent goes)
    victims: dict[str, tuple[str, str, str]] = {}
    if scanner_name == "generic":
        generic = TrappedGeneric.from_config([SERIAL_ENTRY])
        assert isinstance(generic, TrappedGeneric)
        generic.trap, scanner, resource = trap, generic, SERIAL
        for index in range(rounds + 2):
            tty = add_usb_serial(host, index=index)
            victims[f"ttyUSB{index}"] = (tty, f"{USB_HUB}/1-{index + 1}", tty)
    else:
        intel = TrappedIntelGpu()
        intel.trap, scanner, resource = trap, intel, I915
        for index in range(rounds + 2):
            address = f"0000:{index + 1:02x}:00.0"
            pci = add_intel_gpu(host, address, card=index, render=128 + index)
            met = f"{pci}/drm/card{index}" if moment == "listed" else pci
            victims[address] = (met, pci, pci)
    before = outside()

    with structlog.testing.capture_logs() as logs:
        async with running_daemon(
            daemon_settings(kubelet_dir, hotplug=UEVENTS), [scanner]
        ) as daemon:
            session = await kubelet.wait_for_plugin(resource)
            await session.wait_for_update(lambda listed: set(listed) == set(victims))
            remaining = set(victims)
            for device_id in sorted(victims)[:rounds]:
                met, top, event_path = victims[device_id]
                changes = len(named(logs, "servers.tree.changed"))
                trap.arm({met: top}, moment)
                if moment == "listed":
                    await daemon.rescan()
                else:
                    await host.emit_async("change", event_path)
                await eventually(lambda: bool(trap.removed), timeout=WAIT_S)
                remaining.discard(device_id)
                listed = await session.wait_for_update(not_healthy(device_id))
                assert {i for i, d in listed.items() if d.health == "Healthy"} == remaining
                # The tree change is logged; the scan itself failed nowhere.
                changed = named(logs, "servers.tree.changed")[changes:]
                assert changed and resource in changed[-1]["changed"]
                assert trouble(logs) == []
                # The kernel's remove events follow; then the device is gone for good.
                for path in trap.removed:
                    await host.emit_async("remove", path)
                await session.wait_for_update(lambda listed: set(listed) == remaining)
                with pytest.raises(SimulatorRpcError) as refused:
                    await session.allocate([device_id])
                assert refused.value.code == "NOT_FOUND" and device_id in refused.value.details
                answer = await session.allocate(sorted(remaining))
                assert len(answer) == 1 and answer[0].nodes
            assert daemon_task_alive()
    assert trouble(logs) == []
    after = outside()
    # The test removed devices from the testbed; nothing appeared or changed anywhere.
    assert added_or_changed(before, after) == {}
    assert outside_testbed(after) == outside_testbed(before)


# ----------------------------------------------------------------------------- garbage sysfs

OVERSIZED = MAX_ATTRIBUTE_BYTES + 904  # more than a sysfs attribute can hold


def make_unreadable(host: UmockdevHost, sys_path: str, name: str) -> None:
    """Put a directory where the attribute file was: open() fails (EISDIR), even for root."""
    path = host.root / sys_path.lstrip("/") / name
    path.unlink()
    path.mkdir()


# numa_node contents -> the topologies that are a sane reading of them (None: unreadable).
NUMA_CASES: list[tuple[str | bytes | None, set[tuple[int, ...]]]] = [
    ("1", {(1,)}),  # the control: a well-formed node
    ("abc", {()}),
    ("", {()}),
    ("-5", {()}),
    ("-1", {()}),
    ("0x1", {()}),
    ("1e3", {()}),
    (" 2 \n", {(2,)}),
    ("\0", {()}),
    ("\0\0\0\0", {()}),
    ("1\0junk", {()}),
    ("1\0", {(), (1,)}),  # a stray terminator: ignoring it or the value are both fine
    (b"\xff\xfe", {()}),
    ("3" + " " * OVERSIZED, {(), (3,)}),  # oversized: ignored, or its number read
    (None, {()}),  # unreadable
]
# Above int64 (the protobuf NUMANode.ID type), and an oversized file of digits.
OUT_OF_RANGE_NUMA = ["99999999999999999999", "1" * OVERSIZED]


def numa_gpus(host: UmockdevHost, values: list[str | bytes | None]) -> dict[str, str]:
    """One Intel GPU per numa_node value; returns the PCI address of each, by position."""
    addresses: dict[str, str] = {}
    for index, value in enumerate(values):
        address = f"0000:{index + 1:02x}:00.0"
        pci = add_intel_gpu(host, address, card=index, render=128 + index)
        if value is None:
            make_unreadable(host, pci, "numa_node")
        else:
            host.set_attribute(pci, "numa_node", value)
        addresses[str(index)] = address
    return addresses


async def test_garbage_numa_nodes_are_served_without_topology(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    outside: Callable[[], dict[str, str]],
) -> None:
    """Both the generic scanner (NUMA from the render node's PCI ancestor) and the Intel GPU
    scanner read numa_node; garbage there must cost the topology hint, never the device."""
    numa_gpus(host, [value for value, _ in NUMA_CASES])
    # The generic scanner's attribute match reads attributes through the same guarded path.
    # label -> whether the render node must match "gpu*" (None: either way is sane; libudev
    # reads up to the first NUL, so "gpu\0ok" reads as "gpu").
    labels: list[tuple[str | bytes, bool | None]] = [
        ("gpu-ok", True),
        ("gpu\0ok", None),
        ("\0gpu", False),
        ("gpu" + " " * OVERSIZED, False),
        (b"\xff\xfe", False),
    ]
    must_match: set[str] = set()
    may_match: set[str] = set()
    for index, _ in enumerate(NUMA_CASES):
        label, matches = labels[index % len(labels)]
        pci = f"/sys/devices/pci0000:{index + 1:02x}/0000:{index + 1:02x}:00.0"
        host.set_attribute(f"{pci}/drm/renderD{128 + index}", "label", label)
        if matches is not False:
            may_match.add(f"dri_renderD{128 + index}")
        if matches:
            must_match.add(f"dri_renderD{128 + index}")
    before = outside()
    scanners: list[Scanner] = [
        GenericScanner.from_config([RENDER_ENTRY, LABELLED_ENTRY]),
        IntelGpuScanner(),
    ]
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir, hotplug=UEVENTS), scanners):
            render = await kubelet.wait_for_plugin(RENDER)
            gpus = await kubelet.wait_for_plugin(I915)
            labelled_session = await kubelet.wait_for_plugin(LABELLED)
            count = len(NUMA_CASES)
            by_render = await render.wait_for_update(lambda listed: len(listed) == count)
            by_gpu = await gpus.wait_for_update(lambda listed: len(listed) == count)
            matched = set(await labelled_session.wait_for_update())
            assert must_match <= matched <= may_match
            for index, (value, sane) in enumerate(NUMA_CASES):
                for listed in (
                    by_render[f"dri_renderD{128 + index}"],
                    by_gpu[f"0000:{index + 1:02x}:00.0"],
                ):
                    assert listed.health == "Healthy"
                    assert listed.numa_nodes in sane, f"numa_node {value!r} -> {listed.numa_nodes}"
            # Every device is allocatable.
            (answer,) = await render.allocate(sorted(by_render))
            assert len(answer.nodes) == count
            (answer,) = await gpus.allocate(sorted(by_gpu))
            assert len(answer.nodes) == 2 * count  # card and render of each
            assert daemon_task_alive()
    added = named(logs, "servers.tree.changed")[0]["added"]
    assert added == sorted([I915, LABELLED, RENDER])
    assert trouble(logs) == []
    assert outside() == before


@pytest.mark.parametrize("value", OUT_OF_RANGE_NUMA, ids=["above-int64", "oversized-digits"])
async def test_an_out_of_range_numa_node_does_not_break_the_resource(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path, value: str
) -> None:
    addresses = numa_gpus(host, ["0", value])
    scanners: list[Scanner] = [GenericScanner.from_config([RENDER_ENTRY]), IntelGpuScanner()]
    async with running_daemon(daemon_settings(kubelet_dir, hotplug=UEVENTS), scanners):
        for resource, bad, good in (
            (RENDER, "dri_renderD129", "dri_renderD128"),
            (I915, addresses["1"], addresses["0"]),
        ):
            session = await kubelet.wait_for_plugin(resource)
            listed = await session.wait_for_update(lambda listed: len(listed) == 2)
            assert listed[good].numa_nodes == (0,)
            assert listed[bad].numa_nodes == ()  # no node the kubelet could use
            await session.allocate([bad])


# Intel GPU attributes -> whether the GPU must be advertised (None: either way is sane).
INTEL_CASES: list[tuple[str, str | bytes, bool | None]] = [
    ("vendor", "0x8086", True),  # the control
    ("vendor", "garbage", False),
    # libudev reads up to the first NUL: a NUL after the value leaves it readable
    ("vendor", "0x8086\0junk", None),
    ("vendor", "\0" + "0x8086", False),
    ("vendor", "0x8086" + " " * OVERSIZED, False),  # oversized: unreadable
    ("vendor", b"\xff\xfe", False),
    ("vendor", "", False),
    ("device", "zzz", True),  # an unknown PCI device id is still an Intel GPU
    ("device", "0x56a0\0", True),
    ("device", "0x" + "f" * OVERSIZED, True),
    ("device", "", True),
    ("sriov_numvfs", "abc", True),
    ("sriov_numvfs", "-3", True),
    ("sriov_numvfs", "\0", True),
    ("sriov_numvfs", "1" + " " * OVERSIZED, True),
    ("sriov_numvfs", "99999999999999999999", None),  # "VFs enabled": may be held back
    ("numa_node", "garbage", True),
]


async def test_garbage_intel_gpu_attributes_are_served_or_skipped(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    outside: Callable[[], dict[str, str]],
) -> None:
    expected: dict[str, bool | None] = {}
    for index, (name, value, served) in enumerate(INTEL_CASES):
        address = f"0000:{index + 1:02x}:00.0"
        pci = add_intel_gpu(host, address, card=index, render=128 + index)
        host.set_attribute(pci, name, value)
        expected[address] = served
    must = {a for a, served in expected.items() if served}
    may = must | {a for a, served in expected.items() if served is None}
    before = outside()
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(
            daemon_settings(kubelet_dir, hotplug=UEVENTS), [IntelGpuScanner()]
        ) as daemon:
            session = await kubelet.wait_for_plugin(I915)
            listed = await session.wait_for_update()
            assert must <= set(listed) <= may, sorted(set(listed) ^ must)
            assert all(device.health == "Healthy" for device in listed.values())
            for address in sorted(listed):
                (answer,) = await session.allocate([address])
                index = int(address.split(":")[1], 16) - 1
                assert [n.host_path for n in answer.nodes] == [
                    f"/dev/dri/card{index}",
                    f"/dev/dri/renderD{128 + index}",
                ]
            # A rescan reads the same garbage again and comes to the same answer.
            changes = len(named(logs, "servers.tree.changed"))
            await daemon.rescan()
            assert len(named(logs, "servers.tree.changed")) == changes
            assert daemon_task_alive()
    assert named(logs, "servers.tree.changed")[0]["added"] == [I915]
    assert trouble(logs) == []
    assert outside() == before


# ----------------------------------------------------------------------------- dirs going away


def serial_devices(count: int) -> dict[str, DeviceInfo]:
    return {f"dev{i}": DeviceInfo(nodes=(DeviceNode(f"/dev/ttyX{i}"),)) for i in range(count)}


async def test_the_kubelet_dir_removed_and_recreated(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    outside: Callable[[], dict[str, str]],
    scaled: Callable[[int, int], int],
) -> None:
    """The dir goes with the kubelet (a node's /var/lib/kubelet wiped): the daemon waits
    without re-creating it, and registers again once the dir and kubelet.sock are back; half
    the cycles bring the dir back empty first, the kubelet a moment later."""
    cycles = scaled(2, 10)
    before = outside()
    scanner = StaticScanner({SERIAL: serial_devices(2)})
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update(lambda listed: len(listed) == 2)
            for cycle in range(cycles):
                missing = len(named(logs, "kubelet.dir.missing"))
                found = len(named(logs, "kubelet.dir.found"))
                waiting = len(named(logs, "kubelet.waiting"))
                await kubelet.stop()
                shutil.rmtree(kubelet_dir)
                await logged_more(logs, "kubelet.dir.missing", missing)
                assert not kubelet_dir.exists()  # waited for, not made by the daemon
                if cycle % 2:
                    kubelet_dir.mkdir()
                    await logged_more(logs, "kubelet.dir.found", found)
                    await logged_more(logs, "kubelet.waiting", waiting)
                await kubelet.start()
                session = await kubelet.wait_for_plugin(SERIAL, replacing=session)
                await session.wait_for_update(lambda listed: len(listed) == 2)
                (answer,) = await session.allocate(["dev1"])
                assert [n.host_path for n in answer.nodes] == ["/dev/ttyX1"]
                # (The stat backstop may re-register before the dir poll logs the dir back.)
                await logged_more(logs, "kubelet.dir.found", found)
            assert daemon_task_alive()
            # Only the kubelet's files, the plugin's socket and the daemon's control dir: nothing
            # left from old listeners.
            assert sorted(p.name for p in kubelet_dir.iterdir()) == sorted(
                [
                    CHECKPOINT_FILE,
                    KUBELET_SOCKET,
                    socket_path_for(kubelet_dir, SERIAL).name,
                    CONTROL_DIR,
                ]
            )
    gone = named(logs, "kubelet.dir.gone")
    assert len(gone) >= cycles and gone[0]["dir"] == str(kubelet_dir)
    assert gone[0]["log_level"] == "warning"
    assert len(named(logs, "kubelet.register.complete")) == cycles + 1
    assert trouble(logs) == []
    assert outside() == before


def spec_writes(logs: Sequence[LogEntry]) -> int:
    """How often the serial spec was written: "written" for a changed device map,
    "rewritten" (changed on disk) for an unchanged one."""
    return sum(
        e["event"] in ("cdi.spec.written", "cdi.spec.rewritten") and e["resource"] == SERIAL
        for e in logs
    )


def spec_writes_above(logs: Sequence[LogEntry], count: int) -> bool:
    return spec_writes(logs) > count


def cdi_names(daemon: Daemon, device_id: str) -> bool:
    """The daemon's CDI catalog defines ``device_id`` (so Allocate names it)."""
    entry = daemon.cdi_catalog.get(SERIAL)
    return entry is not None and device_id in entry.names


async def test_the_cdi_dir_deleted_while_running(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    outside: Callable[[], dict[str, str]],
    scaled: Callable[[int, int], int],
) -> None:
    """The CDI dir deleted under the daemon: Allocate keeps answering (device specs), and the
    spec is back at the next resync (rewritten as it was) or the next hotplug (with the new
    device)."""
    cdi_dir = short_dir / "cdi"
    spec = cdi_dir / SERIAL_SPEC
    rounds = scaled(4, 20)
    for index in range(2):
        add_usb_serial(host, index=index)
    before = outside()
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            daemon_settings(kubelet_dir, hotplug=UEVENTS),
            [GenericScanner.from_config([SERIAL_ENTRY])],
        ) as daemon:
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update(lambda listed: len(listed) == 2)
            await eventually(spec.exists, timeout=WAIT_S)
            expected = {"ttyUSB0", "ttyUSB1"}

            for round_ in range(rounds):
                writes = spec_writes(logs)
                shutil.rmtree(cdi_dir)
                # Still served: the device nodes are in the answer whatever the spec's fate.
                (answer,) = await session.allocate(["ttyUSB0"])
                assert [n.host_path for n in answer.nodes] == ["/dev/ttyUSB0"]
                if round_ % 2 == 0:
                    await daemon.rescan()  # the periodic resync; the devices did not change
                else:
                    index = 2 + round_ // 2
                    before_add = set(host.devices)
                    add_usb_serial(host, index=index)
                    for path in [p for p in host.devices if p not in before_add]:
                        await host.emit_async("add", path)
                    expected.add(f"ttyUSB{index}")
                    await session.wait_for_update(lambda listed: set(listed) == expected)
                await eventually(functools.partial(spec_writes_above, logs, writes), timeout=WAIT_S)
                # Allocate noticing the missing spec may write it back first, as it was; the
                # new device's spec follows.
                await eventually(
                    lambda: (
                        spec.exists()
                        and {d["name"] for d in json.loads(spec.read_bytes())["devices"]}
                        == expected
                    ),
                    timeout=WAIT_S,
                )
                assert visible(cdi_dir) == [SERIAL_SPEC]  # no temp file, no copy
                newest = sorted(expected)[-1]
                await eventually(functools.partial(cdi_names, daemon, newest), timeout=WAIT_S)
                (answer,) = await session.allocate([newest])
                assert answer.cdi_devices == (f"{SERIAL}={newest}",)
            assert daemon_task_alive()
    assert trouble(logs) == []
    assert outside_testbed(outside()) == outside_testbed(before)


async def test_no_cdi_name_is_sent_for_a_spec_that_was_deleted(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    spec = short_dir / "cdi" / SERIAL_SPEC
    scanner = StaticScanner({SERIAL: serial_devices(1)})
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        shutil.rmtree(spec.parent)
        (answer,) = await session.allocate(["dev0"])
        # Every name sent must resolve when the runtime looks it up.
        assert answer.cdi_devices == () or spec.exists()
        # Noticing it, devplug writes the spec again at once (not at the next resync).
        await eventually(
            lambda: spec.exists() and daemon.cdi_catalog.get(SERIAL) is not None, timeout=WAIT_S
        )
        (again,) = await session.allocate(["dev0"])
        assert again.cdi_devices == (f"{SERIAL}=dev0",)


# ----------------------------------------------------------------------------- processes


class JsonLog:
    """A ``devplug run`` process's JSON log (stdout and stderr go to this file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[LogEntry]:
        """Every complete line, parsed: each must be one JSON object."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        parsed: list[LogEntry] = [json.loads(line) for line in lines if line.endswith("\n")]
        assert all(isinstance(entry, dict) for entry in parsed)
        return parsed

    def named(self, event: str) -> list[LogEntry]:
        return named(self.entries(), event)

    async def wait_for(self, event: str, count: int = 1) -> LogEntry:
        await eventually(lambda: len(self.named(event)) >= count, timeout=WAIT_S)
        return self.named(event)[count - 1]


def stale_temp(cdi_dir: Path, name: str, age_s: float) -> Path:
    """A temp file such as a write cut short by SIGKILL leaves, ``age_s`` old."""
    path = cdi_dir / f"{TEMP_PREFIX}{name}"
    path.write_bytes(b'{"half a spec')
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


async def test_sigkill_then_restart_with_the_same_dirs(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    outside: Callable[[], dict[str, str]],
    scaled: Callable[[int, int], int],
) -> None:
    """A ``devplug run`` killed with SIGKILL leaves its socket and spec behind; the next run
    in the same dirs replaces the stale socket, keeps the spec as it is (no duplicate, no
    rewrite), removes crash leftovers old enough to be stale, and registers again."""
    kills = scaled(2, 8)
    for index in range(2):
        add_usb_serial(host, index=index)
    config = short_dir / "config.yaml"
    config.write_text(PROCESS_CONFIG)
    cdi_dir = short_dir / "cdi"
    spec = cdi_dir / SERIAL_SPEC
    plugin_socket = socket_path_for(kubelet_dir, SERIAL)
    before = outside()

    first = JsonLog(tmp_path / "run-0.log")
    async with daemon_process(config, kubelet_dir, env=host.env(), output=first.path) as process:
        session = await kubelet.wait_for_plugin(SERIAL, timeout=WAIT_S)
        await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0", "ttyUSB1"})
        await first.wait_for("cdi.spec.written")
        spec_stamp = os.lstat(spec)
        process.kill()
        assert await process.wait() == -signal.SIGKILL
    young = None
    for run in range(1, kills + 1):
        # What the kill left: the socket (nobody listening) and the spec.
        assert plugin_socket.exists() and spec.exists()
        old = stale_temp(cdi_dir, f"crash{run}", TEMP_FILE_MIN_AGE_S * 2)
        if young is None:
            young = stale_temp(cdi_dir, "young", 0)  # too young: could be another writer's
        log = JsonLog(tmp_path / f"run-{run}.log")
        async with daemon_process(config, kubelet_dir, env=host.env(), output=log.path) as process:
            session = await kubelet.wait_for_plugin(SERIAL, replacing=session, timeout=WAIT_S)
            listed = await session.wait_for_update()
            assert set(listed) == {"ttyUSB0", "ttyUSB1"}
            (answer,) = await session.allocate(["ttyUSB1"])
            assert [n.host_path for n in answer.nodes] == ["/dev/ttyUSB1"]
            # CDI names come once the spec found on disk is known to be right (no log line:
            # nothing was written).
            async with asyncio.timeout(WAIT_S):
                while not answer.cdi_devices:
                    await asyncio.sleep(0.02)
                    (answer,) = await session.allocate(["ttyUSB1"])
            assert answer.cdi_devices == (f"{SERIAL}=ttyUSB1",)
            replaced = await log.wait_for("server.stale_socket.removed")
            assert replaced["socket"] == str(plugin_socket)
            cleaned = await log.wait_for("cdi.temp_files.removed")
            assert cleaned["count"] == 1
            assert not old.exists() and young.exists()
            # The same spec, not rewritten: its bytes were already right.
            now = os.lstat(spec)
            assert (now.st_ino, now.st_mtime_ns) == (spec_stamp.st_ino, spec_stamp.st_mtime_ns)
            assert log.named("cdi.spec.written") == []
            assert visible(cdi_dir) == sorted([SERIAL_SPEC, young.name])
            assert sorted(p.name for p in kubelet_dir.iterdir()) == sorted(
                [CHECKPOINT_FILE, KUBELET_SOCKET, plugin_socket.name, CONTROL_DIR]
            )
            if run < kills:
                process.kill()
                assert await process.wait() == -signal.SIGKILL
            else:
                process.send_signal(signal.SIGTERM)
                async with asyncio.timeout(WAIT_S):
                    assert await process.wait() == 0
        entries = log.entries()
        assert [e for e in entries if e["level"] in ("error", "critical")] == []
        assert len(named(entries, "kubelet.register.complete")) == 1
    # The orderly stop took the socket and the spec; the young temp file is not ours to take.
    assert sorted(p.name for p in kubelet_dir.iterdir()) == sorted(
        [CHECKPOINT_FILE, KUBELET_SOCKET]
    )
    assert young is not None and visible(cdi_dir) == [young.name]
    assert outside() == before


class StuckRegistration(pb_grpc.RegistrationServicer):
    """A kubelet whose Register never answers."""

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self._never = asyncio.Event()

    async def Register(
        self,
        request: pb.RegisterRequest,
        context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty],
    ) -> pb.Empty:
        self.called.set()
        await self._never.wait()
        return pb.Empty()


class SilentSocket:
    """A kubelet.sock that accepts connections and never says a word (not even HTTP/2)."""

    def __init__(self) -> None:
        self.connected = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connected.set()
        try:
            while await reader.read(4096):
                pass
        finally:
            writer.close()


@pytest.mark.parametrize("kubelet_kind", ["register-never-answers", "socket-never-speaks"])
async def test_sigterm_while_registering(
    host: UmockdevHost,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    outside: Callable[[], dict[str, str]],
    scaled: Callable[[int, int], int],
    kubelet_kind: str,
) -> None:
    """SIGTERM while Register hangs: the process stops at once (not after the register
    timeout), exits 0, and leaves no socket of its own behind."""
    add_usb_serial(host, index=0)
    config = short_dir / "config.yaml"
    config.write_text(PROCESS_CONFIG)
    cdi_dir = short_dir / "cdi"
    kubelet_socket = kubelet_dir / KUBELET_SOCKET
    before = outside()
    for attempt in range(scaled(1, 5)):
        stuck = StuckRegistration()
        silent = SilentSocket()
        grpc_server: grpc.aio.Server | None = None
        unix_server: asyncio.Server | None = None
        if kubelet_kind == "register-never-answers":
            grpc_server = grpc.aio.server()
            pb_grpc.add_RegistrationServicer_to_server(stuck, grpc_server)
            grpc_server.add_insecure_port(f"unix://{kubelet_socket}")
            await grpc_server.start()
            in_register = stuck.called
        else:
            unix_server = await asyncio.start_unix_server(silent.handle, kubelet_socket)
            in_register = silent.connected
        log = JsonLog(tmp_path / f"run-{attempt}.log")
        try:
            async with daemon_process(
                config, kubelet_dir, env=host.env(), output=log.path
            ) as process:
                async with asyncio.timeout(WAIT_S):
                    await in_register.wait()
                await log.wait_for("kubelet.register.started")
                stopping = time.perf_counter()
                process.send_signal(signal.SIGTERM)
                async with asyncio.timeout(WAIT_S):
                    status = await process.wait()
                took = time.perf_counter() - stopping
        finally:
            if grpc_server is not None:
                await grpc_server.stop(None)
            if unix_server is not None:
                unix_server.close()
                await unix_server.wait_closed()
        assert status == 0
        assert took < PROMPT_EXIT_S, f"took {took:.1f} s to stop"
        entries = log.entries()
        events = [e["event"] for e in entries]
        assert "daemon.stopped" in events and "kubelet.register.complete" not in events
        assert [e for e in entries if e["level"] in ("error", "critical")] == []
        # Its own socket and temporary sockets are gone; only the kubelet's is left.
        leftovers = sorted(p.name for p in kubelet_dir.iterdir())
        assert leftovers in ([], [KUBELET_SOCKET]), leftovers
        assert not any(n.startswith(TEMP_PREFIX) for n in leftovers)
        # The spec, if it was written before the signal, went with the orderly stop.
        assert not cdi_dir.exists() or visible(cdi_dir) == []
    assert outside() == before
