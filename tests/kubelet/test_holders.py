"""The daemon follows who holds its devices (the kubelet stand-in's pod resources API): one log
line and a metric when a held device turns unhealthy or is unplugged, the drift check against
the kubelet's allocatable set, and carrying on without the API. Real udev code against
umockdev hardware where the device changes; the stand-in over real unix sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from devplug.config import HotplugSettings
from devplug.daemon import Daemon
from devplug.kubelet.holders import Drift, HeldDevice, HoldersReport, HolderTiming
from devplug.kubelet.podresources import Holder, default_socket
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.ops.control import ask
from devplug.scanners.generic import GenericScanner
from devplug.testing import KubeletSimulator, daemon_settings
from devplug.testing.harness import DaemonStarter, StaticScanner, in_process_daemon
from devplug.testing.podresources import PodResourcesGates
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

SERIAL = "example.com/serial"
ENTRIES: list[dict[str, Any]] = [
    {"resource": SERIAL, "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"}}
]
# Reads soon after each change, so the tests wait less; the logic is the node's.
QUICK = HolderTiming(period_s=3600, absent_period_s=3600, settle_s=0.05)
FRONT = Holder("web", "front", "app")
Logs = list[MutableMapping[str, Any]]


@pytest.fixture
def logs() -> Iterator[Logs]:
    with structlog.testing.capture_logs() as captured:
        yield captured


def events(logs: Logs, name: str) -> Logs:
    """The lines logged as ``name`` at info level or above (repeats go out at debug)."""
    return [e for e in logs if e["event"] == name and e["log_level"] != "debug"]


def metric(daemon: Daemon, name: str, **labels: str) -> float | None:
    """A sample of the daemon's /metrics text (None: no such series)."""
    for family in text_string_to_metric_families(daemon.metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


@pytest.fixture
def serial_daemon(
    host: UmockdevHost, kubelet_dir: Path, start_daemon: DaemonStarter
) -> Callable[[], Awaitable[Daemon]]:
    """A daemon serving the mock host's USB serial adapters, udev events on."""

    async def start() -> Daemon:
        hotplug = HotplugSettings(
            source="kernel", coalesce_ms=2, resync_s=3600, poll_s=3600, health_hold_down_s=0
        )
        daemon = await start_daemon(
            daemon_settings(kubelet_dir, hotplug=hotplug), [GenericScanner.from_config(ENTRIES)]
        )
        daemon.holders.timing = QUICK
        return daemon

    return start


async def test_a_held_device_turning_unhealthy_is_said_once_counted_and_cleared(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    serial_daemon: Callable[[], Awaitable[Daemon]],
    logs: Logs,
) -> None:
    tty = add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    daemon = await serial_daemon()
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: len(listed) == 2)
    await kubelet.allocate(SERIAL, ["ttyUSB0"], pod="web/front", container="app")

    host.set_node_present(tty, False)  # the node vanishes: the device turns unhealthy
    await host.emit_async("change", tty)
    held = HeldDevice(SERIAL, "ttyUSB0", FRONT)
    # No call from the test: the new tree alone makes the daemon read the API.
    report = await daemon.holders.report.wait_for(lambda r: bool(r.unhealthy_in_use), 10)
    assert report.unhealthy_in_use == {held} and report.gone_while_allocated == frozenset()
    assert report.in_use == {SERIAL: 1}
    (said,) = events(logs, "podresources.device.unhealthy_in_use")
    assert (said["namespace"], said["pod"], said["container"]) == ("web", "front", "app")
    assert (said["resource"], said["device"], said["log_level"]) == (SERIAL, "ttyUSB0", "warning")
    name = "devplug_devices_unhealthy_in_use"
    assert metric(daemon, name, resource=SERIAL) == 1
    assert metric(daemon, "devplug_devices_in_use", resource=SERIAL) == 1
    assert metric(daemon, "devplug_pod_resources_up") == 1

    await daemon.holders.read_now()  # nothing changed: nothing more is said
    assert len(events(logs, "podresources.device.unhealthy_in_use")) == 1

    host.set_node_present(tty, True)
    await host.emit_async("change", tty)
    await daemon.holders.report.wait_for(lambda r: not r.unhealthy_in_use, 10)
    (cleared,) = events(logs, "podresources.device.cleared")
    assert (cleared["was"], cleared["now"], cleared["device"]) == (
        "unhealthy_in_use",
        "healthy",
        "ttyUSB0",
    )
    assert metric(daemon, name, resource=SERIAL) == 0


async def test_an_unplugged_device_still_held_is_gone_while_allocated_until_released(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    serial_daemon: Callable[[], Awaitable[Daemon]],
    logs: Logs,
) -> None:
    add_usb_serial(host, index=0)
    tty1 = add_usb_serial(host, index=1)
    daemon = await serial_daemon()
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: len(listed) == 2)
    await kubelet.allocate(SERIAL, ["ttyUSB1"], pod="web/front", container="app")

    await host.unplug(tty1.rsplit("/tty/", 1)[0])  # the adapter leaves, with its events
    await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0"})
    report = await daemon.holders.report.wait_for(lambda r: bool(r.gone_while_allocated), 10)
    assert report.gone_while_allocated == {HeldDevice(SERIAL, "ttyUSB1", FRONT)}
    (said,) = events(logs, "podresources.device.gone_while_allocated")
    assert (said["device"], said["pod"], said["log_level"]) == ("ttyUSB1", "front", "warning")
    assert metric(daemon, "devplug_devices_gone_while_allocated", resource=SERIAL) == 1

    kubelet.release("web/front")  # the pod ended
    report = await daemon.holders.read_now()
    assert report.gone_while_allocated == frozenset() and report.in_use == {}
    (cleared,) = events(logs, "podresources.device.cleared")
    assert (cleared["was"], cleared["now"]) == ("gone_while_allocated", "released")
    assert metric(daemon, "devplug_devices_gone_while_allocated", resource=SERIAL) == 0
    assert metric(daemon, "devplug_devices_in_use", resource=SERIAL) == 0


def two_serials() -> StaticScanner:
    return StaticScanner(
        {SERIAL: {i: DeviceInfo(nodes=(DeviceNode("/dev/null"),)) for i in ("a", "b")}}
    )


async def test_drift_counts_once_seen_twice_and_clears(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, logs: Logs
) -> None:
    daemon = await start_daemon(daemon_settings(kubelet_dir), [two_serials()])
    daemon.holders.timing = QUICK
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    await daemon.stats.wait_for(lambda s: SERIAL in s.advertised, 10)
    report = await daemon.holders.read_now()
    assert report.drift == {}  # in step
    assert (
        metric(daemon, "devplug_kubelet_allocatable_drift", resource=SERIAL, direction="missing")
        == 0
    )

    kubelet.pin_allocatable(SERIAL, ["a", "stale"])  # the kubelet's view went out of step
    first = await daemon.holders.read_now()
    assert first.drift == {}  # once is not enough: it may be a list on its way
    second = await daemon.holders.read_now()
    assert second.drift == {SERIAL: Drift(frozenset({"b"}), frozenset({"stale"}))}
    (found,) = events(logs, "podresources.drift.found")
    assert (found["missing"], found["extra"], found["missing_ids"], found["extra_ids"]) == (
        1,
        1,
        ["b"],
        ["stale"],
    )
    missing = metric(
        daemon, "devplug_kubelet_allocatable_drift", resource=SERIAL, direction="missing"
    )
    extra = metric(daemon, "devplug_kubelet_allocatable_drift", resource=SERIAL, direction="extra")
    assert (missing, extra) == (1, 1)

    await daemon.holders.read_now()
    assert len(events(logs, "podresources.drift.found")) == 1  # the same drift: said once
    kubelet.pin_allocatable(SERIAL, None)
    assert (await daemon.holders.read_now()).drift == {}
    assert [e["resource"] for e in events(logs, "podresources.drift.cleared")] == [SERIAL]
    assert (
        metric(daemon, "devplug_kubelet_allocatable_drift", resource=SERIAL, direction="missing")
        == 0
    )


async def test_without_the_api_the_daemon_says_so_once_and_carries_on(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, logs: Logs
) -> None:
    await kubelet.pod_resources.stop()  # a kubelet without the API, or a pod without the mount
    daemon = await start_daemon(daemon_settings(kubelet_dir), [two_serials()])
    daemon.holders.timing = QUICK
    report = await daemon.holders.read_now()
    await daemon.holders.read_now()
    # It serves all the same.
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    (answer,) = await session.allocate(["a"])
    assert answer.nodes
    assert metric(daemon, "devplug_pod_resources_up") == 0
    assert report.state == "absent" and report.reason is not None
    assert (
        report.reason
        == f"no {default_socket(kubelet_dir).name} in {kubelet_dir.parent / 'pod-resources'}"
    )
    (said,) = events(logs, "podresources.unavailable")  # two readings, one line
    assert said["log_level"] == "info" and said["state"] == "absent"
    assert said["retry_in_s"] == QUICK.absent_period_s


async def test_a_kubelet_without_allocatable_gives_holders_but_no_drift(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, logs: Logs
) -> None:
    # As a kubelet with KubeletPodResourcesGetAllocatable off answers.
    kubelet.pod_resources.lister.gates = PodResourcesGates(get_allocatable=False)
    daemon = await start_daemon(daemon_settings(kubelet_dir), [two_serials()])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    await daemon.stats.wait_for(lambda s: SERIAL in s.advertised, 10)
    await kubelet.allocate(SERIAL, ["b"], pod="web/front", container="app")
    reports: list[HoldersReport] = [await daemon.holders.read_now() for _ in range(2)]
    assert all(r.drift is None for r in reports)
    assert reports[-1].in_use == {SERIAL: 1} and reports[-1].state == "available"
    drift = metric(
        daemon, "devplug_kubelet_allocatable_drift", resource=SERIAL, direction="missing"
    )
    assert drift is None  # unknown, not 0
    (said,) = events(logs, "podresources.allocatable.unavailable")
    assert said["reason"] == "UNKNOWN: Pod Resources API GetAllocatableResources disabled"


@pytest.mark.parametrize("gone", ["socket", "dir"])
async def test_a_socket_made_after_it_was_absent_is_read_at_once(
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    start_daemon: DaemonStarter,
    logs: Logs,
    gone: str,
) -> None:
    # A kubelet restarting (its socket gone a moment), or starting after devplug at boot (its
    # pod-resources dir not made yet): the slow re-check (an hour here) must not be the wait.
    await kubelet.pod_resources.stop()
    socket = default_socket(kubelet_dir)
    if gone == "dir":
        socket.parent.rmdir()
    daemon = await start_daemon(daemon_settings(kubelet_dir), [two_serials()])
    daemon.holders.timing = QUICK
    await daemon.holders.report.wait_for(lambda r: r.state == "absent", 10)

    await kubelet.pod_resources.start()
    await kubelet.allocate(SERIAL, ["a"], pod="web/front", container="app")
    report = await daemon.holders.report.wait_for(lambda r: r.state == "available", 10)
    assert report.in_use == {SERIAL: 1}
    assert metric(daemon, "devplug_pod_resources_up") == 1
    (said,) = events(logs, "podresources.available")
    assert said["socket"] == str(socket)


async def test_the_kubelet_answering_allocatable_again_is_said(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, logs: Logs
) -> None:
    lister = kubelet.pod_resources.lister
    lister.gates = PodResourcesGates(get_allocatable=False)
    daemon = await start_daemon(daemon_settings(kubelet_dir), [two_serials()])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    await daemon.holders.read_now()
    await daemon.holders.read_now()
    assert len(events(logs, "podresources.allocatable.unavailable")) == 1

    lister.gates = PodResourcesGates()  # the kubelet upgraded, or its gate turned on
    assert (await daemon.holders.read_now()).drift == {}
    (said,) = events(logs, "podresources.allocatable.available")
    assert said["log_level"] == "info"

    lister.gates = PodResourcesGates(get_allocatable=False)  # and off again: said again
    await daemon.holders.read_now()
    assert len(events(logs, "podresources.allocatable.unavailable")) == 2


async def test_a_cordoned_device_in_use_is_told_from_a_faulty_one(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, logs: Logs
) -> None:
    scanner = two_serials()
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    daemon.holders.timing = QUICK
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await kubelet.allocate(SERIAL, ["a"], pod="web/front", container="app")
    await kubelet.allocate(SERIAL, ["b"], pod="batch/job", container="worker")

    # The operator drains "a" through the daemon's control channel (devplug cordon's way).
    answer = await ask(
        daemon.control.path,
        {"op": "cordon", "resource": SERIAL, "id": "a", "reason": "bad cable"},
        timeout=10,
    )
    assert answer["ok"], answer
    # "b" fails on its own.
    null = (DeviceNode("/dev/null"),)
    scanner.set(
        {
            SERIAL: {
                "a": DeviceInfo(nodes=null),
                "b": DeviceInfo(health=Health.UNHEALTHY, health_reason="fan failed", nodes=null),
            }
        }
    )
    await daemon.rescan()
    report = await daemon.holders.report.wait_for(lambda r: len(r.unhealthy_in_use) == 2, 10)
    drained = HeldDevice(SERIAL, "a", FRONT)
    assert report.cordoned_in_use == {drained}

    said = {e["device"]: e for e in events(logs, "podresources.device.unhealthy_in_use")}
    assert (said["a"]["reason"], said["a"]["cordoned"]) == ("cordoned: bad cable", True)
    assert said["a"]["log_level"] == "info"  # a drain the operator started
    assert (said["b"]["reason"], said["b"]["cordoned"]) == ("fan failed", False)
    assert said["b"]["log_level"] == "warning"
    # The faulty one alone counts as unhealthy in use (the alert's), the cordoned one apart.
    assert metric(daemon, "devplug_devices_unhealthy_in_use", resource=SERIAL) == 1
    assert metric(daemon, "devplug_devices_cordoned_in_use", resource=SERIAL) == 1

    kubelet.release("web/front")  # the drain is done
    await daemon.holders.read_now()
    assert metric(daemon, "devplug_devices_cordoned_in_use", resource=SERIAL) == 0
    assert metric(daemon, "devplug_devices_unhealthy_in_use", resource=SERIAL) == 1


async def test_devices_advertised_unhealthy_are_not_extra_to_an_old_kubelet(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    null = (DeviceNode("/dev/null"),)
    scanner = StaticScanner(
        {
            SERIAL: {
                "a": DeviceInfo(nodes=null),
                "b": DeviceInfo(health=Health.UNHEALTHY, health_reason="fan failed", nodes=null),
            }
        }
    )
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
    await daemon.stats.wait_for(lambda s: SERIAL in s.advertised, 10)
    # A kubelet before 1.23 lists unhealthy devices as allocatable (kubernetes#104122); one
    # that offers an id devplug does not advertise at all still drifts.
    kubelet.pin_allocatable(SERIAL, ["a", "b"])
    reports = [await daemon.holders.read_now() for _ in range(2)]
    assert reports[-1].drift == {}
    kubelet.pin_allocatable(SERIAL, ["a", "b", "stale"])
    reports = [await daemon.holders.read_now() for _ in range(2)]
    assert reports[-1].drift == {SERIAL: Drift(frozenset(), frozenset({"stale"}))}


async def test_a_device_unplugged_while_devplug_was_down_is_gone_while_allocated(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path, logs: Logs
) -> None:
    tty = add_usb_serial(host, index=0)
    settings = daemon_settings(kubelet_dir)
    async with in_process_daemon(settings, [GenericScanner.from_config(ENTRIES)]):
        await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
        await kubelet.allocate(SERIAL, ["ttyUSB0"], pod="web/front", container="app")
    await host.unplug(tty.rsplit("/tty/", 1)[0])  # while devplug is down

    # Started again, it finds no device of the resource, so never advertises it: the
    # configured scanner's declaration makes the resource devplug's all the same.
    async with in_process_daemon(settings, [GenericScanner.from_config(ENTRIES)]) as daemon:
        assert SERIAL not in daemon.stats.value.advertised
        report = await daemon.holders.read_now()
    assert report.gone_while_allocated == {HeldDevice(SERIAL, "ttyUSB0", FRONT)}
    (said,) = events(logs, "podresources.device.gone_while_allocated")
    assert said["device"] == "ttyUSB0"


async def test_a_run_of_changes_is_read_once_it_pauses_not_during_it(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    serial_daemon: Callable[[], Awaitable[Daemon]],
) -> None:
    """A reading is tens of milliseconds of decoding at 10,000 devices: during a hotplug storm
    it waits for the storm to pause, rather than landing in every few events."""
    tty = add_usb_serial(host, index=0)
    daemon = await serial_daemon()
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: len(listed) == 1)
    await daemon.holders.report.wait_for(lambda r: r.state == "available", 10)
    daemon.holders.timing = HolderTiming(period_s=3600, absent_period_s=3600, settle_s=1.0)
    lists = kubelet.pod_resources.lister.calls
    before = -1
    while lists["List"] != before:  # until the start's own readings are done
        before = lists["List"]
        await asyncio.sleep(0.5)

    for change in range(25):  # 2.5 s of changes, 0.1 s apart: each one a new tree
        host.set_node_present(tty, change % 2 == 1)
        await host.emit_async("change", tty)
        await asyncio.sleep(0.1)
    assert lists["List"] == before  # none while the changes went on

    deadline = asyncio.get_running_loop().time() + 10
    while lists["List"] == before:
        assert asyncio.get_running_loop().time() < deadline, "no reading after the changes"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert lists["List"] == before + 1  # one, for the whole run
