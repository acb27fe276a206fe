"""Start -> first ListAndWatch list, and SIGTERM -> exit, for ``devplug run`` with 1,000 devices.

The clock starts before the process is spawned (so it includes Python's start-up and imports)
and stops when the kubelet simulator receives the first full list. The floor is the start-up
of a bare ``python -c 'import grpc'`` measured in the same run.

    umockdev-wrapper .venv/bin/python -m bench.startup [--devices 1000] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from bench.common import (
    RENDER_CONFIG,
    RENDER_RESOURCE,
    daemon_process,
    gpu_host,
    require_preload,
    scratch_dir,
    summary_ms,
)
from devplug.testing import KubeletSimulator


async def main(devices: int, runs: int) -> None:
    require_preload()
    starts: list[float] = []
    stops: list[float] = []
    floors: list[float] = []
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", devices)
        for run in range(runs):
            started = time.perf_counter()
            floor = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "import grpc", env={**os.environ, **host.env()}
            )
            await floor.wait()
            floors.append(time.perf_counter() - started)
            kubelet_dir = scratch / f"kubelet{run}"
            with host.activated():
                async with KubeletSimulator(kubelet_dir) as kubelet:
                    started = time.perf_counter()
                    async with daemon_process(RENDER_CONFIG, kubelet_dir, host) as process:
                        session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=60)
                        listed = await session.wait_for_update(timeout=60)
                        starts.append(session.update_times[0] - started)
                        assert len(listed) == devices, len(listed)
                        stopping = time.perf_counter()
                        process.send_signal(signal.SIGTERM)
                        code = await process.wait()
                        stops.append(time.perf_counter() - stopping)
                        assert code == 0, code
    print(f"devices: {devices}")
    print(f"floor (python -c 'import grpc'):        {summary_ms(floors)}")
    print(f"start -> first ListAndWatch list:       {summary_ms(starts)} (goal <= 1 s)")
    print(f"SIGTERM -> exit 0, sockets removed:     {summary_ms(stops)} (goal <= 2 s)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.runs))
