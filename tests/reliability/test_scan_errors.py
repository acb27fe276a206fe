"""A scan error is never "no devices", and one bad device never hides the others (issue 15,
items 1 and 2).

Real parts throughout: the daemon in-process on umockdev hosts (real pyudev), the kubelet
simulator on real unix sockets. The process really runs out of file descriptors (its soft
RLIMIT_NOFILE lowered, then filled), and the bad devices really carry bytes that are not UTF-8
in their uevent files and in uevents on the monitor socket. CI runs a round or two;
DEVPLUG_RELIABILITY_LONG=1 runs many more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from devplug.config import HotplugSettings
from devplug.hotplug.scanning import UNKNOWN_AFTER_FAILURES
from devplug.model import DeviceInfo, DeviceNode, DeviceTree
from devplug.scanners.generic import GenericScanner
from devplug.scanners.udev import UdevSource
from devplug.testing import (
    KubeletSimulator,
    StaticScanner,
    daemon_settings,
    eventually,
    running_daemon,
)
from devplug.testing.harness import in_process_daemon
from devplug.testing.simulator import ListedDevice
from devplug.testing.umockdev import UmockdevHost, add_usb_serial
from devplug.testing.umockdev.wire import encode_udev_message

SERIAL = "example.com/serial"
FAILING = "example.com/failing"
SERIAL_ENTRY: dict[str, Any] = {
    "resource": SERIAL,
    "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*", "properties": {"ID_BUS": "usb"}},
}
WAIT_S = 30.0

LogEntry = Mapping[str, Any]


def named(logs: Sequence[LogEntry], event: str) -> list[LogEntry]:
    return [entry for entry in logs if entry["event"] == event]


def logged_more(logs: Sequence[LogEntry], event: str, than: int) -> Callable[[], bool]:
    return lambda: len(named(logs, event)) > than


def exactly(ids: set[str]) -> Callable[[Mapping[str, ListedDevice]], bool]:
    return lambda listed: set(listed) == ids


@contextlib.contextmanager
def out_of_file_descriptors() -> Iterator[None]:
    """This process cannot open another file until the block ends (EMFILE): the soft limit is
    lowered just above the highest descriptor in use, and what is left is filled."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(name) for name in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
    fillers: list[int] = []
    try:
        while True:
            try:
                fillers.append(os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                break
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def serial_ids(listed: Mapping[str, ListedDevice]) -> set[str]:
    return set(listed)


async def test_a_scan_that_cannot_open_files_keeps_the_devices_and_retries(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    scaled: Callable[[int, int], int],
) -> None:
    """Out of descriptors, libudev reads every device as node-less and the scan used to come
    back empty: the kubelet saw every device withdrawn. Now the scan counts as failed, the
    previous devices stay advertised, the failure is logged with its reason, and the scan is
    retried without being asked until it succeeds."""
    for index in range(3):
        add_usb_serial(host, index=index)
    wanted = {"ttyUSB0", "ttyUSB1", "ttyUSB2"}
    scanner = GenericScanner.from_config([SERIAL_ENTRY])
    rounds = scaled(2, 30)
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update(lambda listed: serial_ids(listed) == wanted)
            for round_ in range(rounds):
                with out_of_file_descriptors():
                    daemon.request_scan()
                    await eventually(logged_more(logs, "scan.failed", round_), timeout=WAIT_S)
                # Nobody asks again: the retry after the back-off finds the files it needs.
                await eventually(logged_more(logs, "scan.recovered", round_), timeout=WAIT_S)
                assert daemon.stats.value.advertised.get(SERIAL, {}).keys() == wanted
            await daemon.rescan()
            assert all(serial_ids(listed) == wanted for listed in session.updates)
    failures = named(logs, "scan.failed")
    assert len(failures) == rounds, "logged once per failure, not once per retry"
    assert all("Too many open files" in entry["reason"] for entry in failures)
    assert all(entry["kept_previous"] for entry in failures)


class Failing(StaticScanner):
    """Three devices, or an error, as the test says."""

    name = "failing"

    def __init__(self) -> None:
        node = (DeviceNode("/dev/null"),)
        super().__init__({FAILING: {f"dev{i}": DeviceInfo(nodes=node) for i in range(3)}})
        self.error: OSError | None = None

    def scan(self, source: UdevSource) -> DeviceTree:
        if self.error is not None:
            raise self.error
        return self.tree


async def test_devices_of_a_scanner_that_keeps_failing_turn_unhealthy_then_recover(
    kubelet: KubeletSimulator, kubelet_dir: Path, scaled: Callable[[int, int], int]
) -> None:
    """A scanner failing now and then keeps its devices as they were; failing
    UNKNOWN_AFTER_FAILURES times in a row, it can no longer tell: its devices are reported
    Unhealthy, with the reason (never withdrawn); its next good scan makes them Healthy."""
    scanner = Failing()
    hotplug = HotplugSettings(source="none", poll_s=3600, resync_s=3600, health_hold_down_s=0)
    settings = daemon_settings(kubelet_dir, hotplug=hotplug)
    healthy = {"dev0", "dev1", "dev2"}
    async with running_daemon(settings, [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(FAILING)
        await session.wait_for_update(lambda listed: session.healthy_ids() == healthy)
        for _ in range(scaled(2, 10)):
            scanner.error = OSError(errno.EIO, "Input/output error")
            for _ in range(UNKNOWN_AFTER_FAILURES - 1):
                await daemon.rescan()
            assert daemon.stats.value.advertised[FAILING].keys() == healthy
            assert session.healthy_ids() == healthy
            await daemon.rescan()
            listed = await session.wait_for_update(lambda listed: not session.healthy_ids())
            assert set(listed) == healthy, "never withdrawn"
            reason = daemon.stats.value.advertised[FAILING]["dev0"].health_reason
            assert "state unknown" in reason and "Input/output error" in reason
            scanner.error = None
            await daemon.rescan()
            await session.wait_for_update(lambda listed: session.healthy_ids() == healthy)
        assert all(set(listed) == healthy for listed in session.updates)


async def test_a_device_with_text_that_is_not_utf8_is_skipped_and_the_others_served(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """One device's DEVNAME, another's matched property (ID_BUS) is not UTF-8: each used to
    fail every scan of the scanner, so nothing was served. Now those two are skipped with a
    warning naming their sysfs paths, and the rest are served."""
    paths = [add_usb_serial(host, index=index) for index in range(4)]
    corrupt(host, paths[1], b"DEVNAME=ttyUSB1", b"DEVNAME=ttyUSB\xff1")
    corrupt(host, paths[2], b"ID_BUS=usb", b"ID_BUS=us\xfe")
    scanner = GenericScanner.from_config([SERIAL_ENTRY])
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
            session = await kubelet.wait_for_plugin(SERIAL)
            listed = await session.wait_for_update()
            assert set(listed) == {"ttyUSB0", "ttyUSB3"}
            await daemon.rescan()  # warned once, not at every scan
    unreadable = named(logs, "scan.device.unreadable")
    warnings = [entry["sys_path"] for entry in unreadable if entry["log_level"] == "warning"]
    assert sorted(warnings) == sorted([paths[1], paths[2]]), "one warning each, not per scan"
    assert named(logs, "scan.failed") == []


def corrupt(host: UmockdevHost, sys_path: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` in the device's uevent file (where libudev reads it)."""
    uevent = Path(f"{host.root}{sys_path}/uevent")
    content = uevent.read_bytes()
    assert old in content
    uevent.write_bytes(content.replace(old, new))


def hotplug_settings() -> HotplugSettings:
    return HotplugSettings(source="kernel", coalesce_ms=2, resync_s=3600, poll_s=3600)


async def test_a_uevent_that_is_not_utf8_does_not_lose_the_events_read_with_it(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    scaled: Callable[[int, int], int],
) -> None:
    """Good events and one whose DEVPATH is not UTF-8 arrive in one read: the bad one used to
    raise out of the reader and take the good ones read before it along. Now it is skipped
    (and logged) and every good one is acted on."""
    add_usb_serial(host, index=0)
    scanner = GenericScanner.from_config([SERIAL_ENTRY])
    rounds = scaled(2, 20)
    settings = daemon_settings(kubelet_dir, hotplug=hotplug_settings())
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(settings, [scanner]) as daemon:
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0"})
            for round_ in range(rounds):
                before = add_usb_serial(host, index=2 * round_ + 1)
                after = add_usb_serial(host, index=2 * round_ + 2)
                # No await in between: the reader gets all three in one wake-up.
                host.emit("add", before)
                send_raw(host, bad_devpath_event(host, before))
                host.emit("add", after)
                expected = {f"ttyUSB{i}" for i in range(2 * round_ + 3)}
                await session.wait_for_update(exactly(expected))
            assert daemon.listener.unreadable == rounds
    assert named(logs, "udev.event.unreadable")


def bad_devpath_event(host: UmockdevHost, sys_path: str) -> bytes:
    """An "add" uevent for ``sys_path`` with one byte of its DEVPATH made invalid UTF-8."""
    datagram = encode_udev_message(host.event_properties("add", sys_path))
    devpath = ("DEVPATH=" + sys_path.removeprefix("/sys")).encode()
    assert devpath in datagram
    return datagram.replace(devpath, devpath[:-1] + b"\xff")


def send_raw(host: UmockdevHost, datagram: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for path in host.event_sockets():
            sock.sendto(datagram, path)
