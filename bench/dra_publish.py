"""DRA ResourceSlices: hotplug -> the pool updated at the API server, and requests while idle.

A :class:`~devplug.dra.publisher.SlicePublisher` follows a tree of ``--devices`` GPU-like
devices (8 slices at 1,000) and publishes to the stand-in API server
(``devplug.testing.apiserver``, in this process, its schema and semantic checks off so that
it answers as fast as it can) through the real lightkube client. Each sample adds one device
at the end of the tree, or removes it again, and times from the tree's publication to the
moment the stand-in has answered the last PUT of the new generation (every slice is PUT: the
generation is bumped on every change). Two settings, interleaved sample by sample:

- ``settle 0``: the publisher's own work (build, screen and plan in a worker thread, then
  the concurrent PUTs through lightkube);
- ``settle 0.15 s``: as the daemon runs it (the settling window that coalesces a burst).

The floors, measured in the same run, interleaved: a raw PUT of one 128-device slice with
httpx2 (JSON encoded and decoded, nothing else), and raw PUTs of as many such slices as the
pool has, sent concurrently: the least any client does to publish the pool's new
generation. The build, screen and plan steps are also timed alone (medians).

Then the idle spell: ``--idle-s`` seconds with the publisher running, the same tree set
again every ``--resync-s`` (as the scan loop's resync may), the stand-in ending watches every
``--watch-s`` seconds (a real API server: every 30-60 min); the requests it sees are counted
and extrapolated to an hour. Nothing is asserted.

    flock /tmp/devplug-bench.lock .venv/bin/python -m bench.dra_publish \
        [--devices 1000] [--samples 30] [--idle-s 180] [--resync-s 10] [--watch-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2

from bench.common import summary_ms
from devplug._kits.values import LatestValue
from devplug.dra.apiclient import KubeApi, load_api_client
from devplug.dra.publisher import SETTLE_S, PublishTiming, SlicePublisher
from devplug.dra.screening import SliceScreen
from devplug.dra.slicediff import plan_slices
from devplug.dra.slices import build_pool
from devplug.dra.validate import validate_resource_slice
from devplug.model import DeviceInfo, DeviceTree
from devplug.testing.apiserver import ApiServer

NODE, FLOOR_NODE = "node1", "floor-node"
DRIVER, RESOURCE = "gpu.intel.com", "gpu.intel.com/i915"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


def address(n: int) -> str:
    return f"0000:{n // 256 + 1:02x}:{n % 256 // 8:02x}.{n % 8}"


def gpu_tree(count: int) -> DeviceTree:
    return DeviceTree(
        {
            RESOURCE: {
                address(n): DeviceInfo(
                    numa_nodes=(n % 2,),
                    sources=(f"/sys/devices/pci0000:00/0000:00:01.0/{address(n)}",),
                    attributes={"model": "A770", "family": "Arc", "pciId": "0x56a0"},
                )
                for n in range(count)
            }
        }
    )


@contextlib.asynccontextmanager
async def running(publisher: SlicePublisher) -> AsyncIterator[SlicePublisher]:
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def pool_updated(api: ApiServer, since: int, slices: int) -> bool:
    done = [r for r in list(api.request_log)[since:] if r.verb == "update" and r.code == 200]
    return len(done) >= slices


class RawFloor:
    """Slices of another node, PUT with plain httpx2: the least a client does."""

    def __init__(self, api: ApiServer, template: list[dict[str, Any]]) -> None:
        self.client = httpx2.AsyncClient(
            base_url=api.url, headers={"Authorization": f"Bearer {api.token}"}, timeout=30
        )
        self.stored: list[dict[str, Any]] = []
        self.template = template

    async def create(self) -> None:
        for index, obj in enumerate(self.template):
            body = copy.deepcopy(obj)
            body["metadata"] = {"name": f"floor-{index}"}
            body["spec"]["nodeName"] = body["spec"]["pool"]["name"] = FLOOR_NODE
            response = await self.client.post(SLICES_PATH, json=body)
            response.raise_for_status()
            self.stored.append(response.json())

    async def put(self, index: int) -> float:
        obj = self.stored[index]
        obj["spec"]["pool"]["generation"] += 1
        start = time.perf_counter()
        response = await self.client.put(f"{SLICES_PATH}/{obj['metadata']['name']}", json=obj)
        response.raise_for_status()
        self.stored[index] = response.json()
        return time.perf_counter() - start

    async def put_all(self) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(self.put(i) for i in range(len(self.stored))))
        return time.perf_counter() - start


def stage_times(count: int, runs: int) -> dict[str, float]:
    """Medians (s) of the steps of a pass, alone, for the changes the samples make (the
    screen keeps its verdicts between passes, as the publisher's does)."""
    trees = [gpu_tree(count), gpu_tree(count + 1)]
    taken: dict[str, list[float]] = {"build": [], "screen": [], "plan": []}
    screen = SliceScreen(validate_resource_slice)
    stored: dict[str, Any] = {}
    for run in range(runs + 1):
        tree = trees[run % 2]
        start = time.perf_counter()
        pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=0, node_uid="u")
        built = time.perf_counter()
        screened = screen(pool.slices)
        checked = time.perf_counter()
        plan = plan_slices(screened.slices, stored)
        planned = time.perf_counter()
        stored = {s["metadata"]["name"]: s for s in plan.slices}
        if run:  # the first pass builds from nothing
            taken["build"].append(built - start)
            taken["screen"].append(checked - built)
            taken["plan"].append(planned - checked)
    return {name: statistics.median(values) for name, values in taken.items()}


async def hotplug(api: ApiServer, kube: KubeApi, args: argparse.Namespace) -> None:
    count = args.devices
    small, big = gpu_tree(count), gpu_tree(count + 1)
    settings = {"settle 0": 0.0, f"settle {SETTLE_S:g} s": SETTLE_S}
    trees = {name: LatestValue[DeviceTree | None](small) for name in settings}
    publishers = {
        name: SlicePublisher(
            kube,
            trees[name],
            node_name=f"{NODE}-{index}",
            driver=DRIVER,
            timing=PublishTiming(settle_s=settle),
        )
        for index, (name, settle) in enumerate(settings.items())
    }
    async with contextlib.AsyncExitStack() as stack:
        for publisher in publishers.values():
            await stack.enter_async_context(running(publisher))
        for publisher in publishers.values():
            await publisher.published.wait_for(lambda pool: pool is not None, timeout=60)
        first = next(iter(publishers.values())).pool()
        assert first is not None
        slices = len(first.slices)
        floor = RawFloor(api, [dict(s) for s in first.slices])
        await floor.create()
        samples: dict[str, list[float]] = {name: [] for name in settings}
        floor_one: list[float] = []
        floor_pool: list[float] = []
        for sample in range(args.samples):
            tree = big if sample % 2 == 0 else small
            for name in settings:
                since = len(api.request_log)
                start = time.perf_counter()
                trees[name].set(tree)
                await api.wait_for(functools.partial(pool_updated, since=since, slices=slices), 60)
                samples[name].append(time.perf_counter() - start)
            floor_one.append(await floor.put(sample % slices))
            floor_pool.append(await floor.put_all())
        await floor.client.aclose()
    one_p50 = statistics.median(floor_one)
    print(f"\nhotplug -> pool updated at the stand-in, {count} devices ({slices} slices)")
    print(f"  floor: raw PUT of one 128-device slice  {summary_ms(floor_one)}")
    print(f"  floor: raw PUTs of {slices} slices at once   {summary_ms(floor_pool)}")
    for name, values in samples.items():
        p50 = statistics.median(values)
        print(
            f"  publisher, {name:<14}         {summary_ms(values)}  "
            f"p50 {p50 / one_p50:.1f}x one PUT, {p50 / statistics.median(floor_pool):.1f}x "
            "the pool's raw PUTs"
        )
    stages = stage_times(count, 9)
    print(
        "  a pass's steps alone (medians): "
        + ", ".join(f"{name} {value * 1000:.1f} ms" for name, value in stages.items())
    )


async def idle(api: ApiServer, kube: KubeApi, args: argparse.Namespace) -> None:
    trees = LatestValue[DeviceTree | None](gpu_tree(args.devices))
    publisher = SlicePublisher(kube, trees, node_name=NODE, driver=DRIVER)
    async with running(publisher):
        await publisher.published.wait_for(lambda pool: pool is not None, timeout=60)
        before, writes = Counter(api.requests), api.writes
        start = time.monotonic()
        resyncs = 0
        while (left := args.idle_s - (time.monotonic() - start)) > 0:
            await asyncio.sleep(min(args.resync_s, left))
            trees.set(gpu_tree(args.devices))  # equal content, a new tree
            resyncs += 1
        spell = time.monotonic() - start
    seen = Counter(api.requests)
    seen.subtract(before)
    per_hour = 3600 / spell
    print(
        f"\nidle {spell:.0f} s, {args.devices} devices published, {resyncs} equal trees set, "
        f"watches ended every {args.watch_s:g} s"
    )
    print(
        f"  write requests: {api.writes - writes} ({(api.writes - writes) * per_hour:.0f}/hour); "
        f"all requests: {dict(+seen)} ({sum((+seen).values()) * per_hour:.0f}/hour)"
    )


async def main(args: argparse.Namespace) -> None:
    async with ApiServer(
        schema_version=None, slice_validator=None, max_watch_seconds=args.watch_s
    ) as api:
        for node in (NODE, f"{NODE}-0", f"{NODE}-1"):
            api.put_node(node)
        with tempfile.TemporaryDirectory() as scratch:
            kubeconfig = api.write_kubeconfig(Path(scratch) / "kubeconfig")
            kube = load_api_client({"KUBECONFIG": str(kubeconfig)})
            try:
                await hotplug(api, kube, args)
                if args.idle_s > 0:
                    await idle(api, kube, args)
            finally:
                await kube.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--idle-s", type=float, default=180.0)
    parser.add_argument("--resync-s", type=float, default=10.0)
    parser.add_argument("--watch-s", type=float, default=60.0)
    asyncio.run(main(parser.parse_args()))
