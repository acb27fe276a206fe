"""Hotplug end to end: umockdev uevents -> the daemon's monitor -> rescans -> kubelet simulator.

The daemon runs in this process with a real pyudev monitor (umockdev redirects it to the
testbed); events are injected while ListAndWatch streams are open and Allocate calls run.
umockdev 0.17.16 sends no remove events itself, so the tests emit them, children first.
"""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
from helpers import UeventDaemon, uevents

from devplug.daemon import Daemon
from devplug.hotplug.listener import MonitorSource
from devplug.scanners.generic import GenericScanner
from devplug.scanners.udev import UdevMonitor, UdevSource
from devplug.testing import KubeletSimulator, ListedDevice, SimulatorRpcError, eventually
from devplug.testing.umockdev import MockNode, UmockdevHost, add_intel_gpu, add_usb_serial

SERIAL = "example.com/serial"
RENDER = "example.com/render"
RENDER_BASE = 2000  # render minors far above the card minors
ACCEL = "example.com/accel"
ENTRIES: list[dict[str, Any]] = [
    {"resource": SERIAL, "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"}},
    {"resource": RENDER, "match": {"subsystem": "drm", "devnode": "/dev/dri/renderD*"}},
    {"resource": ACCEL, "match": {"subsystem": "accel", "properties": {"DRIVER": "ivpu"}}},
]


def ids(listed: dict[str, ListedDevice]) -> set[str]:
    return set(listed)


async def emit_removal(host: UmockdevHost, sys_path: str) -> None:
    """Remove a device and send its remove events, children first (as the kernel does)."""
    for path in host.remove_device(sys_path):
        await host.emit_async("remove", path)


def add_accel(host: UmockdevHost, index: int, driver: str | None = "ivpu") -> str:
    """An accelerator whose driver can be bound and unbound (class device with a node)."""
    return host.add_device(
        f"/sys/devices/virtual/accel/accel{index}",
        "accel",
        node=MockNode(f"accel/accel{index}", 261, index),
        driver=driver,
    )


@pytest.fixture
def daemon_for(uevent_daemon: UeventDaemon) -> Callable[..., Awaitable[Daemon]]:
    """Factory: an in-process daemon serving ENTRIES (or ``entries``) with the given hotplug
    section (``uevents(...)``)."""

    def start(
        hotplug: Mapping[str, object], entries: list[dict[str, Any]] = ENTRIES, **options: Any
    ) -> Awaitable[Daemon]:
        return uevent_daemon([GenericScanner.from_config(entries)], hotplug, **options)

    return start


async def test_add_and_remove_events_update_the_list_without_full_scans(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    daemon = await daemon_for(uevents())
    assert daemon.listener.active
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})

    added = add_usb_serial(host, index=1)
    # The usb parents were created with the first adapter; announce the new chain, parent first.
    for path in host.devices:
        if added.startswith(path) and "1-2" in path:
            await host.emit_async("add", path)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})

    seen = len(session.updates)
    await emit_removal(host, added.rsplit("/tty/", 1)[0])
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"}, after=seen)
    assert (
        daemon.stats.value.full_scans == 1
    )  # only the start-up scan: events were handled incrementally
    assert daemon.stats.value.incremental_scans >= 2


async def test_the_coalescing_window_ends_when_the_burst_does(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    """coalesce_ms caps the window; it ends once no datagram came for a short quiet gap, so
    an event does not wait out a long cap (10 s here, against a 5 s timeout)."""
    daemon = await daemon_for(uevents(coalesce_ms=10_000))
    added = add_usb_serial(host, index=0)
    before = daemon.listener.last_read
    for path in host.devices:
        if added.startswith(path):
            await host.emit_async("add", path)
    session = await kubelet.wait_for_plugin(SERIAL, timeout=5)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"}, timeout=5)
    assert daemon.listener.last_read > before
    assert daemon.stats.value.full_scans == 1


async def test_allocate_of_a_removed_device_is_an_error(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    gone = add_usb_serial(host, index=1)
    await daemon_for(uevents())
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: "ttyUSB1" in listed)
    assert (await session.allocate(["ttyUSB1"]))[0].nodes[0].host_path == "/dev/ttyUSB1"

    await emit_removal(host, gone)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})
    with pytest.raises(SimulatorRpcError) as refused:
        await session.allocate(["ttyUSB1"])
    assert refused.value.code == "NOT_FOUND"
    assert "ttyUSB1" in refused.value.details
    await session.allocate(["ttyUSB0"])  # and the daemon keeps serving


async def test_last_device_removed_sends_an_empty_list_and_the_socket_goes(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    gpu = add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    daemon = await daemon_for(uevents())
    session = await kubelet.wait_for_plugin(RENDER)
    await session.wait_for_update(lambda listed: ids(listed) == {"dri_renderD128"})
    socket_path = daemon.servers.servers[RENDER].socket_path
    assert socket_path.exists()

    await emit_removal(host, gpu)
    await session.wait_for_update(lambda listed: listed == {})
    async with asyncio.timeout(5):
        await session.stream_ended.wait()
    assert RENDER not in daemon.servers.servers
    await eventually(lambda: not socket_path.exists())
    # The other resource is untouched and still served.
    serial = await kubelet.wait_for_plugin(SERIAL)
    assert ids(serial.latest) == {"ttyUSB0"}


async def test_unbind_and_bind_events_take_a_device_out_and_back(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_accel(host, 0)
    second = add_accel(host, 1)
    await daemon_for(uevents())
    session = await kubelet.wait_for_plugin(ACCEL)
    await session.wait_for_update(lambda listed: ids(listed) == {"accel_accel0", "accel_accel1"})

    host.set_driver(second, None)
    await host.emit_async("unbind", second)
    await session.wait_for_update(lambda listed: ids(listed) == {"accel_accel0"})

    seen = len(session.updates)
    host.set_driver(second, "ivpu")
    await host.emit_async("bind", second)
    await session.wait_for_update(
        lambda listed: ids(listed) == {"accel_accel0", "accel_accel1"}, after=seen
    )


async def test_a_remove_event_takes_the_device_out_while_its_sysfs_dir_is_still_there(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    """The kernel sends a device's ``remove``, then deletes its directory. Here the files stay
    throughout and the re-check of kernel events is a long way off: only the events can
    take the device out, and an ``add`` after them brings it back."""
    kept = f"dri_renderD{RENDER_BASE}"
    gone = f"dri_renderD{RENDER_BASE + 1}"
    add_intel_gpu(host, "0000:00:02.0", card=0, render=RENDER_BASE)
    gpu = add_intel_gpu(host, "0000:00:03.0", card=1, render=RENDER_BASE + 1)
    daemon = await daemon_for(uevents())
    daemon.listener.recheck_s = 3600
    session = await kubelet.wait_for_plugin(RENDER)
    await session.wait_for_update(lambda listed: ids(listed) == {kept, gone})

    order = host.removal_order(gpu)  # card, render minor, then the PCI function
    for path in order:
        await host.emit_async("remove", path)
    await session.wait_for_update(lambda listed: ids(listed) == {kept})
    with pytest.raises(SimulatorRpcError) as refused:
        await session.allocate([gone])
    assert refused.value.code == "NOT_FOUND"

    # Plugged in again under the same paths (parent first): back at once.
    for path in reversed(order):
        await host.emit_async("add", path)
    await session.wait_for_update(lambda listed: ids(listed) == {kept, gone})

    # Removed and plugged in again before the daemon took the events: it stays.
    scans = daemon.stats.value.incremental_scans
    for action, paths in (("remove", order), ("add", order[::-1])):
        for path in paths:
            await host.emit_async(action, path)
    await daemon.stats.wait_for(lambda s: s.incremental_scans > scans, timeout=5)
    await daemon.scan_loop.quiet()
    assert set(daemon.stats.value.advertised[RENDER]) == {kept, gone}
    assert daemon.stats.value.full_scans == 1  # all of it through the events


async def test_a_remove_event_for_a_device_that_stays_is_undone_by_the_next_look(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    """``udevadm trigger --action=remove`` sends a remove for a device that stays: believed
    at once like any removal, then looked at again (here after 0.1 s), found, advertised."""
    add_usb_serial(host, index=0)
    tty = add_usb_serial(host, index=1)
    daemon = await daemon_for(uevents(source="udev"))
    daemon.listener.recheck_s = 0.1
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})
    seen = len(session.updates)
    await host.emit_async("remove", tty)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"}, after=seen)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"}, after=seen)
    assert daemon.stats.value.full_scans == 1  # brought back by the look, not by a resync


async def test_kernel_events_are_read_again_once_udev_has_run(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    ftdi = "example.com/ftdi"
    add_usb_serial(host, index=0)
    entry = {
        "resource": ftdi,
        "match": {"subsystem": "tty", "properties": {"ID_VENDOR_ID": "0403"}},
    }
    daemon = await daemon_for(uevents(source="kernel"), entries=[entry])
    session = await kubelet.wait_for_plugin(ftdi)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})

    tty = add_usb_serial(host, index=1)
    host.set_property(tty, "ID_VENDOR_ID", None)  # the kernel's event comes before udevd's rules
    await host.emit_async("add", tty)
    await daemon.stats.wait_for(lambda s: s.incremental_scans >= 1, timeout=5)
    assert ids(session.latest) == {"ttyUSB0"}
    # udevd has run its rules; its own event does not reach a daemon on kernel events.
    host.set_property(tty, "ID_VENDOR_ID", "0403")
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})
    assert daemon.stats.value.full_scans == 1  # found by the re-read, not by a resync


async def test_a_device_is_advertised_only_once_its_node_exists(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    daemon = await daemon_for(uevents())
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})

    late = add_usb_serial(host, index=1)
    host.set_node_present(late, False)
    scans = daemon.stats.value.incremental_scans
    await host.emit_async("add", late)
    await daemon.stats.wait_for(lambda s: s.incremental_scans > scans, timeout=5)
    before = len(session.updates)
    host.set_node_present(late, True)
    await host.emit_async("change", late)
    listed = await session.wait_for_update(lambda listed: "ttyUSB1" in listed, after=before)
    assert listed["ttyUSB1"].health == "Healthy"
    assert all("ttyUSB1" not in update for update in session.updates[:before])


async def test_health_goes_both_ways_and_recovery_is_held_down(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    # Long enough that no flap below outlasts it, even on a loaded 2-core machine.
    hold_down = 3.0
    tty = add_usb_serial(host, index=0)
    daemon = await daemon_for(uevents(health_hold_down_s=hold_down))
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: "ttyUSB0" in listed)

    async def node(present: bool) -> None:
        """Flip the node and wait until the daemon has rescanned after the event."""
        scans = daemon.stats.value.incremental_scans
        host.set_node_present(tty, present)
        await host.emit_async("change", tty)
        await daemon.stats.wait_for(lambda s: s.incremental_scans > scans, timeout=5)

    await node(False)
    # The scan is done; its list may still be on its way to the simulator.
    await session.wait_for_update(lambda listed: listed["ttyUSB0"].health == "Unhealthy")
    first_bad = next(
        index
        for index, listed in enumerate(session.updates)
        if listed["ttyUSB0"].health == "Unhealthy"
    )
    with pytest.raises(SimulatorRpcError) as refused:
        await session.allocate(["ttyUSB0"])
    assert "unhealthy" in refused.value.details.lower()

    # Flap: every recovery is shorter than the hold-down, so the kubelet is not told of it:
    # not even of the changing reasons ("held down", then the cause again).
    for _ in range(5):
        await node(True)
        await node(False)
    assert len(session.updates) == first_bad + 1
    assert daemon.stats.value.advertised[SERIAL]["ttyUSB0"].health_reason.startswith("device node")
    restored_at = time.perf_counter()
    await node(True)
    await session.wait_for_update(
        lambda listed: listed["ttyUSB0"].health == "Healthy", after=first_bad
    )
    healthy_at = next(
        at
        for at, listed in zip(
            session.update_times[first_bad:], session.updates[first_bad:], strict=True
        )
        if listed["ttyUSB0"].health == "Healthy"
    )
    # A lower bound only: a slow machine makes recovery later, never earlier.
    assert healthy_at - restored_at >= hold_down
    await session.allocate(["ttyUSB0"])


async def test_a_storm_of_1000_events_ends_with_the_hosts_devices(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    """Adds, removes and changes while streams are open and 8 Allocate callers run."""
    rng = random.Random(5)
    present: dict[str, str] = {}  # render id -> PCI path
    for index in range(20):
        pci = add_intel_gpu(host, f"0000:01:{index:02x}.0", card=index, render=RENDER_BASE + index)
        present[f"dri_renderD{RENDER_BASE + index}"] = pci
    daemon = await daemon_for(uevents())
    session = await kubelet.wait_for_plugin(RENDER)
    await session.wait_for_update(lambda listed: ids(listed) == set(present))

    failures: list[str] = []
    stop = asyncio.Event()

    async def allocate_forever() -> int:
        calls = 0
        while not stop.is_set():
            listed = sorted(session.latest)
            if not listed:
                await asyncio.sleep(0)
                continue
            wanted = rng.choice(listed)
            try:
                answer = await session.allocate([wanted])
                if answer[0].nodes[0].host_path != f"/dev/dri/{wanted.removeprefix('dri_')}":
                    failures.append(f"{wanted}: wrong answer {answer}")
            except SimulatorRpcError as exc:
                # Only a device removed since the list was read may be refused.
                if exc.code != "NOT_FOUND":
                    failures.append(f"{wanted}: {exc.code} {exc.details}")
            calls += 1
        return calls

    callers = [asyncio.create_task(allocate_forever()) for _ in range(8)]
    sent = watched = 0
    next_index = 20
    try:
        while sent < 1000:
            roll = rng.random()
            if roll < 0.45 or len(present) < 5:
                index = next_index
                next_index += 1
                bus, slot = divmod(index, 32)
                render = RENDER_BASE + index
                pci = add_intel_gpu(
                    host, f"0000:{bus + 1:02x}:{slot:02x}.0", card=index, render=render
                )
                for path in (pci, f"{pci}/drm/card{index}", f"{pci}/drm/renderD{render}"):
                    await host.emit_async("add", path)
                    sent += 1
                    watched += "/drm/" in path
                present[f"dri_renderD{render}"] = pci
            elif roll < 0.8:
                victim = rng.choice(sorted(present))
                for path in host.remove_device(present.pop(victim)):
                    await host.emit_async("remove", path)
                    sent += 1
                    watched += "/drm/" in path
            else:
                await host.emit_async("change", present[rng.choice(sorted(present))])
                sent += 1
        final = await session.wait_for_update(
            lambda listed: ids(listed) == set(present), after=len(session.updates) - 1
        )
    finally:
        stop.set()
        calls = await asyncio.gather(*callers)
    assert ids(final) == set(present)
    assert all(device.health == "Healthy" for device in final.values())
    assert failures == []
    assert sum(calls) > 0
    # Every drm event reached the daemon (pci ones are filtered out by the monitor's filter).
    assert daemon.listener.received == watched
    assert daemon.stats.value.full_scans == 1
    # What the events built is what a fresh scan of the host finds, to the last field.
    assert daemon.stats.value.advertised == GenericScanner.from_config(ENTRIES).scan(UdevSource())


class _FailingOpener:
    """Opens no monitor while ``denied`` (as when netlink sockets are not allowed)."""

    def __init__(self) -> None:
        self.denied = True
        self.calls = 0

    def __call__(self, source: MonitorSource, subsystems: frozenset[str] | None) -> UdevMonitor:
        self.calls += 1
        if self.denied:
            raise PermissionError(errno.EPERM, "netlink socket denied")
        return UdevMonitor(source, subsystems)


async def test_without_a_monitor_the_daemon_polls_and_retries_the_monitor(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    opener = _FailingOpener()
    daemon = await daemon_for(uevents(poll_s=0.1), monitor_opener=opener)
    assert not daemon.listener.active
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})

    # No event is sent: only polling can find this one.
    add_usb_serial(host, index=1)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})
    assert daemon.stats.value.full_scans >= 2
    assert opener.calls >= 2  # every poll tries the monitor again

    # Once the monitor can be opened, the next poll opens it (and scans fully); from then on
    # events are used and the resync period is long again.
    opener.denied = False
    await eventually(lambda: daemon.listener.active)
    seen = len(session.updates)
    await emit_removal(host, host.devices[-1])
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"}, after=seen)
    # (The full scan after opening may see the removal first; the events follow it.)
    await daemon.stats.wait_for(lambda s: s.incremental_scans >= 1, timeout=5)


class _OverflowingMonitor(UdevMonitor):
    """A real monitor whose next read fails with ENOBUFS, as a kernel socket does on overflow.

    The kernel's ENOBUFS cannot be produced under umockdev (its sockets are unix datagram
    sockets), so this one read is simulated; everything else is the real monitor.
    """

    overflow_next = False
    fail_next = False

    def _receive_one(self) -> Any:
        if _OverflowingMonitor.overflow_next:
            _OverflowingMonitor.overflow_next = False
            raise OSError(errno.ENOBUFS, "No buffer space available")
        if _OverflowingMonitor.fail_next:
            _OverflowingMonitor.fail_next = False
            raise OSError(errno.EBADF, "Bad file descriptor")
        return super()._receive_one()


async def test_socket_overflow_leads_to_a_full_rescan(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    daemon = await daemon_for(uevents(), monitor_opener=_OverflowingMonitor)
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})

    # A device whose event was "lost": only a full rescan can find it.
    add_usb_serial(host, index=1)
    _OverflowingMonitor.overflow_next = True
    await host.emit_async("change", host.devices[0])
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})
    assert daemon.stats.value.full_scans == 2
    assert daemon.listener.overflows == 1
    assert daemon.listener.active  # overflow is not a reason to stop listening


async def test_a_failing_monitor_is_closed_then_reopened_by_polling(
    host: UmockdevHost, kubelet: KubeletSimulator, daemon_for: Any
) -> None:
    add_usb_serial(host, index=0)
    daemon = await daemon_for(uevents(poll_s=0.1), monitor_opener=_OverflowingMonitor)
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0"})
    _OverflowingMonitor.fail_next = True
    await host.emit_async("change", host.devices[0])
    await daemon.stats.wait_for(lambda s: s.full_scans >= 2, timeout=5)
    await eventually(lambda: daemon.listener.active)
    add_usb_serial(host, index=1)
    await host.emit_async("add", host.devices[-1])
    await session.wait_for_update(lambda listed: ids(listed) == {"ttyUSB0", "ttyUSB1"})
