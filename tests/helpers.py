"""Helpers that several test modules share; the fixtures built on them are in conftest.py.

Test modules import this as ``helpers`` (tests/ is on the path, as for ``cdi_library``).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from devplug import DeviceInfo
from devplug.daemon import Daemon
from devplug.testing import ListedDevice, StaticScanner

# The hotplug section of a test driven by uevents (``daemon_settings(..., hotplug=UEVENTS)``):
# the kernel's uevents as the mock host sends them, coalesced for 2 ms, and health changes
# advertised at once; no periodic rescans (daemon_settings keeps resync and poll off).
UEVENTS: Mapping[str, object] = {"source": "kernel", "coalesce_ms": 2, "health_hold_down_s": 0}


# The uevent_daemon fixture: (scanners, hotplug=None, **in_process_daemon's options) -> the
# daemon, serving the mock host's devices and driven by its uevents (UEVENTS, with hotplug's
# keys over them).
UeventDaemon = Callable[..., Awaitable[Daemon]]


# How long a command may take before the test fails: a command is answered in a second or two;
# this is for a loaded machine, not for a command that hangs.
COMMAND_TIMEOUT_S = 60.0


async def run_devplug(
    *args: str, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """``devplug ARGS`` in a child process, as an operator runs a command: (exit status,
    stdout, stderr). ``env`` is added to this process's environment. (A daemon that runs
    until stopped is :func:`devplug.testing.daemon_process`'s.)"""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def uevents(**overrides: object) -> dict[str, object]:
    """:data:`UEVENTS` with ``overrides`` (``uevents(coalesce_ms=10_000)``)."""
    return {**UEVENTS, **overrides}


def health(listed: Mapping[str, ListedDevice]) -> dict[str, str]:
    """Each listed device's health, as the kubelet saw it (``Healthy`` or ``Unhealthy``)."""
    return {device_id: device.health for device_id, device in listed.items()}


# What a preferred-allocation double answers: (available, must_include, size, devices) -> ids.
Pick = Callable[[Sequence[str], Sequence[str], int, Mapping[str, DeviceInfo]], object]


class PreferringScanner(StaticScanner):
    """A :class:`StaticScanner` whose GetPreferredAllocation hook answers with ``pick``."""

    def __init__(
        self, resources: Mapping[str, Mapping[str, DeviceInfo]], pick: Pick, name: str = "static"
    ) -> None:
        super().__init__(resources)
        self.pick = pick
        self.name = name

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> object:
        return self.pick(available, must_include, size, devices)
