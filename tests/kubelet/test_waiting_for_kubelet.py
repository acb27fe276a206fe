"""A server waiting for a kubelet says so at once, again at a slowing bounded pace, and how
long it waited when it registers (issue 25: it said so once, then nothing for hours)."""

from __future__ import annotations

import itertools
import time
from collections.abc import MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from devplug.kubelet.server import DEFAULT_TIMING
from devplug.kubelet.waiting import KubeletWait
from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import (
    FAST_TIMING,
    KubeletSimulator,
    StaticScanner,
    daemon_settings,
    eventually,
)
from devplug.testing.harness import in_process_daemon

SERIAL = "example.com/serial"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reminders_come_after_a_minute_then_doubling_up_to_fifteen_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    wait = KubeletWait(
        DEFAULT_TIMING.waiting_reminder_initial_s, DEFAULT_TIMING.waiting_reminder_max_s
    )
    log = structlog.get_logger("test")
    said: list[tuple[float, MutableMapping[str, Any]]] = []
    with structlog.testing.capture_logs() as logs:
        # The server wakes up at least every 60 s (the stat backstop), and when told to.
        while clock.now < 1000.0 + 3 * 3600:
            before = len(logs)
            next_in = wait.note(log, "no kubelet.sock", "/dir")
            said += [(clock.now - 1000.0, entry) for entry in logs[before:]]
            clock.now += min(next_in, 60.0)
    times = [moment for moment, _ in said]
    assert times[:7] == [0, 60, 180, 420, 900, 1800, 2700]  # +60, 120, 240, 480, 900, 900
    assert all(b - a == 900 for a, b in itertools.pairwise(times[5:]))
    assert "waited_s" not in said[0][1]
    assert [entry["waited_s"] for _, entry in said[1:4]] == [60, 180, 420]
    assert {entry["reason"] for _, entry in said} == {"no kubelet.sock"}
    wait.over()
    assert wait.waited_s == clock.now - 1000.0
    wait.said()
    assert wait.waited_s is None


def test_a_missing_dir_is_left_to_the_watcher_at_first_but_reminded_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    wait = KubeletWait(60.0, 900.0)
    with structlog.testing.capture_logs() as logs:
        wait.note(structlog.get_logger("test"), "dir missing", "/dir")
        assert logs == []  # kubelet.dir.missing (the watcher's) said it
        clock.now += 60
        wait.note(structlog.get_logger("test"), "dir missing", "/dir")
        clock.now += 1
        wait.note(structlog.get_logger("test"), "no kubelet.sock", "/dir")  # the dir is back
    assert [(e["reason"], e.get("waited_s")) for e in logs] == [
        ("dir missing", 60),
        ("no kubelet.sock", None),
    ]


async def test_a_daemon_waiting_for_the_kubelet_keeps_saying_so_and_how_long_it_waited(
    kubelet_dir: Path,
) -> None:
    timing = replace(FAST_TIMING, waiting_reminder_initial_s=0.05, waiting_reminder_max_s=0.2)
    scanner = StaticScanner({SERIAL: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})

    def said() -> list[MutableMapping[str, Any]]:
        return [e for e in logs if e["event"] == "kubelet.waiting"]

    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(daemon_settings(kubelet_dir), [scanner], timing=timing):
            await eventually(lambda: len(said()) >= 5, what="five kubelet.waiting lines")
            first, *reminders = said()
            assert first["reason"] == "no kubelet.sock" and "waited_s" not in first
            assert first["resource"] == SERIAL and first["dir"] == str(kubelet_dir)
            waited = [e["waited_s"] for e in reminders]
            assert waited == sorted(waited) and waited[0] > 0
            async with KubeletSimulator(kubelet_dir) as kubelet:
                await kubelet.wait_for_plugin(SERIAL)
    (complete,) = [e for e in logs if e["event"] == "kubelet.register.complete"]
    assert complete["waited_s"] >= waited[-1]
