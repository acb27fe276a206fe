"""Where a hotplug event's time goes, stage by stage, at 1,000 and 10,000 devices present.

Samples like bench/hotplug.py's (a mock Intel GPU added, then removed), but each sent in one
burst (the PCI function, card and render minor uevents; on removal, children first, after the
files went) rather than in the kernel's order, so that each is one batch whose stages can be
told apart. They go to a ``devplug run`` started through bench.traced_daemon,
which records when each stage of the path started and ended (bench-only wrappers; nothing in
``src/`` is changed). Each sample's records are matched to it by time (one clock for every
process: ``time.perf_counter``), giving per stage p50 / p99 / max:

    event read   emit of the first uevent -> the daemon's first monitor read
    coalesce     first read -> the scan loop takes the batch (the coalescing window)
    rescan       the worker thread round trip: the scanner's re-read, the tree edit, the list
                 limit, and the thread hand-offs
    health gate  HealthGate.gate over the scanners' tree
    publish      ScanLoop._publish until delivered: diff + new map to the server, metrics, stats
    wake         publish -> the ListAndWatch stream runs (task switch)
    message      the stream's message: ListMessageBuilder.build + its size
    serialize    grpc's call of SerializeToString
    send         serialized -> the message reached the kubelet simulator's stream (taken
                 before the simulator converts it to a dict, which at 10,000 devices costs
                 tens of milliseconds of the bench process's own: reported in the floor)

The floor, same run, same socket type and preload: bench.list_floor builds the same
ListAndWatch message of n devices from scratch with protobuf and sends it on an open stream;
reported as build, serialize and send, their total, and apart the simulator's parse (the same
conversion, done by the floor's client: it is in bench.hotplug's figures, not in these).

    umockdev-wrapper .venv/bin/python -m bench.hotplug_stages [--devices 1000 10000] \
        [--samples 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from bench.common import (
    RENDER_CONFIG,
    RENDER_MINOR_BASE,
    RENDER_RESOURCE,
    gpu_host,
    percentile,
    require_preload,
    scratch_dir,
    summary_ms,
)
from bench.hotplug import SETTLE_S, arrival, new_gpu
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.testing import KubeletSimulator
from devplug.testing.harness import daemon_process
from devplug.testing.simulator import ListedDevice, PluginSession
from devplug.testing.umockdev import UmockdevHost

Record = tuple[str, float, float]
STAGES = (
    "event read",
    "coalesce",
    "rescan",
    "  thread hand-offs",
    "  scanner re-read",
    "  tree edit",
    "  list limit",
    "health gate",
    "publish",
    "  diff",
    "  apply (diff + push)",
    "  metrics",
    "wake",
    "message (build+size)",
    "  build",
    "serialize",
    "send",
    "unaccounted",
    "total",
)


@contextlib.asynccontextmanager
async def traced_daemon(
    config_text: str,
    kubelet_dir: Path,
    host: UmockdevHost,
    trace: Path,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``devplug run`` through bench.traced_daemon; the trace is written when it exits."""
    config = kubelet_dir.parent / "config.yaml"
    config.write_text(config_text)
    async with daemon_process(
        config,
        kubelet_dir,
        env={**host.env(), "DEVPLUG_TRACE": str(trace)},
        output=asyncio.subprocess.DEVNULL,
        module="bench.traced_daemon",
    ) as process:
        yield process


async def receipt(session: PluginSession, seen: int, device_id: str, present: bool) -> float:
    """When the first list after the ``seen``-th with ``device_id`` present (or not) reached
    the simulator's stream (its update time: noted before its conversion)."""
    await arrival(session, seen, device_id, present)
    for index in range(seen, len(session.updates)):
        if (device_id in session.updates[index]) == present:
            return session.update_times[index]
    raise AssertionError("no such list")


def _one(records: Sequence[Record], name: str, after: float = 0.0) -> Record | None:
    return next((r for r in records if r[0] == name and r[1] >= after), None)


def _dur(record: Record | None) -> float:
    return 0.0 if record is None else record[2] - record[1]


def split(records: Sequence[Record], started: float, arrived: float) -> dict[str, float] | None:
    """One sample's stages from the records between its first emit and the list's arrival."""
    mine = [r for r in records if started <= r[1] and r[2] <= arrived]
    read = _one(mine, "read")
    if read is None:
        return None
    take = _one(mine, "take", read[1])
    scan = _one(mine, "scan", take[2] if take else read[1])
    if take is None or scan is None:
        return None
    thread = _one(mine, "scan.thread", scan[1])
    within = [r for r in mine if scan[1] <= r[1] and r[2] <= scan[2]]
    gate = _one(mine, "gate", scan[2])
    publish = _one(mine, "publish", scan[2])
    if publish is None:
        return None
    during = [r for r in mine if publish[1] <= r[1] and r[2] <= publish[2]]
    message = [r for r in mine if r[0] == "message" and r[1] >= publish[1]]
    builds = [r for r in mine if r[0] == "build" and r[1] >= publish[1]]
    serialized = [r for r in mine if r[0] == "serialize" and r[1] >= publish[1]]
    if not message or not serialized:
        return None
    last_message, last_serialize = message[-1], serialized[-1]
    stages = {
        "event read": read[1] - started,
        "coalesce": take[1] - read[1],
        "rescan": _dur(scan),
        "  thread hand-offs": _dur(scan) - _dur(thread),
        "  scanner re-read": sum(_dur(r) for r in within if r[0] == "rescan"),
        "  tree edit": sum(_dur(r) for r in within if r[0] == "edit"),
        "  list limit": sum(_dur(r) for r in within if r[0] == "list_limit"),
        "health gate": _dur(gate),
        "publish": _dur(publish),
        "  diff": sum(_dur(r) for r in during if r[0] == "diff"),
        "  apply (diff + push)": sum(_dur(r) for r in during if r[0] == "apply"),
        "  metrics": sum(_dur(r) for r in during if r[0] == "metrics"),
        "wake": max(0.0, last_message[1] - publish[2]),
        "message (build+size)": _dur(last_message),
        "  build": _dur(builds[-1]) if builds else 0.0,
        "serialize": _dur(last_serialize),
        "send": arrived - last_serialize[2],
        "total": arrived - started,
    }
    top = ("event read", "coalesce", "rescan", "health gate", "publish", "wake")
    accounted = sum(stages[s] for s in top) + stages["message (build+size)"]
    accounted += stages["serialize"] + stages["send"]
    stages["unaccounted"] = stages["total"] - accounted
    return stages


async def floor_samples(
    socket: Path, host: UmockdevHost, count: int, samples: int
) -> dict[str, list[float]]:
    """Build + send the same message (``count`` devices) with protobuf, ``samples`` times."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.list_floor",
        str(socket),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **host.env()},
    )
    assert child.stdin is not None and child.stdout is not None
    out: dict[str, list[float]] = defaultdict(list)
    try:
        assert (await child.stdout.readline()).strip() == b"ready"
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
            for index in range(samples + 2):  # two warm-ups
                await asyncio.sleep(SETTLE_S)
                child.stdin.write(f"{count}\n".encode())
                await child.stdin.drain()
                message = await stream.read()
                received = time.perf_counter()
                assert isinstance(message, pb.ListAndWatchResponse)
                # What the kubelet simulator does with every list before it timestamps it.
                listed = {
                    d.ID: ListedDevice(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                    for d in message.devices
                }
                parsed = time.perf_counter()
                assert len(listed) == count
                started, built, serialized = map(float, (await child.stdout.readline()).split())
                if index < 2:
                    continue
                out["build"].append(built - started)
                out["serialize"].append(serialized - built)
                out["send"].append(received - serialized)
                out["simulator's parse"].append(parsed - received)
                out["total"].append(received - started)
            stream.cancel()
    finally:
        child.stdin.close()
        child.kill()
        await child.wait()
    return out


async def run_size(scratch: Path, devices: int, samples: int, first_after: float) -> None:
    built = time.perf_counter()
    host = gpu_host(scratch / f"testbed{devices}", devices)
    gc.freeze()
    gc.disable()  # no collections of this process inside the windows measured (bench.hotplug)
    print(
        f"\n== {devices:,} devices present (testbed built in {time.perf_counter() - built:.1f} s)"
    )
    kubelet_dir = scratch / f"kubelet{devices}"
    trace = scratch / f"trace{devices}.jsonl"
    windows: list[tuple[str, float, float]] = []
    with host.activated():
        floor = await floor_samples(scratch / f"floor{devices}.sock", host, devices, samples)
        async with (
            KubeletSimulator(kubelet_dir) as kubelet,
            traced_daemon(RENDER_CONFIG, kubelet_dir, host, trace),
        ):
            session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=600)
            await session.wait_for_update(lambda listed: len(listed) == devices, timeout=600)
            # 1 s: the CDI task's start and first render are over; bench.hotplug waits 0.05 s.
            await asyncio.sleep(first_after)
            for index in range(devices, devices + samples):
                device_id = f"dri_renderD{RENDER_MINOR_BASE + index}"
                await asyncio.sleep(SETTLE_S)
                pci, paths = new_gpu(host, index)
                seen = len(session.updates)
                started = time.perf_counter()
                for path in paths:
                    await host.emit_async("add", path)
                windows.append(("add", started, await receipt(session, seen, device_id, True)))
                await asyncio.sleep(SETTLE_S)
                removed = host.remove_device(pci)
                seen = len(session.updates)
                started = time.perf_counter()
                for path in removed:
                    await host.emit_async("remove", path)
                windows.append(("remove", started, await receipt(session, seen, device_id, False)))
    records: list[Record] = sorted(
        (
            (name, start, end)
            for name, start, end in map(json.loads, trace.read_text().splitlines())
        ),
        key=lambda r: r[1],
    )
    by_kind: dict[str, dict[str, list[float]]] = {
        "add": defaultdict(list),
        "remove": defaultdict(list),
    }
    missing = 0
    split_samples: list[tuple[int, dict[str, float]]] = []
    for number, (kind, started, arrived) in enumerate(windows):
        stages = split(records, started, arrived)
        if stages is None:
            missing += 1
            continue
        split_samples.append((number, stages))
        for stage, value in stages.items():
            by_kind[kind][stage].append(value)
            by_kind.setdefault("all", defaultdict(list))[stage].append(value)
    print(f"{len(windows)} samples ({samples} adds + {samples} removes); {missing} not matched")
    cdi = [r for r in records if r[0] in ("cdi.pass", "cdi.render")]
    overlapping = sum(
        any(r[1] < arrived and r[2] > started for r in cdi) for _, started, arrived in windows
    )
    renders = [r[2] - r[1] for r in cdi if r[0] == "cdi.render"][1:]  # not the first render
    passes = [r[2] - r[1] for r in cdi if r[0] == "cdi.pass"][1:]
    if renders and passes:
        print(
            f"CDI: {len(passes)} passes after the first (render p50 "
            f"{percentile(renders, 0.5) * 1000:.2f} ms, max {max(renders) * 1000:.2f} ms; whole "
            f"pass with the write p50 {percentile(passes, 0.5) * 1000:.2f} ms); samples whose "
            f"window a CDI pass overlapped: {overlapping} of {len(windows)}"
        )
    # How soon the spec on disk is current: from a list's arrival at the simulator to the end
    # of the first CDI pass that started after that list's publication (a pass writes the
    # latest tree when it starts).
    current: list[float] = []
    publishes = [r for r in records if r[0] == "publish"]
    for _, started, arrived in windows:
        published = next((r for r in publishes if r[1] >= started), None)
        after = published and next(
            (r for r in cdi if r[0] == "cdi.pass" and r[1] >= published[2]), None
        )
        if after:
            current.append(after[2] - arrived)
    if current:
        print(f"spec on disk current after the list arrived: {summary_ms(current)}")
    collections = [r for r in records if r[0].startswith("gc")]
    parts = []
    for generation in (0, 1, 2):
        mine = [r for r in collections if r[0] == f"gc{generation}"]
        inside = [r for r in mine if any(r[1] < a and r[2] > s for _, s, a in windows)]
        longest = max((r[2] - r[1] for r in inside), default=0.0) * 1000
        parts.append(f"gen {generation}: {len(inside)} of {len(mine)} (longest {longest:.2f} ms)")
    print("the daemon's collections inside the samples' windows: " + ", ".join(parts))
    # What the slowest samples have in common: their stages beside the median's, and what
    # else ran in the daemon during them.
    slowest = sorted(split_samples, key=lambda item: -item[1]["total"])[:3]
    for number, stages in slowest:
        kind, started, arrived = windows[number]
        over = sorted(
            {
                r[0]
                for r in records
                if r[0].startswith(("cdi", "gc")) and r[1] < arrived and r[2] > started
            }
        )
        above = [
            f"{stage.strip()} {stages[stage] * 1000:.2f}"
            for stage in STAGES
            if stage != "total" and stages[stage] - percentile(by_kind["all"][stage], 0.5) > 0.3e-3
        ]
        print(
            f"slow sample {number // 2} ({kind}) {stages['total'] * 1000:.2f} ms: above their "
            f"median by > 0.3 ms: {', '.join(above) or 'none'}; overlapped: "
            f"{', '.join(over) or 'nothing recorded'}"
        )
    print(
        f"{'stage':<26} {'add p50':>8} {'add p99':>8} {'rm p50':>8} {'rm p99':>8} "
        f"{'all max':>8}  (ms)"
    )
    for stage in STAGES:
        row = [
            percentile(by_kind[k][stage], q) * 1000
            for k, q in (("add", 0.5), ("add", 0.99), ("remove", 0.5), ("remove", 0.99))
        ]
        top = max(by_kind["all"][stage]) * 1000
        print(f"{stage:<26} " + " ".join(f"{v:8.2f}" for v in row) + f" {top:8.2f}")
    print(f"floor: protobuf build + send of the same {devices:,}-device message, same socket type:")
    for part in ("build", "serialize", "send", "total", "simulator's parse"):
        values = [v * 1000 for v in floor[part]]
        print(
            f"  {part:<18} p50 {percentile(values, 0.5):7.2f} ms  "
            f"p99 {percentile(values, 0.99):7.2f} ms"
        )
    ours = [v * 1000 for v in by_kind["all"]["total"]]
    base = percentile([v * 1000 for v in floor["total"]], 0.5)
    print(
        f"devplug total p50 {percentile(ours, 0.5):.2f} ms, p99 {percentile(ours, 0.99):.2f} ms: "
        f"{percentile(ours, 0.5) / base:.2f}x / {percentile(ours, 0.99) / base:.2f}x "
        "the floor's p50"
    )


async def main(sizes: Sequence[int], samples: int, first_after: float) -> None:
    require_preload()
    for devices in sizes:
        with scratch_dir(size="4g") as scratch:
            await run_size(scratch, devices, samples, first_after)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument(
        "--first-after", type=float, default=1.0, help="seconds from the first list to sampling"
    )
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.samples, args.first_after))
