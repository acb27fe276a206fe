"""``devplug cordon`` and ``uncordon`` against a real daemon serving the kubelet stand-in:
the device is listed Unhealthy with its reason (ListAndWatch, status, the logs), refused at
Allocate, kept across reloads, SIGKILL and restarts, put back only after the health hold-down,
and shown drained once no pod holds it. The commands run as child processes, as an operator
runs them; the daemon runs in this process, or as ``devplug run`` where it must be killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import health
from test_status import run_status

from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import (
    KubeletSimulator,
    SimulatorRpcError,
    daemon_process,
    daemon_settings,
    eventually,
)
from devplug.testing.harness import DaemonStarter, StaticScanner

SERIAL = "example.com/serial"
REASON = "fan replacement, ticket OPS-1234"


def serials(*ids: str) -> dict[str, dict[str, DeviceInfo]]:
    return {SERIAL: {i: DeviceInfo(nodes=(DeviceNode("/dev/null"),)) for i in ids}}


async def devplug(*args: str) -> tuple[int, str, str]:
    """``devplug ARGS`` in a child process: (exit status, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devplug",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def cordon(kubelet_dir: Path, device_id: str, reason: str = REASON) -> str:
    code, out, err = await devplug(
        "cordon", SERIAL, device_id, "--reason", reason, "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 0, err
    return out


async def uncordon(kubelet_dir: Path, device_id: str) -> str:
    code, out, err = await devplug("uncordon", SERIAL, device_id, "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    return out


async def status_document(kubelet_dir: Path, *args: str) -> dict[str, Any]:
    code, out, err = await run_status("--kubelet-dir", str(kubelet_dir), "-o", "json", *args)
    assert code == 0, err
    document: dict[str, Any] = json.loads(out)
    return document


def cordoned(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["id"]: d for d in document["cordons"]["devices"]}


async def test_a_cordoned_device_is_unhealthy_with_its_reason_and_refused_at_allocate(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    await start_daemon(daemon_settings(kubelet_dir), [StaticScanner(serials("s0", "s1"))])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update(lambda listed: set(listed) == {"s0", "s1"})

    said = await cordon(kubelet_dir, "s1")
    assert f"cordoned {SERIAL} s1: {REASON}" in said
    # When the command returns, the kubelet front has the tree: no wait for the list needed
    # by Allocate, which refuses the device, naming why.
    with pytest.raises(SimulatorRpcError) as refused:
        await kubelet.allocate(SERIAL, ["s1"], pod="web/front")
    assert f"unhealthy device ids: 's1' (cordoned: {REASON})" in refused.value.details
    await kubelet.allocate(SERIAL, ["s0"], pod="web/other")  # the other device still serves
    listed = await session.wait_for_update(lambda listed: listed["s1"].health == "Unhealthy")
    assert health(listed) == {"s0": "Healthy", "s1": "Unhealthy"}

    document = await status_document(kubelet_dir)
    (plugin,) = document["plugins"]
    assert (plugin["healthy"], plugin["unhealthy"]) == (1, 1)
    (device,) = document["cordons"]["devices"]
    assert (device["resource"], device["id"], device["reason"]) == (SERIAL, "s1", REASON)
    assert device["present"] is True and device["state"] == "cordoned"  # holders unknown
    assert device["since"].endswith("Z")
    code, table, err = await run_status("--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert [SERIAL, "s1", "cordoned"] in [line.split()[:3] for line in table.splitlines()]
    assert REASON in table

    # Cordoned twice: nothing changes, and the command says so.
    assert "was cordoned already" in await cordon(kubelet_dir, "s1")


async def test_the_logs_say_which_device_was_cordoned_and_why(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(
        "hotplug: {source: none, poll_s: 3600, resync_s: 3600}\nscanners:\n  generic:\n"
        f"    - {{resource: {SERIAL}, match: {{subsystem: mem, devnode: /dev/null}}}}\n"
    )
    async with daemon_process(config, kubelet_dir) as process:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update(lambda listed: set(listed) == {"null"})
        await cordon(kubelet_dir, "null")
        await session.wait_for_update(lambda listed: listed["null"].health == "Unhealthy")
        process.terminate()
        _, err = await asyncio.wait_for(process.communicate(), 30)
    events = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    (put,) = [e for e in events if e["event"] == "device.cordoned"]
    assert (put["resource"], put["device"], put["reason"]) == (SERIAL, "null", REASON)
    changed = [e for e in events if e["event"] == "device.health.changed"]
    assert [e["reason"] for e in changed if e["device"] == "null"] == [f"cordoned: {REASON}"]


async def test_a_cordon_survives_sigkill_and_restart(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(
        "hotplug: {source: none, poll_s: 3600, resync_s: 3600}\nscanners:\n  generic:\n"
        f"    - {{resource: {SERIAL}, match: {{subsystem: mem, devnode: /dev/null}}}}\n"
    )
    async with daemon_process(config, kubelet_dir) as process:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update(lambda listed: set(listed) == {"null"})
        await cordon(kubelet_dir, "null")
        process.send_signal(signal.SIGKILL)  # no clean-up of any kind
        await process.wait()
    state = kubelet_dir / "devplug" / "devplug.cordons.json"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700

    async with daemon_process(config, kubelet_dir):
        session = await kubelet.wait_for_plugin(SERIAL, replacing=session)
        # The very first list of the new daemon has it Unhealthy: no window in between.
        first = await session.wait_for_update()
        assert health(first) == {"null": "Unhealthy"}
        with pytest.raises(SimulatorRpcError, match=f"cordoned: {REASON}"):
            await kubelet.allocate(SERIAL, ["null"])
        document = await status_document(kubelet_dir)
        assert cordoned(document)["null"]["reason"] == REASON
        # The stale socket the killed daemon left was taken over.
        assert [d["error"] for d in document["cordons"]["daemons"]] == [None]
