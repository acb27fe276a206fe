"""Start -> first ListAndWatch list, and SIGTERM -> exit, for ``devplug run`` with N mock GPUs.

The clock starts before the process is spawned (so it includes Python's start-up and imports)
and stops when the kubelet simulator receives the first full list. Two floors, each a fresh
process with the same interpreter, measured in the same run, interleaved with the daemon's
starts:

- ``import grpc``: the least any Python gRPC plugin pays before it can serve;
- raw pyudev enumeration: import pyudev, enumerate the drm subsystem (every card and render
  node of the host) and read what devplug reads of each device (its devnode, its udev
  properties). The 10,000-GPU goal is start -> first list <= 1.2x this floor.

``--python runtime`` runs the daemon the way operators install it: a venv holding the
checkout and its runtime dependencies only (``.bench/runtime-venv``, created on first use),
without the test extras, which pull in ``rich`` (structlog imports it when present: ~60 ms).
``current`` is this interpreter; ``both`` (the default) interleaves the two. devplug's sources
are byte-compiled first: an install from a wheel has its .pyc, and this machine sets
PYTHONDONTWRITEBYTECODE, which would otherwise make every start compile them (~90 ms).
``--env PYTHONPATH=<a worktree>/src`` times another commit with the same interpreters.

    umockdev-wrapper .venv/bin/python -m bench.startup [--devices 1000] [--runs 7] \\
        [--python runtime|current|both] [--env NAME=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    RENDER_CONFIG,
    RENDER_RESOURCE,
    REPO,
    compile_bytecode,
    daemon_process,
    env_pairs,
    gpu_host,
    require_preload,
    runtime_python,
    scratch_dir,
    summary_ms,
)
from devplug.testing import KubeletSimulator
from devplug.testing.umockdev import UmockdevHost

# The floor's process: what devplug's generic scanner must at least do for this config.
ENUMERATE = """
import pyudev
count = 0
for device in pyudev.Context().list_devices(subsystem="drm"):
    device.device_node
    dict(device.properties)
    count += 1
print(count)
"""


@dataclass
class Samples:
    python: str
    grpc: list[float] = field(default_factory=list)
    enumeration: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    stops: list[float] = field(default_factory=list)
    listed: list[int] = field(default_factory=list)


async def timed_process(python: str, code: str, env: dict[str, str]) -> tuple[float, bytes]:
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        python, "-c", code, env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE
    )
    output, _ = await process.communicate()
    elapsed = time.perf_counter() - started
    assert process.returncode == 0, process.returncode
    return elapsed, output


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far, all its threads (``/proc/PID/task/*/schedstat``, in
    nanoseconds): unlike the wall clock, hardly moved by other work on a shared machine."""
    total = 0
    with os.scandir(f"/proc/{pid}/task") as tasks:
        for task in tasks:
            # A thread that just ended is gone.
            with contextlib.suppress(FileNotFoundError), open(f"{task.path}/schedstat") as file:
                total += int(file.read().split()[0])
    return total / 1e9


async def one_run(
    samples: Samples, host: UmockdevHost, kubelet_dir: Path, env: dict[str, str]
) -> None:
    elapsed, _ = await timed_process(samples.python, "import grpc", host.env())
    samples.grpc.append(elapsed)
    elapsed, _ = await timed_process(samples.python, ENUMERATE, host.env())
    samples.enumeration.append(elapsed)
    with host.activated():
        async with KubeletSimulator(kubelet_dir) as kubelet:
            started = time.perf_counter()
            async with daemon_process(
                RENDER_CONFIG, kubelet_dir, host, env, python=samples.python
            ) as process:
                session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=120)
                listed = await session.wait_for_update(timeout=120)
                samples.starts.append(session.update_times[0] - started)
                samples.cpu.append(cpu_seconds(process.pid))
                samples.listed.append(len(listed))
                stopping = time.perf_counter()
                process.send_signal(signal.SIGTERM)
                code = await process.wait()
                samples.stops.append(time.perf_counter() - stopping)
                assert code == 0, code


def report(samples: Samples, devices: int) -> None:
    ratio = statistics.median(samples.starts) / statistics.median(samples.enumeration)
    per_run = sorted(s / e for s, e in zip(samples.starts, samples.enumeration, strict=True))
    print(f"python: {samples.python}")
    print(f"  floor: python -c 'import grpc':          {summary_ms(samples.grpc)}")
    print(f"  floor: raw pyudev enumeration (process): {summary_ms(samples.enumeration)}")
    print(
        f"  start -> first ListAndWatch list:        {summary_ms(samples.starts)} "
        f"(goal <= {'0.25 s' if devices <= 1 else '1.2x the enumeration floor'})"
    )
    print(f"  daemon CPU (all threads) until then:     {summary_ms(samples.cpu)}")
    print(
        f"  first list / enumeration floor:          p50s {ratio:.2f}x "
        f"(per run {per_run[0]:.2f}x-{per_run[-1]:.2f}x)"
    )
    print(f"  SIGTERM -> exit 0, sockets removed:      {summary_ms(samples.stops)} (goal <= 2 s)")


async def main(devices: int, runs: int, pythons: list[str], env: dict[str, str]) -> None:
    require_preload()
    trees = [str(REPO / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    for python in pythons:
        compile_bytecode(python, *trees)
    everything = [Samples(python) for python in pythons]
    with scratch_dir("4g") as scratch:
        host = gpu_host(scratch / "testbed", devices)
        # Each floor process must see every card and render node the daemon sees.
        _, output = await timed_process(pythons[0], ENUMERATE, host.env())
        assert int(output) == 2 * devices, output
        for run in range(runs):
            for index, samples in enumerate(everything):
                await one_run(samples, host, scratch / f"kubelet{run}-{index}", env)
                assert samples.listed[-1] == devices, samples.listed
    print(f"devices: {devices}, runs: {runs} (interleaved); bytecode compiled first, as pip does")
    for samples in everything:
        report(samples, devices)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--python",
        choices=("runtime", "current", "both"),
        default="both",
        help="runtime: a venv without the test extras (.bench/runtime-venv); current: this one",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="add to the daemon's environment (e.g. PYTHONPATH=<a worktree>/src to time "
        "another commit with the same interpreter)",
    )
    args = parser.parse_args()
    chosen = {
        "runtime": [runtime_python()],
        "current": [sys.executable],
        "both": [runtime_python(), sys.executable],
    }[args.python]
    asyncio.run(main(args.devices, args.runs, chosen, env_pairs(args.env)))
