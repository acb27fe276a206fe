"""A device node name libudev cannot take never reaches it (issue 15, item 3).

libudev aborts the whole process (an assertion in ``sd_device_get_devname``, exit -6) when
asked for the node of a device whose DEVNAME has a first component over 255 bytes. That is
why this runs ``devplug run`` as a child process: on the old code the child died, leaving its
socket and spec behind, and the supervisor's restart met the same device again (a crash loop).
The daemon now builds node paths from DEVNAME itself and checks them first.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from devplug.kubelet.server import socket_path_for
from devplug.scanners.udev import NAME_MAX, node_path_problem
from devplug.testing import KubeletSimulator, daemon_process, eventually
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

SERIAL = "example.com/serial"
LONG = "example.com/long"
CONFIG = """
hotplug: {source: kernel, coalesce_ms: 2, poll_s: 3600, resync_s: 3600}
scanners:
  generic:
    - {resource: example.com/serial, match: {subsystem: tty, devnode: "/dev/ttyUSB*"}}
    - {resource: example.com/long, match: {subsystem: tty, devnode: "/dev/x*"}}
"""
WAIT_S = 30.0

LogEntry = Mapping[str, Any]


def entries(path: Path) -> list[LogEntry]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def exactly(ids: set[str]) -> Callable[[Mapping[str, object]], bool]:
    return lambda listed: set(listed) == ids


def warned_about(log: Path, paths: set[str]) -> Callable[[], bool]:
    def check() -> bool:
        found = {e["sys_path"] for e in entries(log) if e["event"] == "scan.device.unreadable"}
        return found >= paths

    return check


def make_name_too_long(host: UmockdevHost, sys_path: str, index: int) -> str:
    """Give the device a DEVNAME whose first component is NAME_MAX + 45 bytes."""
    name = "x" * (NAME_MAX + 45) + f"/tty{index}"
    uevent = Path(f"{host.root}{sys_path}/uevent")
    content = uevent.read_bytes()
    old = f"DEVNAME=ttyUSB{index}".encode()
    assert old in content
    uevent.write_bytes(content.replace(old, f"DEVNAME={name}".encode()))
    return name


def test_node_path_components_over_name_max_are_refused() -> None:
    assert node_path_problem("/dev/" + "x" * (NAME_MAX + 1)) is not None
    assert node_path_problem("/dev/" + "x" * (NAME_MAX + 1) + "/tty0") is not None
    assert node_path_problem("/dev/dri/" + "x" * (NAME_MAX + 1)) is not None
    assert node_path_problem("/dev/" + "x" * NAME_MAX) is None


async def test_a_hotplugged_node_name_over_name_max_neither_crashes_nor_leaves_files(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    scaled: Callable[[int, int], int],
) -> None:
    """Devices with such names are hot-plugged into a running ``devplug run``: it stays up,
    serves the good devices, warns naming each bad one's sysfs path, creates nothing for a
    resource whose only devices are bad ones, and on SIGTERM removes everything it made."""
    add_usb_serial(host, index=0)
    config = short_dir / "config.yaml"
    config.write_text(CONFIG)
    cdi_dir = short_dir / "cdi"
    log = tmp_path / "run.log"
    rounds = scaled(1, 10)
    bad: list[str] = []
    async with daemon_process(config, kubelet_dir, env=host.env(), output=log) as process:
        session = await kubelet.wait_for_plugin(SERIAL, timeout=WAIT_S)
        await session.wait_for_update(lambda listed: set(listed) == {"ttyUSB0"})
        for round_ in range(rounds):
            good = add_usb_serial(host, index=2 * round_ + 1)
            tty = add_usb_serial(host, index=2 * round_ + 2)
            make_name_too_long(host, tty, 2 * round_ + 2)
            bad.append(tty)
            host.emit("add", tty)
            host.emit("add", good)
            want = {"ttyUSB0"} | {f"ttyUSB{2 * r + 1}" for r in range(round_ + 1)}
            await session.wait_for_update(exactly(want))
            await eventually(warned_about(log, set(bad)), timeout=WAIT_S)
            assert process.returncode is None, "the daemon died"
        assert not socket_path_for(kubelet_dir, LONG).exists()
        # The CDI sync writes after the servers are told: wait for the good spec, then check
        # that it is the only one.
        await eventually(lambda: (cdi_dir / "example.com-serial.json").exists(), timeout=WAIT_S)
        assert [n for n in os.listdir(cdi_dir) if n.endswith(".json")] == [
            "example.com-serial.json"
        ]
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
    leftovers = [name for name in os.listdir(kubelet_dir) if name.startswith("devplug")]
    assert leftovers == []
    assert [name for name in os.listdir(cdi_dir) if name.endswith(".json")] == []
