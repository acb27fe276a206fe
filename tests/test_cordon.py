"""``devplug cordon`` and ``uncordon`` against a real daemon serving the kubelet stand-in:
the device is listed Unhealthy with its reason (ListAndWatch, status, the logs), refused at
Allocate, kept across reloads, SIGKILL and restarts, put back only after the health hold-down,
and shown drained once no pod holds it. The commands run as child processes, as an operator
runs them; the daemon runs in this process, or as ``devplug run`` where it must be killed."""

from __future__ import annotations

import asyncio
import json
import signal
import stat
from pathlib import Path
from typing import Any

import pytest
from helpers import health, run_devplug
from test_plugin_entry import start as start_plugin
from test_plugin_entry import write_config as write_plugin_config

from devplug.daemon import Daemon
from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import (
    KubeletSimulator,
    PluginSession,
    SimulatorRpcError,
    daemon_process,
    daemon_settings,
)
from devplug.testing.harness import DaemonStarter, StaticScanner

SERIAL = "example.com/serial"
REASON = "fan replacement, ticket OPS-1234"


def serials(*ids: str) -> dict[str, dict[str, DeviceInfo]]:
    return {SERIAL: {i: DeviceInfo(nodes=(DeviceNode("/dev/null"),)) for i in ids}}


async def cordon(kubelet_dir: Path, device_id: str, reason: str = REASON) -> str:
    code, out, err = await run_devplug(
        "cordon", SERIAL, device_id, "--reason", reason, "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 0, err
    return out


async def uncordon(kubelet_dir: Path, device_id: str) -> str:
    code, out, err = await run_devplug(
        "uncordon", SERIAL, device_id, "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 0, err
    return out


def null_config(directory: Path) -> Path:
    """A config for ``devplug run``: /dev/null as the one device of SERIAL, id ``null``."""
    config = directory / "config.yaml"
    config.write_text(
        "hotplug: {source: none, poll_s: 3600, resync_s: 3600}\nscanners:\n  generic:\n"
        f"    - {{resource: {SERIAL}, match: {{subsystem: mem, devnode: /dev/null}}}}\n"
    )
    return config


async def status_document(kubelet_dir: Path, *args: str) -> dict[str, Any]:
    code, out, err = await run_devplug(
        "status", "--kubelet-dir", str(kubelet_dir), "-o", "json", *args
    )
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
    code, table, err = await run_devplug("status", "--kubelet-dir", str(kubelet_dir))
    assert code == 0, err
    assert [SERIAL, "s1", "cordoned"] in [line.split()[:3] for line in table.splitlines()]
    assert REASON in table

    # Cordoned twice: nothing changes, and the command says so.
    assert "was cordoned already" in await cordon(kubelet_dir, "s1")


async def test_the_logs_say_which_device_was_cordoned_and_why(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    async with daemon_process(null_config(short_dir), kubelet_dir) as process:
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
    async with daemon_process(null_config(short_dir), kubelet_dir) as process:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update(lambda listed: set(listed) == {"null"})
        await cordon(kubelet_dir, "null")
        process.send_signal(signal.SIGKILL)  # no clean-up of any kind
        await process.wait()
    state = kubelet_dir / "devplug" / "devplug.cordons.json"
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700

    async with daemon_process(null_config(short_dir), kubelet_dir):
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


async def cordoned_s0(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter, hold_down_s: float
) -> tuple[Daemon, PluginSession]:
    """A daemon serving s0 with this health hold-down, s0 cordoned and listed so."""
    settings = daemon_settings(kubelet_dir, hotplug={"health_hold_down_s": hold_down_s})
    daemon = await start_daemon(settings, [StaticScanner(serials("s0"))])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await cordon(kubelet_dir, "s0")
    await session.wait_for_update(lambda listed: listed["s0"].health == "Unhealthy")
    return daemon, session


async def test_uncordon_keeps_the_device_held_down_until_the_hold_down_ends(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    daemon, _ = await cordoned_s0(kubelet, kubelet_dir, start_daemon, 3600)
    said = await uncordon(kubelet_dir, "s0")
    assert f"uncordoned {SERIAL} s0" in said and "3600s" in said
    # The cordon is lifted, but the device is not Healthy before an hour has passed: Allocate
    # still refuses it, saying why.
    held = "uncordoned; held down until healthy for 3600s"
    with pytest.raises(SimulatorRpcError, match=held):
        await kubelet.allocate(SERIAL, ["s0"])
    assert daemon.stats.value.advertised[SERIAL]["s0"].health_reason == held
    assert (await status_document(kubelet_dir))["cordons"]["devices"] == []
    assert "was not cordoned" in await uncordon(kubelet_dir, "s0")


async def test_an_uncordoned_device_is_served_again_after_the_hold_down(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    _, session = await cordoned_s0(kubelet, kubelet_dir, start_daemon, 0.2)
    after = len(session.updates)  # every list since has it Unhealthy, until the hold-down ends
    await uncordon(kubelet_dir, "s0")
    # Nothing but the hold-down's end wakes the daemon: no rescan, no event.
    await session.wait_for_update(lambda listed: listed["s0"].health == "Healthy", after=after)
    await kubelet.allocate(SERIAL, ["s0"])


async def test_a_cordoned_device_is_drained_once_no_pod_holds_it(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    await start_daemon(daemon_settings(kubelet_dir), [StaticScanner(serials("s0", "s1"))])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await kubelet.allocate(SERIAL, ["s1"], pod="batch/train", container="worker")
    await cordon(kubelet_dir, "s1")

    held = cordoned(await status_document(kubelet_dir, "--pods"))["s1"]
    assert (held["state"], held["holders"]) == ("in use", ["batch/train/worker"])
    code, table, err = await run_devplug("status", "--kubelet-dir", str(kubelet_dir), "--pods")
    assert code == 0, err
    assert [SERIAL, "s1", "in", "use", "by", "batch/train/worker"] in [
        line.split()[:6] for line in table.splitlines()
    ]

    kubelet.release("batch/train")
    drained = cordoned(await status_document(kubelet_dir, "--pods"))["s1"]
    assert (drained["state"], drained["holders"]) == ("drained", [])
    code, table, err = await run_devplug("status", "--kubelet-dir", str(kubelet_dir), "--pods")
    assert code == 0, err
    assert [SERIAL, "s1", "drained"] in [line.split()[:3] for line in table.splitlines()]


async def test_a_reload_keeps_the_cordons(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    settings = daemon_settings(kubelet_dir)
    scanner = StaticScanner(serials("s0", "s1"))
    daemon = await start_daemon(settings, [scanner], config_loader=lambda: (settings, [scanner]))
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await cordon(kubelet_dir, "s1")
    await session.wait_for_update(lambda listed: listed["s1"].health == "Unhealthy")
    daemon.request_reload()
    await daemon.stats.wait_for(lambda s: s.reloads == 1, timeout=10)
    await daemon.rescan()  # returns once its tree, gated after the reload, is delivered
    assert daemon.stats.value.advertised[SERIAL]["s1"].health_reason == f"cordoned: {REASON}"
    assert health(session.latest)["s1"] == "Unhealthy"


async def test_a_device_that_goes_keeps_its_cordon_and_comes_back_cordoned(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    scanner = StaticScanner(serials("s0", "s1"))
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    await cordon(kubelet_dir, "s1")
    scanner.set(serials("s0"))  # unplugged for repair
    await daemon.rescan()
    await session.wait_for_update(lambda listed: set(listed) == {"s0"})
    gone = cordoned(await status_document(kubelet_dir))["s1"]
    assert (gone["reason"], gone["present"]) == (REASON, False)
    # It can be cordoned again while away (a new reason), though it is not there.
    said = await cordon(kubelet_dir, "s1", "sent for repair")
    assert "not there now" in said

    scanner.set(serials("s0", "s1"))
    after = len(session.updates)
    await daemon.rescan()
    listed = await session.wait_for_update(lambda listed: set(listed) == {"s0", "s1"}, after=after)
    assert health(listed) == {"s0": "Healthy", "s1": "Unhealthy"}
    back = daemon.stats.value.advertised[SERIAL]["s1"]
    assert back.health_reason == "cordoned: sent for repair"


async def test_an_unknown_resource_or_id_is_refused_naming_what_there_is(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    many = serials(*(f"s{i}" for i in range(50)))
    await start_daemon(daemon_settings(kubelet_dir), [StaticScanner(many)])
    await (await kubelet.wait_for_plugin(SERIAL)).wait_for_update()

    code, out, err = await run_devplug(
        "cordon", SERIAL, "s99", "--reason", "x", "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 1 and out == ""
    # The first ids in natural order, then how many more: a huge resource stays one line.
    listed = ", ".join(f"s{i}" for i in range(20))
    assert f"{SERIAL}: no device 's99'; its devices: {listed} and 30 more" in err
    code, _, err = await run_devplug("uncordon", SERIAL, "s99", "--kubelet-dir", str(kubelet_dir))
    assert code == 1 and "no device 's99'" in err

    code, _, err = await run_devplug(
        "cordon", "example.com/other", "s0", "--reason", "x", "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 1 and f"example.com/other: no daemon here has it; they have: {SERIAL}" in err
    assert (await status_document(kubelet_dir))["cordons"]["devices"] == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["cordon", "not a name", "s0", "--reason", "x"], "resource 'not a name'"),
        (["cordon", SERIAL, "../s0", "--reason", "x"], "device id '../s0'"),
        (["cordon", SERIAL, "s0", "--reason", "two\nlines"], "--reason: printable"),
        (["cordon", SERIAL, "s0", "--reason", " "], "--reason: give a reason"),
        (["cordon", SERIAL, "s0", "--reason", "x" * 201], "--reason: at most 200"),
        (["cordon", SERIAL, "s0"], "the following arguments are required: --reason"),
    ],
)
async def test_a_bad_command_line_is_refused_before_asking_anyone(
    kubelet_dir: Path, args: list[str], expected: str
) -> None:
    code, out, err = await run_devplug(*args, "--kubelet-dir", str(kubelet_dir))
    assert (code, out) == (2, "")
    assert expected in err


async def test_without_a_daemon_the_commands_say_so(kubelet_dir: Path) -> None:
    code, _, err = await run_devplug(
        "cordon", SERIAL, "s0", "--reason", "x", "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 1
    assert f"no devplug daemon in {kubelet_dir}" in err and "is it running?" in err


async def test_an_unreadable_state_file_holds_every_device_until_it_is_fixed(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    state = kubelet_dir / "devplug" / "devplug.cordons.json"
    state.parent.mkdir(mode=0o700)
    state.write_text('{"version": 1, "cordons": {')  # cut short
    settings = daemon_settings(kubelet_dir, hotplug={"health_hold_down_s": 0})
    scanner = StaticScanner(serials("s0", "s1"))
    daemon = await start_daemon(settings, [scanner], config_loader=lambda: (settings, [scanner]))
    session = await kubelet.wait_for_plugin(SERIAL)
    # Failing closed: which devices were cordoned is unknown, so none is offered.
    first = await session.wait_for_update()
    assert health(first) == {"s0": "Unhealthy", "s1": "Unhealthy"}
    reason = daemon.stats.value.advertised[SERIAL]["s0"].health_reason
    assert reason.startswith(f"cordons unknown: {state} cannot be read (not JSON")
    assert "fixed or removed and the daemon reloaded (SIGHUP)" in reason
    # A change would overwrite what the file holds: refused, and the file is left as it is.
    code, _, err = await run_devplug(
        "cordon", SERIAL, "s0", "--reason", "x", "--kubelet-dir", str(kubelet_dir)
    )
    assert code == 1 and "cordons unknown" in err
    assert state.read_text() == '{"version": 1, "cordons": {'
    document = await status_document(kubelet_dir)
    (answered,) = document["cordons"]["daemons"]
    assert answered["unreadable"] == reason

    # The operator writes what it should hold, and reloads.
    state.write_text(
        json.dumps(
            {
                "version": 1,
                "cordons": {SERIAL: {"s1": {"reason": "bad fan", "since": "2025-01-31T09:30:00Z"}}},
            }
        )
    )
    daemon.request_reload()
    listed = await session.wait_for_update(lambda listed: listed["s0"].health == "Healthy")
    assert health(listed) == {"s0": "Healthy", "s1": "Unhealthy"}
    assert cordoned(await status_document(kubelet_dir))["s1"]["reason"] == "bad fan"


async def test_a_plugin_authors_daemon_has_a_socket_of_its_own_name(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """``serve(..., program="dummy-plugin")``: its control socket and state file are named
    after it (so it and devplug can share a node), and ``devplug cordon`` finds it."""
    process = await start_plugin(short_dir, write_plugin_config(short_dir, kubelet_dir, 2))
    try:
        session = await kubelet.wait_for_plugin("example.com/dummy", timeout=60)
        await session.wait_for_update()
        code, _, err = await run_devplug(
            "cordon",
            "example.com/dummy",
            "dev1",
            "--reason",
            "x",
            "--kubelet-dir",
            str(kubelet_dir),
        )
        assert code == 0, err
        await session.wait_for_update(lambda listed: listed["dev1"].health == "Unhealthy")
        own = kubelet_dir / "devplug"
        assert sorted(p.name for p in own.iterdir()) == [
            "dummy-plugin.cordons.json",
            "dummy-plugin.sock",
        ]
    finally:
        process.terminate()
        await process.communicate()
