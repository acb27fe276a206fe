"""What ``devplug run`` costs when nothing happens, and its memory with many devices.

Idle: with ``--devices`` (1,000) mock GPUs served and a kubelet simulator connected, the daemon
is left alone for ``--idle-s`` (60) seconds; reported are the CPU seconds it used (utime +
stime from /proc) and its wake-ups (context switches summed over its threads), per thread
name. The floor, measured in the same run: a bare ``python -c 'import grpc'`` process
sleeping for the same time.

Memory: peak RSS (VmHWM) of a daemon that scanned and serves ``--big`` (10,000) GPUs, taken
after its first list reached the simulator.

    umockdev-wrapper .venv/bin/python -m bench.footprint [--devices 1000] [--idle-s 60] \
        [--big 10000] [--env GRPC_POLL_STRATEGY=poll ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path

from bench.common import (
    RENDER_CONFIG,
    RENDER_RESOURCE,
    daemon_process,
    env_pairs,
    gpu_host,
    require_preload,
    scratch_dir,
)
from devplug.testing import KubeletSimulator

SETTLE_S = 2.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def switches_by_thread(pid: int) -> Counter[str]:
    """Context switches (voluntary + involuntary) per thread name: each is a wake-up."""
    counts: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                counts[name] += int(line.split()[1])
    return counts


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


async def measure_idle(pid: int, seconds: float) -> tuple[float, Counter[str]]:
    cpu, woke = cpu_seconds(pid), switches_by_thread(pid)
    await asyncio.sleep(seconds)
    after = switches_by_thread(pid)
    after.subtract(woke)
    return cpu_seconds(pid) - cpu, +after


async def idle(devices: int, seconds: float, env: dict[str, str]) -> None:
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", devices)
        floor = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            f"import grpc, time; time.sleep({seconds + 10})",
            env={**os.environ, **env},
        )
        kubelet_dir = scratch / "kubelet"
        with host.activated():
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(RENDER_CONFIG, kubelet_dir, host, env) as process,
            ):
                session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=60)
                await session.wait_for_update(lambda listed: len(listed) == devices, timeout=60)
                await asyncio.sleep(SETTLE_S)
                threads = len(list(Path(f"/proc/{process.pid}/task").iterdir()))
                (cpu, woke), (floor_cpu, floor_woke) = await asyncio.gather(
                    measure_idle(process.pid, seconds), measure_idle(floor.pid, seconds)
                )
                messages = len(session.updates)
        floor.kill()
        await floor.wait()
    print(f"idle for {seconds:g} s with {devices} devices served ({threads} threads), env {env}:")
    print(
        f"  floor (python importing grpc, asleep): cpu {floor_cpu:.3f} s, "
        f"wake-ups {sum(floor_woke.values())}"
    )
    print(
        f"  devplug run:                           cpu {cpu:.3f} s, "
        f"wake-ups {sum(woke.values())} {dict(woke.most_common())}"
    )
    print(f"  ListAndWatch messages while idle: {messages - 1}")


async def peak_rss(devices: int) -> None:
    with scratch_dir(size="4g") as scratch:
        started = time.perf_counter()
        host = gpu_host(scratch / "testbed", devices)
        built = time.perf_counter() - started
        kubelet_dir = scratch / "kubelet"
        with host.activated():
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(RENDER_CONFIG, kubelet_dir, host) as process,
            ):
                started = time.perf_counter()
                session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=300)
                await session.wait_for_update(lambda listed: len(listed) == devices, timeout=300)
                listed = time.perf_counter() - started
                peak = status_kib(process.pid, "VmHWM")
                rss = status_kib(process.pid, "VmRSS")
    print(f"{devices} GPUs (testbed built in {built:.1f} s; first full list after {listed:.1f} s):")
    print(
        f"  peak RSS {peak / 1024:.1f} MiB, RSS after first list {rss / 1024:.1f} MiB "
        "(goal <= 90 MiB)"
    )


async def main(devices: int, seconds: float, big: int, env: dict[str, str]) -> None:
    require_preload()
    if seconds > 0:
        await idle(devices, seconds, env)
    if big > 0:
        await peak_rss(big)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--big", type=int, default=10_000)
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for the daemon and the floor"
    )
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.idle_s, args.big, env_pairs(args.env)))
