"""docs/writing-a-scanner.md followed by an outsider: a fresh virtualenv, devplug installed into
it with pip from a copy of this checkout, the guide's files written as it says, its tests run
with pytest, and its plugin's commands run as shown.

To stay fast and off the network, the new venv sees the test venv's site-packages through a
``.pth`` file and pip runs with ``--no-index --no-build-isolation``: devplug's dependencies,
pytest and pytest-asyncio are found there ("already satisfied"), while devplug itself is built
and installed into the new venv (the test checks that the plugin imports that copy). The
venv's bundled setuptools is removed first: build isolation would have fetched the newer one
pyproject.toml asks for, which the test venv has.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import GUIDE, command_lines, guide_files, guide_tests

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_COMMAND = ".venv/bin/python misc_plugin.py"


def run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DEVPLUG_"))}
    environ.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        args,
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def copy_checkout(destination: Path) -> None:
    """What ``pip install`` reads of a clone: the build config, the README and the sources."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    shutil.copytree(
        ROOT / "src",
        destination / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )


def guide_commands(prefix: str) -> list[str]:
    return [line for line in command_lines(GUIDE.read_text()) if line.startswith(prefix)]


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python3 = shutil.which("python3")
    assert python3 is not None
    base = tmp_path_factory.mktemp("guide")
    copy_checkout(base / "devplug")  # the guide's ../devplug
    plugin = base / "plugin"
    plugin.mkdir()
    for name, body in guide_files().items():
        (plugin / name).write_text(body)
    (setup,) = guide_commands(".venv/bin/pip install")
    created = run([python3, "-m", "venv", ".venv"], plugin)  # the guide's second command
    assert created.returncode == 0, created.stderr
    venv_python = plugin / ".venv" / "bin" / "python"
    version = run([str(venv_python), "-c", "import sys; print(sys.version_info[:2])"], plugin)
    assert version.stdout.strip() == str(sys.version_info[:2]), "python3 is not this Python"
    (purelib,) = {
        line
        for line in run(
            [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            plugin,
        ).stdout.split()
    }
    Path(purelib, "devplug-test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # pip's build isolation would fetch pyproject's setuptools>=68; the venv's bundled one (65
    # on Python 3.11) cannot build wheels alone, and would shadow the test venv's.
    dropped = run([str(venv_python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], plugin)
    assert dropped.returncode == 0, dropped.stderr
    installed = run([*shlex.split(setup), "--no-index", "--no-build-isolation"], plugin)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return plugin


def test_devplug_is_installed_into_the_fresh_venv(plugin_dir: Path) -> None:
    where = run(
        [".venv/bin/python", "-c", "import devplug.cli; print(devplug.cli.__file__)"], plugin_dir
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(plugin_dir / ".venv")), where.stdout


def test_the_guides_tests_pass_under_pytest(plugin_dir: Path) -> None:
    wrapper = shutil.which("umockdev-wrapper")
    assert wrapper is not None, "umockdev-wrapper is missing: .ci/run installs umockdev"
    result = run(
        [wrapper, ".venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider"], plugin_dir
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(rf"\b{len(guide_tests())} passed\b", result.stdout), result.stdout[-500:]
    assert "skipped" not in result.stdout and "warning" not in result.stdout.lower()


def test_the_plugins_commands_run_as_shown(plugin_dir: Path) -> None:
    shown = guide_commands(PLUGIN_COMMAND)
    assert shown, "the guide shows no command of the plugin"
    for line in shown:
        result = run(shlex.split(line), plugin_dir)
        assert result.returncode == 0, f"{line}: {result.stderr}"
    version = run([*shlex.split(PLUGIN_COMMAND), "--version"], plugin_dir)
    assert version.stdout.startswith("misc-plugin ")


def test_the_plugin_reads_devplug_config_and_refuses_typos(plugin_dir: Path) -> None:
    command = [*shlex.split(PLUGIN_COMMAND), "scan", "-o", "json"]
    from_env = run(command, plugin_dir, env={"DEVPLUG_CONFIG": "config.yaml"})
    assert from_env.returncode == 0, from_env.stderr
    missing = run(command, plugin_dir, env={"DEVPLUG_CONFIG": "nope.yaml"})
    assert missing.returncode == 2
    assert missing.stderr.startswith(
        "misc-plugin: configuration error: DEVPLUG_CONFIG: file not found: nope.yaml"
    )
    (plugin_dir / "typo.yaml").write_text("scanners:\n  misc:\n    shres: 4\n")
    typo = run([*command, "--config", "typo.yaml"], plugin_dir)
    assert typo.returncode == 2
    assert typo.stderr.startswith(
        "misc-plugin: configuration error: scanners.misc.shres: unknown setting; "
        "did you mean 'shares'?"
    )
