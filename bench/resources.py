"""Many resources, one server each: time to register them all, and threads, fds and RSS each.

``--resources`` (200) mock GPUs, and a config with one generic entry per GPU's render node,
so ``devplug run`` serves that many resources (one grpc.aio server and socket each). The
clock starts before the process is spawned and stops when the kubelet simulator has accepted
every Register and has every resource's first list. Threads, open fds and RSS are read from
/proc once all are served (after a short settle), and compared with the same daemon serving
one resource on the same host in the same run: per resource = (N - 1 resource) / (N - 1).

    umockdev-wrapper .venv/bin/python -m bench.resources [--resources 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from bench.common import (
    RENDER_MINOR_BASE,
    daemon_process,
    gpu_host,
    require_preload,
    scratch_dir,
    summary_ms,
)
from bench.footprint import status_kib
from devplug.testing import KubeletSimulator
from devplug.testing.umockdev import UmockdevHost

SETTLE_S = 1.0


def config(resources: int) -> str:
    entries = "\n".join(
        f"    - resource: example.com/gpu{index}\n"
        f"      match: {{subsystem: drm, devnode: /dev/dri/renderD{RENDER_MINOR_BASE + index}}}"
        for index in range(resources)
    )
    return f"""
hotplug: {{source: kernel, resync_s: 3600, poll_s: 3600}}
scanners:
  generic:
{entries}
"""


async def serve(
    scratch: Path, host: UmockdevHost, resources: int, run: int
) -> tuple[float, int, int, int, float, float]:
    """(start -> all registered and listed, threads, fds, RSS KiB, start -> first Register
    accepted, start -> last) of a daemon serving ``resources`` resources."""
    kubelet_dir = scratch / f"kubelet{resources}-{run}"
    names = [f"example.com/gpu{index}" for index in range(resources)]
    with host.activated():
        async with KubeletSimulator(kubelet_dir) as kubelet:
            started = time.perf_counter()
            async with daemon_process(config(resources), kubelet_dir, host) as process:
                await kubelet.wait_for_registrations(resources, timeout=300)
                sessions = [await kubelet.wait_for_plugin(n, timeout=300) for n in names]
                for session in sessions:
                    await session.wait_for_update(timeout=300)
                elapsed = max(s.update_times[0] for s in sessions) - started
                await asyncio.sleep(SETTLE_S)
                pid = process.pid
                threads = len(os.listdir(f"/proc/{pid}/task"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
                rss = status_kib(pid, "VmRSS")
                accepted = [r.at - started for r in kubelet.registrations if r.accepted]
                assert len(accepted) >= resources, accepted
    return elapsed, threads, fds, rss, min(accepted), max(accepted)


async def main(resources: int, runs: int) -> None:
    require_preload()
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", resources)
        one: list[tuple[float, int, int, int, float, float]] = []
        many: list[tuple[float, int, int, int, float, float]] = []
        for run in range(runs):
            one.append(await serve(scratch, host, 1, run))
            many.append(await serve(scratch, host, resources, run))
    print(f"{resources} resources, one server each ({runs} runs, alternating with 1 resource)")
    print(f"start -> 1 resource registered and listed:   {summary_ms([r[0] for r in one])}")
    print(f"start -> all {resources} registered and listed: {summary_ms([r[0] for r in many])}")
    print(
        "  of which: start -> first Register accepted "
        + ", ".join(f"{r[4] * 1000:.0f}" for r in many)
        + " ms; -> last accepted "
        + ", ".join(f"{r[5] * 1000:.0f}" for r in many)
        + " ms"
    )
    for label, index in (("threads", 1), ("open fds", 2), ("RSS KiB", 3)):
        a = [r[index] for r in one]
        b = [r[index] for r in many]
        per = [(y - x) / (resources - 1) for x, y in zip(a, b, strict=True)]
        print(
            f"{label:<9} 1 resource {a}, {resources} resources {b}: per resource "
            + ", ".join(f"{p:.2f}" for p in per)
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--resources", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.resources, args.runs))
