"""What a hostile local client costs a running daemon (issue 15): memory, fds, loop delay.

A child process serves two resources through ``devplug.plugin.run_daemon`` (what ``run``
does in devplug's command line and in a plugin's own): ``example.com/blob``, 64 devices with
16 KiB of environment each (large Allocate answers), and ``example.com/big``, 100,000 devices
for the scenarios that need them (one otherwise); CDI is off. The parent plays the kubelet
(``KubeletSimulator``) and the attacker, and reads the child's RSS and fds from /proc:

- 4,096 distinct Allocates with ~64 KiB answers (the answer cache);
- 8 parallel Allocates of 200,000 ids (refused by size);
- 2,000 ListAndWatch streams that never read (capped per server);
- 1,100 idle TCP connections to the metrics port (capped, cut after the deadline);
- an unrelated call's latency while GetPreferredAllocation offers 200,000 ids;
- SIGTERM to exit, with four such calls in flight.

Each scenario gets a fresh daemon, so its figure does not inherit the previous one's RSS.

    .venv/bin/python -m bench.hardening

It prints figures; it asserts nothing (the tests in tests/reliability/ check behaviour).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.server import socket_path_for
from devplug.testing import KubeletSimulator

BLOB = "example.com/blob"
BIG = "example.com/big"
BIG_COUNT = 100_000
MIB = 1024 * 1024
# A client that takes no more than it reads: what it does not read stays with the server.
STINGY = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * 1024)]


def child(kubelet_dir: str, port: int, big_count: int) -> int:
    """Serve BLOB and BIG (``big_count`` devices) until SIGTERM (run in the child process)."""
    from devplug.config import CdiSettings
    from devplug.logconfig import configure
    from devplug.model import DeviceInfo, DeviceNode
    from devplug.plugin import run_daemon
    from devplug.testing import StaticScanner, daemon_settings

    settings = daemon_settings(
        Path(kubelet_dir),
        metrics_address=f"127.0.0.1:{port}",
        log_level="warning",
        cdi=CdiSettings(enabled=False),  # a 100,000-device spec would cost its own memory
    )
    null = (DeviceNode("/dev/null"),)
    blob = {f"b{i}": DeviceInfo(nodes=null, env={f"BLOB_{i}": "x" * 16 * 1024}) for i in range(64)}
    big = {f"d{i}": DeviceInfo(nodes=null) for i in range(big_count)}
    scanner = StaticScanner({BLOB: blob, BIG: big})
    configure(settings.log_format, settings.log_level)
    return run_daemon(settings, [scanner])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def settled(pid: int) -> None:
    """Until the daemon's RSS holds still for a second (start-up work done)."""
    before = -1.0
    while abs(rss_mib(pid) - before) > 0.5:
        before = rss_mib(pid)
        await asyncio.sleep(1.0)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """The child's peak RSS while a block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mib(self.pid))
            await asyncio.sleep(0.01)

    async def __aenter__(self) -> Sampler:
        self.peak = rss_mib(self.pid)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, rss_mib(self.pid))


def line(name: str, figure: str) -> None:
    """One figure, on stdout (the child's logs go to stderr)."""
    print(f"{name:<58} {figure}", flush=True)


def allocate(ids: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])


async def answer_cache(stub: Any, pid: int) -> None:
    before = rss_mib(pid)
    for index in range(4096):
        ids = list(dict.fromkeys(f"b{(index + k * (1 + index // 64)) % 64}" for k in range(4)))
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
        )
        await stub.Allocate(request)
    line(
        "4,096 distinct Allocates (~64 KiB answers): RSS growth", f"{rss_mib(pid) - before:.1f} MiB"
    )


async def oversized_allocates(stub: Any, pid: int) -> None:
    ghosts = [f"ghost-{i}" for i in range(200_000)]
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ghosts)]
    )
    before = rss_mib(pid)
    async with Sampler(pid) as sampler:
        results = await asyncio.gather(
            *(stub.Allocate(request) for _ in range(8)), return_exceptions=True
        )
    refused = sum(isinstance(r, grpc.aio.AioRpcError) for r in results)
    line(
        f"8 parallel Allocates of 200,000 ids ({request.ByteSize() / MIB:.1f} MiB each)",
        f"peak +{sampler.peak - before:.1f} MiB, after +{rss_mib(pid) - before:.1f} MiB, "
        f"{refused} refused",
    )


async def idle_streams(path: Path, pid: int) -> None:
    before = rss_mib(pid)
    async with grpc.aio.insecure_channel(f"unix://{path}", options=STINGY) as channel:
        stub: Any = pb_grpc.DevicePluginStub(channel)
        calls = [stub.ListAndWatch(pb.Empty()) for _ in range(2000)]
        outcomes = await asyncio.gather(*(_first(c) for c in calls))
        line(
            "2,000 ListAndWatch streams that never read: RSS growth",
            f"{rss_mib(pid) - before:.1f} MiB ({outcomes.count('ok')} open, "
            f"{outcomes.count('RESOURCE_EXHAUSTED')} refused)",
        )
        for call in calls:
            call.cancel()


async def _first(call: Any) -> str:
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "ok"


async def idle_connections(port: int, pid: int) -> None:
    before = fds(pid)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(1100)]
    for client in clients:
        client.setblocking(False)
    peak = before
    started = time.monotonic()
    while not all(_closed(c) for c in clients) and time.monotonic() - started < 60:
        peak = max(peak, fds(pid))
        await asyncio.sleep(0.01)
    for client in clients:
        client.close()
    line("1,100 idle metrics connections: peak fds above idle", f"{peak - before}")


def _closed(client: socket.socket) -> bool:
    try:
        return client.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def preferred(available: list[str], size: int) -> pb.PreferredAllocationRequest:
    container = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, allocation_size=size
    )
    return pb.PreferredAllocationRequest(container_requests=[container])


async def loop_delay(stub: Any) -> None:
    offered = [f"d{i}" for i in range(BIG_COUNT)] + [f"ghost-{i}" for i in range(100_000)]
    request = preferred(offered[::-1], BIG_COUNT // 2)
    quiet = []
    for _ in range(20):
        started = time.perf_counter()
        await stub.GetDevicePluginOptions(pb.Empty())
        quiet.append(time.perf_counter() - started)
    heavy = asyncio.ensure_future(stub.GetPreferredAllocation(request))
    busy = []
    while not heavy.done():
        started = time.perf_counter()
        await stub.GetDevicePluginOptions(pb.Empty())
        busy.append(time.perf_counter() - started)
    started = time.perf_counter()
    await heavy
    line(
        "GetDevicePluginOptions during a 200,000-id preferred call",
        f"max {max(busy or [0]) * 1000:.1f} ms (idle max {max(quiet) * 1000:.1f} ms), "
        f"{len(busy)} calls answered meanwhile",
    )


async def sigterm_exit(process: asyncio.subprocess.Process, stub: Any) -> None:
    offered = [f"d{i}" for i in range(BIG_COUNT)] + [f"ghost-{i}" for i in range(100_000)]
    request = preferred(offered, BIG_COUNT // 2)
    calls = [asyncio.ensure_future(stub.GetPreferredAllocation(request)) for _ in range(4)]
    await asyncio.sleep(0.2)
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    status = await process.wait()
    line(
        "SIGTERM with 4 such calls in flight: exit",
        f"{(time.perf_counter() - started) * 1000:.0f} ms (status {status})",
    )
    await asyncio.gather(*calls, return_exceptions=True)


@dataclass
class Child:
    """A fresh daemon process for one scenario, so each figure starts from the same RSS."""

    process: asyncio.subprocess.Process
    kubelet_dir: Path
    port: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def channel(self, resource: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{socket_path_for(self.kubelet_dir, resource)}")


@contextlib.asynccontextmanager
async def daemon(big_count: int = 1) -> AsyncIterator[Child]:
    with tempfile.TemporaryDirectory(prefix="dph-", dir="/tmp") as tmp:
        kubelet_dir = Path(tmp) / "device-plugins"
        kubelet_dir.mkdir()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        async with KubeletSimulator(kubelet_dir) as kubelet:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.hardening",
                "--child",
                str(kubelet_dir),
                str(port),
                str(big_count),
            )
            try:
                await kubelet.wait_for_plugin(BLOB, timeout=120)
                await kubelet.wait_for_plugin(BIG, timeout=120)
                await settled(process.pid)
                yield Child(process, kubelet_dir, port)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def main() -> None:
    async with daemon() as child:
        line("idle daemon (65 devices): RSS", f"{rss_mib(child.pid):.1f} MiB")
        async with child.channel(BLOB) as channel:
            stub: Any = pb_grpc.DevicePluginStub(channel)
            await answer_cache(stub, child.pid)
            await answer_cache(stub, child.pid)  # again: a high-water mark or a leak?
    async with daemon() as child, child.channel(BLOB) as channel:
        await oversized_allocates(pb_grpc.DevicePluginStub(channel), child.pid)
    async with daemon() as child:
        await idle_streams(socket_path_for(child.kubelet_dir, BLOB), child.pid)
    async with daemon() as child:
        await idle_connections(child.port, child.pid)
    async with daemon(BIG_COUNT) as child, child.channel(BIG) as channel:
        line("idle daemon (100,064 devices): RSS", f"{rss_mib(child.pid):.1f} MiB")
        await loop_delay(pb_grpc.DevicePluginStub(channel))
    async with daemon(BIG_COUNT) as child, child.channel(BIG) as channel:
        await sigterm_exit(child.process, pb_grpc.DevicePluginStub(channel))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("KUBELET_DIR", "PORT", "BIG_COUNT"))
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args.child[0], int(args.child[1]), int(args.child[2])))
    asyncio.run(main())
