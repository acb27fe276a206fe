"""What keeping a CDI spec current costs: render + validate + atomic write, per change.

For 1,000 and 10,000 GPU-like devices (two nodes and two read-only mounts each) in one
resource, in a scratch dir (a tmpfs when we may mount one), medians of ``--runs``:

- floor: ``json.dumps`` of the same spec document (compact) plus a plain ``write_bytes`` of
  it to the same directory: the least any writer of this file does;
- first: a new SpecRenderer rendering every device, then the daemon's write through its
  SpecStore (ownership record, then the atomic write: temp file, fsync, 0644, rename,
  directory fsync; all file I/O through aiofiles);
- one change: one device replaced, rendered again (the other devices' fragments reused), and
  written the same way: what a hotplug event costs the CDI task. The renderer is told the
  tree's edit (``DeviceTree.edit_since``) as the CDI sync tells it, so it looks at that one
  device only; the render without the edit (every id looked at again) is shown beside it.

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
from devplug.cdi.ownership import OwnerLock
from devplug.cdi.render import SpecRenderer, resource_spec
from devplug.cdi.spec import spec_document
from devplug.cdi.store import SpecStore
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Mount

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
    render_edit: list[float] = []
    render_all: list[float] = []
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

        # One device replaced, as a hotplug event's tree edit does it: the renderer is told
        # the edit (DeviceTree.edit_since), so only that device is looked at.
        key = next(iter(devices))
        tree = DeviceTree({RESOURCE: devices})
        renderer.render(tree[RESOURCE])  # the map the renderer rendered last (untimed)
        changed_tree = tree.with_changes([(RESOURCE, key)], {RESOURCE: {key: gpu(0, 10_000 + run)}})
        changed = changed_tree[RESOURCE]
        edit = changed_tree.edit_since(RESOURCE, tree[RESOURCE])
        started = time.perf_counter()
        await store.prepare()
        rendered = renderer.render(changed, edit)
        rendered_at = time.perf_counter()
        assert rendered is not None
        await store.write(FILE, RESOURCE, rendered.data)
        change.append(time.perf_counter() - started)
        render_edit.append(rendered_at - started)
        # The same change without the edit: every id looked at again (the fragments reused).
        again = changed_tree.with_changes(
            [(RESOURCE, key)], {RESOURCE: {key: gpu(0, 20_000 + run)}}
        )
        started = time.perf_counter()
        renderer.render(again[RESOURCE])
        render_all.append(time.perf_counter() - started)
    size = (directory / FILE).stat().st_size
    print(
        f"{count:>6} devices ({size / 1024:.0f} KiB spec): floor (json.dumps + write) "
        f"{median_ms(floor):.1f} ms; devplug first render + atomic write "
        f"{median_ms(first):.1f} ms ({median_ms(first) / median_ms(floor):.2f}x); one device "
        f"changed {median_ms(change):.1f} ms ({median_ms(change) / median_ms(floor):.2f}x) "
        f"(medians of {runs}); of which the render {median_ms(render_edit):.2f} ms (told the "
        f"edit; without it, every id looked at again: {median_ms(render_all):.2f} ms)"
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
