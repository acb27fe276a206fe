"""A plugin author's own entry point, built on ``devplug.serve``, run as a real process.

The child process runs a small script that imports only devplug's public names (plus a
StaticScanner from devplug.testing as its scanner, and structlog to log from its loader); the
kubelet simulator in this process sees it register, list, reload on SIGHUP and stop on SIGTERM
or SIGQUIT. The script can hold its loader on a line of stdin (``hold: first`` or ``hold:
reload``), which puts a signal at a known point of the start-up or of the shutdown.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from devplug.testing import KubeletSimulator

RESOURCE = "example.com/dummy"
SCRIPT = """
import json
import sys
from pathlib import Path

import structlog

from devplug import ConfigError, DeviceInfo, DeviceNode, load_settings, serve
from devplug.testing.harness import StaticScanner

CONFIG = Path(sys.argv[1])
CALLS = []


def say(event, **fields):
    # The loader runs in a worker thread: once serve() has configured structlog, through it,
    # whose lines share one lock (print() here could land between the text of one of its lines
    # and that line's newline); before that, only this thread writes.
    if structlog.is_configured():
        structlog.get_logger("test").info(event, **fields)
    else:
        print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)


class Scanner(StaticScanner):
    def stop(self, resource):
        say("test.resource.stopped", resource=resource)


def load():
    CALLS.append(1)
    settings = load_settings(CONFIG)
    section = settings.scanners.get("dummy") or {}
    count = section.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise ConfigError("scanners.dummy.count", f"must be a positive integer, got {count!r}")
    if section.get("hold") == ("first" if len(CALLS) == 1 else "reload"):
        say("test.load.held", call=len(CALLS))
        sys.stdin.readline()
    info = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
    devices = {f"dev{i}": info for i in range(count)}
    return settings, [Scanner({"example.com/dummy": devices})]


sys.exit(serve(load, program="dummy-plugin"))
"""


def write_config(directory: Path, kubelet_dir: Path, count: object, hold: str = "none") -> Path:
    config = directory / "config.yaml"
    config.write_text(
        f"kubelet_dir: {kubelet_dir}\n"
        "log_format: json\n"
        f"cdi: {{dir: {directory / 'cdi'}}}\n"
        f"scanners:\n  dummy:\n    count: {count}\n    hold: {hold}\n"
    )
    return config


async def start(directory: Path, config: Path) -> asyncio.subprocess.Process:
    script = directory / "dummy_plugin.py"
    script.write_text(SCRIPT)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(config),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")},
    )


async def test_a_bad_config_exits_2_naming_the_field_and_serves_nothing(
    kubelet_dir: Path, short_dir: Path
) -> None:
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 0))
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert stdout == b""
    assert stderr.decode().strip() == (
        "dummy-plugin: configuration error: scanners.dummy.count: must be a positive integer, got 0"
    )
    assert not (short_dir / "cdi").exists()
    assert sorted(p.name for p in kubelet_dir.iterdir()) == []


async def read_until(
    process: asyncio.subprocess.Process, event: str, seen: list[dict[str, object]]
) -> dict[str, object]:
    """Read the JSON log lines on stderr into ``seen`` until one is ``event``; return it."""
    assert process.stderr is not None
    async with asyncio.timeout(60):
        while line := await process.stderr.readline():
            seen.append(json.loads(line))
            if seen[-1]["event"] == event:
                return seen[-1]
    raise AssertionError(f"the process ended before logging {event}: {seen}")


async def test_the_entry_point_serves_reloads_on_sighup_and_stops_on_sigterm(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    config = write_config(short_dir, kubelet_dir, 2)
    process = await start(short_dir, config)
    events: list[dict[str, object]] = []
    try:
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=60)
        assert set(await session.wait_for_update()) == {"dev0", "dev1"}
        (answer,) = await session.allocate(["dev1"])
        assert [node.host_path for node in answer.nodes] == ["/dev/null"]

        write_config(short_dir, kubelet_dir, 3)
        process.send_signal(signal.SIGHUP)
        await read_until(process, "config.reloaded", events)
        await session.wait_for_update(lambda listed: set(listed) == {"dev0", "dev1", "dev2"})

        write_config(short_dir, kubelet_dir, "many")  # refused: the running config stays
        process.send_signal(signal.SIGHUP)
        refused = await read_until(process, "config.reload.refused", events)
        assert refused["field"] == "scanners.dummy.count"
        assert "got 'many'" in str(refused["reason"])
        assert set(session.latest) == {"dev0", "dev1", "dev2"}

        process.send_signal(signal.SIGTERM)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode()
    assert stdout == b""
    names = [e["event"] for e in events] + [
        json.loads(line)["event"] for line in stderr.decode().splitlines()
    ]
    for expected in ("daemon.started", "kubelet.register.complete", "daemon.stopped"):
        assert expected in names
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


async def test_a_loader_that_raises_something_else_exits_1_with_its_traceback(
    kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    # A string where the loader expects a mapping: its .get() raises AttributeError.
    config.write_text(f"kubelet_dir: {kubelet_dir}\nscanners:\n  dummy: text\n")
    process = await start(short_dir, config)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 1
    text = stderr.decode()
    assert text.startswith("dummy-plugin: cannot start: loading the configuration failed\n")
    assert "Traceback" in text and "AttributeError" in text


async def finish(process: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    try:
        return await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def events_of(seen: list[dict[str, object]], stderr: bytes) -> list[str]:
    return [str(e["event"]) for e in seen] + [
        json.loads(line)["event"] for line in stderr.decode().splitlines()
    ]


async def test_sigquit_stops_like_sigterm(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """KubeVirt's device plugin manager stops on SIGQUIT too: an orderly stop, exit 0."""
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 1))
    seen: list[dict[str, object]] = []
    try:
        await kubelet.wait_for_plugin(RESOURCE, timeout=60)
        await read_until(process, "daemon.ready", seen)
        process.send_signal(signal.SIGQUIT)
    finally:
        stdout, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()
    assert stdout == b""
    names = events_of(seen, stderr)
    # The scanner's stop hook ran, after the stop began and before the daemon was done.
    assert names.index("daemon.stopping") < names.index("test.resource.stopped")
    assert names.index("test.resource.stopped") < names.index("daemon.stopped")
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


async def test_a_sighup_while_the_config_loads_does_not_kill_and_is_applied(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """The first moments of the process (loading the config, importing gRPC) are when a
    SIGHUP's default action would kill it; it is a reload request once the daemon runs."""
    config = write_config(short_dir, kubelet_dir, 2, hold="first")
    process = await start(short_dir, config)
    assert process.stdin is not None
    seen: list[dict[str, object]] = []
    try:
        await read_until(process, "test.load.held", seen)
        write_config(short_dir, kubelet_dir, 3)  # changed after the loader read it
        process.send_signal(signal.SIGHUP)
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=60)
        await session.wait_for_update(lambda listed: set(listed) == {"dev0", "dev1", "dev2"})
        process.send_signal(signal.SIGTERM)
    finally:
        _, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()
    assert "config.reloaded" in events_of(seen, stderr)


async def test_a_sigterm_while_the_config_loads_exits_0_without_serving(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 1, hold="first"))
    assert process.stdin is not None
    seen: list[dict[str, object]] = []
    try:
        await read_until(process, "test.load.held", seen)
        process.send_signal(signal.SIGTERM)
        process.stdin.write(b"go\n")
        await process.stdin.drain()
    finally:
        _, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()
    assert "daemon.started" not in events_of(seen, stderr)
    assert kubelet.registrations == []
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


async def test_a_second_sigterm_during_shutdown_still_exits_0(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """After the daemon stopped, asyncio still waits for worker threads (here a reload's
    loader, held on stdin): a second SIGTERM then must not kill the process."""
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 1, hold="reload"))
    assert process.stdin is not None
    seen: list[dict[str, object]] = []
    try:
        # Its log first: a process that ended shows why (a wait for the plugin would not).
        await read_until(process, "daemon.ready", seen)
        await kubelet.wait_for_plugin(RESOURCE, timeout=60)
        process.send_signal(signal.SIGHUP)
        await read_until(process, "test.load.held", seen)
        process.send_signal(signal.SIGTERM)
        await read_until(process, "daemon.stopped", seen)
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGQUIT)
        process.stdin.write(b"go\n")
        await process.stdin.drain()
    finally:
        _, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()


def test_importing_devplug_stays_light() -> None:
    """Scanners and their tests import devplug: neither gRPC nor pydantic comes with it, and
    the entry point's names load on first use."""
    code = (
        "import sys, devplug\n"
        "print(sorted(m for m in ('grpc', 'pydantic', 'yaml') if m in sys.modules))\n"
        "from devplug import Settings, load_settings, serve\n"
        "print(serve.__module__, Settings.__module__, load_settings.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.splitlines() == ["[]", "devplug.cli devplug.config devplug.config"]


def test_the_signal_guard_comes_before_anything_slow() -> None:
    """An entry point can guard the signals before pydantic, structlog or gRPC load (until
    then a SIGHUP kills the process); serve() does it first thing."""
    code = (
        "import signal, sys\n"
        "from devplug.plugin import guard_signals\n"
        "slow = sorted(m for m in ('grpc', 'pydantic', 'structlog', 'yaml') if m in sys.modules)\n"
        "guard = guard_signals()\n"
        "print(slow, signal.getsignal(signal.SIGHUP) == guard._handle)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.splitlines() == ["[] True"]
