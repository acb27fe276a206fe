"""The udev monitor and the event listener against umockdev's event sockets."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from devplug.hotplug.listener import MonitorSource, UeventListener, choose_source
from devplug.scanners.udev import UdevEvent, UdevMonitor
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial


def test_auto_source_follows_udevd(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert choose_source("auto", control) == "kernel"  # no udevd: its monitor would stay silent
    control.touch()
    assert choose_source("auto", control) == "udev"
    assert choose_source("kernel", control) == "kernel"
    assert choose_source("udev", tmp_path / "absent") == "udev"
    assert choose_source("none", control) is None
    with pytest.raises(ValueError, match="unknown hotplug source"):
        choose_source("netlink", control)


def test_monitor_reads_events_of_its_subsystems_only(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    gpu = add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    monitor = UdevMonitor("kernel", frozenset({"tty"}))
    try:
        host.emit("add", gpu)  # pci: filtered out
        host.emit("add", f"{gpu}/drm/card0")  # drm: filtered out
        host.emit("change", tty)
        host.emit("remove", tty)
        received = monitor.receive(limit=10)
    finally:
        monitor.close()
    assert received.events == (
        UdevEvent("change", tty, "tty"),
        UdevEvent("remove", tty, "tty"),
    )
    assert not received.overflowed
    assert not received.more


def test_monitor_read_stops_at_the_limit(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    monitor = UdevMonitor("udev", None)
    try:
        for _ in range(5):
            host.emit("change", tty)
        first = monitor.receive(limit=3)
        rest = monitor.receive(limit=3)
    finally:
        monitor.close()
    assert len(first.events) == 3 and first.more
    assert len(rest.events) == 2 and not rest.more


def test_monitor_refuses_unknown_sources() -> None:
    with pytest.raises(ValueError, match="'udev' or 'kernel'"):
        UdevMonitor("netlink")


async def test_listener_batches_events_one_per_path(host: UmockdevHost) -> None:
    first = add_usb_serial(host, index=0)
    second = add_usb_serial(host, index=1)
    woken = asyncio.Event()
    listener = UeventListener("kernel", None, woken.set)
    assert listener.open()
    try:
        for action, path in [("add", first), ("change", second), ("change", first)]:
            await host.emit_async(action, path)
        async with asyncio.timeout(5):
            while listener.received < 3:
                await woken.wait()
                woken.clear()
        batch = listener.take()
        # The newest action per path; the order of first arrival is kept.
        assert batch.events == (
            UdevEvent("change", first, "tty"),
            UdevEvent("change", second, "tty"),
        )
        assert not batch.overflowed
        assert not listener.take()  # taken means gone
    finally:
        listener.close()
    assert not listener.active


async def test_listener_without_a_source_never_opens() -> None:
    listener = UeventListener(None, None, lambda: None)
    assert not listener.open()
    assert not listener.active


async def collect(listener: UeventListener, woken: asyncio.Event, count: int) -> float:
    """Wait until ``listener`` has received ``count`` events; return when it had."""
    async with asyncio.timeout(5):
        while listener.received < count:
            await woken.wait()
            woken.clear()
    return time.monotonic()


async def test_kernel_events_come_back_once_each_after_their_own_delay(
    host: UmockdevHost,
) -> None:
    first = add_usb_serial(host, index=0)
    second = add_usb_serial(host, index=1)
    delay = 0.3
    woken = asyncio.Event()
    listener = UeventListener("kernel", None, woken.set, recheck_s=delay)
    assert listener.open()
    try:
        sent_first = time.monotonic()
        await host.emit_async("add", first)
        await collect(listener, woken, 1)
        assert [e.sys_path for e in listener.take().events] == [first]
        await asyncio.sleep(delay / 2)
        sent_second = time.monotonic()
        await host.emit_async("add", second)
        await collect(listener, woken, 2)
        assert [e.sys_path for e in listener.take().events] == [second]

        came_back: dict[str, float] = {}
        async with asyncio.timeout(5):
            while len(came_back) < 2:
                await woken.wait()
                woken.clear()
                now = time.monotonic()
                for event in listener.take().events:
                    assert event.sys_path not in came_back, "re-read twice"
                    came_back[event.sys_path] = now
    finally:
        listener.close()
    # Lower bounds only: each path comes back no earlier than its own delay (a slow machine
    # makes them later, never earlier), so the second is not swept up with the first.
    assert came_back[first] - sent_first >= delay
    assert came_back[second] - sent_second >= delay


async def test_udev_events_are_not_read_again(host: UmockdevHost) -> None:
    tty = add_usb_serial(host, index=0)
    woken = asyncio.Event()
    listener = UeventListener("udev", None, woken.set, recheck_s=0.05)
    assert listener.open()
    try:
        await host.emit_async("add", tty)
        await collect(listener, woken, 1)
        assert listener.take()
        await asyncio.sleep(0.3)  # six times the delay: a recheck would have come
        assert not listener.take()
    finally:
        listener.close()


@pytest.mark.parametrize("source", ["kernel", "udev"])
async def test_a_removal_is_read_again_as_a_look_not_a_second_removal(
    host: UmockdevHost, source: MonitorSource
) -> None:
    """A ``remove`` comes back as a ``change``, from either source: scanners believe a
    removal at once, and the look a while later brings back a device still there (a remove
    event for a device that stays); a second removal could drop a device that came back in
    between without an event of its own (its ``add`` lost to an overflow, say)."""
    tty = add_usb_serial(host, index=0)
    woken = asyncio.Event()
    listener = UeventListener(source, None, woken.set, recheck_s=0.05)
    assert listener.open()
    try:
        await host.emit_async("remove", tty)
        await collect(listener, woken, 1)
        assert listener.take().events == (UdevEvent("remove", tty, "tty"),)
        woken.clear()
        async with asyncio.timeout(5):
            while not (batch := listener.take()):
                await woken.wait()
                woken.clear()
    finally:
        listener.close()
    assert batch.events == (UdevEvent("change", tty, "tty"),)
