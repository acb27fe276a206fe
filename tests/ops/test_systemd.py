"""The systemd unit verifies and is hardened; the notify protocol is spoken in order.

A unix datagram socket stands in for systemd's NOTIFY_SOCKET: the daemon (in-process, or as a
``devplug run`` process) sends its messages there.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from devplug.daemon import Daemon
from devplug.model import DeviceInfo, DeviceNode
from devplug.ops.systemd import SENT_KEPT, SystemdNotifier
from devplug.testing import KubeletSimulator, daemon_process, daemon_settings
from devplug.testing.harness import StaticScanner

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "devplug.service"
DEVPLUG = Path(sys.executable).with_name("devplug")
SERIAL = "example.com/serial"


def unit_here(tmp_path: Path) -> Path:
    """The shipped unit with ExecStart pointing at this venv's devplug (verify checks that
    the command exists)."""
    text = UNIT.read_text().replace("/usr/local/bin/devplug", str(DEVPLUG))
    path = tmp_path / "devplug.service"
    path.write_text(text)
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing: .ci/run installs the systemd package"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_unit_verifies_silently(tmp_path: Path) -> None:
    result = analyze("verify", str(unit_here(tmp_path)))
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result


def test_the_unit_is_rated_5_or_better(tmp_path: Path) -> None:
    result = analyze("security", "--offline=true", str(unit_here(tmp_path)))
    found = re.search(r"Overall exposure level for devplug.service: ([0-9.]+)", result.stdout)
    assert found is not None, result.stdout[-500:]
    assert float(found.group(1)) <= 5.0, result.stdout[-2000:]


def test_the_unit_is_a_notify_service_with_a_watchdog() -> None:
    settings = dict(
        line.split("=", 1)
        for line in UNIT.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify" and settings["WatchdogSec"] == "30s"
    assert "--config /etc/devplug/config.yaml" in settings["ExecStart"]
    assert settings["CapabilityBoundingSet"] == ""
    assert settings["ReadWritePaths"] == "-/var/lib/kubelet/device-plugins -/run/cdi"


# ---------------------------------------------------------------------------- notify


@pytest.fixture
def notify_socket(short_dir: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(short_dir / "notify"))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


async def next_message(sock: socket.socket, timeout: float = 10.0) -> str:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        data = await loop.sock_recv(sock, 4096)
    return data.decode()


async def messages_until(sock: socket.socket, wanted: str) -> list[str]:
    """Every message up to and including the first that contains ``wanted``."""
    seen = []
    while True:
        message = await next_message(sock)
        seen.append(message)
        if wanted in message.splitlines():
            return seen


def serial() -> StaticScanner:
    return StaticScanner({SERIAL: {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}})


async def next_status(sock: socket.socket) -> str:
    """The next message that is not a watchdog ping."""
    while (message := await next_message(sock)) == "WATCHDOG=1":
        pass
    return message


async def readyz(port: int) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    async with asyncio.timeout(10):
        answer = (await reader.read()).decode()
    writer.close()
    head, _, body = answer.partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


WAITING = "STATUS=serving 1 resource(s); waiting for the kubelet to register 1"
REGISTERED = "STATUS=serving 1 resource(s), all registered"


async def test_ready_without_a_kubelet_then_status_follows_registration(
    kubelet_dir: Path, notify_socket: socket.socket
) -> None:
    """READY=1 comes before any kubelet exists (a unit waiting for it would hold up boot);
    STATUS= and /readyz then tell "serving, waiting for the kubelet" from "serving and
    registered", through a kubelet restart, with watchdog pings all along."""
    environ = {
        "NOTIFY_SOCKET": notify_socket.getsockname(),
        "WATCHDOG_USEC": "200000",  # pinged every 0.1 s
        "WATCHDOG_PID": str(os.getpid()),
    }
    notifier = SystemdNotifier(environ)
    assert notifier.watchdog_s == 0.2
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    daemon = Daemon(settings, [serial()], notifier=notifier)
    task = asyncio.create_task(daemon.run())
    try:
        assert await next_status(notify_socket) == "STATUS=scanning"
        assert await next_status(notify_socket) == f"READY=1\n{WAITING}"
        assert daemon.http is not None
        port = daemon.http.port
        assert await readyz(port) == (
            503,
            f"not ready: serving, waiting for the kubelet: {SERIAL} (not registered)\n",
        )
        async with KubeletSimulator(kubelet_dir) as kubelet:
            assert await next_status(notify_socket) == REGISTERED
            assert await readyz(port) == (200, "ready\n")
            pings = [await next_message(notify_socket) for _ in range(2)]
            assert pings == ["WATCHDOG=1", "WATCHDOG=1"]

            await kubelet.stop()
            for entry in os.scandir(kubelet_dir):  # as a restarting kubelet wipes the sockets
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            assert await next_status(notify_socket) == WAITING
            assert (await readyz(port))[0] == 503
            await kubelet.start()
            assert await next_status(notify_socket) == REGISTERED

            daemon.request_stop()
            rest = await messages_until(notify_socket, "STOPPING=1")
            assert rest[-1] == "STOPPING=1\nSTATUS=stopping"
        await task
    finally:
        daemon.request_stop()
        await asyncio.wait({task})


async def test_no_devices_is_ready_at_once(kubelet_dir: Path, notify_socket: socket.socket) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": notify_socket.getsockname()})
    daemon = Daemon(daemon_settings(kubelet_dir), [StaticScanner({})], notifier=notifier)
    task = asyncio.create_task(daemon.run())
    try:
        assert await next_message(notify_socket) == "STATUS=scanning"
        assert await next_message(notify_socket) == (
            "READY=1\nSTATUS=no devices found; watching for them"
        )
    finally:
        daemon.request_stop()
        await task
    assert notifier.sent[-1] == "STOPPING=1\nSTATUS=stopping"


def test_an_abstract_socket_name_and_a_foreign_watchdog_pid() -> None:
    name = f"devplug-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        notifier = SystemdNotifier(
            {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
        )
        assert notifier.watchdog_s is None  # the watchdog was meant for another process
        notifier.notify("READY=1")
        assert sock.recv(100) == b"READY=1"
        notifier.close()


def test_a_failing_socket_is_logged_once_until_a_message_gets_through(short_dir: Path) -> None:
    """A watchdog ping goes every few seconds: systemd gone is one warning, not one a ping;
    once a message gets through, the next failure is news again."""
    path = short_dir / "notify"
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})

    def warned(*messages: str) -> list[object]:
        with capture_logs() as logs:
            for message in messages:
                notifier.notify(message)
        return [e["reason"] for e in logs if e["log_level"] == "warning"]

    assert warned("READY=1", "WATCHDOG=1", "WATCHDOG=1") == ["ENOENT: No such file or directory"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        assert warned("WATCHDOG=1") == []
        assert sock.recv(100) == b"WATCHDOG=1"
    path.unlink()
    assert warned("WATCHDOG=1", "STOPPING=1") == ["ENOENT: No such file or directory"]
    notifier.close()


def test_outside_systemd_nothing_is_sent() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled and notifier.watchdog_s is None
    notifier.notify("READY=1")
    assert list(notifier.sent) == []


async def test_devplug_run_notifies_systemd(
    short_dir: Path, kubelet_dir: Path, notify_socket: socket.socket
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(
        "hotplug: {source: none}\nscanners:\n  generic:\n"
        "    - {resource: example.com/mem, match: {subsystem: mem, devnode: /dev/null}}\n"
    )
    environ = {"NOTIFY_SOCKET": notify_socket.getsockname()}
    # No kubelet on this node yet: the process is ready all the same (boot goes on).
    async with daemon_process(config, kubelet_dir, env=environ) as process:
        seen = await messages_until(notify_socket, "READY=1")
        assert seen[-1] == f"READY=1\n{WAITING}"
        async with KubeletSimulator(kubelet_dir):
            assert await next_status(notify_socket) == REGISTERED
            process.terminate()
            rest = await messages_until(notify_socket, "STOPPING=1")
            assert rest[-1] == "STOPPING=1\nSTATUS=stopping"


def test_the_messages_kept_are_bounded(notify_socket: socket.socket) -> None:
    """A watchdog ping every few seconds for the daemon's whole life must not grow memory."""
    notifier = SystemdNotifier({"NOTIFY_SOCKET": notify_socket.getsockname()})
    try:
        for number in range(SENT_KEPT * 3):
            notifier.notify(f"STATUS={number}")
            notify_socket.recv(4096)
        assert len(notifier.sent) == SENT_KEPT
        assert notifier.sent[-1] == f"STATUS={SENT_KEPT * 3 - 1}"
    finally:
        notifier.close()
