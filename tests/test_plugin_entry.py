"""A plugin author's own entry point, built on ``devplug.serve``, run as a real process.

The child process runs a small script that imports only devplug's public names (plus a
StaticScanner from devplug.testing as its scanner, and structlog to log from its factory); the
kubelet simulator in this process sees it register, list, reload on SIGHUP and stop on SIGTERM
or SIGQUIT. The script's factory can hold on a line of stdin while it builds the scanner
(``hold: first`` or ``hold: reload``), which puts a signal at a known point of the start-up
or of the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devplug import __version__
from devplug.testing import KubeletSimulator, StaticScanner

RESOURCE = "example.com/dummy"
SCRIPT = """
import sys

import structlog

from devplug import ConfigError, DeviceInfo, DeviceNode, serve
from devplug.testing import StaticScanner

CALLS = []


def say(event, **fields):
    # Through structlog (configured before the factory runs): a reload builds the scanner in
    # a worker thread, and structlog's lines share one lock (print() here could land between
    # the text of one of its lines and that line's newline).
    structlog.get_logger("test").info(event, **fields)


class Scanner(StaticScanner):
    def stop(self, resource):
        say("test.resource.stopped", resource=resource)


def dummy(raw, field):
    CALLS.append(1)
    section = {} if raw is None else raw
    count = section.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"{field}.count", f"must be a positive integer, got {count!r}")
    if section.get("hold") == ("first" if len(CALLS) == 1 else "reload"):
        say("test.load.held", call=len(CALLS))
        sys.stdin.readline()
    if section.get("hold") == "swallow":  # a factory that catches everything, and holds on
        try:
            say("test.load.held", call=len(CALLS))
            sys.stdin.readline()
        except BaseException as exc:
            say("test.load.swallowed", what=type(exc).__name__)
        sys.stdin.readline()
    info = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
    return Scanner({"example.com/dummy": {f"dev{i}": info for i in range(count)}})


sys.exit(serve({"dummy": dummy}, program="dummy-plugin", version="1.0.0"))
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
        "run",
        "--config",
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


async def test_a_factory_that_raises_something_else_exits_1_with_its_traceback(
    kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    # A string where the factory expects a mapping: its .get() raises AttributeError.
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
        write_config(short_dir, kubelet_dir, 3)  # changed after the factory read it
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


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGTERM, 0), (signal.SIGQUIT, 0), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGQUIT", "SIGINT"],
)
async def test_a_stop_signal_while_the_config_loads_ends_the_process_without_serving(
    signum: int, status: int, kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """Nothing is served yet: the stop ends the load where it is (here a factory that would
    wait for stdin for good), as Ctrl-C ends any command."""
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 1, hold="first"))
    seen: list[dict[str, object]] = []
    try:
        await read_until(process, "test.load.held", seen)
        process.send_signal(signum)
    finally:
        _, stderr = await finish(process)
    assert process.returncode == status, stderr.decode()
    assert b"Traceback" not in stderr, stderr.decode()
    assert "daemon.started" not in events_of(seen, stderr)
    assert kubelet.registrations == []
    assert sorted(p.name for p in kubelet_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
    ]


async def test_a_second_sigterm_ends_a_load_that_swallowed_the_first(
    kubelet_dir: Path, short_dir: Path
) -> None:
    process = await start(short_dir, write_config(short_dir, kubelet_dir, 1, hold="swallow"))
    seen: list[dict[str, object]] = []
    try:
        await read_until(process, "test.load.held", seen)
        process.send_signal(signal.SIGTERM)
        swallowed = await read_until(process, "test.load.swallowed", seen)
        assert swallowed["what"] == "StopSignalled"
        process.send_signal(signal.SIGTERM)
    finally:
        _, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()
    assert "daemon.started" not in events_of(seen, stderr)


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
async def test_a_stop_signal_while_the_config_file_blocks_ends_the_process(
    signum: int, status: int, short_dir: Path
) -> None:
    """A config path that is a FIFO nobody writes (or a hung mount): the read never returns."""
    fifo = short_dir / "config.fifo"
    os.mkfifo(fifo)
    process = await start(short_dir, fifo)
    writer = None
    try:
        # A writer can open the FIFO once the process has it open for reading: it is in the
        # read, which waits for data this test never writes.
        async with asyncio.timeout(60):  # a bound on a hang, not a latency assertion
            while writer is None:
                try:
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # ENXIO: no reader yet
                    assert process.returncode is None
                    await asyncio.sleep(0.05)
        process.send_signal(signum)
    finally:
        stdout, stderr = await finish(process)
        if writer is not None:
            os.close(writer)
    assert process.returncode == status, stderr.decode()
    assert stdout == b"" and b"Traceback" not in stderr, stderr.decode()


async def test_a_second_sigterm_during_shutdown_still_exits_0(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """After the daemon stopped, asyncio still waits for worker threads (here a reload's
    factory, held on stdin): a second SIGTERM then must not kill the process."""
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


# ------------------------------------------------------------------------ serve(scanners)

# A plugin's own entry point in the form the guide shows: its name, version, description and
# scanners. A scanner's section can hold it on a line of stdin (``hold: build`` while the
# scanner is built, ``hold: scan`` while it scans), which puts a Ctrl-C at a known point.
PLUGIN = """
import sys

from pydantic import Field

from devplug import DeviceInfo, DeviceNode, SectionSettings, serve
from devplug.testing import StaticScanner


class DummySettings(SectionSettings):
    count: int = Field(default=1, ge=0)
    hold: str = "none"
    fail: str | None = None


def held():
    print("held", file=sys.stderr, flush=True)
    sys.stdin.readline()


class DummyScanner(StaticScanner):
    def __init__(self, name, resource, settings):
        info = DeviceInfo(nodes=(DeviceNode("/dev/null"),))
        super().__init__({resource: {f"dev{i}": info for i in range(settings.count)}})
        self.name = name
        self.settings = settings

    def scan(self, source):
        if self.settings.hold == "scan":
            held()
        if self.settings.fail:
            raise RuntimeError(self.settings.fail)
        return super().scan(source)


def factory(name, resource):
    def build(raw, field):
        settings = DummySettings.from_raw(raw, field)
        if settings.hold == "build":
            held()
        return DummyScanner(name, resource, settings)

    return build


sys.exit(
    serve(
        {
            "dummy": factory("dummy", "example.com/dummy"),
            "dummy_gpu": factory("dummy_gpu", "example.com/dummy-gpu"),
        },
        program="dummy-plugin",
        version="1.2.3",
        description="Serves dummy devices for devplug's tests.",
    )
)
"""
PLUGIN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")}


def plugin_script(directory: Path) -> Path:
    script = directory / "dummy_plugin_main.py"
    script.write_text(PLUGIN)
    return script


def plugin(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(plugin_script(directory)), *args],
        capture_output=True,
        text=True,
        env=PLUGIN_ENV,
        cwd=directory,
        timeout=60,
        check=False,
    )


def test_the_entry_point_reports_its_own_name_version_and_description(short_dir: Path) -> None:
    """Issue 25 item 1: not devplug's version and help text."""
    version = f"dummy-plugin 1.2.3 (devplug {__version__})\n"
    assert plugin(short_dir, "--version").stdout == version
    assert plugin(short_dir, "version").stdout == version
    shown = plugin(short_dir, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: dummy-plugin ")
    assert "Serves dummy devices for devplug's tests." in shown.stdout
    assert "Kubernetes device plugin daemon" not in shown.stdout


@pytest.mark.parametrize("command", ["run", "scan", "cdi generate"])
def test_the_entry_point_offers_only_its_own_scanners(command: str, short_dir: Path) -> None:
    """``--scanner`` lists the plugin's scanners, and devplug's built-in ones are unknown."""
    shown = plugin(short_dir, *command.split(), "--help")
    assert "comma-separated): dummy, dummy_gpu" in " ".join(shown.stdout.split())
    assert "intel" not in shown.stdout and "vfio" not in shown.stdout
    refused = plugin(short_dir, *command.split(), "--scanner", "intel_gpu")
    assert refused.returncode == 2
    assert refused.stderr == (
        "dummy-plugin: configuration error: --scanner: unknown scanner 'intel_gpu'; "
        "known scanners: dummy, dummy_gpu\n"
    )
    (short_dir / "generic.yaml").write_text("scanners:\n  generic: []\n")
    in_file = plugin(short_dir, *command.split(), "--config", "generic.yaml")
    assert in_file.returncode == 2
    assert in_file.stderr == (
        "dummy-plugin: configuration error: scanners.generic: unknown scanner; "
        "known scanners: dummy, dummy_gpu\n"
    )


def log_events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_a_scanner_name_in_the_other_spelling_is_accepted_with_one_hint(short_dir: Path) -> None:
    """One spelling per scanner name (``dummy_gpu``, as its config key); ``dummy-gpu`` on the
    command line or in the file works, and says how it is written."""
    flag = plugin(short_dir, "scan", "--scanner", "dummy-gpu", "-o", "json", "--log-format", "json")
    assert flag.returncode == 0, flag.stderr
    assert list(json.loads(flag.stdout)["resources"]) == ["example.com/dummy-gpu"]
    (hint,) = log_events(flag.stderr)
    assert hint["event"] == "config.scanner.spelling" and hint["level"] == "warning"
    assert (hint["source"], hint["given"], hint["name"]) == ("--scanner", "dummy-gpu", "dummy_gpu")

    (short_dir / "config.yaml").write_text("scanners:\n  dummy-gpu: {count: 2}\n")
    key = plugin(short_dir, "scan", "--config", "config.yaml", "-o", "json", "--log-format", "json")
    assert key.returncode == 0, key.stderr
    assert len(json.loads(key.stdout)["resources"]["example.com/dummy-gpu"]) == 2
    (hint,) = log_events(key.stderr)
    assert (hint["source"], hint["given"]) == ("scanners.dummy-gpu", "dummy-gpu")

    (short_dir / "both.yaml").write_text("scanners:\n  dummy_gpu: {}\n  dummy-gpu: {count: 2}\n")
    both = plugin(short_dir, "scan", "--config", "both.yaml")
    assert both.returncode == 2
    assert both.stderr == (
        "dummy-plugin: configuration error: scanners.dummy-gpu: names the same scanner as "
        "scanners.dummy_gpu; keep one section, scanners.dummy_gpu\n"
    )


def static(raw: object, field: str) -> StaticScanner:
    return StaticScanner()


def test_a_factory_name_not_in_snake_case_is_refused() -> None:
    from devplug import serve

    with pytest.raises(ValueError, match="'misc-dev' must be snake_case"):
        serve({"misc-dev": static}, program="x", version="1", argv=["scan"])
    with pytest.raises(TypeError, match="argument: 'version'"):
        serve({"misc": static}, program="x", argv=["scan"])  # type: ignore[call-arg]


# ------------------------------------------------------------------------ scan outcomes


def test_a_crashed_scanner_is_named_with_its_reason_not_no_devices_found(short_dir: Path) -> None:
    """Issue 25 item 2: stdout carries only what the scanners that worked found; stderr says
    which scanner failed and why; the status is 1."""
    (short_dir / "crash.yaml").write_text("scanners:\n  dummy: {fail: sysfs went away}\n")
    crashed = plugin(short_dir, "scan", "--config", "crash.yaml", "--log-level", "error")
    assert crashed.returncode == 1
    assert crashed.stdout == ""
    assert "no devices found" not in crashed.stderr
    assert crashed.stderr.splitlines()[-1] == (
        "dummy-plugin: scanner dummy failed: RuntimeError: sysfs went away"
    )

    (short_dir / "half.yaml").write_text(
        "scanners:\n  dummy: {fail: sysfs went away}\n  dummy_gpu: {count: 1}\n"
    )
    half = plugin(short_dir, "scan", "--config", "half.yaml", "--log-level", "error")
    assert half.returncode == 1
    assert [row.split()[:2] for row in half.stdout.splitlines()] == [
        ["RESOURCE", "ID"],
        ["example.com/dummy-gpu", "dev0"],
    ]
    assert "dummy-plugin: scanner dummy failed: RuntimeError: sysfs went away" in half.stderr

    generate = plugin(
        short_dir, "cdi", "generate", "--config", "crash.yaml", "--output-dir", "specs",
        "--log-level", "error",
    )  # fmt: skip
    assert generate.returncode == 1
    assert generate.stdout == ""
    assert "dummy-plugin: scanner dummy failed: RuntimeError: sysfs went away" in generate.stderr
    assert not (short_dir / "specs").exists()


def test_no_devices_found_is_said_on_stderr_when_it_is_true(short_dir: Path) -> None:
    (short_dir / "none.yaml").write_text("scanners:\n  dummy: {count: 0}\n")
    table = plugin(short_dir, "scan", "--config", "none.yaml")
    assert (table.returncode, table.stdout, table.stderr) == (0, "", "no devices found\n")
    document = plugin(short_dir, "scan", "--config", "none.yaml", "-o", "json")
    assert (document.returncode, document.stderr) == (0, "")
    assert json.loads(document.stdout) == {"resources": {}}


# ------------------------------------------------------------------------ Ctrl-C


async def interrupted(
    directory: Path, *args: str
) -> tuple[int | None, bytes, bytes, asyncio.subprocess.Process]:
    """The plugin run with ``args`` until its scanner holds, then a SIGINT (and the line that
    lets a held scanner go on, for a process that handles the signal rather than raising)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(plugin_script(directory)),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=PLUGIN_ENV,
        cwd=directory,
    )
    assert process.stderr is not None and process.stdin is not None
    seen = b""
    try:
        async with asyncio.timeout(60):  # a bound on a hang, not a latency assertion
            while (line := await process.stderr.readline()) != b"held\n":
                assert line, f"the plugin ended before its scanner held: {seen.decode()}"
                seen += line
        process.send_signal(signal.SIGINT)
        # Lets a held scanner go on in a process that handles the signal rather than raising;
        # one that raised may be gone already.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            process.stdin.write(b"go\n")
            await process.stdin.drain()
    finally:
        stdout, stderr = await finish(process)
    return process.returncode, stdout, seen + stderr, process


@pytest.mark.parametrize(
    "command",
    [["scan"], ["scan", "-o", "json"], ["cdi", "generate", "--output-dir", "specs"]],
    ids=" ".join,
)
async def test_ctrl_c_while_a_command_scans_exits_130_without_a_traceback(
    command: list[str], short_dir: Path
) -> None:
    (short_dir / "hold.yaml").write_text("scanners:\n  dummy: {hold: scan}\n")
    code, stdout, stderr, _ = await interrupted(short_dir, *command, "--config", "hold.yaml")
    assert code == 130, stderr.decode()
    assert stdout == b""
    assert b"Traceback" not in stderr and b"KeyboardInterrupt" not in stderr, stderr.decode()
    assert not (short_dir / "specs").exists()


async def test_ctrl_c_before_run_serves_exits_130_and_serves_nothing(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """Run's pre-daemon phase (here: building the scanners) ends on Ctrl-C like any command;
    nothing is registered."""
    config = short_dir / "hold.yaml"
    config.write_text(
        f"kubelet_dir: {kubelet_dir}\nlog_format: json\ncdi: {{dir: {short_dir / 'cdi'}}}\n"
        "scanners:\n  dummy: {hold: build}\n"
    )
    code, stdout, stderr, _ = await interrupted(short_dir, "run", "--config", str(config))
    assert code == 130, stderr.decode()
    assert stdout == b"" and b"Traceback" not in stderr, stderr.decode()
    assert kubelet.registrations == []
    assert not (short_dir / "cdi").exists()


async def test_sigint_while_run_serves_still_stops_in_order_with_0(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    config = short_dir / "config.yaml"
    config.write_text(
        f"kubelet_dir: {kubelet_dir}\nlog_format: json\ncdi: {{dir: {short_dir / 'cdi'}}}\n"
        "scanners:\n  dummy: {count: 2}\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(plugin_script(short_dir)),
        "run",
        "--config",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=PLUGIN_ENV,
    )
    seen: list[dict[str, object]] = []
    try:
        await read_until(process, "daemon.ready", seen)
        session = await kubelet.wait_for_plugin(RESOURCE, timeout=60)
        assert set(await session.wait_for_update()) == {"dev0", "dev1"}
        process.send_signal(signal.SIGINT)
    finally:
        stdout, stderr = await finish(process)
    assert process.returncode == 0, stderr.decode()
    assert stdout == b""
    names = events_of(seen, stderr)
    assert names.index("daemon.stopping") < names.index("daemon.stopped")
