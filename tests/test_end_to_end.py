"""The whole path: umockdev hardware -> pyudev -> generic scanner -> gRPC -> kubelet simulator.

The daemon runs as a real ``devplug run`` process (or in-process where a test needs to poke
it), talking over unix sockets to the simulator in this process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devplug.scanners.generic import GenericScanner
from devplug.testing import KubeletSimulator, daemon_process, daemon_settings, running_daemon
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial

SERIAL_CONFIG = """
scanners:
  generic:
    - resource: example.com/serial
      match: {subsystem: tty, devnode: /dev/ttyUSB*, properties: {ID_VENDOR_ID: "0403"}}
    - resource: example.com/render
      match: {subsystem: drm, devnode: /dev/dri/renderD*}
      shares: 2
"""


def populate(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    add_usb_serial(host, index=2, vendor_id="10c4")  # not FTDI: not matched
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128, numa_node=0)


def write_config(directory: Path) -> Path:
    path = directory / "config.yaml"
    path.write_text(SERIAL_CONFIG)
    return path


def test_scan_prints_the_documented_json(host: UmockdevHost, short_dir: Path) -> None:
    populate(host)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "devplug",
            "scan",
            "--config",
            str(write_config(short_dir)),
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    document = json.loads(result.stdout)  # stdout holds only the document
    resources = document["resources"]
    assert sorted(resources) == ["example.com/render", "example.com/serial"]
    serial = resources["example.com/serial"]
    assert [d["id"] for d in serial] == ["ttyUSB0", "ttyUSB1"]
    first = serial[0]
    assert set(first) >= {
        "id",
        "health",
        "device_nodes",
        "mounts",
        "env",
        "annotations",
        "numa_nodes",
    }
    assert first["health"] == "Healthy"
    assert first["device_nodes"] == [
        {"host_path": "/dev/ttyUSB0", "container_path": "/dev/ttyUSB0", "permissions": "rw"}
    ]
    render = resources["example.com/render"]
    assert [d["id"] for d in render] == ["dri_renderD128-0", "dri_renderD128-1"]
    assert render[0]["numa_nodes"] == [0]


def test_scan_table_and_yaml_and_dry_run(host: UmockdevHost, short_dir: Path) -> None:
    populate(host)
    config = str(write_config(short_dir))

    def run(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "devplug", *args, "--config", config],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout

    table = run("scan")
    assert table.splitlines()[0].split() == ["RESOURCE", "ID", "HEALTH", "NUMA", "DEVICE", "NODES"]
    assert any(
        line.split()[:3] == ["example.com/serial", "ttyUSB1", "Healthy"]
        for line in table.splitlines()
    )
    import yaml

    assert yaml.safe_load(run("scan", "--output", "yaml")) == json.loads(
        run("scan", "--output", "json")
    )
    assert run("run", "--dry-run") == table


@pytest.fixture
def serial_scanner(host: UmockdevHost) -> GenericScanner:
    populate(host)
    return GenericScanner.from_config(
        [
            {
                "resource": "example.com/serial",
                "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB*"},
            }
        ]
    )


async def test_hardware_changes_reach_the_kubelet(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    serial_scanner: GenericScanner,
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [serial_scanner]) as daemon:
        session = await kubelet.wait_for_plugin("example.com/serial")
        assert set(await session.wait_for_update()) == {"ttyUSB0", "ttyUSB1", "ttyUSB2"}
        (answer,) = await session.allocate(["ttyUSB1"])
        assert [n.host_path for n in answer.nodes] == ["/dev/ttyUSB1"]
        # Unplug one adapter: it leaves the list; allocating it is an error, not a stale answer.
        for path in host.remove_device("/sys/devices/pci0000:00/0000:00:14.0/usb1/1-2"):
            assert path
        await daemon.rescan()
        listed = await session.wait_for_update(lambda d: "ttyUSB1" not in d)
        assert set(listed) == {"ttyUSB0", "ttyUSB2"}
        with pytest.raises(Exception, match="NOT_FOUND"):
            await session.allocate(["ttyUSB1"])
        # Unplug the rest: the resource goes (empty list, then the socket).
        for index in (0, 2):
            host.remove_device(f"/sys/devices/pci0000:00/0000:00:14.0/usb1/1-{index + 1}")
        await daemon.rescan()
        await asyncio.wait_for(session.stream_ended.wait(), 5)
        assert session.latest == {}
        assert not (kubelet_dir / "devplug-example.com_serial.sock").exists()
        # Plug one back: a new server registers.
        add_usb_serial(host, index=7)
        await daemon.rescan()
        again = await kubelet.wait_for_plugin("example.com/serial", replacing=session)
        assert set(await again.wait_for_update()) == {"ttyUSB7"}


async def test_daemon_process_serves_and_stops_cleanly_on_sigterm(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    populate(host)
    config = write_config(short_dir)
    async with daemon_process(config, kubelet_dir, env=host.env()) as process:
        serial = await kubelet.wait_for_plugin("example.com/serial", timeout=30)
        render = await kubelet.wait_for_plugin("example.com/render", timeout=30)
        assert set(await serial.wait_for_update()) == {"ttyUSB0", "ttyUSB1"}
        assert len(await render.wait_for_update()) == 2
        (answer,) = await render.allocate(["dri_renderD128-0", "dri_renderD128-1"])
        assert [n.host_path for n in answer.nodes] == ["/dev/dri/renderD128"]
        # A kubelet restart while the process runs: it re-registers on its own.
        await kubelet.restart()
        await kubelet.wait_for_plugin("example.com/serial", timeout=30)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()
    assert stdout == b""  # logs go to stderr only
    events = [json.loads(line)["event"] for line in stderr.decode().splitlines()]
    for expected in (
        "daemon.started",
        "kubelet.register.complete",
        "kubelet.restart.detected",
        "daemon.stopped",
    ):
        assert expected in events
    # Own sockets gone; the kubelet's socket and checkpoint untouched.
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]
