"""``python -m devplug.testing kubelet DIR``: the kubelet stand-in a user runs beside
``devplug run``. A real child process, driven through its stdin, sees an in-process daemon
register, list, answer Allocate, re-register after a restart, and stops on ``quit``."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner

SERIAL = "example.com/serial"


def scanner() -> StaticScanner:
    return StaticScanner(
        {
            SERIAL: {
                "ttyUSB0": DeviceInfo(nodes=(DeviceNode("/dev/null"),), numa_nodes=(0,)),
                "ttyUSB1": DeviceInfo(health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/zero"),)),
            }
        }
    )


class Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def line(self) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(30):  # a bound on a hang, not a latency assertion
            raw = await self.process.stdout.readline()
        assert raw, "the console exited"
        return raw.decode().rstrip("\n")

    async def line_starting(self, prefix: str) -> str:
        while not (line := await self.line()).startswith(prefix):
            pass
        return line

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        await self.process.stdin.drain()


@pytest.fixture
async def console(kubelet_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Child]:
    output = getattr(request, "param", "text")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug.testing",
        "kubelet",
        str(kubelet_dir),
        "-o",
        output,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        yield Child(process)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await process.wait()


async def test_registrations_lists_allocate_restart_and_quit(
    console: Child, kubelet_dir: Path
) -> None:
    assert (await console.line()).startswith(f"kubelet: serving {kubelet_dir / 'kubelet.sock'}")
    async with running_daemon(daemon_settings(kubelet_dir), [scanner()]):
        assert await console.line_starting("registered") == (
            f"registered {SERIAL} (devplug-example.com_serial.sock; preferred allocation: yes, "
            "pre-start: no)"
        )
        assert await console.line_starting(SERIAL) == (
            f"{SERIAL}: 2 devices: ttyUSB0 Healthy, ttyUSB1 Unhealthy"
        )
        await console.send(f"allocate {SERIAL} ttyUSB0")
        answer = await console.line_starting(f"{SERIAL}: allocated")
        assert "nodes /dev/null:rw" in answer
        await console.send(f"allocate {SERIAL} ttyUSB1")
        assert (await console.line_starting("error")).startswith("error: INVALID_ARGUMENT")
        await console.send("allocate example.com/none x")
        assert "example.com/none is not registered" in await console.line_starting("error")
        await console.send("restart")
        await console.line_starting("kubelet restarted")
        assert (await console.line_starting("registered")).startswith(f"registered {SERIAL}")
    # The daemon stopped: the kubelet sees its stream end.
    await console.line_starting(f"{SERIAL}: ListAndWatch ended")
    await console.send("quit")
    assert await console.process.wait() == 0
    assert not (kubelet_dir / "kubelet.sock").exists()


@pytest.mark.parametrize("console", ["json"], indirect=True)
async def test_json_lines_for_programs(console: Child, kubelet_dir: Path) -> None:
    assert json.loads(await console.line())["event"] == "serving"
    async with running_daemon(daemon_settings(kubelet_dir), [scanner()]):
        registered = json.loads(await console.line_starting('{"event": "register.accepted"'))
        assert registered["resource"] == SERIAL and registered["preferred_allocation"] is True
        listed = json.loads(await console.line_starting('{"event": "list"'))
        assert [d["id"] for d in listed["devices"]] == ["ttyUSB0", "ttyUSB1"]
        await console.send(f"allocate {SERIAL} ttyUSB0")
        answer = json.loads(await console.line_starting('{"event": "allocate"'))
        assert answer["nodes"][0]["host_path"] == "/dev/null"
    console.process.send_signal(signal.SIGINT)
    assert await console.process.wait() == 0
