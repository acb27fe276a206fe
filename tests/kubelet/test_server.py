"""The daemon against the kubelet simulator over real unix sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from helpers import PreferringScanner

from devplug._kits.socket_claim import SocketIdentity
from devplug.errors import AllocationError
from devplug.kubelet import answer_log
from devplug.kubelet.registration import KubeletDirWatcher
from devplug.kubelet.server import ResourceServer
from devplug.model import (
    ContainerAllocation,
    DeviceInfo,
    DeviceNode,
    DeviceTree,
    DeviceTreeBuilder,
    Health,
)
from devplug.scanners.udev import UdevSource
from devplug.testing import (
    FAST_TIMING,
    KubeletSimulator,
    SimulatorRpcError,
    StaticScanner,
    daemon_settings,
    running_daemon,
)
from devplug.testing.harness import in_process_daemon
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

SERIAL = "example.com/serial"


def devices(
    count: int, health: Health = Health.HEALTHY, numa: int | None = None
) -> dict[str, DeviceInfo]:
    return {
        f"dev{i}": DeviceInfo(
            health=health,
            nodes=(DeviceNode(f"/dev/ttyX{i}"),),
            env={"SERIAL": str(i)},
            numa_nodes=() if numa is None else (numa,),
        )
        for i in range(count)
    }


async def test_registers_and_sends_the_first_list(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(3)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        listed = await session.wait_for_update()
        assert set(listed) == {"dev0", "dev1", "dev2"}
        assert {d.health for d in listed.values()} == {"Healthy"}
        registration = kubelet.registrations[-1]
        assert registration.accepted and registration.version == "v1beta1"
        assert registration.endpoint == "devplug-example.com_serial.sock"
        mode = os.stat(kubelet_dir / registration.endpoint).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert session.options.get_preferred_allocation_available
        assert not session.options.pre_start_required


async def test_updates_reach_the_stream_and_topology_is_sent(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2, numa=1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        first = await session.wait_for_update()
        assert first["dev0"].numa_nodes == (1,)
        sick = devices(2, numa=1)
        sick["dev1"] = DeviceInfo(health=Health.UNHEALTHY, health_reason="node gone")
        scanner.set({SERIAL: {**sick, "dev2": DeviceInfo()}})
        await daemon.rescan()
        listed = await session.wait_for_update(lambda d: "dev2" in d)
        assert listed["dev1"].health == "Unhealthy"
        assert session.healthy_ids() == {"dev0", "dev2"}


async def test_allocate_good_unknown_and_unhealthy_ids(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    tree = devices(3)
    tree["dev2"] = DeviceInfo(health=Health.UNHEALTHY, nodes=(DeviceNode("/dev/ttyX2"),))
    async with running_daemon(daemon_settings(kubelet_dir), [StaticScanner({SERIAL: tree})]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        (first, second) = await session.allocate(["dev0"], ["dev1"])
        assert [n.host_path for n in first.nodes] == ["/dev/ttyX0"]
        assert first.nodes[0].permissions == "rw"
        assert dict(second.env) == {"SERIAL": "1"}
        with pytest.raises(SimulatorRpcError) as unknown:
            await session.allocate(["dev0", "nope"])
        assert unknown.value.code == "NOT_FOUND" and "'nope'" in unknown.value.details
        with pytest.raises(SimulatorRpcError) as sick:
            await session.allocate(["dev2"])
        assert sick.value.code == "INVALID_ARGUMENT" and "'dev2'" in sick.value.details
        # The daemon keeps serving after refusing.
        (again,) = await session.allocate(["dev1"])
        assert [n.host_path for n in again.nodes] == ["/dev/ttyX1"]


async def test_preferred_allocation_honours_must_include(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    tree = {
        **{f"a{i}": DeviceInfo(numa_nodes=(0,)) for i in range(4)},
        **{f"b{i}": DeviceInfo(numa_nodes=(1,)) for i in range(4)},
    }
    async with running_daemon(daemon_settings(kubelet_dir), [StaticScanner({SERIAL: tree})]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        got = await session.preferred(sorted(tree), 3, must_include=["b2"])
        assert got[0] == "b2" and len(got) == 3 and all(i.startswith("b") for i in got)
        # More than available: best effort, no error.
        assert len(await session.preferred(["a0", "a1"], 5)) == 2


class HookedScanner(StaticScanner):
    """Implements every hook, recording calls."""

    def __init__(self) -> None:
        super().__init__({SERIAL: devices(4)})
        self.prestarted: list[list[str]] = []

    def allocate(
        self, resource: str, requests: Sequence[Sequence[str]], devices: Mapping[str, DeviceInfo]
    ) -> Sequence[ContainerAllocation] | None:
        if requests[0] == ["dev3"]:
            return None  # defer to the default answer
        return [ContainerAllocation(env={"CUSTOM": ",".join(ids)}) for ids in requests]

    async def post_allocate(
        self,
        resource: str,
        requests: Sequence[Sequence[str]],
        answers: Sequence[ContainerAllocation],
    ) -> Sequence[ContainerAllocation]:
        return [
            ContainerAllocation(
                env={**a.env, "POST": "1"}, nodes=a.nodes, cdi_devices=("example.com/serial=x",)
            )
            for a in answers
        ]

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        devices: Mapping[str, DeviceInfo],
    ) -> Sequence[str]:
        return ["not-offered", *sorted(available, reverse=True)]

    async def pre_start_container(self, resource: str, device_ids: Sequence[str]) -> None:
        if "dev0" in device_ids:
            raise AllocationError("invalid", "dev0 failed its reset")
        self.prestarted.append(list(device_ids))


async def test_hooks_replace_and_adjust_the_defaults(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = HookedScanner()
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        assert session.options.pre_start_required
        (custom,) = await session.allocate(["dev0", "dev1"])
        assert dict(custom.env) == {"CUSTOM": "dev0,dev1", "POST": "1"}
        assert custom.cdi_devices == ("example.com/serial=x",)
        (default,) = await session.allocate(["dev3"])
        assert dict(default.env) == {"SERIAL": "3", "POST": "1"}
        assert [n.host_path for n in default.nodes] == ["/dev/ttyX3"]
        # The hook's pick is kept within what was offered, must-include first.
        assert await session.preferred(["dev0", "dev1", "dev2"], 2, must_include=["dev0"]) == [
            "dev0",
            "dev2",
        ]
        await session.pre_start(["dev1"])
        assert scanner.prestarted == [["dev1"]]
        with pytest.raises(SimulatorRpcError, match="dev0 failed its reset"):
            await session.pre_start(["dev0"])
        with pytest.raises(SimulatorRpcError) as unknown:
            await session.pre_start(["ghost"])
        assert unknown.value.code == "NOT_FOUND"


async def test_twenty_kubelet_restarts_in_a_row(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2), "example.com/other": devices(1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        await kubelet.wait_for_plugin(SERIAL)
        for _ in range(20):
            await kubelet.restart()
            for resource in (SERIAL, "example.com/other"):
                session = await kubelet.wait_for_plugin(resource)
                listed = await session.wait_for_update()
                assert listed  # a fresh full list after every restart
        assert (kubelet_dir / "kubelet_internal_checkpoint").exists()
    accepted = [r for r in kubelet.registrations if r.accepted and r.resource == SERIAL]
    assert [r.generation for r in accepted] == list(range(21))


async def test_kubelet_missing_at_start_is_waited_for(kubelet_dir: Path) -> None:
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        await asyncio.sleep(0.2)
        server = daemon.servers.servers.get(SERIAL)
        assert server is not None and not server.registered.is_set()
        async with KubeletSimulator(kubelet_dir) as kubelet:
            session = await kubelet.wait_for_plugin(SERIAL)
            assert set(await session.wait_for_update()) == {"dev0"}


async def test_kubelet_dir_missing_at_start_is_waited_for(short_dir: Path) -> None:
    kubelet_dir = short_dir / "later"
    scanner = StaticScanner({SERIAL: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            await asyncio.sleep(1.5)  # several back-off and poll periods
            # Logged once at warning, not per retry (retries go to debug).
            events = [entry["event"] for entry in logs if entry["log_level"] != "debug"]
            assert events.count("kubelet.dir.missing") == 1
            assert "server.listen.failed" not in events
            async with KubeletSimulator(kubelet_dir) as kubelet:
                session = await kubelet.wait_for_plugin(SERIAL, timeout=10)
                assert set(await session.wait_for_update()) == {"dev0"}


async def test_a_vanished_resource_sends_an_empty_list_then_its_socket_goes(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(2), "example.com/stays": devices(1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        socket = kubelet_dir / "devplug-example.com_serial.sock"
        assert socket.exists()
        scanner.set({"example.com/stays": devices(1)})
        await daemon.rescan()
        # The empty list was sent before the stream ended (this raises if the stream ended
        # without it); the simulator may still be reading it when rescan() returns.
        assert await session.wait_for_update(lambda listed: listed == {}) == {}
        await asyncio.wait_for(session.stream_ended.wait(), 5)
        assert not socket.exists()
        assert (kubelet_dir / "devplug-example.com_stays.sock").exists()
        with pytest.raises(SimulatorRpcError) as gone:
            await session.allocate(["dev0"])
        assert gone.value.code == "UNAVAILABLE"
        # It comes back when its devices do.
        scanner.set({SERIAL: devices(1), "example.com/stays": devices(1)})
        await daemon.rescan()
        back = await kubelet.wait_for_plugin(SERIAL, replacing=session)
        assert set(await back.wait_for_update()) == {"dev0"}


async def test_stale_socket_is_replaced_but_a_live_one_is_not_stolen(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    socket_path = kubelet_dir / "devplug-example.com_serial.sock"
    # A leftover file from a killed daemon: nobody listens on it.
    import socket as sockets

    stale = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    stale.bind(str(socket_path))
    stale.close()
    scanner = StaticScanner({SERIAL: devices(1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        assert set(await session.wait_for_update()) == {"dev0"}
        # A second daemon on the same dir must not take over the live socket.
        second = StaticScanner({SERIAL: devices(5)})
        async with in_process_daemon(daemon_settings(kubelet_dir), [second]) as other:
            await asyncio.sleep(0.3)
            assert not other.servers.servers[SERIAL].registered.is_set()
            (answer,) = await session.allocate(["dev0"])
            assert [n.host_path for n in answer.nodes] == ["/dev/ttyX0"]
        assert socket_path.exists()


async def test_shutdown_removes_own_sockets_only(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    scanner = StaticScanner({SERIAL: devices(1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


async def test_a_recreated_kubelet_socket_alone_triggers_re_registration(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """A kubelet that comes back without deleting plugin sockets: only kubelet.sock changes
    (often with the same inode number), and the plugin must still register again, on a fresh
    listener (so no stream of the previous registration outlives it)."""
    scanner = StaticScanner({SERIAL: devices(1)})
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        own_socket = kubelet_dir / "devplug-example.com_serial.sock"
        identities = {SocketIdentity.of(own_socket)}
        for _ in range(3):
            await kubelet.stop()
            await kubelet.start()
            session = await kubelet.wait_for_plugin(SERIAL, replacing=session)
            assert set(await session.wait_for_update()) == {"dev0"}
            identities.add(SocketIdentity.of(own_socket))
        assert len(identities) == 4  # a new listener for every registration


async def test_a_foreign_socket_or_file_at_our_path_is_never_deleted(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """grpc deletes a unix socket path on bind and on stop; devplug must not let it hit a path
    another process owns, neither while trying to listen nor when shutting down."""
    path = kubelet_dir / "devplug-example.com_serial.sock"
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    foreign = await asyncio.start_unix_server(on_connect, path=str(path))
    other = kubelet_dir / "devplug-example.com_other.sock"
    other.write_text("not a socket")
    scanner = StaticScanner({SERIAL: devices(1), "example.com/other": devices(1)})
    try:
        with structlog.testing.capture_logs() as logs:
            async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
                await asyncio.sleep(1.0)  # several listen attempts with back-off
        failures = [
            e for e in logs if e["event"] == "server.listen.failed" and e["log_level"] == "error"
        ]
        assert {e["resource"] for e in failures} == {SERIAL, "example.com/other"}
        assert len(failures) == 2  # each problem logged once at error level, retries at debug
        assert other.read_text() == "not a socket"
        _, writer = await asyncio.open_unix_connection(str(path))  # still the foreign server
        writer.close()
        await writer.wait_closed()
        assert accepted
        assert not [p for p in kubelet_dir.iterdir() if p.name.startswith(".devplug-tmp-")]
    finally:
        foreign.close()
        await foreign.wait_closed()


async def test_cancel_arriving_with_a_dir_change_still_stops_the_server(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """asyncio.wait_for on Python 3.11 can swallow a cancel that lands together with the
    event it waits for; the server must stop anyway (else retire and SIGTERM hang)."""
    watcher = KubeletDirWatcher(kubelet_dir)
    watching = asyncio.create_task(watcher.run())
    server = ResourceServer(
        SERIAL, devices(1), None, kubelet_dir=kubelet_dir, watcher=watcher, timing=FAST_TIMING
    )
    task = asyncio.create_task(server.run())
    try:
        await asyncio.wait_for(server.registered.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0.05)  # the server is parked in its wait again
        watcher.changes.set(watcher.changes.value + 1)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert task in done
    finally:
        watching.cancel()
        await asyncio.wait({watching})
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


class SlowScanner:
    """Reads devices one by one, slowly: a stand-in for a scan of a very large host."""

    name = "slow"

    def __init__(self) -> None:
        self.seen = 0
        self.calls = 0

    def scan(self, source: UdevSource) -> DeviceTree:
        self.calls += 1
        builder = DeviceTreeBuilder()
        for device in source.devices("tty"):
            if self.calls > 1:
                time.sleep(0.2)
            self.seen += 1
            builder.add(SERIAL, device.sys_name, DeviceInfo())
        return builder.build()


async def test_stop_during_a_long_scan_does_not_wait_for_the_whole_scan(
    host: UmockdevHost, kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    for index in range(20):
        add_usb_serial(host, index=index)
    scanner = SlowScanner()
    async with running_daemon(daemon_settings(kubelet_dir), [scanner]) as daemon:
        await kubelet.wait_for_plugin(SERIAL)
        daemon.request_scan()  # the scan loop starts a ~4 s scan (SIGHUP does the same)
        await asyncio.sleep(0.5)
        assert 20 < scanner.seen < 40
    # running_daemon has stopped the daemon; the scan thread gives up at its next device.
    seen = scanner.seen
    await asyncio.sleep(0.5)
    assert scanner.seen <= seen + 1  # at most the device in hand when the stop came
    assert scanner.seen < 40  # the second scan did not run to its end


def broken_preferences(answer: object) -> PreferringScanner:
    """A hook that answers ``answer``, or raises it if it is an exception."""

    def pick(*_: object) -> object:
        if isinstance(answer, Exception):
            raise answer
        return answer

    return PreferringScanner({SERIAL: devices(3)}, pick)


@pytest.mark.parametrize("answer", [None, 42, "dev0", RuntimeError("hook bug"), ["dev1"]])
async def test_a_broken_or_short_preferred_hook_falls_back_to_the_default(
    kubelet: KubeletSimulator, kubelet_dir: Path, answer: object
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [broken_preferences(answer)]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        got = await session.preferred(["dev0", "dev1", "dev2"], 2, must_include=["dev2"])
        assert got[0] == "dev2" and len(got) == 2 and set(got) <= {"dev0", "dev1", "dev2"}
        if answer == ["dev1"]:
            assert got == ["dev2", "dev1"]  # the hook's pick kept, then topped up


SLOW_BACKSTOP = replace(FAST_TIMING, stat_backstop_s=120.0)


async def test_restarts_are_noticed_through_the_dir_watch_not_the_backstop(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """With the stat backstop two minutes away, only the inotify watch can wake the server."""
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner], timing=SLOW_BACKSTOP):
        await kubelet.wait_for_plugin(SERIAL)
        for _ in range(3):
            await kubelet.restart()
            session = await kubelet.wait_for_plugin(SERIAL, timeout=10)
            assert set(await session.wait_for_update()) == {"dev0"}


async def test_a_chmod_or_chown_of_the_sockets_is_no_kubelet_restart(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    """A hardening job that resets modes or owners changes the sockets' ctime, not what they
    are: no re-registration, no restarted listener (the stat backstop runs every 0.5 s)."""
    scanner = StaticScanner({SERIAL: devices(1)})
    with structlog.testing.capture_logs() as logs:
        async with running_daemon(daemon_settings(kubelet_dir), [scanner]):
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update()
            own_socket = kubelet_dir / "devplug-example.com_serial.sock"
            for path in (kubelet_dir / "kubelet.sock", own_socket):
                os.chmod(path, 0o600)
                os.chown(path, os.getuid(), os.getgid())
            await asyncio.sleep(1.2)  # over two backstop periods
    assert [r.accepted for r in kubelet.registrations if r.resource == SERIAL] == [True]
    assert "kubelet.restart.detected" not in [e["event"] for e in logs]


async def test_the_kubelet_dir_removed_and_recreated(kubelet_dir: Path) -> None:
    scanner = StaticScanner({SERIAL: devices(1)})
    async with in_process_daemon(daemon_settings(kubelet_dir), [scanner], timing=SLOW_BACKSTOP):
        async with KubeletSimulator(kubelet_dir) as kubelet:
            await kubelet.wait_for_plugin(SERIAL)
        shutil.rmtree(kubelet_dir)
        await asyncio.sleep(0.3)
        async with KubeletSimulator(kubelet_dir) as kubelet:
            session = await kubelet.wait_for_plugin(SERIAL, timeout=10)
            assert set(await session.wait_for_update()) == {"dev0"}


class FaultyAllocator(StaticScanner):
    def __init__(self) -> None:
        super().__init__({SERIAL: devices(2)})

    def allocate(
        self, resource: str, requests: Sequence[Sequence[str]], devices: Mapping[str, DeviceInfo]
    ) -> Sequence[ContainerAllocation] | None:
        if "dev1" in requests[0]:
            raise RuntimeError("bug in a hook")
        return [ContainerAllocation()]  # one answer, however many containers asked


async def test_a_failing_allocate_hook_is_internal_and_the_server_keeps_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path
) -> None:
    async with running_daemon(daemon_settings(kubelet_dir), [FaultyAllocator()]):
        session = await kubelet.wait_for_plugin(SERIAL)
        await session.wait_for_update()
        with pytest.raises(SimulatorRpcError) as crashed:
            await session.allocate(["dev1"])
        assert crashed.value.code == "INTERNAL" and SERIAL in crashed.value.details
        with pytest.raises(SimulatorRpcError) as short:  # wrong number of answers from the hook
            await session.allocate(["dev0"], ["dev0"])
        assert short.value.code == "INTERNAL"
        assert await session.allocate(["dev0"]) == [ContainerAllocation()]


async def test_each_allocate_is_logged_once_its_answer_is_read_in_order_and_none_lost_at_stop(
    kubelet: KubeletSimulator, kubelet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delay no test outlives: a line can only come with the next answer or at stop.
    monkeypatch.setattr(answer_log, "DELAY_S", 3600.0)

    def written() -> list[object]:
        return [e["devices"] for e in logs if e["event"] == "allocate.complete"]

    with structlog.testing.capture_logs() as logs:
        async with running_daemon(
            daemon_settings(kubelet_dir), [StaticScanner({SERIAL: devices(2)})]
        ):
            session = await kubelet.wait_for_plugin(SERIAL)
            await session.wait_for_update()
            await session.allocate(["dev0"])
            await asyncio.sleep(0.05)  # many loop turns: a line written at once would be here
            assert written() == []
            await session.allocate(["dev1"], ["dev0"])
            await asyncio.sleep(0.05)
            assert written() == [[["dev0"]]]  # with the next answer; that one's line waits
            with pytest.raises(SimulatorRpcError):
                await session.allocate(["nope"])  # a refusal writes the waiting line first
            assert written() == [[["dev0"]], [["dev1"], ["dev0"]]]
            await session.allocate(["dev1"])
    assert written() == [[["dev0"]], [["dev1"], ["dev0"]], [["dev1"]]]  # the last one at stop
    lines = [e for e in logs if e["event"] == "allocate.complete"]
    assert {(e["resource"], e["log_level"]) for e in lines} == {(SERIAL, "info")}
    events = [e["event"] for e in logs if e["event"].startswith(("allocate.", "server.stopped"))]
    assert events == [
        "allocate.complete",
        "allocate.complete",
        "allocate.refused",
        "allocate.complete",
        "server.stopped",
    ]
