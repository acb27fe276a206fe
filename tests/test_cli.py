"""Command-line conventions (kubectl, helm, systemctl): ``--version``, ``-o/--output`` on every
command that prints a document, one-line descriptions and exit statuses in ``--help``, only
the flags a command uses, ``NO_COLOR``, log levels in any case; ``scan`` exits 1 when two
scanners claim one resource, and warns about entries that find nothing; a kubelet dir devplug
cannot write is logged with the kernel's reason."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from devplug import __version__
from devplug.cli import build_parser, commands
from devplug.model import DeviceTree
from devplug.scanners.generic import GenericScanner
from devplug.testing import KubeletSimulator, daemon_process
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_usb_serial


def devplug(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devplug", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=60,
        check=False,
    )


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by its words (``cdi generate``)."""

    def choices(parser: argparse.ArgumentParser, dest: str) -> dict[str, argparse.ArgumentParser]:
        (action,) = [a for a in parser._actions if a.dest == dest]
        assert isinstance(action.choices, dict)
        return dict(action.choices)

    found = choices(build_parser(), "command")
    found["cdi generate"] = choices(found.pop("cdi"), "cdi_command")["generate"]
    found["dra deviceclasses"] = choices(found.pop("dra"), "dra_command")["deviceclasses"]
    return found


def test_version_flag_and_command() -> None:
    assert devplug("--version").stdout == f"devplug {__version__}\n"
    assert devplug("version").stdout == f"devplug {__version__}\n"


@pytest.mark.parametrize("command", ["run", "scan", "status", "cdi generate", "dra deviceclasses"])
def test_every_command_that_prints_a_document_takes_o_json_and_yaml(command: str) -> None:
    parser = subcommands()[command]
    (output,) = [a for a in parser._actions if a.dest == "output"]
    assert output.option_strings == ["-o", "--output"]
    assert output.choices is not None and {"json", "yaml"} <= set(output.choices)


@pytest.mark.parametrize(
    "command", ["run", "scan", "status", "cdi generate", "dra deviceclasses", "version"]
)
def test_help_has_a_one_line_description_and_the_exit_statuses(command: str) -> None:
    result = devplug(*command.split(), "--help")
    assert result.returncode == 0
    description = result.stdout.split("\n\n")[1]
    assert "\n" not in description.strip() and description.strip().endswith(".")
    assert "exit status: 0" in result.stdout


@pytest.mark.parametrize(
    ("command", "absent"),
    [
        ("scan", ["--kubelet-dir", "--cdi-dir", "--metrics-address", "--dry-run"]),
        ("cdi generate", ["--kubelet-dir", "--cdi-dir", "--metrics-address"]),
        ("status", ["--config", "--scanner", "--cdi-dir", "--log-level"]),
        ("dra deviceclasses", ["--kubelet-dir", "--scanner", "--cdi-dir", "--log-level"]),
    ],
)
def test_flags_a_command_does_not_use_are_not_offered(command: str, absent: list[str]) -> None:
    text = devplug(*command.split(), "--help").stdout
    for flag in absent:
        assert flag not in text, f"{command} offers {flag}"
    refused = devplug(*command.split(), absent[0], "/x")
    assert refused.returncode == 2


# A generic entry that finds nothing: scan logs a warning (scan.entry.unmatched).
UNMATCHED = (
    "scanners:\n  generic:\n    - resource: example.com/none\n"
    "      match: {subsystem: no-such-subsystem}\n"
)


@pytest.fixture
def unmatched(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(UNMATCHED)
    return path


def test_log_levels_in_any_case(unmatched: Path) -> None:
    shown = devplug(
        "scan", "--config", str(unmatched), "--log-level", "WARNING", "--log-format", "JSON"
    )
    assert shown.returncode == 0, shown.stderr
    assert '"event": "scan.entry.unmatched"' in shown.stderr
    hidden = devplug("scan", "--config", str(unmatched), env={"DEVPLUG_LOG_LEVEL": "Error"})
    assert hidden.returncode == 0 and hidden.stderr == "no devices found\n"


@pytest.mark.parametrize(("no_color", "coloured"), [(None, True), ("1", False)])
def test_no_color_turns_the_console_colours_off(
    no_color: str | None, coloured: bool, unmatched: Path
) -> None:
    """On a terminal the console log is coloured, unless NO_COLOR is set."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    if no_color is not None:
        env["NO_COLOR"] = no_color
    leader, follower = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "devplug", "scan", "--config", str(unmatched)],
            stdout=subprocess.DEVNULL,
            stderr=follower,
            env=env,
            timeout=60,
            check=False,
        )
        os.close(follower)
        follower = -1
        written = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            written += chunk
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)
    assert result.returncode == 0
    assert b"scan.entry.unmatched" in written
    assert (b"\x1b[" in written) == coloured


def test_scan_exits_1_when_two_scanners_claim_one_resource(
    host: UmockdevHost, short_dir: Path
) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    config = short_dir / "config.yaml"
    config.write_text(
        "scanners:\n  intel_gpu: {}\n  generic:\n    - resource: gpu.intel.com/i915\n"
        "      match: {subsystem: drm, devnode: /dev/dri/renderD*}\n"
    )
    result = devplug("scan", "--config", str(config), "-o", "json", env=host.env())
    assert result.returncode == 1
    assert "0000:00:02.0" in json.loads(result.stdout)["resources"]["gpu.intel.com/i915"][0]["id"]
    assert (
        "devplug: gpu.intel.com/i915 is produced by more than one scanner; served from "
        "intel_gpu, not from generic"
    ) in result.stderr


def test_scan_warns_about_an_entry_that_matches_nothing(
    host: UmockdevHost, short_dir: Path
) -> None:
    add_usb_serial(host, index=0)
    config = short_dir / "config.yaml"
    config.write_text(
        "log_format: json\nscanners:\n  generic:\n"
        "    - resource: example.com/serial\n      match: {subsystem: tty, devnode: /dev/ttyUSB*}\n"
        "    - resource: example.com/modem\n      match: {subsystem: tty, devnode: /dev/ttyACM*}\n"
    )
    result = devplug("scan", "--config", str(config), env=host.env())
    assert result.returncode == 0, result.stderr
    warnings = [json.loads(line) for line in result.stderr.splitlines()]
    (unmatched,) = [w for w in warnings if w["event"] == "scan.entry.unmatched"]
    assert unmatched["resource"] == "example.com/modem" and unmatched["level"] == "warning"


def test_a_properties_match_without_udevs_database_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "UDEV_DATABASE", tmp_path / "no-udev-data")
    scanner = GenericScanner.from_config(
        [
            {
                "resource": "example.com/serial",
                "match": {"subsystem": "tty", "properties": {"ID_VENDOR_ID": "0403"}},
            }
        ]
    )
    with capture_logs() as logs:
        commands.warn_unmatched([scanner], DeviceTree())
    events = {entry["event"]: entry for entry in logs}
    assert events["scan.udev_database.missing"]["properties"] == ["ID_VENDOR_ID"]
    assert "no-udev-data does not exist" in events["scan.udev_database.missing"]["reason"]
    assert "scan.entry.unmatched" in events


async def test_an_unwritable_kubelet_dir_is_logged_with_its_cause(short_dir: Path) -> None:
    """The kernel's reason reaches the JSON log, not only grpc-core's own stderr line."""
    kubelet_dir = short_dir / "kubelet"
    command = [str(Path(sys.executable).with_name("devplug"))]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("as root, needs setpriv (util-linux) to drop DAC override")
        # Still root (so the venv may sit in /root), but without the capabilities that let
        # root ignore permission bits: the 0555 kubelet dir refuses it as it would anyone.
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *command]
    config = short_dir / "config.yaml"
    config.write_text("scanners:\n  generic:\n    - resource: example.com/null\n"
                      "      match: {subsystem: mem, devnode: /dev/null}\n")  # fmt: skip
    config.chmod(0o644)
    async with KubeletSimulator(kubelet_dir):
        kubelet_dir.chmod(0o555)
        process = await asyncio.create_subprocess_exec(
            *command,
            "run",
            "--config",
            str(config),
            "--kubelet-dir",
            str(kubelet_dir),
            "--log-format",
            "json",
            env={**os.environ, "DEVPLUG_CDI_DIR": str(short_dir / "cdi")},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        try:
            async with asyncio.timeout(60):  # a bound on a hang, not a latency assertion
                while True:
                    line = await process.stderr.readline()
                    assert line, "devplug exited without logging server.listen.failed"
                    if line.startswith(b"{"):
                        entry = json.loads(line)
                        if entry["event"] == "server.listen.failed":
                            break
        finally:
            process.send_signal(signal.SIGTERM)
            await process.communicate()
            kubelet_dir.chmod(0o755)
    assert entry["error"] == (
        f"[Errno 13] cannot create a socket in {kubelet_dir}: Permission denied"
    )


HEAVY = ("pydantic", "grpc", "pyudev", "structlog", "yaml")


def loaded_by(*args: str, before: str = "") -> str:
    """Run ``python -m devplug ARGS`` in a subprocess (after ``before``); its last stdout line
    is the JSON of what it reports (the code after ``before`` sets ``report``)."""
    code = (
        "import json, runpy, signal, sys\n"
        f"HEAVY = {HEAVY!r}\n"
        "report = {}\n"
        f"{before}"
        f"sys.argv = ['devplug', *{list(args)!r}]\n"
        "try:\n"
        "    runpy.run_module('devplug', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as exc:\n"
        "    report['exit'] = exc.code\n"
        "report.setdefault('loaded', sorted(m for m in HEAVY if m in sys.modules))\n"
        "print(json.dumps(report))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1]


@pytest.mark.parametrize("args", [["--version"], ["version"], ["--help"], ["run", "--help"]])
def test_version_and_help_load_neither_pydantic_grpc_pyudev_nor_structlog(
    args: list[str],
) -> None:
    """Issue 16: ``version`` and ``--help`` answer at once (an operator's first command, a
    probe); the settings, the daemon and the logging load only for a command that needs them."""
    report = json.loads(loaded_by(*args))
    assert report == {"exit": 0, "loaded": []}


# Records, as each heavy module is first imported, whether SIGHUP and SIGINT still had their
# default actions (a SIGHUP then kills the process; a SIGINT is Ctrl-C).
WATCH_IMPORTS = """
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in report:
            report[name] = [
                signal.getsignal(signal.SIGHUP) is signal.SIG_DFL,
                signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            ]


sys.meta_path.insert(0, Watch())
"""


def test_run_guards_its_signals_before_anything_slow_loads(tmp_path: Path) -> None:
    """Issue 15 item 7: ``devplug run`` handles SIGHUP (a reload) before pydantic, structlog,
    YAML or gRPC load, which takes most of its start-up; until then a SIGHUP killed it."""
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: Serial, match: {subsystem: tty}}]}\n")
    report = json.loads(loaded_by("run", "--config", str(config), before=WATCH_IMPORTS))
    assert report.pop("exit") == 2  # refused config: the import of every settings module ran
    assert set(report.pop("loaded")) >= {"pydantic", "structlog", "yaml"}
    # Each heavy module's import found SIGHUP handled (False: not the default) and SIGINT too.
    assert report and all(sighup is False for sighup, _ in report.values()), report


def test_scan_keeps_ctrl_c(tmp_path: Path) -> None:
    """Only ``run`` holds the signals early: ``scan`` (and ``status``, ``cdi generate``) stop
    on Ctrl-C as any command does."""
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: Serial, match: {subsystem: tty}}]}\n")
    report = json.loads(loaded_by("scan", "--config", str(config), before=WATCH_IMPORTS))
    report.pop("exit")
    report.pop("loaded")
    assert report and all(v == [True, True] for v in report.values()), report


def sighup_caught(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (the kernel's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


async def test_sighups_through_the_whole_start_up_of_run_do_not_kill_it(
    kubelet: KubeletSimulator, kubelet_dir: Path, short_dir: Path
) -> None:
    """SIGHUPs from the moment the process has a handler (the interpreter's own start-up, before
    any of devplug's code runs, cannot have one) until it serves: it survives, registers, serves
    the config and stops with 0 on SIGTERM."""
    config = short_dir / "config.yaml"
    config.write_text(
        "hotplug: {source: none}\n"
        "scanners:\n  generic:\n"
        "    - {resource: example.com/null, match: {subsystem: mem, devnode: /dev/null}}\n"
    )
    async with daemon_process(config, kubelet_dir) as process:
        while not sighup_caught(process.pid):
            assert process.returncode is None
            await asyncio.sleep(0.001)  # the kernel shows it, no event tells it
        sent = 0
        registered = asyncio.create_task(kubelet.wait_for_plugin("example.com/null", timeout=60))
        while not registered.done():
            process.send_signal(signal.SIGHUP)
            sent += 1
            await asyncio.sleep(0.005)
        session = await registered
        await session.wait_for_update(lambda listed: set(listed) == {"null"})
        assert process.returncode is None
        process.terminate()
        _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()[-3000:]
    assert sent > 1
    events = [json.loads(line)["event"] for line in err.decode().splitlines() if line[:1] == "{"]
    assert "config.reloaded" in events


# ------------------------------------------------------------------------ issue 25


def test_the_one_spelling_of_each_scanner_name_is_listed() -> None:
    """Scanner names are written as their config keys (``intel_gpu``) in help and errors."""
    text = " ".join(devplug("scan", "--help").stdout.split())
    assert "comma-separated): generic, intel_gpu, vfio" in text
    refused = devplug("scan", "--scanner", "gpu")
    assert refused.stderr.endswith("known scanners: generic, intel_gpu, vfio\n")


def test_intel_gpu_in_the_other_spelling_is_accepted_with_a_hint(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("scanners:\n  intel-gpu: {shared_dev_num: 2}\n")
    for args, source in [
        (["--scanner", "intel-gpu"], "--scanner"),
        (["--config", str(config)], "scanners.intel-gpu"),
    ]:
        result = devplug("scan", *args, "--log-format", "json", "-o", "json")
        assert result.returncode == 0, result.stderr
        hints = [json.loads(line) for line in result.stderr.splitlines()]
        assert [(h["event"], h["source"], h["name"]) for h in hints] == [
            ("config.scanner.spelling", source, "intel_gpu")
        ]
    spelt = devplug("scan", "--scanner", "intel_gpu", "--log-format", "json")
    assert spelt.returncode == 0 and "config.scanner.spelling" not in spelt.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--config", "{config}", "scan", "-o", "json"],
        ["--config={config}", "--log-level", "WARNING", "scan", "-o", "json"],
        ["-o", "json", "--log-format", "json", "scan", "--config", "{config}"],
        ["--log-level", "error", "--config", "{config}", "cdi", "generate", "--stdout"],
        ["--conf", "{config}", "scan", "-ojson"],
    ],
    ids=lambda args: " ".join(args),
)
def test_flags_before_the_command_are_the_commands_flags(args: list[str], unmatched: Path) -> None:
    """Issue 25 item 2: ``devplug --config x scan`` is ``devplug scan --config x``."""
    result = devplug(*(arg.replace("{config}", str(unmatched)) for arg in args))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) in ({"resources": {}}, {})


def test_a_flag_before_a_command_that_does_not_take_it_is_refused(unmatched: Path) -> None:
    refused = devplug("--config", str(unmatched), "status")
    assert refused.returncode == 2
    assert f"unrecognized arguments: --config {unmatched}" in refused.stderr
    assert devplug("--config", str(unmatched)).returncode == 2  # no command: usage


def test_the_early_option_table_is_the_parsers() -> None:
    """cli.early moves flags without loading the parser: its table must be the parser's."""
    from devplug.cli import early

    takes_value: dict[str, bool] = {}
    for name, parser in subcommands().items():
        for action in parser._actions:
            for option in action.option_strings:
                valued = action.nargs is None and not isinstance(
                    action, argparse._HelpAction | argparse._StoreConstAction
                )
                assert takes_value.setdefault(option, valued) == valued, (name, option)
    assert {o for o, valued in takes_value.items() if valued} == early.VALUED
    assert {o for o, valued in takes_value.items() if not valued} - {"-h", "--help"} == early.FLAGS
    top = {option for action in build_parser()._actions for option in action.option_strings}
    assert top == early.TOP_LEVEL
    groups = {name.split()[0] for name in subcommands() if " " in name}
    assert groups == early.GROUPS


def test_run_with_flags_first_guards_its_signals_before_anything_slow(tmp_path: Path) -> None:
    """``devplug --config x run`` is ``run``: its signals are held from the start."""
    config = tmp_path / "config.yaml"
    config.write_text("scanners: {generic: [{resource: Serial, match: {subsystem: tty}}]}\n")
    report = json.loads(
        loaded_by("--log-level", "debug", "--config", str(config), "run", before=WATCH_IMPORTS)
    )
    assert report.pop("exit") == 2  # refused config: the import of every settings module ran
    assert set(report.pop("loaded")) >= {"pydantic", "structlog", "yaml"}
    assert report and all(sighup is False for sighup, _ in report.values()), report


async def test_ctrl_c_during_status_exits_130_without_a_traceback(short_dir: Path) -> None:
    """A plugin socket that accepts and never answers holds ``status`` in its probe."""
    connected = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()  # until the client goes
        writer.close()

    server = await asyncio.start_unix_server(silent, short_dir / "vendor-silent.sock")
    async with server:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "devplug", "status", "--kubelet-dir", str(short_dir),
            "--timeout", "60",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(60):  # a bound on a hang, not a latency assertion
                await connected.wait()
            process.send_signal(signal.SIGINT)
            stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 130, stderr.decode()
    assert stdout == b"" and b"Traceback" not in stderr, stderr.decode()


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
@pytest.mark.parametrize("args", [["version"], ["status"], ["status", "--pods"]], ids=" ".join)
def test_a_reader_that_goes_away_ends_a_command_quietly(
    tmp_path: Path, args: list[str], buffered: bool
) -> None:
    """``devplug status --pods | head -1``: the command ends as one that SIGPIPE ends (status
    141), without a traceback, whether its write fails at once or at the last flush."""
    if args[0] == "status":
        args = [*args, "--kubelet-dir", str(tmp_path)]  # no sockets: a line or two to print
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED" or not buffered}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        result = subprocess.run(
            [sys.executable, "-m", "devplug", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
