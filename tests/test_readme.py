"""The README's code and commands stay true: its Python examples run as written, its sessions
print what they show, its config example loads, and its headline figures are the benchmarks
page's."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The built-in scanners' page: the scan samples the mock-host presets reproduce.
SCANNERS = (ROOT / "docs" / "scanners.md").read_text()
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_the_plugin_author_example_has_serves_entry_point(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 3: the README shows serve() as it is: the plugin's own name, version,
    description and scanners."""
    from devplug import __version__

    scanner_code, _ = python_blocks()
    namespace: dict[str, Any] = {}
    exec(compile(scanner_code, "README.md:scanner", "exec"), namespace)

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["camera-plugin", *args])
        capsys.readouterr()
        try:
            code = namespace["main"]()
        except SystemExit as exc:  # argparse's --help
            code = exc.code
        return code, capsys.readouterr().out

    assert run("--version") == (0, f"camera-plugin 1.0.0 (devplug {__version__})\n")
    code, shown = run("scan", "--help")
    assert code == 0 and shown.startswith("usage: camera-plugin scan ")
    assert "comma-separated): camera\n" in shown
    code, shown = run("--help")
    assert "Serves video4linux cameras to containers." in shown


def test_the_stand_in_section_has_a_pasteable_setup_with_umockdev() -> None:
    """The kubelet stand-in needs umockdev: its section installs it, in a command to paste."""
    text = section("Try it with a kubelet stand-in")
    (setup,) = [line for line in sh_lines(text) if line.startswith("SUDO=")]
    install = re.search(r"\$SUDO apt-get install -y ([^&]+)&&", setup)
    assert install is not None and "umockdev" in install.group(1).split()
    assert "python3 -m venv .venv && .venv/bin/pip install ." in setup
    assert sh_lines(text).index(setup) == 0  # before the commands that need it


async def test_the_plugin_author_example_runs(short_dir: Path) -> None:
    from devplug.testing.umockdev import preload_active

    if not preload_active():
        pytest.skip("the example runs against umockdev hardware: needs its preload")
    scanner_code, test_code = python_blocks()
    namespace: dict[str, Any] = {}
    exec(compile(scanner_code, "README.md:scanner", "exec"), namespace)
    exec(compile(test_code, "README.md:test", "exec"), namespace)
    await namespace["test_camera"](short_dir)


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "umockdev-wrapper .venv/bin/python -m pytest"
    assert f"`{ci[-1]}`" in README
    assert f"&& {ci[-1]}\n" in README


# ------------------------------------------------------------------------ try it, mock hosts

DEVPLUG = Path(sys.executable).with_name("devplug")
TRY_DIR = "/tmp/devplug-try"
# The console commands a user types (the other lines of its block are what it prints).
TYPED = ("allocate ", "preferred ", "list", "restart", "quit")


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def fenced(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block, in order."""
    blocks: list[tuple[str, list[str]]] = []
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, lines))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def plain_blocks(text: str) -> list[list[str]]:
    return [lines for language, lines in fenced(text) if language == ""]


def sh_lines(text: str) -> list[str]:
    return [line for language, lines in fenced(text) if language == "sh" for line in lines]


def local(command: str, root: Path) -> list[str]:
    """A README command line run here: this venv's programs, ``root`` for /tmp/devplug-try."""
    command = command.replace(TRY_DIR, str(root))
    command = command.replace(".venv/bin/python", sys.executable)
    command = command.replace(".venv/bin/devplug", str(DEVPLUG))
    return ["env", *shlex.split(command)]


async def read_line(stream: asyncio.StreamReader) -> str:
    async with asyncio.timeout(30):  # a bound on a hang, not a latency assertion
        raw = await stream.readline()
    assert raw, "the process exited"
    return raw.decode().rstrip("\n")


async def spec_written(daemon: asyncio.subprocess.Process) -> None:
    """Until devplug logs that it wrote a CDI spec (its log is JSON: stderr is a pipe)."""
    assert daemon.stderr is not None
    while '"cdi.spec.written"' not in await read_line(daemon.stderr):
        pass


async def test_the_two_terminal_session_runs_as_shown(short_dir: Path) -> None:
    if shutil.which("umockdev-wrapper") is None:
        pytest.skip("needs umockdev-wrapper (.ci/run installs umockdev)")
    text = section("Try it with a kubelet stand-in")
    (terminal_1,) = plain_blocks(text)
    first, *shown = terminal_1
    assert first.startswith("$ ")
    console = await asyncio.create_subprocess_exec(
        *local(first[2:], short_dir),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    assert console.stdin is not None and console.stdout is not None
    daemon: asyncio.subprocess.Process | None = None
    try:
        assert await read_line(console.stdout) == shown[0].replace(TRY_DIR, str(short_dir))
        setup, mock_host, run = sh_lines(text)
        assert setup in setup_commands()
        built = await asyncio.create_subprocess_exec(*local(mock_host, short_dir), cwd=ROOT)
        assert await built.wait() == 0
        daemon = await asyncio.create_subprocess_exec(
            *local(run, short_dir), cwd=ROOT, stderr=asyncio.subprocess.PIPE
        )
        written = False
        for expected in shown[1:]:
            if expected.startswith(TYPED):
                # A user types after reading the list; by then the CDI spec that Allocate
                # names is written (it follows the list).
                if not written:
                    await spec_written(daemon)
                    written = True
                console.stdin.write(expected.encode() + b"\n")
                await console.stdin.drain()
                continue
            assert await read_line(console.stdout) == expected.replace(TRY_DIR, str(short_dir))
    finally:
        if daemon is not None and daemon.returncode is None:
            daemon.send_signal(signal.SIGTERM)
            await daemon.communicate()
            assert daemon.returncode == 0
        if console.returncode is None:
            console.stdin.write(b"quit\n")
            await console.stdin.drain()
            assert await console.wait() == 0


@pytest.mark.parametrize(
    ("preset", "command"),
    [
        ("intel-gpu", "devplug scan --scanner intel_gpu"),
        ("vfio", "devplug scan --config examples/vfio.yaml"),
    ],
)
def test_the_scan_samples_come_from_the_mock_host_presets(
    preset: str, command: str, short_dir: Path
) -> None:
    wrapper = shutil.which("umockdev-wrapper")
    if wrapper is None:
        pytest.skip("needs umockdev-wrapper (.ci/run installs umockdev)")
    (sample,) = [block for block in plain_blocks(SCANNERS) if block[0] == f"$ {command}"]
    host = short_dir / "host"
    built = subprocess.run(
        [sys.executable, "-m", "devplug.testing", "mock-host", str(host), "--preset", preset],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert built.returncode == 0 and built.stdout == f"UMOCKDEV_DIR={host}\n", built.stderr
    result = subprocess.run(
        [wrapper, str(DEVPLUG), *shlex.split(command)[1:]],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        env={**os.environ, "UMOCKDEV_DIR": str(host)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == sample[1:]
    assert f"--preset {preset}" in SCANNERS


# ------------------------------------------------------------------------ setup commands


def setup_commands() -> list[str]:
    return [line for line in sh_lines(README) if line.startswith("SUDO=")]


def sudo_prefix(command: str, as_nobody: bool) -> str:
    """What the README command's ``SUDO=...`` assignment yields for this user or nobody."""
    assignment = command.split("; ", 1)[0]
    script = f'{assignment}; printf %s "$SUDO"'
    prefix: list[str] = []
    if as_nobody:
        setpriv = shutil.which("setpriv")
        assert setpriv is not None
        prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    result = subprocess.run(
        [*prefix, "bash", "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    return result.stdout


def test_the_setup_commands_need_no_sudo_as_root_and_use_it_otherwise() -> None:
    """A fresh Debian machine's root has no sudo (``sudo: command not found``); a normal user
    needs it. Both run the README's two commands as they are."""
    commands = setup_commands()
    assert len(commands) == 3, "the dry run's, the stand-in's and the tests' setup commands"
    for command in commands:
        assert command.split("; ", 1)[1].startswith("$SUDO apt-get update && $SUDO apt-get")
        assert " sudo " not in f" {command.split('; ', 1)[1]} "
        if os.geteuid() == 0:
            assert sudo_prefix(command, as_nobody=False) == ""
            if shutil.which("setpriv") is not None:
                assert sudo_prefix(command, as_nobody=True) == "sudo"
        else:
            assert sudo_prefix(command, as_nobody=False) == "sudo"


# ------------------------------------------------------------------------ configure


def test_the_configure_example_is_a_config_devplug_accepts(tmp_path: Path) -> None:
    from devplug.config import load_settings
    from devplug.scanners.registry import build_scanners

    (example,) = [lines for language, lines in fenced(section("Configure")) if language == "yaml"]
    config = tmp_path / "config.yaml"
    config.write_text("\n".join(example) + "\n")
    settings = load_settings(config, {}, [], {})
    (scanner,) = build_scanners(settings.scanners)
    assert scanner.name == "generic"


# ------------------------------------------------------------------------ headline figures

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def benchmarks_section(anchor: str) -> str:
    """The text of the benchmarks page's section whose heading has this GitHub anchor."""
    from test_links import heading_anchors

    text = BENCHMARKS.read_text()
    headings = list(re.finditer(r"^(#{2,3}) (.+)$", text, flags=re.MULTILINE))
    anchors = heading_anchors("\n".join(match.group(0) for match in headings))
    for match, slug in zip(headings, anchors, strict=True):
        if slug == anchor:
            end = text.find("\n## ", match.end())
            return text[match.end() : end if end != -1 else None]
    raise AssertionError(f"docs/benchmarks.md has no section #{anchor}")


def headline_rows() -> list[list[str]]:
    text = section("Headline figures")
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| [")
    ]


def test_every_headline_figure_is_the_benchmarks_pages() -> None:
    """A headline row links to its section of docs/benchmarks.md, and every number the row
    gives (figure, floor, goal) is written there: the README cannot drift from the page that
    names the command and the conditions."""
    rows = headline_rows()
    assert len(rows) >= 5
    for row in rows:
        (link,) = LINK.findall(row[0])
        target, _, anchor = link[1].partition("#")
        assert target == "docs/benchmarks.md" and anchor, row[0]
        text = benchmarks_section(anchor)
        missing = [n for cell in row[1:] for n in NUMBER.findall(cell) if n not in text]
        assert not missing, f"{row[0]}: not in docs/benchmarks.md#{anchor}: {missing}"
