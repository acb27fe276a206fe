"""uevent -> kubelet simulator has the new list, for ``devplug run`` with 1,000 devices present.

Each sample adds, then removes, one mock Intel GPU, with the uevents in the kernel's order:

- add: the PCI function (no driver yet), a driver-probe gap (``--probe-gap-ms``), then the
  drm card and render minors and the function's ``bind`` in one burst. The clock starts
  before the burst's first event: the device can be advertised no earlier.
- remove: children first, each device's /dev node gone, ``unbind`` for the bound function,
  its ``remove`` sent while its sysfs directory is still there, then the directory deleted
  (``UmockdevHost.unplug``). The clock starts before the first event. ``--linger-ms N``
  sends all the events first and deletes the directories N ms later (the kernel's thread
  preempted between its event and the deletion): a consumer must not wait for them to go.

The daemon runs the Intel GPU scanner (``--scanner intel_gpu``, the default): the advertised
device is the whole GPU, its id the PCI address, so a remove ends only when the GPU has left
the list, whichever of its events (the minors', the function's) takes it out. ``--scanner
generic`` advertises each render minor instead (the generic scanner's path). The clock stops
when the simulator receives the list with the device added (or gone); the daemon's coalescing
window is inside that figure. Before the samples, one add and one remove are made and not
counted: the first incremental scan after start pays for what start-up left cold (it was add's
slowest sample by far, and its p99 with 30 samples). Adds and removes are reported apart, with
their ratio (the p50s and p99s of one run, taken from interleaved samples).

The floor, measured in the same run: a bare pyudev monitor in another process (``--floor``
child, bench.monitor_floor) receiving the event that completes the device (the Intel GPU
scanner: the function's ``bind``, then its ``remove``; the generic scanner: the render
minor's), in the same order, and telling this process.

    umockdev-wrapper .venv/bin/python -m bench.hotplug [--devices 1000] [--samples 100] \
        [--scanner intel_gpu|generic] [--probe-gap-ms 20] [--linger-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import (
    RENDER_CONFIG,
    RENDER_MINOR_BASE,
    RENDER_RESOURCE,
    add_gpu,
    daemon_process,
    gpu_address,
    gpu_host,
    percentile,
    require_preload,
    scratch_dir,
    summary_ms,
)
from devplug.testing import KubeletSimulator
from devplug.testing.simulator import ListedDevice, PluginSession
from devplug.testing.umockdev import UmockdevHost, add_drm_minors, add_pci_device

# Quiet time between samples, so the hotplug path is idle when each one starts. At 10,000
# devices the CDI pass that follows a change may still be running then (its render waits for
# the hotplug path's quiet, slice by slice).
SETTLE_S = 0.05
PROBE_GAP_S = 0.02  # the driver's probe between the function's add and its drm minors'
# After the first CDI spec is on disk, until the daemon's start-up work is over: the garbage
# collector's settle follows that spec once the hotplug path is quiet (one full collection,
# ~150 ms at 10,000 devices; devplug._kits.collector).
START_UP_QUIET_S = 1.0

INTEL_GPU_RESOURCE = "gpu.intel.com/i915"
INTEL_GPU_CONFIG = """
hotplug: {source: kernel, resync_s: 3600, poll_s: 3600}
scanners:
  intel_gpu: {}
"""


@dataclass(frozen=True, slots=True)
class Target:
    """What the daemon advertises for GPU number ``index``, and the events that complete it."""

    scanner: str

    @property
    def config(self) -> str:
        return INTEL_GPU_CONFIG if self.scanner == "intel_gpu" else RENDER_CONFIG

    @property
    def resource(self) -> str:
        return INTEL_GPU_RESOURCE if self.scanner == "intel_gpu" else RENDER_RESOURCE

    def device_id(self, index: int) -> str:
        if self.scanner == "intel_gpu":
            return gpu_address(index)
        return f"dri_renderD{RENDER_MINOR_BASE + index}"

    @property
    def subsystems(self) -> list[str]:
        """What the floor's monitor listens to: the subsystems of :meth:`last_events`."""
        return ["drm", "pci"] if self.scanner == "intel_gpu" else ["drm"]

    def last_events(self, pci: str, render: str) -> tuple[str, str]:
        """The add and the remove uevent (``action path``) after which the device is whole,
        or gone, as the floor's monitor sees them."""
        if self.scanner == "intel_gpu":
            return f"bind {pci}", f"remove {pci}"
        return f"add {render}", f"remove {render}"


def new_gpu(host: UmockdevHost, index: int) -> tuple[str, list[str]]:
    """A new GPU, whole and not yet announced: its PCI path and its paths, parent first, to
    announce in one burst (bench.hotplug_stages; :func:`plug_gpu` has the kernel's order)."""
    pci = add_gpu(host, index)
    return pci, [pci, f"{pci}/drm/card{index}", f"{pci}/drm/renderD{RENDER_MINOR_BASE + index}"]


async def plug_gpu(host: UmockdevHost, index: int, probe_gap_s: float) -> tuple[str, float, str]:
    """GPU number ``index`` added in the kernel's order: the PCI function (no driver yet),
    the probe gap, then its drm card and render minors and ``bind`` in one burst.

    Returns its PCI path, when the burst started (``time.perf_counter``) and the render
    minor's path."""
    address = gpu_address(index)
    pci = add_pci_device(
        host, address, vendor="0x8086", device="0x56a0", driver=None, numa_node=index % 2
    )
    await host.emit_async("add", pci)
    await asyncio.sleep(probe_gap_s)
    host.set_driver(pci, "i915")
    card, render = add_drm_minors(
        host, pci, card=index, render=RENDER_MINOR_BASE + index, by_path=address
    )
    started = time.perf_counter()
    await host.emit_async("add", card)
    await host.emit_async("add", render)
    await host.emit_async("bind", pci)
    return pci, started, render


async def arrival(session: PluginSession, seen: int, device_id: str, present: bool) -> float:
    """When the first list after the ``seen``-th with ``device_id`` present (or not) arrived."""

    def wanted(listed: dict[str, ListedDevice]) -> bool:
        return (device_id in listed) == present

    await session.wait_for_update(wanted, after=seen)
    return next(
        at
        for at, listed in zip(session.update_times[seen:], session.updates[seen:], strict=True)
        if wanted(listed)
    )


async def floor_samples(
    host: UmockdevHost,
    target: Target,
    first_index: int,
    samples: int,
    probe_gap_s: float,
    linger_s: float,
) -> tuple[list[float], list[float]]:
    """(adds, removes): first event -> a bare monitor in another process has the event that
    completes the device, in the kernel's order as for the daemon; after one uncounted
    add and remove (``first_index``)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.monitor_floor",
        *target.subsystems,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **host.env()},
    )
    assert child.stdout is not None
    stdout = child.stdout

    async def delivered(event: str) -> float:
        wanted = event.encode()
        while (await stdout.readline()).rstrip() != wanted:
            pass
        return time.perf_counter()

    adds: list[float] = []
    removes: list[float] = []
    try:
        assert (await stdout.readline()).strip() == b"ready"
        for index in range(first_index, first_index + 1 + samples):
            pci, started, render = await plug_gpu(host, index, probe_gap_s)
            added, removed = target.last_events(pci, render)
            add = await delivered(added) - started
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            unplugged = asyncio.create_task(host.unplug(pci, linger_s=linger_s))
            remove = await delivered(removed) - started
            await unplugged
            await asyncio.sleep(SETTLE_S)
            if index > first_index:  # the first is the warm-up
                adds.append(add)
                removes.append(remove)
    finally:
        child.kill()
        await child.wait()
    return adds, removes


async def daemon_samples(
    session: PluginSession,
    host: UmockdevHost,
    target: Target,
    first_index: int,
    samples: int,
    probe_gap_s: float,
    linger_s: float,
) -> tuple[list[float], list[float]]:
    """(adds, removes): first event -> the simulator has the list with the device added (or
    gone); after one uncounted add and remove (``first_index``)."""
    adds: list[float] = []
    removes: list[float] = []
    for index in range(first_index, first_index + 1 + samples):
        device_id = target.device_id(index)
        await asyncio.sleep(SETTLE_S)
        seen = len(session.updates)
        pci, started, _ = await plug_gpu(host, index, probe_gap_s)
        add = await arrival(session, seen, device_id, True) - started

        await asyncio.sleep(SETTLE_S)
        seen = len(session.updates)
        started = time.perf_counter()
        unplugged = asyncio.create_task(host.unplug(pci, linger_s=linger_s))
        remove = await arrival(session, seen, device_id, False) - started
        await unplugged
        if index > first_index:  # the first is the warm-up
            adds.append(add)
            removes.append(remove)
    return adds, removes


async def start_up_over(cdi_dir: Path, timeout_s: float = 60.0) -> None:
    """Once the daemon's start-up work is done: its first CDI pass (the render of every
    device, ~140 ms of slices at 10,000 devices) and the collector's settle after it. The
    samples measure hotplug on a running daemon, not on one still starting."""
    deadline = time.monotonic() + timeout_s
    while not any(cdi_dir.glob("*.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no CDI spec in {cdi_dir} after {timeout_s:g} s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(START_UP_QUIET_S)


def ratio(removes: list[float], adds: list[float], fraction: float) -> str:
    return f"{percentile(removes, fraction) / percentile(adds, fraction):.2f}x"


async def main(
    devices: int, samples: int, scanner: str, probe_gap_s: float, linger_s: float
) -> None:
    require_preload()
    target = Target(scanner)
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", devices)
        # The mock host is big and long-lived: keep it out of this process's GC passes, whose
        # pauses would otherwise land in the simulator's timestamps. While samples are taken
        # this process does not collect at all: the lists the simulator keeps (hundreds of
        # them, of 10,000 devices each at most) made its own collections pause for
        # milliseconds inside the windows measured. (The daemon, another process, collects
        # as it always does.)
        gc.freeze()
        gc.disable()
        kubelet_dir = scratch / "kubelet"
        with host.activated():
            floor_adds, floor_removes = await floor_samples(
                host, target, devices + samples + 1, samples, probe_gap_s, linger_s
            )
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(target.config, kubelet_dir, host),
            ):
                session = await kubelet.wait_for_plugin(target.resource, timeout=60)
                await session.wait_for_update(lambda listed: len(listed) == devices, timeout=60)
                await start_up_over(kubelet_dir.parent / "cdi")
                adds, removes = await daemon_samples(
                    session, host, target, devices, samples, probe_gap_s, linger_s
                )
    print(
        f"devices present: {devices} ({scanner} scanner, {target.resource}), samples: "
        f"{samples} adds + {samples} removes after one of each uncounted, probe gap "
        f"{probe_gap_s * 1000:g} ms, sysfs dirs linger {linger_s * 1000:g} ms"
    )
    print(f"floor (bare pyudev monitor, other process), add:    {summary_ms(floor_adds)}")
    print(f"floor (bare pyudev monitor, other process), remove: {summary_ms(floor_removes)}")
    goal = "p99 <= 25 ms at 10,000 devices, 8 ms at 1,000 (issue 16)"
    print(f"uevent -> new list at the kubelet, add:     {summary_ms(adds)} (goal {goal})")
    print(f"uevent -> new list at the kubelet, remove:  {summary_ms(removes)}")
    print(
        f"remove / add: p50 {ratio(removes, adds, 0.5)}, p99 {ratio(removes, adds, 0.99)}, "
        f"max {max(removes) / max(adds):.2f}x (goal: p99 <= 2x, issue 25)"
    )
    print(f"both:                                       {summary_ms(adds + removes)}")
    slowest = sorted(range(samples), key=lambda i: -max(adds[i], removes[i]))[:3]
    print(
        "slowest samples (index: add ms, remove ms): "
        + ", ".join(f"{i}: {adds[i] * 1000:.1f}, {removes[i] * 1000:.1f}" for i in slowest)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument(
        "--scanner",
        choices=["intel_gpu", "generic"],
        default="intel_gpu",
        help="intel_gpu: the whole GPU is the device; generic: each render minor is",
    )
    parser.add_argument(
        "--probe-gap-ms",
        type=float,
        default=PROBE_GAP_S * 1000,
        help="between the PCI function's add and its drm minors' (the driver's probe)",
    )
    parser.add_argument(
        "--linger-ms",
        type=float,
        default=0.0,
        help="how long removed devices' sysfs dirs stay after their events (0: each goes "
        "right after its own event)",
    )
    args = parser.parse_args()
    asyncio.run(
        main(
            args.devices,
            args.samples,
            args.scanner,
            args.probe_gap_ms / 1000,
            args.linger_ms / 1000,
        )
    )
