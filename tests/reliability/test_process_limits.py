"""What a ``devplug run`` process does about its own limits (issue 15, items 1, 6 and 8).

- idle TCP connections to the metrics port cannot use up its file descriptors;
- it raises its soft RLIMIT_NOFILE to the hard limit at start;
- SIGTERM during a huge GetPreferredAllocation still ends it cleanly;
- tracebacks in its logs carry no local variables.

The first three run ``devplug run`` as a child (its fds and limits are read from /proc); the
last configures logging in-process and logs a real exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import resource
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import structlog

from devplug import logconfig
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.ops.http import MAX_CONNECTIONS
from devplug.testing import KubeletSimulator, daemon_process
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

SERIAL = "example.com/serial"
WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(directory: Path, port: int) -> Path:
    config = directory / "config.yaml"
    config.write_text(
        f"metrics_address: 127.0.0.1:{port}\n"
        "hotplug: {source: none, poll_s: 3600, resync_s: 3600}\n"
        "scanners:\n  generic:\n"
        '    - {resource: example.com/serial, match: {subsystem: tty, devnode: "/dev/ttyUSB*"}}\n'
    )
    return config


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            return await reader.read()
    finally:
        writer.close()


async def test_idle_metrics_connections_cannot_use_up_the_daemons_fds(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    scaled: Callable[[int, int], int],
) -> None:
    """~1,100 idle connections to the metrics port used to take 1,100 of the daemon's fds
    (EMFILE at systemd's 1,024, and the next scan read an empty host). The daemon now serves
    at most MAX_CONNECTIONS at a time and closes the others at once; the idle ones it serves
    are cut after the deadline; then /healthz answers, and the devices were never withdrawn."""
    idle = scaled(300, 1100)
    add_usb_serial(host, index=0)
    port = free_port()
    config = write_config(short_dir, port)
    async with daemon_process(
        config, kubelet_dir, env=host.env(), output=tmp_path / "run.log"
    ) as process:
        session = await kubelet.wait_for_plugin(SERIAL, timeout=WAIT_S)
        await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0"})
        baseline = open_fds(process.pid)
        clients: list[socket.socket] = []
        try:
            for _ in range(idle):
                client = socket.create_connection(("127.0.0.1", port))
                client.setblocking(False)
                clients.append(client)
            # Until the server has closed every one (at once, or at the deadline), its fds are
            # sampled: the peak is what counts.
            peak = baseline
            async with asyncio.timeout(WAIT_S):
                while not all(closed(client) for client in clients):
                    peak = max(peak, open_fds(process.pid))
                    await asyncio.sleep(0.02)
            # Only the served ones: the others wait in the kernel's backlog, however many
            # clients there are and however busy the loop is (a little slack for the fds the
            # daemon opens meanwhile for other work).
            most = MAX_CONNECTIONS + 8
            assert peak <= baseline + most, f"{peak - baseline} fds for {idle} connections"
        finally:
            for client in clients:
                client.close()
        assert (await get(port, "/healthz")).startswith(b"HTTP/1.1 200")
        assert process.returncode is None
        assert all(set(listed) == {"ttyUSB0"} for listed in session.updates)


def closed(client: socket.socket) -> bool:
    """True once the server closed ``client`` (a read gives EOF or a reset)."""
    try:
        return client.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def soft_fd_limit(soft: int) -> Iterator[int]:
    """Children started in the block inherit a soft RLIMIT_NOFILE of ``soft``; yields the
    hard limit they get."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield before[1]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def fd_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' in /proc/<pid>/limits")


async def test_the_soft_fd_limit_is_raised_to_the_hard_limit_at_start(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
) -> None:
    """Started with a soft limit of 256 (as systemd starts a service with 1,024), the daemon
    runs with the hard limit (clamped at 2^20)."""
    add_usb_serial(host, index=0)
    config = write_config(short_dir, free_port())
    with soft_fd_limit(256) as hard:
        context = daemon_process(config, kubelet_dir, env=host.env(), output=tmp_path / "run.log")
        process = await context.__aenter__()
    try:
        await kubelet.wait_for_plugin(SERIAL, timeout=WAIT_S)
        assert fd_limits(process.pid) == (min(hard, 1 << 20), hard)
    finally:
        await context.__aexit__(None, None, None)


async def test_sigterm_during_a_huge_preferred_allocation_exits_cleanly(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    scaled: Callable[[int, int], int],
) -> None:
    """SIGTERM while GetPreferredAllocation calls offering 200,000 ids are in progress: the
    daemon exits 0 and removes its socket (bench/hardening.py measures how soon)."""
    ids = scaled(20_000, 200_000)
    add_usb_serial(host, index=0)
    config = write_config(short_dir, free_port())
    async with daemon_process(
        config, kubelet_dir, env=host.env(), output=tmp_path / "run.log"
    ) as process:
        session = await kubelet.wait_for_plugin(SERIAL, timeout=WAIT_S)
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[f"ttyUSB{i}" for i in range(ids)], allocation_size=ids
                )
            ]
        )
        async with grpc.aio.insecure_channel(f"unix://{session.endpoint}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            calls = [stub.GetPreferredAllocation(request) for _ in range(4)]
            await asyncio.sleep(0.05)
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(WAIT_S):
                assert await process.wait() == 0
            await asyncio.gather(*calls, return_exceptions=True)
    assert not session.endpoint.exists()


def test_tracebacks_in_logs_carry_no_local_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``config.reload.failed`` used to log a traceback with every frame's locals (the raw
    config bytes, the environment). Both formats now print the traceback without them."""
    for log_format in ("json", "console"):
        stderr = io.StringIO()
        monkeypatch.setattr("sys.stderr", stderr)
        logconfig.configure(log_format)
        try:
            secret = "hunter2-" + log_format  # a local of the frame that raises
            raise ValueError(f"bad config ({len(secret)} bytes)")
        except ValueError:
            structlog.get_logger("test").exception("config.reload.failed")
        finally:
            structlog.reset_defaults()
        output = stderr.getvalue()
        assert "ValueError" in output and "bad config" in output
        assert "hunter2" not in output, f"{log_format} log shows locals: {output[:500]}"
