"""Full scan of big Intel GPU hosts against raw pyudev enumeration of the same host.

For each size (1,000 and 10,000 GPUs; each a PCI function with a card and a render minor and
their by-path links) a testbed is built on a tmpfs, then, alternating, ``--runs`` times each:

- floor: raw pyudev enumeration of the drm subsystem (``Context().list_devices(subsystem=
  "drm")``, each device's sys_path read): the least a udev-based GPU scan must do;
- by path: the same devices opened one by one from a listing of /sys/class/drm (how
  devplug's udev source enumerates; faster than libudev's enumerator), for reference;
- devplug: ``IntelGpuScanner.scan`` with the defaults (vendor and driver checks, SR-IOV and
  allow/deny checks, nodes and by-path links stat'ed, NUMA read, the size guard);
- rescan: one GPU's incremental rescan after a ``change`` event, for scale, also with the
  monitoring device on (which carries every GPU's nodes) while one GPU's card node flaps.

Medians are printed with the ratio to the floor. Nothing is asserted.

    umockdev-wrapper .venv/bin/python -m bench.intel_gpu_scan [--sizes 1000 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import pyudev

from bench.common import gpu_address, gpu_host, require_preload, scratch_dir
from devplug.model import DeviceTree
from devplug.scanners.intel_gpu import IntelGpuScanner, IntelGpuSettings
from devplug.scanners.udev import UdevEvent, UdevSource


def raw_enumeration() -> int:
    context = pyudev.Context()
    return sum(1 for device in context.list_devices(subsystem="drm") if device.sys_path)


def opened_by_path() -> int:
    """The faster way to the same devices: list /sys/class/drm, open each through libudev."""
    context = pyudev.Context()
    with os.scandir("/sys/class/drm") as entries:
        paths = [entry.path for entry in entries]
    return sum(1 for path in paths if pyudev.Devices.from_sys_path(context, path).sys_path)


def timed(action: Callable[[], object]) -> float:
    gc.collect()
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(count: int, runs: int) -> None:
    with scratch_dir("4g") as root:
        started = time.perf_counter()
        host = gpu_host(root / "testbed", count)
        host.add_dev_dir("dri/by-path")
        built = time.perf_counter() - started
        with host.activated():
            pyudev.Context()  # load libudev once, outside the timings
            scanner = IntelGpuScanner()
            tree = scanner.scan(UdevSource())
            found = sum(len(devices) for devices in tree.values())
            assert found == count, f"expected {count} GPUs, scanned {found}"
            assert raw_enumeration() == 2 * count
            assert opened_by_path() == 2 * count
            floor: list[float] = []
            by_path: list[float] = []
            full: list[float] = []
            for _ in range(runs):
                floor.append(timed(raw_enumeration))
                by_path.append(timed(opened_by_path))
                full.append(timed(lambda: scanner.scan(UdevSource())))
            target = (
                f"/sys/devices/pci0000:{gpu_address(count // 2)[5:7]}/{gpu_address(count // 2)}"
            )
            event = [UdevEvent("change", target, "pci")]
            rescans = []
            for _ in range(runs):
                rescans.append(timed(lambda: rescan(scanner, tree, event)))
            # With the monitoring device, whose nodes are every GPU's: the node vanishes and
            # comes back, so the device changes at every rescan.
            watched = IntelGpuScanner(IntelGpuSettings(monitoring=True))
            watched_tree = watched.scan(UdevSource())
            card = f"{target}/drm/card{count // 2}"
            monitored = []
            change = [UdevEvent("change", card, "drm")]
            for run in range(runs):
                host.set_node_present(card, run % 2 == 1)
                started = time.perf_counter()
                watched_tree = rescan(watched, watched_tree, change)
                monitored.append(time.perf_counter() - started)
        floor_s, full_s = statistics.median(floor), statistics.median(full)
        by_path_s = statistics.median(by_path)
        print(
            f"{count:>6} GPUs (built in {built:.1f} s): raw pyudev enumeration "
            f"{floor_s * 1000:.0f} ms (opened by path: {by_path_s * 1000:.0f} ms); "
            f"devplug full scan {full_s * 1000:.0f} ms = {full_s / floor_s:.2f}x the floor "
            f"({full_s / by_path_s:.2f}x by path); one-GPU rescan "
            f"{statistics.median(rescans) * 1000:.2f} ms, with monitoring "
            f"{statistics.median(monitored) * 1000:.2f} ms (medians of {runs})"
        )


def rescan(scanner: IntelGpuScanner, tree: DeviceTree, events: list[UdevEvent]) -> DeviceTree:
    result = scanner.rescan(UdevSource(), tree, events)
    if result is None:
        raise RuntimeError("the rescan asked for a full scan")
    return result


def main() -> None:
    require_preload()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for count in args.sizes:
        measure(count, args.runs)


if __name__ == "__main__":
    main()
