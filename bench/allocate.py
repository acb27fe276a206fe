"""Allocate latency against an empty unary call on the same kind of socket, same run.

1,000 devices (render nodes of mock GPUs) served by a ``devplug run`` process; 50 concurrent
callers on one channel (as the kubelet has one connection per plugin), each Allocate asking for
one random device; ``--callers 1`` is issue 16's single-caller case (goal: p99 <= 1.2x the
empty floor). Rounds go through every target in turn to spread machine noise; with one
caller, every call does, in a random order (so a busy moment on the shared machine hits every
target alike, and so does work a server leaves for after its answers), or every ``--block``
calls (so that such work, a log line say, is charged to the server's own calls), or with a
``--pause-ms`` after every call (as a kubelet calls: sparse; such work then delays no call).

The targets, all driven by the same client through the same kind of socket (see
bench/floor_server.py), each served by a process of its own (so each one's CPU time per call,
every thread counted, is printed too), each a step closer to the daemon:

- empty floor: an empty grpc.aio unary RPC served by a bare process (the goal's floor);
- sized floor: the same process answers the daemon's AllocateResponse for the requested id,
  built with protobuf per call (the response's size and building, no devplug code);
- servicer alone: devplug's DevicePlugin servicer over the same 1,000 render nodes in a process
  of its own, without the daemon around it (no metrics, no CDI, logs off);
- devplug: the ``devplug run`` process, through the kubelet simulator's client.

    umockdev-wrapper .venv/bin/python -m bench.allocate [--devices 1000] [--callers 50]
    umockdev-wrapper .venv/bin/python -m bench.allocate --callers 1 --per-caller 500
    umockdev-wrapper .venv/bin/python -m bench.allocate --callers 1 --per-caller 500 --block 50
    umockdev-wrapper .venv/bin/python -m bench.allocate --callers 1 --per-caller 200 --pause-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from bench.common import (
    RENDER_CONFIG,
    RENDER_RESOURCE,
    daemon_process,
    gpu_host,
    percentile,
    render_ids,
    require_preload,
    scratch_dir,
    summary_ms,
)
from bench.floor_server import CDI_KIND, METHOD, SIZED_METHOD, render_tree
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from devplug.kubelet.servicer import DevicePluginServicer
from devplug.model import ContainerAllocation, DeviceMap
from devplug.testing import KubeletSimulator

Call = Callable[[], Awaitable[object]]
# Target names, in the order rounds visit them and the report lists them.
EMPTY, SIZED, ALONE, DAEMON = "empty floor", "sized floor", "servicer alone", "devplug"


async def drive(call: Call, callers: int, per_caller: int) -> list[float]:
    samples: list[float] = []

    async def caller() -> None:
        for _ in range(per_caller):
            started = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - started)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return samples


async def drive_interleaved(
    calls: Mapping[str, Call], count: int, block: int = 1, pause: float = 0.0, seed: int = 16
) -> dict[str, list[float]]:
    """One caller, ``count`` timed calls per target, in turns of ``block`` calls, the targets
    in a new random order every round of turns: each target's samples meet the same moments
    of a shared machine, so its noise is not charged to one, and whatever a server leaves for
    after its answers lands on every other target alike (a fixed rotation put the empty floor
    after devplug three times in four). With turns of more than one call, the first call of
    each turn is not timed: it meets the work the previous target left, and the others then
    meet only their own server's. With a ``pause`` (seconds) after every call, each call meets
    a server that has done all it left for after its earlier answers (as a kubelet's sparse
    calls do): that work then delays no call, and shows only in the server's CPU."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    shuffle = random.Random(seed).sample
    for turn in range(-(-count // block)):
        for name, call in shuffle(order, len(order)):
            if block > 1:
                await call()
            for _ in range(min(block, count - turn * block)):
                started = time.perf_counter()
                await call()
                samples[name].append(time.perf_counter() - started)
                if pause:
                    await asyncio.sleep(pause)
    return samples


@contextlib.asynccontextmanager
async def floor_process(
    socket: Path, env: Mapping[str, str], *args: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """bench.floor_server on ``socket``, ready to answer."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.floor_server",
        str(socket),
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert process.stdout is not None
    try:
        await process.stdout.readline()
        yield process
    finally:
        process.terminate()
        await process.wait()


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid`` so far (the scheduler's nanoseconds:
    grpc-core's threads work for each call too)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def report(
    samples: dict[str, list[float]],
    rounds: dict[str, list[list[float]]],
    cpu: dict[str, float],
    goal: str,
) -> None:
    width = max(map(len, samples)) + 1
    for name, values in samples.items():
        print(
            f"{name + ':':{width}} {summary_ms(values)}; "
            f"server CPU {cpu[name] / len(values) * 1e6:.0f} us/call"
        )
    floor = samples[EMPTY]
    for name in (SIZED, ALONE, DAEMON):
        ratios = [
            f"{q} {percentile(samples[name], f) / percentile(floor, f):.2f}x"
            for q, f in (("p50", 0.5), ("p99", 0.99))
        ]
        print(f"{name} / empty floor: {', '.join(ratios)}")
    sized = samples[SIZED]
    daemon = samples[DAEMON]
    print(
        f"devplug / sized floor: p50 {percentile(daemon, 0.5) / percentile(sized, 0.5):.2f}x,"
        f" p99 {percentile(daemon, 0.99) / percentile(sized, 0.99):.2f}x"
    )
    print(f"goal: {goal}")
    # Every round's own ratio, because the machine is shared and one noisy round moves a
    # pooled percentile a lot.
    for q, f in (("p50", 0.5), ("p99", 0.99)):
        per_round = sorted(
            percentile(d, f) / percentile(e, f)
            for d, e in zip(rounds[DAEMON], rounds[EMPTY], strict=True)
        )
        print(f"per-round devplug/empty {q} ratios: {', '.join(f'{r:.2f}' for r in per_round)}")


async def main(
    devices: int,
    callers: int,
    per_caller: int,
    round_count: int,
    block: int = 1,
    pause: float = 0.0,
) -> None:
    require_preload()
    with scratch_dir() as scratch:
        built = time.perf_counter()
        host = gpu_host(scratch / "testbed", devices)
        print(f"mock host: {devices} GPUs built in {time.perf_counter() - built:.1f} s")
        kubelet_dir = scratch / "kubelet"
        # The floors run under the same preload and testbed as the daemon: umockdev wraps
        # socket calls, and the comparison must not charge that to devplug alone.
        async with (
            floor_process(scratch / "floor.sock", host.env()) as empty_server,
            floor_process(scratch / "sized.sock", host.env()) as sized_server,
            floor_process(scratch / "alone.sock", host.env(), "--devices", str(devices)) as alone,
        ):
            with host.activated():
                async with (
                    KubeletSimulator(kubelet_dir) as kubelet,
                    daemon_process(RENDER_CONFIG, kubelet_dir, host) as daemon,
                    grpc.aio.insecure_channel(f"unix://{scratch / 'floor.sock'}") as channel,
                    grpc.aio.insecure_channel(f"unix://{scratch / 'sized.sock'}") as sized_channel,
                    grpc.aio.insecure_channel(f"unix://{scratch / 'alone.sock'}") as alone_channel,
                ):
                    session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=120)
                    listed = await session.wait_for_update(timeout=120)
                    print(f"daemon advertises {len(listed)} devices")
                    ids = render_ids(devices)
                    empty = channel.unary_unary(
                        METHOD,
                        request_serializer=pb.Empty.SerializeToString,
                        response_deserializer=pb.Empty.FromString,
                    )
                    sized = sized_channel.unary_unary(
                        SIZED_METHOD,
                        request_serializer=pb.AllocateRequest.SerializeToString,
                        response_deserializer=pb.AllocateResponse.FromString,
                    )
                    alone_stub = pb_grpc.DevicePluginStub(alone_channel)
                    # A ListAndWatch stream open on the channel, as the kubelet keeps one.
                    stream = alone_stub.ListAndWatch(pb.Empty())
                    await stream.read()

                    def request() -> pb.AllocateRequest:
                        return pb.AllocateRequest(
                            container_requests=[
                                pb.ContainerAllocateRequest(devices_ids=[random.choice(ids)])
                            ]
                        )

                    async def empty_call() -> object:
                        return await empty(pb.Empty())

                    async def sized_call() -> object:
                        return await sized(request())

                    async def alone_call() -> object:
                        return await alone_stub.Allocate(request())

                    async def daemon_call() -> object:
                        return await session.stub.Allocate(request())

                    calls: dict[str, Call] = {
                        EMPTY: empty_call,
                        SIZED: sized_call,
                        ALONE: alone_call,
                        DAEMON: daemon_call,
                    }
                    for call in calls.values():  # warm-up
                        await drive(call, callers, 20)
                    # Each target is served by a process of its own: its CPU is that call's.
                    pids = {
                        EMPTY: empty_server.pid,
                        SIZED: sized_server.pid,
                        ALONE: alone.pid,
                        DAEMON: daemon.pid,
                    }
                    cpu = {name: -cpu_seconds(pid) for name, pid in pids.items()}
                    rounds: dict[str, list[list[float]]] = {name: [] for name in calls}
                    for _ in range(round_count):
                        if callers == 1:
                            turned = await drive_interleaved(calls, per_caller, block, pause)
                            for name, done in turned.items():
                                rounds[name].append(done)
                            continue
                        for name, call in calls.items():
                            rounds[name].append(await drive(call, callers, per_caller))
                    for name, pid in pids.items():
                        cpu[name] += cpu_seconds(pid)
    samples = {name: [s for r in done for s in r] for name, done in rounds.items()}
    turns = f", turns of {block} calls" if callers == 1 else ""
    if pause:
        turns += f", {pause * 1e3:g} ms pause after each"
    print(
        f"{callers} caller(s) x {per_caller} calls x {round_count} rounds{turns}, {devices} devices"
    )
    goal = "p99 <= 1.2x the empty floor" if callers == 1 else "p99 <= 1.5x the empty floor"
    report(samples, rounds, cpu, goal)


def timed(work: Callable[[], object], count: int = 20_000) -> float:
    """Microseconds per call of ``work``, best of three runs."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(count):
            work()
        best = min(best, (time.perf_counter() - started) / count)
    return best * 1e6


def parts(devices: int) -> None:
    """One Allocate of one render node split into its parts, in this process: the daemon's
    servicer with its CDI names (a spec on disk; no dir watch here, so the handler's confirm
    stats it every call, as the daemon's does only after a change in the dir), metrics and
    JSON logs (to /dev/null). Hit: the request was answered before under the same snapshot."""
    from devplug import logconfig
    from devplug._kits.values import LatestValue
    from devplug.cdi.allocate import CdiCatalog, CdiNames, CdiOptions, CdiResource
    from devplug.cdi.stamps import file_stamp
    from devplug.kubelet.allocation import default_allocation
    from devplug.kubelet.servicer import DevicePluginServicer
    from devplug.kubelet.wire import container_response
    from devplug.ops.metrics import Metrics

    tree = render_tree(devices)
    device_id = next(iter(tree))
    catalog = CdiCatalog()
    stderr = sys.stderr
    with tempfile.NamedTemporaryFile(suffix=".json") as spec, open(os.devnull, "w") as devnull:
        # Configured before the servicer binds its logger, with the daemon's settings; the
        # renderer writes to the stderr of configure(), here /dev/null as in the bench daemon.
        sys.stderr = devnull
        try:
            logconfig.configure("json", "info")
        finally:
            sys.stderr = stderr
        path = Path(spec.name)
        catalog.set(
            CDI_KIND,
            CdiResource(CDI_KIND, path.name, frozenset(tree), tree, path, file_stamp(path)),
        )
        names = CdiNames(CdiOptions(catalog, annotations=False, device_specs=True))
        servicer = DevicePluginServicer(CDI_KIND, LatestValue(tree), None, names, Metrics())
        raw = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])]
        ).SerializeToString()
        message = pb.AllocateRequest.FromString(raw)
        ids = [device_id]
        plain = default_allocation(ids, tree)
        named = names.extend(CDI_KIND, ids, plain, tree)
        response = pb.AllocateResponse(container_responses=[container_response(named)])
        table = parts_table(servicer, raw, message, ids, tree, plain, named, response)
    width = max(map(len, table)) + 1
    print(
        f"one Allocate's parts in process, us per call ({len(tree)} devices, answer "
        f"{len(response.SerializeToString())} bytes; the empty floor's is 0):"
    )
    for name, micros in table.items():
        print(f"  {name + ':':{width}} {micros:6.2f}")


def confirm_watched(extension: object) -> float:
    """Microseconds per confirm while the CDI dir watch has seen no change since the last
    lstat (the daemon's case once its watch is set): a token that stays the same."""
    from devplug.cdi.allocate import CdiNames

    assert isinstance(extension, CdiNames)
    catalog = extension.options.catalog
    catalog.dir_token = lambda: 1
    try:
        return timed(lambda: extension.confirm(CDI_KIND))
    finally:
        catalog.dir_token = None


def parts_table(
    servicer: DevicePluginServicer,
    raw: bytes,
    message: pb.AllocateRequest,
    ids: list[str],
    tree: DeviceMap,
    plain: ContainerAllocation,
    named: ContainerAllocation,
    response: pb.AllocateResponse,
) -> dict[str, float]:
    from devplug.kubelet.allocation import check_request, check_size, default_allocation
    from devplug.kubelet.handlers import allocate_request
    from devplug.kubelet.wire import allocate_response, container_response

    extension = servicer.extension
    assert extension is not None
    loop = asyncio.new_event_loop()
    context: Any = object()  # the handler asks nothing of its context when no refusal is due

    def allocate(fresh: bool, count: int = 5_000) -> float:
        """The handler until it returns the answer (its count included), best of three runs;
        its log line, 2 ms later, is untimed here (the table's last line)."""

        async def calls() -> float:
            started = time.perf_counter()
            for _ in range(count):
                if fresh:
                    servicer.answer_cache.entries.clear()
                await servicer.Allocate((raw, message), context)  # never suspends: no turn
            elapsed = (time.perf_counter() - started) / count
            servicer.answer_log.flush()  # the log lines, after the timing
            return elapsed

        return min(loop.run_until_complete(calls()) for _ in range(3)) * 1e6

    def checks() -> None:
        requests = message.container_requests
        check_size(CDI_KIND, [c.devices_ids for c in requests], tree)
        check_request(CDI_KIND, [list(c.devices_ids) for c in requests], tree)

    try:
        return {
            "request parse (with its bytes)": timed(lambda: allocate_request(raw)),
            "CDI spec confirm, dir not watched (lstat)": timed(lambda: extension.confirm(CDI_KIND)),
            "CDI spec confirm, watch saw no change": confirm_watched(extension),
            "hit: cache lookup": timed(
                lambda: servicer.answer_cache.lookup(raw, tree, extension.generation)
            ),
            "miss: id checks": timed(checks),
            "miss: default answer": timed(lambda: default_allocation(ids, tree)),
            "miss: CDI names": timed(lambda: extension.extend(CDI_KIND, ids, plain, tree)),
            "miss: answer encoded": timed(lambda: allocate_response([named])),
            "  (with protobuf: build": timed(
                lambda: pb.AllocateResponse(container_responses=[container_response(named)])
            ),
            "  and serialize)": timed(response.SerializeToString),
            "handler until its answer, hit": allocate(fresh=False),
            "handler until its answer, miss": allocate(fresh=True),
            "2 ms later: the log line": timed(
                lambda: servicer._log.info("allocate.complete", devices=ids)
            ),
        }
    finally:
        loop.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--per-caller", type=int, default=20, help="calls per caller per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="with one caller: calls per target's turn (longer turns charge a server with "
        "the work it leaves for after its answers)",
    )
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="with one caller: a pause after every call (sparse calls, as a kubelet makes)",
    )
    parser.add_argument(
        "--parts-only", action="store_true", help="only one Allocate's parts, in process"
    )
    args = parser.parse_args()
    if args.block < 1 or (args.block > 1 and args.callers != 1):
        parser.error("--block takes a count of 1 or more, with --callers 1")
    if args.pause_ms < 0 or (args.pause_ms > 0 and args.callers != 1):
        parser.error("--pause-ms takes 0 or more milliseconds, with --callers 1")
    if not args.parts_only:
        asyncio.run(
            main(
                args.devices,
                args.callers,
                args.per_caller,
                args.rounds,
                args.block,
                args.pause_ms / 1e3,
            )
        )
    parts(args.devices)
