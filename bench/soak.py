"""Soak: ``devplug run`` under a long random mix of hotplug, health flips, kubelet restarts and
allocations, with its RSS and open file descriptors sampled throughout.

The daemon serves ``--devices`` (200) mock Intel GPUs through the Intel GPU scanner (ids are
PCI addresses, with CDI specs and metrics on). Every ``--step-ms`` one action is drawn:

- hotplug: a GPU is added (PCI function, card, render node, with their uevents) or removed;
- health: a present GPU's card node vanishes or comes back (a ``change`` uevent);
- kubelet: the simulated kubelet restarts (sockets wiped, re-registration);
- allocate: a random advertised GPU is allocated (unknown and unhealthy ones are refused).

RSS (VmRSS) and the fd count of the daemon are sampled every ``--sample-s``. Printed: the first
and last minute's medians, min and max, and the allocations and restarts done. Nothing is
asserted; the README keeps the figures of the last run.

    umockdev-wrapper .venv/bin/python -m bench.soak [--minutes 10] [--devices 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

from bench.common import daemon_process, gpu_address, require_preload, scratch_dir
from devplug.testing import KubeletSimulator
from devplug.testing.simulator import PluginSession, SimulatorRpcError
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu

RESOURCE = "gpu.intel.com/i915"
CONFIG = """
hotplug: {source: kernel, resync_s: 60, poll_s: 60, health_hold_down_s: 1}
metrics_address: 127.0.0.1:0
scanners:
  intel_gpu: {shared_dev_num: 2}
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Host:
    """The mock GPUs and what has been done to them."""

    def __init__(self, host: UmockdevHost) -> None:
        self.host = host
        self.present: dict[int, str] = {}  # index -> PCI path
        self.hidden: set[int] = set()  # card node removed

    def add(self, index: int) -> list[str]:
        pci = add_intel_gpu(
            self.host, gpu_address(index), card=index, render=100_000 + index, numa_node=index % 2
        )
        self.present[index] = pci
        return [pci, f"{pci}/drm/card{index}", f"{pci}/drm/renderD{100_000 + index}"]

    def remove(self, index: int) -> list[str]:
        self.hidden.discard(index)
        return self.host.remove_device(self.present.pop(index))

    def flip(self, index: int) -> str:
        card = f"{self.present[index]}/drm/card{index}"
        hide = index not in self.hidden
        self.host.set_node_present(card, not hide)
        (self.hidden.add if hide else self.hidden.discard)(index)
        return card


async def soak(minutes: float, devices: int, step_ms: float, sample_s: float) -> None:
    require_preload()
    rng = random.Random(1)
    with scratch_dir("1g") as scratch:
        mock = Host(UmockdevHost(scratch / "testbed"))
        for index in range(devices):
            mock.add(index)
        kubelet_dir = scratch / "kubelet"
        samples: list[tuple[float, int, int]] = []
        counts = {"hotplug": 0, "health": 0, "kubelet": 0, "allocate": 0, "refused": 0}
        with mock.host.activated():
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(CONFIG, kubelet_dir, mock.host) as process,
            ):
                session: PluginSession = await kubelet.wait_for_plugin(RESOURCE, timeout=60)
                await session.wait_for_update(lambda listed: len(listed) == 2 * devices, timeout=60)
                started = time.monotonic()
                next_sample = started
                next_index = devices
                while (now := time.monotonic()) - started < minutes * 60:
                    if now >= next_sample:
                        samples.append((now - started, rss_kib(process.pid), fds(process.pid)))
                        next_sample += sample_s
                    action = rng.choices(
                        ["hotplug", "health", "kubelet", "allocate"], [30, 30, 2, 38]
                    )[0]
                    counts[action] += 1
                    if action == "hotplug":
                        if mock.present and (rng.random() < 0.5 or len(mock.present) > devices):
                            for path in mock.remove(rng.choice(sorted(mock.present))):
                                await mock.host.emit_async("remove", path)
                        else:
                            for path in mock.add(next_index):
                                await mock.host.emit_async("add", path)
                            next_index += 1
                    elif action == "health" and mock.present:
                        card = mock.flip(rng.choice(sorted(mock.present)))
                        await mock.host.emit_async("change", card)
                    elif action == "kubelet":
                        await kubelet.restart()
                        session = await kubelet.wait_for_plugin(RESOURCE, timeout=60)
                        await session.wait_for_update(timeout=60)
                    elif action == "allocate" and session.latest:
                        try:
                            await session.allocate([rng.choice(sorted(session.latest))])
                        except SimulatorRpcError:
                            counts["refused"] += 1
                    await asyncio.sleep(step_ms / 1000)
    report(samples, counts, minutes)


def report(samples: list[tuple[float, int, int]], counts: dict[str, int], minutes: float) -> None:
    first = [s for s in samples if s[0] < 60] or samples[:1]
    last = [s for s in samples if s[0] >= minutes * 60 - 60] or samples[-1:]
    rss = [s[1] for s in samples]
    fd = [s[2] for s in samples]
    print(f"soak: {minutes:g} min, {len(samples)} samples; actions: {counts}")
    print(
        f"RSS MiB: first minute median {statistics.median(s[1] for s in first) / 1024:.1f}, "
        f"last minute median {statistics.median(s[1] for s in last) / 1024:.1f}, "
        f"min {min(rss) / 1024:.1f}, max {max(rss) / 1024:.1f}"
    )
    print(
        f"open fds: first minute median {statistics.median(s[2] for s in first):g}, "
        f"last minute median {statistics.median(s[2] for s in last):g}, "
        f"min {min(fd)}, max {max(fd)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(soak(args.minutes, args.devices, args.step_ms, args.sample_s))


if __name__ == "__main__":
    main()
