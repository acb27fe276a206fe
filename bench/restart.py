"""Kubelet restart -> re-registered, with a ``devplug run`` process serving 1,000 devices.

Each round does what a kubelet restart does to the device plugin dir (the simulator's
``restart()``: its socket goes, plugin sockets are deleted, ``kubelet.sock`` comes back) and
measures from the moment the new ``kubelet.sock`` is served to the moment the simulator has
accepted the plugin's Register (after dialling it back), and to its first full list.

    umockdev-wrapper .venv/bin/python -m bench.restart [--devices 1000] [--restarts 30] \
        [--env GRPC_POLL_STRATEGY=poll ...]
"""

from __future__ import annotations

import argparse
import asyncio

from bench.common import (
    RENDER_CONFIG,
    RENDER_RESOURCE,
    daemon_process,
    env_pairs,
    gpu_host,
    require_preload,
    scratch_dir,
    summary_ms,
)
from devplug.testing import KubeletSimulator


async def main(devices: int, restarts: int, env: dict[str, str]) -> None:
    require_preload()
    registered: list[float] = []
    listed: list[float] = []
    with scratch_dir() as scratch:
        host = gpu_host(scratch / "testbed", devices)
        kubelet_dir = scratch / "kubelet"
        with host.activated():
            async with (
                KubeletSimulator(kubelet_dir) as kubelet,
                daemon_process(RENDER_CONFIG, kubelet_dir, host, env),
            ):
                session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=60)
                await session.wait_for_update(timeout=60)
                for _ in range(restarts):
                    await asyncio.sleep(0.2)  # let the previous round settle
                    await kubelet.restart()
                    session = await kubelet.wait_for_plugin(RENDER_RESOURCE, timeout=60)
                    await session.wait_for_update(timeout=60)
                    record = next(
                        r
                        for r in reversed(kubelet.registrations)
                        if r.accepted and r.generation == kubelet.generation
                    )
                    registered.append(record.at - kubelet.serving_since)
                    listed.append(session.update_times[0] - kubelet.serving_since)
    print(f"devices: {devices}, restarts: {restarts}, env {env}")
    print(f"kubelet.sock back -> Register accepted: {summary_ms(registered)} (goal p99 <= 200 ms)")
    print(f"kubelet.sock back -> first full list:   {summary_ms(listed)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--restarts", type=int, default=30)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the daemon")
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.restarts, env_pairs(args.env)))
