"""Allocate latency against an empty unary call on the same kind of socket, same run.

1,000 devices (render nodes of mock GPUs) served by a ``devplug run`` process; 50 concurrent
callers on one channel (as the kubelet has one connection per plugin), each Allocate asking for
one random device. The floor is an empty grpc.aio unary RPC served by another process on a unix
socket, driven by the same client. Rounds alternate floor / Allocate to spread machine noise.

    umockdev-wrapper .venv/bin/python -m bench.allocate [--devices 1000] [--callers 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable

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
from bench.floor_server import METHOD
from devplug._proto import deviceplugin_v1beta1_pb2 as pb
from devplug.testing import KubeletSimulator


async def drive(
    call: Callable[[], Awaitable[object]], callers: int, per_caller: int
) -> list[float]:
    samples: list[float] = []

    async def caller() -> None:
        for _ in range(per_caller):
            started = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - started)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return samples


async def main(devices: int, callers: int, per_caller: int, rounds: int) -> None:
    require_preload()
    with scratch_dir() as scratch:
        built = time.perf_counter()
        host = gpu_host(scratch / "testbed", devices)
        print(f"mock host: {devices} GPUs built in {time.perf_counter() - built:.1f} s")
        kubelet_dir = scratch / "kubelet"
        floor_socket = scratch / "floor.sock"
        # The floor runs under the same preload and testbed as the daemon: umockdev wraps
        # socket calls, and the comparison must not charge that to devplug alone.
        floor = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.floor_server",
            str(floor_socket),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **host.env()},
        )
        assert floor.stdout is not None
        await floor.stdout.readline()
        try:
            with host.activated():
                async with (
                    KubeletSimulator(kubelet_dir) as kubelet,
                    daemon_process(RENDER_CONFIG, kubelet_dir, host),
                ):
                    session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=120)
                    listed = await session.wait_for_update(timeout=120)
                    print(f"daemon advertises {len(listed)} devices")
                    ids = render_ids(devices)
                    async with grpc.aio.insecure_channel(f"unix://{floor_socket}") as channel:
                        empty = channel.unary_unary(
                            METHOD,
                            request_serializer=pb.Empty.SerializeToString,
                            response_deserializer=pb.Empty.FromString,
                        )

                        async def floor_call() -> object:
                            return await empty(pb.Empty())

                        async def allocate_call() -> object:
                            request = pb.AllocateRequest(
                                container_requests=[
                                    pb.ContainerAllocateRequest(devices_ids=[random.choice(ids)])
                                ]
                            )
                            return await session.stub.Allocate(request)

                        await drive(floor_call, callers, 20)  # warm-up
                        await drive(allocate_call, callers, 20)
                        floor_samples: list[float] = []
                        allocate_samples: list[float] = []
                        round_ratios: list[float] = []
                        for _ in range(rounds):
                            floor_round = await drive(floor_call, callers, per_caller)
                            allocate_round = await drive(allocate_call, callers, per_caller)
                            round_ratios.append(
                                percentile(allocate_round, 0.5) / percentile(floor_round, 0.5)
                            )
                            floor_samples += floor_round
                            allocate_samples += allocate_round
        finally:
            floor.terminate()
            await floor.wait()
    print(f"floor (empty unary, unix socket): {summary_ms(floor_samples)}")
    print(f"Allocate ({devices} devices):       {summary_ms(allocate_samples)}")
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        ratio = percentile(allocate_samples, q) / percentile(floor_samples, q)
        print(f"Allocate/floor {name}: {ratio:.2f}x (goal p99 <= 1.5x)")
    spread = ", ".join(f"{r:.2f}" for r in sorted(round_ratios))
    print(f"per-round p50 ratios (noise on a shared machine): {spread}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--per-caller", type=int, default=20, help="calls per caller per round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.callers, args.per_caller, args.rounds))
