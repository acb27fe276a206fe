"""What other writers' files in the CDI dir cost devplug's own spec at start-up.

A CDI dir is shared: a neighbour may fill it with thousands of specs and junk. This starts the
daemon's CDI task (:class:`~devplug.cdi.sync.CdiSync`, as the daemon runs it, without the
kubelet front) on a CDI dir holding, besides one stale spec an earlier run of this instance
left (for the start-up clean-up to find):

- ``--foreign N`` other writers' specs (``vendor.example-f<i>.json``, ~250 bytes each);
- as many junk lock files: ``<32 hex>.lock`` in the CDI dir, and the same names, unheld, in
  devplug's state dir (``.devplug/``), where they look like the locks of daemons gone (the
  clean-up probes and deletes each);

and times, from the task's start, (1) devplug's own spec (one resource, 100 devices) on disk
and (2) the start-up clean-up done (the stale spec gone). The floor is the same run with none
of those files, in the same process. In a scratch dir (a tmpfs when we may mount one);
medians of ``--runs``. Nothing is asserted.

    .venv/bin/python -m bench.cdi_crowded [--foreign 10000 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
import uuid
from pathlib import Path

from bench.common import scratch_dir
from devplug.cdi.allocate import CdiCatalog
from devplug.cdi.ownership import STATE_DIR, STATE_DIR_MODE, OwnerLock
from devplug.cdi.store import SpecStore
from devplug.cdi.sync import CdiSync
from devplug.config import CdiSettings
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, Health

RESOURCE = "example.com/serial"
OWN_SPEC = "example.com-serial.json"
STALE_SPEC = "example.com-gone.json"
INSTANCE = "generic"
FOREIGN_SPEC = (
    b'{"cdiVersion":"0.5.0","kind":"vendor.example/f","devices":[{"name":"gpu%d",'
    b'"containerEdits":{"deviceNodes":[{"path":"/dev/vendor/gpu%d","type":"c",'
    b'"major":226,"minor":%d}]}}],"containerEdits":{"env":["VENDOR_VISIBLE=all"]}}\n'
)
WAIT_LIMIT_S = 600.0  # a bound on a hang, far past any figure here


def devices(count: int) -> dict[str, DeviceInfo]:
    return {
        f"tty{i}": DeviceInfo(health=Health.HEALTHY, nodes=(DeviceNode(f"/dev/ttyX{i}"),))
        for i in range(count)
    }


async def leave_stale_spec(cdi_dir: Path) -> None:
    """A spec an earlier daemon of this instance wrote and left (killed, or keep_on_exit)."""
    earlier = SpecStore(cdi_dir, INSTANCE, OwnerLock(cdi_dir))
    await earlier.prepare()
    stale = b'{"cdiVersion":"0.3.0","kind":"example.com/gone","devices":[]}\n'
    await earlier.write(STALE_SPEC, "example.com/gone", stale)
    await earlier.close()


def crowd(cdi_dir: Path, count: int) -> None:
    """``count`` foreign specs, and as many junk lock files in the dir and in the state dir."""
    state = cdi_dir / STATE_DIR
    state.mkdir(mode=STATE_DIR_MODE, exist_ok=True)
    for index in range(count):
        (cdi_dir / f"vendor.example-f{index}.json").write_bytes(
            FOREIGN_SPEC % (index, index, index)
        )
        junk = uuid.uuid4().hex + ".lock"
        (cdi_dir / junk).write_bytes(b"")
        (state / junk).write_bytes(b"")


async def one_run(cdi_dir: Path, foreign: int) -> tuple[float, float]:
    """(own spec on disk, clean-up done), seconds from the CDI task's start."""
    shutil.rmtree(cdi_dir, ignore_errors=True)
    cdi_dir.mkdir()
    await leave_stale_spec(cdi_dir)
    crowd(cdi_dir, foreign)
    os.sync()
    catalog = CdiCatalog()
    spec_written = asyncio.Event()
    sync = CdiSync(
        CdiSettings(dir=cdi_dir),
        catalog,
        INSTANCE,
        on_change=lambda: spec_written.set() if catalog.get(RESOURCE) else None,
    )
    sync.submit(DeviceTree({RESOURCE: devices(100)}))
    started = time.perf_counter()
    task = asyncio.create_task(sync.run())
    try:
        async with asyncio.timeout(WAIT_LIMIT_S):
            await spec_written.wait()
            own = time.perf_counter() - started
            assert (cdi_dir / OWN_SPEC).exists()
            while (cdi_dir / STALE_SPEC).exists():  # noqa: ASYNC110 - a file, no event
                await asyncio.sleep(0.001)
            cleaned = time.perf_counter() - started
    finally:
        sync.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sync.close()
    return own, cleaned


async def measure(sizes: list[int], runs: int, directory: Path) -> None:
    cdi_dir = directory / "cdi"
    results: dict[int, tuple[list[float], list[float]]] = {}
    for _ in range(runs):
        for size in [0, *sizes]:  # interleaved: the floor meets the same machine
            own, cleaned = await one_run(cdi_dir, size)
            results.setdefault(size, ([], []))[0].append(own)
            results[size][1].append(cleaned)
    floor_own = statistics.median(results[0][0])
    floor_clean = statistics.median(results[0][1])
    print(
        f"empty dir (floor): own spec {floor_own * 1000:.0f} ms, clean-up done "
        f"{floor_clean * 1000:.0f} ms (medians of {runs})"
    )
    for size in sizes:
        own = statistics.median(results[size][0])
        cleaned = statistics.median(results[size][1])
        per_10k = (own - floor_own) / size * 10_000
        print(
            f"{size:>6} foreign specs + {size} junk locks in the dir + {size} in .devplug/: own "
            f"spec {own * 1000:.0f} ms ({own - floor_own:+.3f} s over the floor, {per_10k:+.3f} s "
            f"per 10,000), clean-up done {cleaned * 1000:.0f} ms "
            f"({cleaned - floor_clean:+.3f} s) (medians of {runs})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--foreign", type=int, nargs="+", default=[10_000, 20_000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with scratch_dir("1g") as directory:
        asyncio.run(measure(args.foreign, args.runs, directory))


if __name__ == "__main__":
    main()
