"""The daemon serving ``gpu.intel.com/i915`` through DRA on a mock Intel GPU host (issue 27,
"done when"): the issue's ``dra`` section, the API-server stand-in (``KUBECONFIG``), the kubelet
DRA stand-in and ``NODE_NAME``, beside the device-plugin kubelet simulator, which keeps serving
``gpu.intel.com/xe``.

Nothing here is timed: each step waits for a state of a stand-in. Where time must pass (the
idle spell) the test only bounds the requests from above.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from cdi_library import check_spec_dir

from devplug._kits.values import LatestValue
from devplug.config import DraSettings, HotplugSettings, Settings
from devplug.daemon import Daemon
from devplug.dra.front import DraFront
from devplug.naming import socket_file_name
from devplug.scanners.base import Scanner
from devplug.scanners.generic import GenericScanner
from devplug.scanners.intel_gpu import IntelGpuScanner
from devplug.testing import KubeletSimulator, daemon_settings, eventually
from devplug.testing.apiserver import ApiServer, allocated_claim
from devplug.testing.harness import daemon_process, in_process_daemon
from devplug.testing.kubelet_dra import ClaimAnswer, ClaimName, KubeletDra
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu

DRIVER = "gpu.intel.com"
NODE = "node-a"
I915 = "gpu.intel.com/i915"
XE = "gpu.intel.com/xe"
IGPU, IGPU_NAME = "0000:00:02.0", "0000-00-02-0"  # devplug id, its DRA device name
DGPU = "0000:03:00.0"  # xe: stays with the device-plugin front
SECOND, SECOND_NAME = "0000:04:00.0", "0000-04-00-0"  # an i915 GPU plugged in later
OWN_SLICES = f"spec.driver={DRIVER},spec.nodeName={NODE}"


@dataclass
class Node:
    """A node's kubelet root with both kubelets, and its cluster's API server."""

    root: Path  # the kubelet's --root-dir: device-plugins/, plugins_registry/, plugins/
    kubelet_dir: Path
    api: ApiServer
    kubelet: KubeletSimulator
    dra: KubeletDra
    host: UmockdevHost
    env: dict[str, str]

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"  # daemon_settings' and daemon_process' default

    def settings(self, *, dra: bool = True) -> Settings:
        section = DraSettings(driver=DRIVER, resources=(I915,), kubelet_root=self.root)
        return daemon_settings(
            self.kubelet_dir,
            hotplug=HotplugSettings(
                source="kernel", coalesce_ms=2, resync_s=3600, poll_s=3600, health_hold_down_s=0
            ),
            dra=section if dra else None,
        )

    def slice_devices(self) -> dict[str, dict[str, Any]]:
        """The devices of this node's pool at the API server, by name."""
        return {
            device["name"]: device
            for obj in self.api.slices(OWN_SLICES).values()
            for device in obj["spec"].get("devices", ())
        }

    async def wait_for_pool(self, names: set[str], what: str) -> None:
        await self.api.wait_for(lambda _: set(self.slice_devices()) == names, what=what)

    def claim(self, name: str, *devices: str) -> ClaimName:
        """A claim allocated ``devices`` (names in the pool), stored at the API server."""
        results = [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
            for device in devices
        ]
        stored = self.api.put_claim(
            allocated_claim(name, "team-a", results, device_class=f"i915.{DRIVER}")
        )
        return ClaimName.of(stored)


@pytest.fixture
async def node(
    short_dir: Path,
    kubelet_dir: Path,
    kubelet: KubeletSimulator,
    host: UmockdevHost,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Node]:
    """An i915 GPU and an xe GPU; KUBECONFIG and NODE_NAME set as a DaemonSet sets them."""
    host.add_dev_dir("dri/by-path")
    add_intel_gpu(host, IGPU, card=0, render=128)
    add_intel_gpu(host, DGPU, card=1, render=129, driver="xe", device_id="0xe20b")
    async with (
        ApiServer(max_watch_seconds=0.2) as api,
        KubeletDra(short_dir / "plugins_registry", health_interval_s=0.2) as dra,
    ):
        api.put_node(NODE)
        env = {"KUBECONFIG": str(api.write_kubeconfig(short_dir / "kubeconfig")), "NODE_NAME": NODE}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        yield Node(short_dir, kubelet_dir, api, kubelet, dra, host, env)


@contextlib.asynccontextmanager
async def serving(node: Node, *, dra: bool = True) -> AsyncIterator[Daemon]:
    """An in-process daemon running the Intel GPU scanner with its defaults."""
    scanners = [IntelGpuScanner.from_config({})]
    async with in_process_daemon(node.settings(dra=dra), scanners) as daemon:
        yield daemon


async def spec_written(daemon: Daemon, resource: str) -> None:
    await daemon.stats.wait_for(lambda stats: resource in stats.cdi_specs, timeout=10)


async def prepare_train(node: Node, daemon: Daemon) -> tuple[ClaimName, ClaimAnswer]:
    """Once the driver is registered, its pool published and the i915 spec on disk: claim
    ``team-a/train`` for the i915 GPU, prepared."""
    await node.dra.wait_for_plugin(DRIVER)
    await node.wait_for_pool({IGPU_NAME}, "the pool")
    await spec_written(daemon, I915)
    claim = node.claim("train", IGPU_NAME)
    answer = (await node.dra.prepare(DRIVER, [claim]))[claim.uid]
    assert answer.error == ""
    return claim, answer


# ------------------------------------------------------------------ the two fronts


async def test_i915_is_served_through_dra_only_and_xe_through_the_device_plugin(
    node: Node,
) -> None:
    async with serving(node) as daemon:
        session = await node.dra.wait_for_plugin(DRIVER)
        info = await session.get_info()
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert info.endpoint == str(node.root / "plugins" / DRIVER / "dra.sock")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert (node.root / "plugins_registry" / f"{DRIVER}-reg.sock").is_socket()

        await node.wait_for_pool({IGPU_NAME}, "the i915 GPU in this node's pool")
        (obj,) = node.api.slices(OWN_SLICES).values()
        assert obj["spec"]["pool"]["name"] == NODE
        assert obj["spec"]["pool"]["resourceSliceCount"] == 1
        device = node.slice_devices()[IGPU_NAME]
        attributes = device["attributes"]
        assert attributes["resource"] == {"string": I915}
        assert attributes["id"] == {"string": IGPU}
        assert attributes["resource.kubernetes.io/pciBusID"] == {"string": IGPU}
        # What Intel's own DRA driver publishes, by its names and formats, so that selectors
        # written for it (device.attributes["gpu.intel.com"].model == "A770") select this GPU.
        intel = {
            "model": {"string": "A770"},  # PCI device id 0x56a0
            "family": {"string": "Arc A-Series"},
            "driver": {"string": "i915"},
            "sriov": {"bool": False},
            "type": {"string": "gpu"},
            "pciId": {"string": "0x56a0"},
            "health": {"string": "Healthy"},
            "pciAddress": {"string": IGPU},  # deprecated by Intel, kept for old selectors
            "pciRoot": {"string": "00"},  # likewise: the root complex's bus
        }
        assert {name: attributes.get(name) for name in intel} == intel

        # xe registers through the device plugin API; i915 never does, and has no socket there.
        xe = await node.kubelet.wait_for_plugin(XE)
        assert set(await xe.wait_for_update()) == {DGPU}
        assert I915 in daemon.stats.value.advertised  # the scanner found it ...
        assert [r.resource for r in node.kubelet.registrations] == [XE]  # ... DRA serves it
        assert not (node.kubelet_dir / socket_file_name(I915)).exists()
        assert set(daemon.servers.servers) == {XE}
        # Nor is xe in the pool: one front per resource.
        assert {d["attributes"]["resource"]["string"] for d in node.slice_devices().values()} == {
            I915
        }
        assert daemon.not_ready() == []  # both fronts registered


async def test_prepare_answers_with_allocates_cdi_ids_and_they_resolve(node: Node) -> None:
    # The same GPU through the device-plugin front first: what Allocate names for it.
    async with serving(node, dra=False) as daemon:
        i915 = await node.kubelet.wait_for_plugin(I915)
        await i915.wait_for_update()
        await spec_written(daemon, I915)
        (allocated,) = await i915.allocate([IGPU])
    assert allocated.cdi_devices == (f"{I915}={IGPU}",)

    async with serving(node) as daemon:
        claim, answer = await prepare_train(node, daemon)
        (device,) = answer.devices
        assert (device.pool_name, device.device_name) == (NODE, IGPU_NAME)
        assert device.cdi_device_ids == allocated.cdi_devices
        checked = check_spec_dir(node.cdi_dir, device.cdi_device_ids)
        assert checked.unresolved == () and set(device.cdi_device_ids) <= set(checked.devices)
        assert daemon.dra is not None and set(daemon.dra.prepared()) == {claim.uid}

        # Prepared once: another claim of the same GPU is refused, the first one's answer kept.
        other = node.claim("steal", IGPU_NAME)
        refused = await node.dra.prepare(DRIVER, [other, claim])
        assert "already prepared for ResourceClaim team-a/train" in refused[other.uid].error
        assert refused[claim.uid] == answer
        assert await node.dra.unprepare(DRIVER, [claim, other]) == {claim.uid: "", other.uid: ""}
        assert daemon.dra.prepared() == {}


# ------------------------------------------------------------------ the pool follows the host


async def test_hotplug_changes_the_pool_and_a_wipe_is_put_back(node: Node) -> None:
    async with serving(node) as daemon:
        await node.wait_for_pool({IGPU_NAME}, "the first pool")
        generation = node.api.slices(OWN_SLICES).popitem()[1]["spec"]["pool"]["generation"]

        pci = add_intel_gpu(node.host, SECOND, card=2, render=130)
        for path in (pci, f"{pci}/drm/card2", f"{pci}/drm/renderD130"):
            await node.host.emit_async("add", path)
        await node.wait_for_pool({IGPU_NAME, SECOND_NAME}, "the plugged GPU in the pool")
        (obj,) = node.api.slices(OWN_SLICES).values()
        assert obj["spec"]["pool"]["generation"] > generation

        await node.host.unplug(pci)
        await node.wait_for_pool({IGPU_NAME}, "the unplugged GPU out of the pool")

        # The kubelet deletes the driver's slices (its start, or the plugin gone for 30 s).
        assert node.api.delete_slices(OWN_SLICES) == 1
        await node.wait_for_pool({IGPU_NAME}, "the pool written back")
        assert daemon.stats.value.full_scans == 1  # the GPU came and went through events


async def test_an_idle_node_writes_nothing(node: Node) -> None:
    async with serving(node) as daemon:
        await node.wait_for_pool({IGPU_NAME}, "the first pool")
        xe = await node.kubelet.wait_for_plugin(XE)
        await xe.wait_for_update()
        writes, watches = node.api.writes, node.api.requests["watch"]
        for _ in range(3):
            await daemon.rescan()  # the same host: equal trees, new objects
        # A device-plugin resource changes: a new tree, the same pool.
        pci = add_intel_gpu(node.host, "0000:05:00.0", card=3, render=131, driver="xe")
        for path in (pci, f"{pci}/drm/card3", f"{pci}/drm/renderD131"):
            await node.host.emit_async("add", path)
        await xe.wait_for_update(lambda listed: len(listed) == 2)
        # The slices' watch ends every 0.2 s and is opened again: let three go by.
        await node.api.wait_for(lambda a: a.requests["watch"] >= watches + 3, what="rewatches")
        assert node.api.writes == writes


async def test_a_reload_whose_scanners_no_longer_make_a_dra_resource_is_refused(
    node: Node,
) -> None:
    settings = node.settings()
    loaded: list[str] = []

    def loader() -> tuple[Settings, list[Scanner]]:
        # An edited config: the GPUs now served by a generic entry, not the Intel scanner.
        loaded.append("read")
        entry = {"resource": "example.com/card", "match": {"subsystem": "drm"}}
        return settings, [GenericScanner.from_config([entry])]

    scanners = [IntelGpuScanner.from_config({})]
    async with in_process_daemon(settings, scanners, config_loader=loader) as daemon:
        await node.wait_for_pool({IGPU_NAME}, "the pool")
        with structlog.testing.capture_logs() as logs:
            daemon.request_reload()
            await eventually(lambda: loaded == ["read"], timeout=10)
            await daemon.rescan()
        (refused,) = [e for e in logs if e["event"] == "config.reload.refused"]
        assert refused["field"] == "dra.resources"
        assert (
            "'gpu.intel.com/i915' is made by none of the configured scanners (generic)"
            in (refused["reason"])
        )
        assert daemon.stats.value.reloads == 0
        assert set(daemon.stats.value.advertised) == {I915, XE}  # the Intel scanner still runs


# ------------------------------------------------------------------ restarts


async def test_kubelet_and_daemon_restarts_keep_registration_and_prepared_claims(
    node: Node,
) -> None:
    async with serving(node) as daemon:
        claim, answer = await prepare_train(node, daemon)

        # A kubelet restart: it finds the registration socket again and asks again.
        await node.dra.restart()
        await node.dra.wait_for_plugin(DRIVER, generation=1)
        assert (await node.dra.prepare(DRIVER, [claim]))[claim.uid] == answer
        # A registry dir deleted and created again (a kubelet re-provisioned): back too.
        registry = node.root / "plugins_registry"
        (registry / f"{DRIVER}-reg.sock").unlink()
        registry.rmdir()
        await node.dra.restart()
        await node.dra.wait_for_plugin(DRIVER, generation=2)

    # The daemon restarts: it registers again, and the claim is still prepared (its answer
    # unchanged, its GPU still taken), until the kubelet unprepares it.
    async with serving(node) as daemon:
        session = await node.dra.wait_for_plugin(DRIVER, generation=2, replacing=None)
        await node.dra.wait_for_registration(
            lambda r: r.accepted and r.driver == DRIVER, after=len(node.dra.registrations) - 1
        )
        assert daemon.dra is not None and set(daemon.dra.prepared()) == {claim.uid}
        assert (await session.prepare([claim]))[claim.uid] == answer  # from the checkpoint
        # New claims wait until the restarted daemon has its pool (it finds it published as
        # it left it, and writes nothing) and its spec on disk.
        await daemon.dra.publisher.published.wait_for(lambda pool: pool is not None, timeout=10)
        await spec_written(daemon, I915)
        other = node.claim("steal", IGPU_NAME)
        refused = (await node.dra.prepare(DRIVER, [other]))[other.uid]
        assert "already prepared" in refused.error
        assert await node.dra.unprepare(DRIVER, [claim]) == {claim.uid: ""}
        assert (await node.dra.prepare(DRIVER, [other]))[other.uid].error == ""


# ------------------------------------------------------------------ devplug status


async def devplug_status(node: Node, *args: str) -> tuple[int, str]:
    """``devplug status ARGS`` for this node's kubelet dir, in a child process."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug",
        "status",
        "--kubelet-dir",
        str(node.kubelet_dir),
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_status_shows_the_dra_driver_and_its_prepared_claims(node: Node) -> None:
    async with serving(node) as daemon:
        claim, _ = await prepare_train(node, daemon)

        code, out = await devplug_status(node, "--output", "json")
        assert code == 0, out
        (driver,) = json.loads(out)["dra"]
        assert driver["driver"] == DRIVER and driver["state"] == "serving"
        assert driver["registration_socket"] == str(
            node.root / "plugins_registry" / f"{DRIVER}-reg.sock"
        )
        assert driver["endpoint"] == str(node.root / "plugins" / DRIVER / "dra.sock")
        (prepared,) = driver["prepared_claims"]
        assert (prepared["namespace"], prepared["name"], prepared["uid"]) == (
            "team-a",
            "train",
            claim.uid,
        )
        assert prepared["devices"] == [
            {
                "resource": I915,
                "id": IGPU,
                "device": IGPU_NAME,
                "cdi_device_ids": [f"{I915}={IGPU}"],
            }
        ]

        code, out = await devplug_status(node)
        assert code == 0, out
        assert f"{DRIVER}: team-a/train holds {I915}={IGPU}" in out.splitlines()
        row = next(line for line in out.splitlines() if line.startswith(DRIVER + " "))
        assert row.split()[-2:] == ["1", "serving"]  # PREPARED CLAIMS, STATUS

        # The metrics count it.
        assert daemon.metrics.registry.get_sample_value("devplug_dra_prepared_claims") == 1
        calls = {"operation": "prepare", "result": "ok"}
        assert daemon.metrics.registry.get_sample_value("devplug_dra_calls_total", calls) == 1
        assert daemon.metrics.registry.get_sample_value("devplug_dra_registered") == 1
        assert daemon.metrics.registry.get_sample_value("devplug_dra_slices") == 1
        writes = daemon.metrics.registry.get_sample_value(
            "devplug_dra_slice_writes_total", {"result": "ok"}
        )
        assert writes == node.api.writes  # the create of the one slice, nothing else


# ------------------------------------------------------------------ devplug run, SIGTERM


def write_config(node: Node) -> Path:
    config = node.root / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "scanners": {"intel_gpu": {}},
                "hotplug": {"source": "none"},
                "dra": {"driver": DRIVER, "resources": [I915], "kubelet_root": str(node.root)},
            }
        )
    )
    return config


async def test_sigterm_stops_devplug_run_with_both_sockets_removed(node: Node) -> None:
    registration = node.root / "plugins_registry" / f"{DRIVER}-reg.sock"
    dra_socket = node.root / "plugins" / DRIVER / "dra.sock"
    env = {**node.host.env(), **node.env}
    log = node.root / "daemon.log"
    async with daemon_process(write_config(node), node.kubelet_dir, env=env, output=log) as proc:
        await node.dra.wait_for_plugin(DRIVER, timeout=30)
        await node.wait_for_pool({IGPU_NAME}, "the pool, published by the process")
        await node.kubelet.wait_for_plugin(XE, timeout=30)
        assert registration.is_socket() and dra_socket.is_socket()
        gone = len(node.dra.deregistrations)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):  # a bound, not a measurement: "within a few seconds"
            returncode = await proc.wait()
    assert returncode == 0, log.read_text()[-4000:]
    assert not registration.exists() and not dra_socket.exists()
    await node.dra.wait_for_deregistration(DRIVER, after=gone)
    events = [json.loads(line).get("event") for line in lines(log)]
    assert "daemon.stopped" in events and "dra.plugin.stopped" in events


def lines(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            yield line


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{garbage", "not a JSON object"),
        ('{"version": 99, "driver": "gpu.intel.com", "claims": {}}', "version: 99"),
        ('{"version": 1, "driver": "gpu.intel.com", "claims": {"u": {}}}', "claims.u."),
    ],
)
async def test_an_unreadable_checkpoint_stops_devplug_run_before_anything_is_served(
    node: Node, content: str, field: str
) -> None:
    checkpoint = node.root / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(content)
    env = {**node.host.env(), **node.env}
    log = node.root / "daemon.log"
    async with daemon_process(write_config(node), node.kubelet_dir, env=env, output=log) as proc:
        async with asyncio.timeout(30):  # a bound: it stops at start
            returncode = await proc.wait()
    output = log.read_text()
    assert returncode == 2, output[-4000:]
    # One line naming the file, the field and the fix; no traceback, no crash report.
    (line,) = output.splitlines()
    assert line.startswith(f"devplug: configuration error: {checkpoint}: {field}"), line
    assert "move the file aside" in line
    # Nothing was served: no device-plugin registration, no DRA socket, the file as it was.
    assert node.kubelet.registrations == []
    assert not (node.root / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    assert not (checkpoint.parent / "dra.sock").exists()
    assert checkpoint.read_text() == content


class NoCdiIds:
    def cdi_device_ids(self, resource: str, device_id: str) -> tuple[str, ...]:
        return ()


@pytest.mark.parametrize("id_property", [None, "ID_PATH"])
async def test_a_generic_resource_named_by_dev_names_is_warned_about_at_start(
    node: Node, id_property: str | None
) -> None:
    entry: dict[str, Any] = {"resource": "example.com/tty", "match": {"subsystem": "tty"}}
    if id_property is not None:
        entry["id_property"] = id_property
    scanners: list[Scanner] = [
        GenericScanner.from_config(
            [entry, {"resource": "example.com/other", "match": entry["match"]}]
        )
    ]
    section = DraSettings(driver=DRIVER, resources=("example.com/tty",), kubelet_root=node.root)
    with structlog.testing.capture_logs() as logs:
        front = DraFront.from_environment(
            section, scanners, node.env, advertised=LatestValue(None), cdi=NoCdiIds()
        )
    await front.api.aclose()
    warned = [e for e in logs if e["event"] == "dra.names.unstable"]
    if id_property is not None:
        assert warned == []
        return
    (warning,) = warned  # once, and only for the DRA resource
    assert warning["resource"] == "example.com/tty" and warning["log_level"] == "warning"
    assert "id_property" in warning["fix"]
