"""DRA Prepare: a batch of claims prepared over the DRA socket, without the API read.

The real kubelet plugin (:class:`~devplug.dra.registration.KubeletPlugin`: the DRAPlugin
service on its unix socket, the :class:`~devplug.dra.claims.ClaimPreparer`, the checkpoint in
the plugin dir, written and fsynced on every change) is called by the kubelet DRA stand-in
(``devplug.testing.kubelet_dra``) over v1, as a 1.34+ kubelet calls it. The claims are read
from memory, not from an API server: the figure is devplug's own work (map each result to a
device of the published pool, check who holds it, name the CDI ids the spec on disk defines,
record the checkpoint, answer), as issue 27 asks. The CDI ids come from a CDI catalog of a
spec written for the run, through the device-plugin front's Allocate code (``CdiNames``), as
the daemon gives them to Prepare.

Each round, interleaved, with ``--claims`` new claims of one device each:

- floor: an empty NodePrepareResources on the same socket (the gRPC round trip, the
  stand-in's client, the service with nothing to do);
- floor: the checkpoint write alone (``Checkpoint.save`` of the batch's claims to another file
  in the same dir: serialise, write, fsync, rename, fsync the dir);
- Prepare of the batch, first time: every claim read (from memory), mapped and recorded;
- Prepare of the same batch again, served from the checkpoint (what the kubelet gets when it
  asks again after its own restart);
- Unprepare of the batch (a checkpoint write too), which frees the devices for the next round.

The plugin dir is on the disk (``--dir``, default /tmp), not a tmpfs: on a tmpfs fsync costs
nothing, and a node's /var/lib/kubelet is a disk. The plugin logs as the daemon does (JSON,
one line per claim prepared and unprepared) to stderr.

    flock /tmp/devplug-bench.lock .venv/bin/python -m bench.dra_prepare [--rounds 200] \\
        [--claims 10] 2>/dev/null
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from bench.common import summary_ms
from devplug.cdi.allocate import CdiCatalog, CdiNames, CdiOptions, CdiResource
from devplug.cdi.render import SpecRenderer, default_kind
from devplug.cdi.stamps import file_stamp
from devplug.dra.checkpoint import CHECKPOINT_FILE, Checkpoint, PreparedClaim
from devplug.dra.claims import ClaimPreparer
from devplug.dra.registration import KubeletPlugin, PluginPaths
from devplug.dra.slices import Pool, build_pool
from devplug.logconfig import configure
from devplug.model import ContainerAllocation, DeviceInfo, DeviceNode
from devplug.naming import spec_file_name
from devplug.testing.apiserver import allocated_claim
from devplug.testing.kubelet_dra import V1, ClaimName, DraPluginSession, KubeletDra

DRIVER, NODE, NAMESPACE = "gpu.intel.com", "node1", "team-a"
RESOURCE = "gpu.intel.com/i915"
KIND = default_kind(RESOURCE)


def address(n: int) -> str:
    return f"0000:{n // 256 + 1:02x}:{n % 256 // 8:02x}.{n % 8}"


def gpus(count: int) -> dict[str, DeviceInfo]:
    return {
        address(n): DeviceInfo(
            nodes=(DeviceNode("/dev/null", f"/dev/dri/card{n}"),),
            numa_nodes=(n % 2,),
            sources=(f"/sys/devices/pci0000:00/0000:00:01.0/{address(n)}",),
        )
        for n in range(count)
    }


class AllocateCdiIds:
    """Prepare's CDI ids through the device-plugin front's Allocate code, as the daemon's
    adapter gives them: only while the spec on disk defines the device as advertised."""

    def __init__(self, names: CdiNames, devices: Mapping[str, DeviceInfo]) -> None:
        self.names = names
        self.devices = devices

    def cdi_device_ids(self, resource: str, device_id: str) -> tuple[str, ...]:
        info = self.devices.get(device_id) if resource == RESOURCE else None
        if info is None:
            return ()
        self.names.confirm(resource)
        answer = self.names.extend(resource, [device_id], ContainerAllocation(), {device_id: info})
        return answer.cdi_devices


def cdi_names(cdi_dir: Path, devices: Mapping[str, DeviceInfo]) -> CdiNames:
    """The resource's spec rendered and written to ``cdi_dir``, known to a catalog."""
    rendered = SpecRenderer(KIND).render(devices)
    assert rendered is not None
    path = cdi_dir / spec_file_name(KIND)
    path.write_bytes(rendered.data)
    catalog = CdiCatalog()
    catalog.set(
        RESOURCE,
        CdiResource(KIND, path.name, rendered.names, dict(devices), path, file_stamp(path)),
    )
    return CdiNames(CdiOptions(catalog, annotations=False, device_specs=False))


class MemoryClaims:
    """The claims the scheduler allocated, read from memory: the API read left out."""

    def __init__(self, pool: Pool) -> None:
        self.names = sorted(pool.devices)
        self.stored: dict[tuple[str, str], dict[str, Any]] = {}

    async def read(self, namespace: str, name: str) -> Mapping[str, Any]:
        return self.stored[(namespace, name)]

    def batch(self, round_: int, count: int) -> list[ClaimName]:
        """``count`` new claims, each allocated one device of the pool."""
        claims = []
        for index in range(count):
            name = f"r{round_}-c{index}"
            result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": self.names[index]}
            claim = allocated_claim(
                name, NAMESPACE, [result], uid=f"uid-{name}", device_class=f"i915.{DRIVER}"
            )
            self.stored[(NAMESPACE, name)] = claim
            claims.append(ClaimName(NAMESPACE, f"uid-{name}", name))
        return claims


@contextlib.asynccontextmanager
async def plugin_served(plugin: KubeletPlugin) -> AsyncIterator[None]:
    task = asyncio.create_task(plugin.run(), name="dra-plugin")
    try:
        await plugin.serving.wait_for(bool, timeout=30)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def timed(call: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await call
    return time.perf_counter() - start, result


def check_prepared(answers: Mapping[str, Any], claims: list[ClaimName]) -> None:
    for claim in claims:
        answer = answers[claim.uid]
        if answer.error or not answer.devices or not answer.devices[0].cdi_device_ids:
            raise SystemExit(f"{claim.name} was not prepared: {answer}")


async def measure(root: Path, args: argparse.Namespace) -> None:
    devices = gpus(args.claims)
    pool = build_pool({RESOURCE: devices}, node_name=NODE, driver=DRIVER, generation=1)
    cdi_dir = root / "cdi"
    cdi_dir.mkdir()
    paths = PluginPaths.under(root / "kubelet", DRIVER)
    claims = MemoryClaims(pool)
    preparer = ClaimPreparer(
        driver=DRIVER,
        pool_name=NODE,
        read_claim=claims.read,
        pool=lambda: pool,
        advertised=lambda resource, device_id: devices.get(device_id),
        cdi=AllocateCdiIds(cdi_names(cdi_dir, devices), devices),
        checkpoint=Checkpoint(paths.plugin_dir / CHECKPOINT_FILE, DRIVER),
    )
    floor_checkpoint = Checkpoint(paths.plugin_dir / f"floor-{CHECKPOINT_FILE}", DRIVER)
    samples: dict[str, list[float]] = defaultdict(list)
    async with (
        KubeletDra(paths.registry_dir) as kubelet,
        plugin_served(KubeletPlugin(paths, preparer)),
    ):
        session: DraPluginSession = await kubelet.wait_for_plugin(DRIVER)
        assert session.service == V1
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            for round_ in range(args.warmup + args.rounds):
                batch = claims.batch(round_, args.claims)
                rpc, _ = await timed(session.prepare([]))
                first, answers = await timed(session.prepare(batch))
                check_prepared(answers, batch)
                again, repeated = await timed(session.prepare(batch))
                if repeated != answers:
                    raise SystemExit("the answer from the checkpoint differs from the first")
                recorded: dict[str, PreparedClaim] = dict(preparer.prepared())
                write, _ = await timed(floor_checkpoint.save(recorded))
                unprepare, errors = await timed(session.unprepare(batch))
                if any(errors.values()):
                    raise SystemExit(f"unprepare failed: {errors}")
                if round_ >= args.warmup:
                    taken = {
                        "floor_rpc": rpc,
                        "floor_checkpoint": write,
                        "first": first,
                        "again": again,
                        "unprepare": unprepare,
                    }
                    for name, value in taken.items():
                        samples[name].append(value)
        finally:
            gc.enable()
            gc.unfreeze()
    report(samples, args)


def report(samples: Mapping[str, list[float]], args: argparse.Namespace) -> None:
    rpc = statistics.median(samples["floor_rpc"])
    write = statistics.median(samples["floor_checkpoint"])
    print(
        f"\nPrepare of a {args.claims}-claim batch over the DRA socket (v1), the API read "
        f"excluded (claims in memory), {args.rounds} rounds after {args.warmup} warm-up"
    )
    rows = (
        ("floor: empty NodePrepareResources", "floor_rpc", None),
        (f"floor: checkpoint write alone, {args.claims} claims", "floor_checkpoint", None),
        ("Prepare, first (map, record, answer)", "first", (rpc + write, "the two floors")),
        ("Prepare again, from the checkpoint", "again", (rpc, "the empty call")),
        ("Unprepare (a checkpoint write)", "unprepare", (rpc + write, "the two floors")),
    )
    for label, name, floor in rows:
        line = f"  {label:<44} {summary_ms(samples[name])}"
        if floor is not None:
            line += f"  p50 {statistics.median(samples[name]) / floor[0]:.2f}x {floor[1]}"
        print(line)


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="dpb-", dir=args.dir))
    try:
        await measure(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--claims", type=int, default=10)
    parser.add_argument("--dir", default="/tmp", help="where the kubelet root is made (a disk)")
    configure("json")  # the daemon's log lines (one per claim prepared), to stderr
    asyncio.run(main(parser.parse_args()))
