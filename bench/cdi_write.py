"""What keeping a CDI spec current costs: render + validate + atomic write, per change.

For 1,000 and 10,000 GPU-like devices (two nodes and two read-only mounts each) in one
resource, in a scratch dir (a tmpfs when we may mount one), medians of ``--runs``:

- floor: ``json.dumps`` of the same spec document (compact) plus a plain ``write_bytes`` of
  it to the same directory: the least any writer of this file does;
- first: a new SpecRenderer rendering every device, then the daemon's write through its
  SpecStore (ownership record, then the atomic write: temp file, fsync, 0644, rename,
  directory fsync; all file I/O through aiofiles);
- one change: one device replaced, rendered again (the other devices' fragments reused), and
  written the same way: what a hotplug event costs the CDI task.

Nothing is asserted.

    .venv/bin/python -m bench.cdi_write [--sizes 1000 10000] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bench.common import scratch_dir
from devplug.cdi.build import SpecRenderer, resource_spec
from devplug.cdi.ownership import OwnerLock
from devplug.cdi.spec import spec_document
from devplug.cdi.store import SpecStore
from devplug.model import DeviceInfo, DeviceNode, Mount

RESOURCE = KIND = "gpu.intel.com/i915"
FILE = "gpu.intel.com-i915.json"


def gpu(index: int, card: int) -> DeviceInfo:
    address = f"0000:{index // 256 + 1:02x}:{index % 256 // 8:02x}.{index % 8}"
    return DeviceInfo(
        nodes=(DeviceNode(f"/dev/dri/card{card}"), DeviceNode(f"/dev/dri/renderD{card + 128}")),
        mounts=(
            Mount(f"/dev/dri/by-path/pci-{address}-card"),
            Mount(f"/dev/dri/by-path/pci-{address}-render"),
        ),
    )


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def measure(count: int, runs: int, directory: Path) -> None:
    devices = {
        f"0000:{i // 256 + 1:02x}:{i % 256 // 8:02x}.{i % 8}": gpu(i, i) for i in range(count)
    }
    spec = resource_spec(KIND, devices)
    assert spec is not None
    document = spec_document(spec)
    floor, first, change = [], [], []
    store = SpecStore(directory, "bench", OwnerLock(directory))
    await store.prepare()
    for run in range(runs):
        started = time.perf_counter()
        await store.remove(FILE)  # the first write finds no file
        (directory / FILE).unlink(missing_ok=True)
        (directory / "plain.json").write_bytes(json.dumps(document, separators=(",", ":")).encode())
        floor.append(time.perf_counter() - started)

        started = time.perf_counter()
        await store.prepare()  # as the daemon does once per pass
        renderer = SpecRenderer(KIND)
        rendered = renderer.render(devices)
        assert rendered is not None
        await store.write(FILE, RESOURCE, rendered.data)
        first.append(time.perf_counter() - started)

        changed = dict(devices)
        key = next(iter(devices))
        changed[key] = gpu(0, 10_000 + run)
        started = time.perf_counter()
        await store.prepare()
        rendered = renderer.render(changed)
        assert rendered is not None
        await store.write(FILE, RESOURCE, rendered.data)
        change.append(time.perf_counter() - started)
    size = (directory / FILE).stat().st_size
    print(
        f"{count:>6} devices ({size / 1024:.0f} KiB spec): floor (json.dumps + write) "
        f"{median_ms(floor):.1f} ms; devplug first render + atomic write "
        f"{median_ms(first):.1f} ms ({median_ms(first) / median_ms(floor):.2f}x); one device "
        f"changed {median_ms(change):.1f} ms ({median_ms(change) / median_ms(floor):.2f}x) "
        f"(medians of {runs})"
    )
    await store.remove(FILE)
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with scratch_dir("256m") as directory:
        for count in args.sizes:
            asyncio.run(measure(count, args.runs, directory))


if __name__ == "__main__":
    main()
