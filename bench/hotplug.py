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

The clock stops when the simulator receives the list with the render device added (or gone);
the daemon's coalescing window is inside that figure. Adds and removes are reported apart,
with their ratio (the p99s of one run, taken from interleaved samples).

The floor, measured in the same run: a bare pyudev monitor in another process (``--floor``
child, bench.monitor_floor) receiving the render minor's event, in the same order, and
telling this process.

    umockdev-wrapper .venv/bin/python -m bench.hotplug [--devices 1000] [--samples 30] \
        [--probe-gap-ms 20] [--linger-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time

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

SETTLE_S = 0.05  # quiet time between samples, so each one starts from an idle daemon
PROBE_GAP_S = 0.02  # the driver's probe between the function's add and its drm minors'


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
    host: UmockdevHost, first_index: int, samples: int, probe_gap_s: float, linger_s: float
) -> tuple[list[float], list[float]]:
    """(adds, removes): first event -> a bare monitor in another process has the render
    minor's event, in the kernel's order as for the daemon."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.monitor_floor",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **host.env()},
    )
    assert child.stdout is not None
    stdout = child.stdout

    async def delivered(action: str, sys_path: str) -> float:
        wanted = f"{action} {sys_path}".encode()
        while (await stdout.readline()).rstrip() != wanted:
            pass
        return time.perf_counter()

    adds: list[float] = []
    removes: list[float] = []
    try:
        assert (await stdout.readline()).strip() == b"ready"
        for index in range(first_index, first_index + samples):
            pci, started, render = await plug_gpu(host, index, probe_gap_s)
            adds.append(await delivered("add", render) - started)
            await asyncio.sleep(SETTLE_S)
            started = time.perf_counter()
            unplugged = asyncio.create_task(host.unplug(pci, linger_s=linger_s))
            removes.append(await delivered("remove", render) - started)
            await unplugged
            await asyncio.sleep(SETTLE_S)
    finally:
        child.kill()
        await child.wait()
    return adds, removes


def ratio(removes: list[float], adds: list[float], fraction: float) -> str:
    return f"{percentile(removes, fraction) / percentile(adds, fraction):.2f}x"


async def main(devices: int, samples: int, probe_gap_s: float, linger_s: float) -> None:
    require_preload()
    adds: list[float] = []
    removes: list[float] = []
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", devices)
        # The mock host is big and long-lived: keep it out of this process's GC passes, whose
        # pauses would otherwise land in the simulator's timestamps. While samples are taken
        # this process does not collect at all: the lists the simulator keeps (60 of them, of
        # 10,000 devices each at most) made its own collections pause for milliseconds inside
        # the windows measured. (The daemon, another process, collects as it always does.)
        gc.freeze()
        gc.disable()
        kubelet_dir = scratch / "kubelet"
        with host.activated():
            floor_adds, floor_removes = await floor_samples(
                host, devices + samples, samples, probe_gap_s, linger_s
            )
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(RENDER_CONFIG, kubelet_dir, host),
            ):
                session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=60)
                await session.wait_for_update(lambda listed: len(listed) == devices, timeout=60)
                for index in range(devices, devices + samples):
                    device_id = f"dri_renderD{RENDER_MINOR_BASE + index}"
                    await asyncio.sleep(SETTLE_S)
                    seen = len(session.updates)
                    pci, started, _ = await plug_gpu(host, index, probe_gap_s)
                    adds.append(await arrival(session, seen, device_id, True) - started)

                    await asyncio.sleep(SETTLE_S)
                    seen = len(session.updates)
                    started = time.perf_counter()
                    unplugged = asyncio.create_task(host.unplug(pci, linger_s=linger_s))
                    removes.append(await arrival(session, seen, device_id, False) - started)
                    await unplugged
    print(
        f"devices present: {devices}, samples: {samples} adds + {samples} removes, "
        f"probe gap {probe_gap_s * 1000:g} ms, sysfs dirs linger {linger_s * 1000:g} ms"
    )
    print(f"floor (bare pyudev monitor, other process), add:    {summary_ms(floor_adds)}")
    print(f"floor (bare pyudev monitor, other process), remove: {summary_ms(floor_removes)}")
    goal = "p99 <= 25 ms at 10,000 devices, 8 ms at 1,000 (issue 16)"
    print(f"uevent -> new list at the kubelet, add:     {summary_ms(adds)} (goal {goal})")
    print(f"uevent -> new list at the kubelet, remove:  {summary_ms(removes)}")
    print(
        f"remove / add: p50 {ratio(removes, adds, 0.5)}, p99 {ratio(removes, adds, 0.99)} "
        "(goal: p99 <= 2x, issue 25)"
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
    parser.add_argument("--samples", type=int, default=30)
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
    asyncio.run(main(args.devices, args.samples, args.probe_gap_ms / 1000, args.linger_ms / 1000))
