"""The daemon's control channel: its socket is the daemon's user's alone, claimed without
taking anyone's, made again when it goes; no client (garbage, a huge line, a slow sender, one
that never sends) keeps a command out or stalls the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from devplug._kits.values import LatestValue
from devplug.model import DeviceInfo, DeviceNode
from devplug.ops.control import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    ChannelError,
    ControlChannel,
    ask,
    control_name,
    socket_path,
)
from devplug.testing import KubeletSimulator, daemon_settings, eventually
from devplug.testing.harness import DaemonStarter, StaticScanner

SERIAL = "example.com/serial"


class Recorder:
    """A handler that answers every request with what it was asked."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.hold = False

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.hold:
            await self.release.wait()
        self.requests.append(request)
        return {"ok": True, "echo": request}


@contextlib.asynccontextmanager
async def channel(path: Path, handler: Recorder, **options: Any) -> AsyncIterator[ControlChannel]:
    """The channel's run() task, until the block ends."""
    made = ControlChannel(path, handler, **options)
    task = asyncio.create_task(made.run())
    try:
        await eventually(made.intact, 10)
        yield made
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def exchange(path: Path, data: bytes) -> bytes:
    """Send raw ``data``; what comes back before the daemon closes."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def test_the_socket_and_its_dir_are_the_daemons_users_alone(kubelet_dir: Path) -> None:
    path = socket_path(kubelet_dir, "devplug")
    path.parent.mkdir(mode=0o755)  # made by someone with a wider umask
    os.chmod(path.parent, 0o755)
    async with channel(path, Recorder()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert [p.name for p in path.parent.iterdir()] == ["devplug.sock"]  # no temp names
    assert not path.parent.exists()  # the socket removed on close (it was ours), then its dir

    kept = path.parent / "devplug.cordons.json"
    async with channel(path, Recorder()):
        kept.write_text("{}")
    assert [p.name for p in path.parent.iterdir()] == [kept.name]  # a dir in use stays


def test_a_program_name_becomes_a_plain_file_name() -> None:
    assert control_name("misc-plugin") == "misc-plugin"
    assert control_name("../My Plugin/x") == "_My_Plugin_x"
    assert control_name("...") == "devplug"
    assert len(control_name("p" * 100)) == 64


async def test_garbage_and_an_overlong_line_are_refused_and_never_handled(
    kubelet_dir: Path,
) -> None:
    path = socket_path(kubelet_dir, "devplug")
    handler = Recorder()
    async with channel(path, handler):
        assert b'"the request is not JSON' in await exchange(path, b"GET / HTTP/1.1\r\n\r\n")
        assert b'"the request is not a JSON object"' in await exchange(path, b"[1, 2]\n")
        huge = b"{" + b" " * (4 * MAX_REQUEST_BYTES) + b"}\n"
        answer = await exchange(path, huge)
        assert f"one line of at most {MAX_REQUEST_BYTES} bytes".encode() in answer
        assert await exchange(path, b'{"op": "li') == b""  # closed before its end
        assert handler.requests == []
        # And the next one is answered.
        assert (await ask(path, {"op": "list"}, 10))["echo"] == {"op": "list"}


async def test_a_request_nested_too_deeply_is_answered_and_logged_at_a_bounded_rate(
    kubelet_dir: Path,
) -> None:
    """Past the JSON parser's nesting (Python's recursion limit), a line is refused like any
    other that is no JSON object, not dropped with its connection; a client sending it in a
    loop gets one log line in full and the rest counted."""
    path = socket_path(kubelet_dir, "devplug")
    handler = Recorder()
    deep = b"[" * 3000 + b"\n"
    assert len(deep) < MAX_REQUEST_BYTES  # refused for its depth, not its length
    with capture_logs() as logs:
        async with channel(path, handler):
            for _ in range(10):
                answer = await exchange(path, deep)
                assert answer == b'{"ok":false,"error":"the request is nested too deeply"}\n'
            assert handler.requests == []
            assert (await ask(path, {"op": "list"}, 10))["echo"] == {"op": "list"}
    said = [
        (e["log_level"], e["reason"], e.get("repeated"))
        for e in logs
        if e["event"] == "control.request.refused"
    ]
    # The first in full; the nine after it on one line, written at the latest when it closes.
    reason = "the request is nested too deeply"
    assert said == [("warning", reason, None), ("warning", reason, 9)]


async def test_a_client_that_sends_nothing_is_closed_after_the_request_timeout(
    kubelet_dir: Path,
) -> None:
    path = socket_path(kubelet_dir, "devplug")
    async with channel(path, Recorder(), request_timeout_s=0.2):
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b'{"op"')  # a start, then nothing
        async with asyncio.timeout(10):  # bounded: the channel's own 0.2 s ends it
            assert await reader.read() == b""
        writer.close()


async def test_slow_senders_are_evicted_so_a_command_gets_through(kubelet_dir: Path) -> None:
    path = socket_path(kubelet_dir, "devplug")
    # No request timeout to help: only eviction makes room.
    async with channel(path, Recorder(), request_timeout_s=3600) as made:
        slow = []
        for _ in range(3 * MAX_CONNECTIONS):
            _, writer = await asyncio.open_unix_connection(path)
            writer.write(b"{")  # begun, never finished
            slow.append(writer)
        try:
            answer = await ask(path, {"op": "list"}, 10)
            assert answer["ok"] is True
            assert made.connections.evicted == 2 * MAX_CONNECTIONS + 1
        finally:
            for writer in slow:
                writer.close()


async def test_at_the_cap_a_begun_request_gives_way_before_a_silent_connection(
    kubelet_dir: Path,
) -> None:
    """A connection that has sent nothing yet may be a command whose request is on its way; one
    that has sent part of a request and stopped is the slow one, even if it is younger."""
    path = socket_path(kubelet_dir, "devplug")
    async with channel(path, Recorder(), request_timeout_s=3600, max_connections=2) as made:
        silent_reader, silent = await asyncio.open_unix_connection(path)
        await eventually(lambda: made.connections.active == 1, 10, what="the silent one served")
        begun_reader, begun = await asyncio.open_unix_connection(path)
        begun.write(b'{"op": ')
        await eventually(lambda: made.connections.begun == 1, 10, what="the partial request")
        try:
            assert (await ask(path, {"op": "list"}, 10))["ok"] is True
            assert made.connections.evicted == 1
            async with asyncio.timeout(10):
                assert await begun_reader.read() == b""  # the begun one was closed
                silent.write(b'{"op": "late"}\n')  # the silent one is still served
                assert b'"echo":{"op":"late"}' in await silent_reader.read()
        finally:
            silent.close()
            begun.close()


async def test_the_cap_is_logged_once_per_episode(kubelet_dir: Path) -> None:
    """A client keeping the channel at its cap must not write a line per connection: one
    warning while the cap holds, ``below_cap`` when every connection has ended, and a warning
    again at the next episode."""
    path = socket_path(kubelet_dir, "devplug")
    async with channel(path, Recorder(), request_timeout_s=3600, max_connections=1) as made:
        for episode in range(2):
            with capture_logs() as logs:
                held = []
                for count in range(4):  # each one after the first takes the slot of the last
                    _, writer = await asyncio.open_unix_connection(path)
                    writer.write(b"{")
                    held.append(writer)
                    evicted = 3 * episode + count
                    await eventually(
                        lambda evicted=evicted: (  # type: ignore[misc]
                            made.connections.active == 1 and made.connections.evicted == evicted
                        ),
                        10,
                        what=f"{count} evicted",
                    )
                for writer in held:
                    writer.close()
                await eventually(lambda: made.connections.active == 0, 10, what="all ended")
            assert made.connections.evicted == 3 * (episode + 1)
            said = [(e["event"], e["log_level"]) for e in logs if e["log_level"] != "debug"]
            assert said == [
                ("control.connections.capped", "warning"),
                ("control.connections.below_cap", "info"),
            ], f"episode {episode}"


async def test_a_request_is_carried_out_even_if_its_client_goes(kubelet_dir: Path) -> None:
    path = socket_path(kubelet_dir, "devplug")
    handler = Recorder()
    handler.hold = True
    async with channel(path, handler):
        with pytest.raises(ChannelError, match="no answer within"):
            await ask(path, {"op": "cordon"}, 0.1)  # the command gives up (Ctrl-C, say)
        handler.release.set()
        await eventually(lambda: handler.requests, 10)
    assert handler.requests == [{"op": "cordon"}]


async def test_a_stale_socket_is_taken_over_and_a_live_one_left_alone(kubelet_dir: Path) -> None:
    path = socket_path(kubelet_dir, "devplug")
    path.parent.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a killed daemon's: nobody listens
    stale.close()
    async with channel(path, Recorder()) as first:
        assert (await ask(path, {"op": "list"}, 10))["ok"] is True
        second = ControlChannel(path, Recorder(), backstop_s=3600)
        with capture_logs() as logs:
            task = asyncio.create_task(second.run())
            await eventually(lambda: any(e["event"] == "control.unavailable" for e in logs), 10)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        (refused,) = [e for e in logs if e["event"] == "control.unavailable"]
        assert "another process is serving on" in refused["reason"]
        assert "a second daemon of the same name" in refused["reason"]
        assert refused["log_level"] == "error"
        assert first.intact()  # the second daemon took nothing, removed nothing
        assert (await ask(path, {"op": "list"}, 10))["ok"] is True


async def test_a_removed_dir_and_socket_are_made_again(kubelet_dir: Path) -> None:
    path = socket_path(kubelet_dir, "devplug")
    changes = LatestValue(0)  # the kubelet dir watch's counter
    async with channel(path, Recorder(), changes=changes, backstop_s=3600) as made:
        path.unlink()
        path.parent.rmdir()
        changes.set(changes.value + 1)
        await eventually(made.intact, 10)
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert (await ask(path, {"op": "list"}, 10))["ok"] is True


async def test_slow_clients_do_not_stall_the_daemon(
    kubelet: KubeletSimulator, kubelet_dir: Path, start_daemon: DaemonStarter
) -> None:
    """Against the real daemon: while a crowd of connections trickles and another sends
    nothing, a hotplug change still reaches the kubelet, and a cordon still takes effect."""
    device = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
    scanner = StaticScanner({SERIAL: {"s0": device}})
    daemon = await start_daemon(daemon_settings(kubelet_dir), [scanner])
    session = await kubelet.wait_for_plugin(SERIAL)
    await session.wait_for_update()
    path = socket_path(kubelet_dir, "devplug")
    crowd = []
    try:
        for _ in range(2 * MAX_CONNECTIONS):
            _, writer = await asyncio.open_unix_connection(path)
            writer.write(b'{"op": ')
            crowd.append(writer)
        scanner.set({SERIAL: {"s0": device, "s1": device}})
        await daemon.rescan()
        await session.wait_for_update(lambda listed: set(listed) == {"s0", "s1"})
        request = {"op": "cordon", "resource": SERIAL, "id": "s1", "reason": "crowded"}
        assert (await ask(path, request, 10))["changed"] is True
        await session.wait_for_update(
            lambda listed: "s1" in listed and listed["s1"].health == "Unhealthy"
        )
    finally:
        for writer in crowd:
            writer.close()
