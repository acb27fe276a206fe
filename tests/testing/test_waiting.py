"""Waiting in tests: ``eventually`` returns once the condition holds; a wait that runs out
(``eventually``, the kubelet simulator's) says what it waited for, what it saw, and what the
in-test daemon last logged as a problem."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from devplug.model import DeviceInfo, DeviceNode, DeviceTree
from devplug.scanners.udev import UdevSource
from devplug.testing import (
    KubeletSimulator,
    StaticScanner,
    daemon_settings,
    eventually,
    running_daemon,
)
from devplug.testing.daemon_log import daemon_note

SERIAL = "example.com/serial"


async def test_eventually_returns_once_the_condition_holds() -> None:
    calls = 0

    def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    await eventually(third_time, timeout=5, interval=0)
    assert calls == 3


async def test_eventually_times_out_when_the_condition_never_holds() -> None:
    with pytest.raises(TimeoutError):
        await eventually(lambda: False, timeout=0.05)


async def test_eventually_lets_the_loop_run_between_checks() -> None:
    done = asyncio.Event()
    asyncio.get_running_loop().call_soon(done.set)
    await eventually(done.is_set, timeout=5, interval=0)


async def test_eventually_names_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError) as named:
        await eventually(lambda: False, timeout=0.05, what="the spec file to appear")
    assert str(named.value) == (
        "timed out after 0.05 s waiting for the spec file to appear: it was still false"
    )

    def never() -> bool:
        return False

    with pytest.raises(TimeoutError) as unnamed:
        await eventually(never, timeout=0.05)
    assert str(unnamed.value) == (
        "timed out after 0.05 s waiting for never at "
        f"test_waiting.py:{never.__code__.co_firstlineno}: it was still false"
    )


async def test_a_timeout_raised_inside_the_condition_is_not_renamed() -> None:
    def broken() -> bool:
        raise TimeoutError("the condition's own")

    with pytest.raises(TimeoutError, match=r"^the condition's own$"):
        await eventually(broken, timeout=5)


class BrokenScanner(StaticScanner):
    """What a plugin author's scanner does when it calls the udev view wrongly."""

    name = "broken"

    def scan(self, source: UdevSource) -> DeviceTree:
        raise ValueError("attribute names are plain file names, got 'loop/backing_file'")


async def test_a_timed_out_wait_quotes_what_the_daemon_logged(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [BrokenScanner()]):
        with pytest.raises(TimeoutError) as waited:
            await kubelet.wait_for_plugin(SERIAL, timeout=0.5)
        message = str(waited.value)
        assert message.startswith(
            f"timed out after 0.5 s waiting for {SERIAL} to register with the kubelet "
            f"simulator in {kubelet_dir} (kubelet generation 0): no Register call named it "
            "(Register calls: none)"
        )
        assert "the in-test daemon's last warnings and errors (newest last):" in message
        assert "scan.failed [error] scanner=broken" in message
        assert "ValueError: attribute names are plain file names" in message
        assert "'loop/backing_file'" in message

    # The next daemon starts with a clean record, and one that logged nothing says so.
    scanner = StaticScanner({SERIAL: {"ttyUSB0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        with pytest.raises(TimeoutError) as waited:
            await session.wait_for_update(lambda listed: "ttyUSB9" in listed, timeout=0.2)
        message = str(waited.value)
        assert f"waiting for a ListAndWatch list of {SERIAL} matching <lambda> at " in message
        assert "got 1 lists, the last with 1 devices (ttyUSB0)" in message
        assert message.endswith("\nthe in-test daemon logged no warning or error")
        assert "scan.failed" not in message

    # No daemon running: nothing of one to quote, and the recorder is out of structlog's chain.
    assert daemon_note() == ""
    processors = structlog.get_config()["processors"]
    assert not any(type(p).__name__ == "_Recorder" for p in processors)
    with pytest.raises(TimeoutError) as waited:
        await kubelet.wait_for_plugin("example.com/other", timeout=0.1)
    assert str(waited.value).endswith(f"no Register call named it (Register calls: {SERIAL})")


async def test_the_daemons_problems_reach_a_test_capturing_logs(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """structlog.testing.capture_logs around the daemon still sees every event."""
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [BrokenScanner()]):
            with pytest.raises(TimeoutError, match=r"scan\.failed \[error\]"):
                await kubelet.wait_for_plugin(SERIAL, timeout=0.2)
    assert any(e["event"] == "scan.failed" and e["log_level"] == "error" for e in logs)
