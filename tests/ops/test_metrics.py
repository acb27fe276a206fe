"""/metrics, /healthz and /readyz of a running daemon, read over real HTTP."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devplug.config import parse_address
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.sizing import list_message_bytes
from devplug.testing import KubeletSimulator, RunningDaemon, daemon_settings, running_daemon
from devplug.testing.harness import StaticScanner
from devplug.testing.simulator import SimulatorRpcError

SERIAL = "example.com/serial"


async def get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def scanner() -> StaticScanner:
    return StaticScanner(
        {
            SERIAL: {
                "dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),), numa_nodes=(0,)),
                "dev1": DeviceInfo(nodes=(DeviceNode("/dev/zero"),)),
                "dev2": DeviceInfo(health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/full"),)),
            }
        }
    )


def http_port(daemon: RunningDaemon) -> int:
    assert daemon.metrics_port is not None
    return daemon.metrics_port


async def test_metrics_after_a_scan_and_allocations(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    async with running_daemon(settings, [scanner()]) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update(lambda listed: len(listed) == 3)
        await session.allocate(["dev0"])
        with pytest.raises(SimulatorRpcError):
            await session.allocate(["nope"])
        with pytest.raises(SimulatorRpcError):
            await session.allocate(["dev2"])  # unhealthy
        status, text = await get(http_port(daemon), "/metrics")
    assert status == 200
    found = samples(text)
    resource = (("resource", SERIAL),)
    assert found[("devplug_devices", (("health", "Healthy"), *resource))] == 2
    assert found[("devplug_devices", (("health", "Unhealthy"), *resource))] == 1
    for result, count in (("ok", 1), ("not_found", 1), ("invalid", 1)):
        assert found[("devplug_allocations_total", (*resource, ("result", result)))] == count
    assert found[("devplug_registrations_total", (*resource, ("result", "ok")))] == 1
    assert found[("devplug_scan_duration_seconds_count", (("kind", "full"),))] >= 1
    expected_bytes = list_message_bytes(
        [("dev0", "Healthy", (0,)), ("dev1", "Healthy", ()), ("dev2", "Unhealthy", ())]
    )
    assert found[("devplug_listandwatch_message_bytes", resource)] == expected_bytes
    assert found[("devplug_udev_events_total", ())] == 0  # hotplug source none in tests


async def test_readyz_flips_when_the_kubelet_goes_and_comes_back(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    async with running_daemon(settings, [scanner()]) as daemon:
        port = http_port(daemon)
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        assert await get(port, "/readyz") == (200, "ready\n")
        assert await get(port, "/healthz") == (200, "ok\n")

        await kubelet.stop()
        for entry in os.scandir(kubelet_dir):  # as a restarting kubelet wipes plugin sockets
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.unlink(entry.path)
        async with asyncio.timeout(10):
            while (await get(port, "/readyz"))[0] != 503:  # noqa: ASYNC110 - polled over HTTP
                await asyncio.sleep(0.02)
        status, body = await get(port, "/readyz")
        assert status == 503 and f"{SERIAL} (not registered)" in body
        assert await get(port, "/healthz") == (200, "ok\n")  # alive all the same

        await kubelet.start()
        async with asyncio.timeout(10):
            while (await get(port, "/readyz"))[0] != 200:  # noqa: ASYNC110 - polled over HTTP
                await asyncio.sleep(0.02)
        found = samples((await get(port, "/metrics"))[1])
        assert found[("devplug_kubelet_restarts_total", (("resource", SERIAL),))] == 1
        assert found[("devplug_registrations_total", (("resource", SERIAL), ("result", "ok")))] == 2


async def test_other_paths_and_methods(kubelet: KubeletSimulator, kubelet_dir: Path) -> None:
    settings = daemon_settings(kubelet_dir, metrics_address="127.0.0.1:0")
    async with running_daemon(settings, [scanner()]) as daemon:
        port = http_port(daemon)
        assert (await get(port, "/nope"))[0] == 404
        assert (await get(port, "/metrics", method="POST"))[0] == 405
        status, body = await get(port, "/healthz", method="HEAD")
        assert status == 200 and body == ""


async def test_a_taken_port_leaves_the_daemon_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    blocker = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = blocker.sockets[0].getsockname()[1]
    try:
        settings = daemon_settings(kubelet_dir, metrics_address=f"127.0.0.1:{port}")
        async with running_daemon(settings, [scanner()]) as daemon:
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update()
            assert daemon.metrics_port is None
    finally:
        blocker.close()
        await blocker.wait_closed()


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [("127.0.0.1:9400", "127.0.0.1", 9400), (":9400", "0.0.0.0", 9400), ("[::1]:80", "::1", 80)],
)
def test_addresses(text: str, host: str, port: int) -> None:
    assert parse_address(text) == (host, port)


@pytest.mark.parametrize("text", ["9400", "host:", "host:99999", "[::1]", "a b:1"])
def test_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def test_the_devices_gauge_follows_trees_and_zeroes_gone_resources() -> None:
    from devplug.model import DeviceTree
    from devplug.ops.metrics import Metrics

    metrics = Metrics()
    sick = DeviceInfo(health=Health.UNHEALTHY)
    first = DeviceTree(
        {SERIAL: {"a": DeviceInfo(), "b": sick}, "example.com/gpu": {"g": DeviceInfo()}}
    )
    metrics.set_devices(first)
    # The serial map changes (b recovers); the gpu resource goes.
    second = first.with_changes(
        [(SERIAL, "b"), ("example.com/gpu", "g")], {SERIAL: {"b": DeviceInfo()}}
    )
    metrics.set_devices(second)
    found = samples(metrics.exposition().decode())
    assert found[("devplug_devices", (("health", "Healthy"), ("resource", SERIAL)))] == 2
    assert found[("devplug_devices", (("health", "Unhealthy"), ("resource", SERIAL)))] == 0
    gpu = (("health", "Healthy"), ("resource", "example.com/gpu"))
    assert found[("devplug_devices", gpu)] == 0


def test_the_devices_gauge_counted_from_edits_matches_a_full_count() -> None:
    """A random walk of edits: counting only the edited ids gives what counting all does."""
    import random

    from devplug.model import DeviceTree
    from devplug.ops.metrics import Metrics

    rng = random.Random(16)
    resources = [f"example.com/r{i}" for i in range(3)]
    tree = DeviceTree({r: {"0": DeviceInfo()} for r in resources})
    incremental, full = Metrics(), Metrics()
    for _ in range(300):
        removed = [(r, i) for r in tree for i in tree[r] if rng.random() < 0.2]
        added: dict[str, dict[str, DeviceInfo]] = {}
        for _ in range(rng.randrange(4)):
            r, i = rng.choice(resources), str(rng.randrange(12))
            if (r, i) in removed or i not in tree.get(r, {}):
                health = rng.choice([Health.HEALTHY, Health.UNHEALTHY])
                added.setdefault(r, {})[i] = DeviceInfo(health=health)
        tree = tree.with_changes(removed, added)
        incremental.set_devices(tree)
        full.set_devices(DeviceTree(tree))  # a fresh tree: no edits, counted in full
        counted, recounted = (
            {k: v for k, v in samples(m.exposition().decode()).items() if k[0] == "devplug_devices"}
            for m in (incremental, full)
        )
        assert counted == recounted
