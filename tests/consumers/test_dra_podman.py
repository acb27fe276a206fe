"""podman runs a container with the CDI ids the DRA front's Prepare returned, and those ids are
the ones the device-plugin front's Allocate names for the same devices.

Real parts on both sides of one spec on disk: the daemon (device-plugin front and CDI sync)
serves a static tree of mknod'ed GPU-like nodes to the kubelet simulator and writes its CDI
spec into the machine's /var/run/cdi, where podman 4.3 reads specs (under a kind of this test
session's own, see podman_harness); the DRA kubelet plugin, set up as tests/dra do it (the
stand-in API server read through lightkube, a pool from the slice builder, the kubelet DRA
stand-in), prepares claims against the daemon's own CDI catalog. Each id Prepare returns goes
to ``podman run --device``, alone and with a claim's others, and the container must see each
node with the host node's numbers, mode and group.

They need root, podman, runc and busybox-static (see podman_harness); without them they skip,
and with ``CI=true`` they fail instead.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from podman_harness import HostCdiDir, Podman, device_id, isolated_podman, node_access

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dra"))  # the DRA tests' setup

from dra_plugin_env import DRIVER, IDS, NAMES, NODE, RESOURCE, plugin_env

from devplug.config import CdiSettings
from devplug.dra.slices import build_pool
from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import KubeletSimulator
from devplug.testing.harness import StaticScanner, daemon_settings, in_process_daemon
from devplug.testing.kubelet_dra import ClaimAnswer

# Host nodes, made with mknod in a temp dir: (name, major, minor, mode, group). The numbers
# are the null and zero devices', so nothing a container could open is a real GPU; the modes
# and group are a render node's (0660, a group of its own) and a card node's.
GROUP = 4242
NODES = (("card", 1, 3, 0o660, GROUP), ("renderD", 1, 5, 0o666, 0))


def container_paths(index: int) -> list[str]:
    return [f"/dev/dri/card{index}", f"/dev/dri/renderD{128 + index}"]


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    with isolated_podman(tmp_path_factory.mktemp("podman")) as podman:
        yield podman


@pytest.fixture(scope="module")
def host_cdi(podman: Podman) -> Iterator[HostCdiDir]:
    with HostCdiDir() as cdi:
        yield cdi


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory, podman: Podman) -> dict[str, DeviceInfo]:
    """The GPUs of IDS: a card and a render node each, made here (after ``podman``, which
    skips or fails these tests without root)."""
    directory = tmp_path_factory.mktemp("dri")
    found = {}
    for index, gpu in enumerate(IDS):
        nodes = []
        for (name, major, minor, mode, group), inside in zip(
            NODES, container_paths(index), strict=True
        ):
            path = directory / f"{name}{index}"
            os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
            os.chmod(path, mode)  # mknod's mode went through the umask
            os.chown(path, 0, group)
            nodes.append(DeviceNode(str(path), inside))
        found[gpu] = DeviceInfo(nodes=tuple(nodes))
    return found


def host_view(info: DeviceInfo) -> dict[str, str]:
    """What ``stat -c '%n %t:%T %a %g'`` must print for each of the device's nodes."""
    return {
        n.container_path: f"{device_id(n.host_path)} {node_access(n.host_path)}" for n in info.nodes
    }


def container_view(podman: Podman, ids: Sequence[str], paths: Sequence[str]) -> dict[str, str]:
    """The nodes at ``paths`` in a container given only the CDI ``ids``."""
    result = podman.run(ids, "stat", "-c", "%n %t:%T %a %g", *paths)
    assert result.returncode == 0, f"podman run --device {' --device '.join(ids)}: {result.stderr}"
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


def prepared_ids(answer: ClaimAnswer) -> dict[str, tuple[str, ...]]:
    """Pool device name -> the CDI ids Prepare returned for it."""
    assert answer.error == "", answer.error
    return {device.device_name: device.cdi_device_ids for device in answer.devices}


async def allocate_cdi_names(
    kubelet: KubeletSimulator, ids: Sequence[str], timeout: float = 30
) -> dict[str, tuple[str, ...]]:
    """Device id -> the CDI names of its Allocate answer, asked one device at a time, once
    the spec is on disk (the daemon names only devices its spec defines, and writes the spec
    just after the kubelet's first lists)."""
    session = await kubelet.wait_for_plugin(RESOURCE, timeout=timeout)
    await session.wait_for_update(lambda listed: set(ids) <= set(listed), timeout=timeout)
    names: dict[str, tuple[str, ...]] = {}
    async with asyncio.timeout(timeout):
        for gpu in ids:
            while not names.get(gpu):
                (answer,) = await session.allocate([gpu])
                names[gpu] = answer.cdi_devices
                if not names[gpu]:
                    await asyncio.sleep(0.05)
    return names


async def test_prepared_cdi_ids_are_allocates_and_podman_runs_them(
    podman: Podman,
    host_cdi: HostCdiDir,
    devices: Mapping[str, DeviceInfo],
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
) -> None:
    kind = host_cdi.kind("dra-gpu")
    settings = daemon_settings(
        kubelet_dir,
        cdi=CdiSettings(
            dir=host_cdi.path, kinds={RESOURCE: kind}, instance=f"{host_cdi.token}-dra"
        ),
    )
    tree = {RESOURCE: dict(devices)}
    async with in_process_daemon(settings, [StaticScanner(tree)]) as daemon:
        allocated = await allocate_cdi_names(kubelet, IDS)
        assert allocated == {gpu: (f"{kind}={gpu}",) for gpu in IDS}

        (short_dir / "dra").mkdir()
        async with plugin_env(short_dir / "dra", start=False) as env:
            # The DRA front on the daemon's own catalog of the spec it wrote, and this tree.
            env.catalog, env.tree = daemon.cdi_catalog, tree
            env.pool = build_pool(tree, node_name=NODE, driver=DRIVER, generation=1)
            await env.start_plugin()
            await env.kubelet.wait_for_plugin(DRIVER)
            one = env.put_claim("one-gpu", [NAMES[0]])
            two = env.put_claim("two-gpus", [NAMES[1], NAMES[2]])
            answers = await env.kubelet.prepare(DRIVER, [one, two])

        prepared = {**prepared_ids(answers[one.uid]), **prepared_ids(answers[two.uid])}
        # Each device: the very ids the device-plugin front's Allocate names for it.
        assert prepared == {name: allocated[gpu] for name, gpu in zip(NAMES, IDS, strict=True)}

        # podman, while the daemon keeps its spec in /var/run/cdi: each device alone ...
        for index, (name, gpu) in enumerate(zip(NAMES, IDS, strict=True)):
            seen = await asyncio.to_thread(
                container_view, podman, prepared[name], container_paths(index)
            )
            assert seen == host_view(devices[gpu]), gpu
        # ... and a claim's ids together, as the runtime gets them for one container.
        claim_ids = [i for name in NAMES[1:] for i in prepared[name]]
        paths = container_paths(1) + container_paths(2)
        seen = await asyncio.to_thread(container_view, podman, claim_ids, paths)
        assert seen == {**host_view(devices[IDS[1]]), **host_view(devices[IDS[2]])}
