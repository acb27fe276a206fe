"""``devplug status --pods``: each device of devplug's resources with its health and the pod
and container holding it, read from the kubelet stand-in's pod resources API; the allocatable
column; one line and exit status 1 without the API. The command runs as a child process; the
daemon, in this one, serves the stand-in over real unix sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from helpers import run_devplug

from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import KubeletSimulator, daemon_settings, running_daemon
from devplug.testing.harness import DaemonStarter, StaticScanner
from devplug.testing.podresources import PodResourcesGates

SERIAL = "example.com/serial"
SOCKET = "devplug-example.com_serial.sock"


def serials(*ids: str, unhealthy: tuple[str, ...] = ()) -> dict[str, dict[str, DeviceInfo]]:
    return {
        SERIAL: {
            i: DeviceInfo(
                health=Health.UNHEALTHY if i in unhealthy else Health.HEALTHY,
                nodes=(DeviceNode("/dev/null"),),
                numa_nodes=(0,),
            )
            for i in ids
        }
    }


async def serving(
    kubelet: KubeletSimulator, start_daemon: DaemonStarter, scanner: StaticScanner
) -> None:
    await start_daemon(daemon_settings(kubelet.directory), [scanner])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines()]


def holders(device: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(h["namespace"], h["pod"], h["container"]) for h in device["holders"]]


async def test_every_held_device_names_its_pod_and_container(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    scanner = StaticScanner(serials("s0", "s1", "s2"))
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await kubelet.allocate(SERIAL, ["s0"], pod="web/front", container="app")
    await kubelet.allocate(SERIAL, ["s2"], pod="batch/job-7", container="worker")
    scanner.set(serials("s0", "s1", "s2", unhealthy=("s2",)))  # unhealthy while held
    await daemon.rescan()
    await session.wait_for_update(lambda listed: listed["s2"].health == "Unhealthy")

    code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    got = rows(table)
    assert got[0] == ["SOCKET", "RESOURCE", "HEALTHY", "UNHEALTHY", "NUMA", "ALLOCATABLE", "STATUS"]
    assert got[1] == [SOCKET, SERIAL, "2", "1", "0", "agrees", "serving"]
    start = got.index(["RESOURCE", "DEVICE", "HEALTH", "HELD", "BY"])
    assert got[start + 1 : start + 4] == [
        [SERIAL, "s0", "Healthy", "web/front/app"],
        [SERIAL, "s1", "Healthy", "-"],
        [SERIAL, "s2", "Unhealthy", "batch/job-7/worker"],
    ]
    socket = kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    assert table.splitlines()[-1] == f"pod resources: 2 pods, read from {socket}"

    code, as_json, err = await run_devplug(
        "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "json"
    )
    assert code == 0, err
    document = json.loads(as_json)
    code, as_yaml, err = await run_devplug(
        "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "yaml"
    )
    assert code == 0, err
    assert yaml.safe_load(as_yaml) == document
    assert document["pod_resources"] == {
        "socket": str(socket),
        "state": "available",
        "error": None,
        "allocatable_error": None,
    }
    (plugin,) = document["plugins"]
    devices = {d["id"]: d for d in plugin["devices"]}
    assert holders(devices["s0"]) == [("web", "front", "app")]
    assert holders(devices["s1"]) == []
    assert holders(devices["s2"]) == [("batch", "job-7", "worker")]
    assert devices["s2"]["health"] == "Unhealthy" and devices["s0"]["numa_nodes"] == [0]
    assert plugin["allocatable"] == {"state": "agrees", "missing": [], "extra": []}


async def test_an_unplugged_device_still_held_is_listed_gone(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    scanner = StaticScanner(serials("s0", "s1"))
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await kubelet.allocate(SERIAL, ["s1"], pod="web/front", container="app")
    scanner.set(serials("s0"))  # s1 is unplugged; its pod still runs
    await daemon.rescan()
    await session.wait_for_update(lambda listed: set(listed) == {"s0"})

    code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert [SERIAL, "s1", "gone", "web/front/app"] in rows(table)
    code, as_json, _ = await run_devplug(
        "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "json"
    )
    (plugin,) = json.loads(as_json)["plugins"]
    gone = [d for d in plugin["devices"] if d["health"] == "gone"]
    assert [(d["id"], holders(d)) for d in gone] == [("s1", [("web", "front", "app")])]


async def test_the_allocatable_column_shows_the_kubelets_drift(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    await serving(kubelet, start_daemon, StaticScanner(serials("s0", "s1")))
    kubelet.pin_allocatable(SERIAL, ["s0", "old"])
    code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert rows(table)[1] == [SOCKET, SERIAL, "2", "0", "0", "missing=1,extra=1", "serving"]
    code, as_json, _ = await run_devplug(
        "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "json"
    )
    (plugin,) = json.loads(as_json)["plugins"]
    assert plugin["allocatable"] == {"state": "differs", "missing": ["s1"], "extra": ["old"]}


async def test_without_the_api_one_line_says_so_and_the_exit_status_is_1(
    kubelet_dir: Path,
) -> None:
    async with (
        KubeletSimulator(kubelet_dir, pod_resources=False) as kubelet,
        running_daemon(daemon_settings(kubelet_dir), [StaticScanner(serials("s0"))]),
    ):
        await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
        code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
        json_code, as_json, _ = await run_devplug(
            "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "json"
        )
        plain_code, _, _ = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    where = kubelet_dir.parent / "pod-resources"
    lines = table.splitlines()
    assert code == json_code == 1, err
    assert plain_code == 0  # without --pods, nothing is asked of the API
    assert rows(table)[1] == [SOCKET, SERIAL, "1", "0", "0", "unknown", "serving"]
    assert lines[-1] == (
        f"pod resources: no {where} (a kubelet without the pod resources API, or a pod "
        "without its mount; --pod-resources-socket PATH names another): holders unknown"
    )
    assert sum(line.startswith("pod resources:") for line in lines) == 1
    document = json.loads(as_json)
    assert document["pod_resources"]["state"] == "absent"
    (plugin,) = document["plugins"]
    assert plugin["devices"][0]["holders"] is None  # unknown, not "nobody"
    assert plugin["allocatable"] == {"state": "unknown", "missing": None, "extra": None}


async def test_a_socket_elsewhere_is_named_with_the_flag(
    kubelet_dir: Path, short_dir: Path
) -> None:
    elsewhere = short_dir / "pr" / "api.sock"
    async with (
        KubeletSimulator(kubelet_dir, pod_resources_socket=elsewhere) as kubelet,
        running_daemon(daemon_settings(kubelet_dir), [StaticScanner(serials("s0"))]),
    ):
        await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
        await kubelet.allocate(SERIAL, ["s0"], pod="web/front")
        flag = ("--pod-resources-socket", str(elsewhere))
        code, table, err = await run_devplug("status", *flag, "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err  # the flag alone asks for the pods
    assert [SERIAL, "s0", "Healthy", "web/front/main"] in rows(table)
    assert table.splitlines()[-1] == f"pod resources: 1 pods, read from {elsewhere}"


async def test_a_kubelet_without_allocatable_still_names_the_holders(kubelet_dir: Path) -> None:
    gates = PodResourcesGates(get_allocatable=False)
    async with (
        KubeletSimulator(kubelet_dir, gates=gates) as kubelet,
        running_daemon(daemon_settings(kubelet_dir), [StaticScanner(serials("s0"))]),
    ):
        await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()
        await kubelet.allocate(SERIAL, ["s0"], pod="web/front")
        code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert rows(table)[1][5] == "unknown"
    assert [SERIAL, "s0", "Healthy", "web/front/main"] in rows(table)
    assert table.splitlines()[-1].endswith(
        "; allocatable unknown (UNKNOWN: Pod Resources API GetAllocatableResources disabled)"
    )


async def test_devices_are_listed_by_id_whatever_their_health(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    # A device that turns unhealthy moves in the plugin's list; the table is by id all the
    # same, the held device that is gone among them.
    scanner = StaticScanner(serials("s1", "s2", "s3", "s10"))
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await kubelet.allocate(SERIAL, ["s3"], pod="web/front", container="app")
    scanner.set(serials("s1", "s2", "s10", unhealthy=("s1",)))  # s3 unplugged under its pod
    await daemon.rescan()
    await session.wait_for_update(lambda listed: "s3" not in listed)

    code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    got = rows(table)
    start = got.index(["RESOURCE", "DEVICE", "HEALTH", "HELD", "BY"])
    assert [row[1] for row in got[start + 1 : start + 5]] == ["s1", "s2", "s3", "s10"]
    code, as_json, _ = await run_devplug(
        "status", "--pods", "--kubelet-dir", str(kubelet_dir), "-o", "json"
    )
    (plugin,) = json.loads(as_json)["plugins"]
    assert [d["id"] for d in plugin["devices"]] == ["s1", "s2", "s3", "s10"]


async def test_a_device_listed_unhealthy_is_not_extra_to_an_old_kubelet(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    await serving(kubelet, start_daemon, StaticScanner(serials("s0", "s1", unhealthy=("s1",))))
    # A kubelet before 1.23 counts unhealthy devices as allocatable (kubernetes#104122).
    kubelet.pin_allocatable(SERIAL, ["s0", "s1"])
    code, table, err = await run_devplug("status", "--pods", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert rows(table)[1] == [SOCKET, SERIAL, "1", "1", "0", "agrees", "serving"]


async def test_a_file_that_is_no_socket_is_said_so_and_pods_asked_for_give_no_hint(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, tmp_path: Path
) -> None:
    await serving(kubelet, start_daemon, StaticScanner(serials("s0")))
    code, _, err = await run_devplug(
        "cordon", SERIAL, "s0", "--reason", "bad cable", "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 0, err
    hint = "(--pods tells a drained device from one in use)"
    code, table, err = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert hint in table.splitlines()  # who holds it was not asked

    a_file = tmp_path / "kubelet.sock"
    a_file.write_text("")
    code, table, _ = await run_devplug(
        "status", "--pod-resources-socket", str(a_file), "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 1
    lines = table.splitlines()
    (said,) = [line for line in lines if line.startswith("pod resources:")]
    assert said == f"pod resources: {a_file} is not a socket: holders unknown"
    assert hint not in lines  # --pods was given: the line above says why holders are unknown
