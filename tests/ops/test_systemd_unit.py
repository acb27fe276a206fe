"""The unit starts on a fresh node: its writable dirs need not exist, fds are not systemd's
1,024, and its documentation is there.

These check the unit's rules offline (with systemd's own parser where it has one:
``systemd-analyze verify``, in test_systemd.py). Starting the unit for real needs systemd as
PID 1. The test machines do not run it (their PID 1 is a sandbox's process manager) and have no
container engine or systemd-nspawn. systemd does start as PID 1 in an ``unshare --pid --mount``
namespace there, but its boot units then act on the host's shared directories (tried once:
systemd-tmpfiles' boot clean-up emptied the shared /tmp), so the suite does not boot it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "devplug.service"


def directives(name: str) -> list[str]:
    """Every value of ``name`` in the unit, in order (comments and continuation-free lines)."""
    return [
        line.split("=", 1)[1]
        for line in UNIT.read_text().splitlines()
        if not line.startswith("#") and line.split("=", 1)[0] == name
    ]


def writable_paths() -> list[str]:
    return [path for value in directives("ReadWritePaths") for path in value.split()]


def made_before_start() -> set[str]:
    """Dirs an ExecStartPre=+ mkdir -p creates outside the sandbox, before ExecStart."""
    made: set[str] = set()
    for command in directives("ExecStartPre"):
        assert command.startswith("+"), "run outside the sandbox, or it cannot create the dirs"
        words = shlex.split(command[1:])
        if Path(words[0]).name == "mkdir":
            assert "-p" in words
            made.update(word for word in words[1:] if not word.startswith("-"))
    return made


def test_every_writable_dir_is_created_or_tolerated_when_missing() -> None:
    paths = writable_paths()
    assert paths, "devplug writes its sockets and CDI specs: ReadWritePaths is needed"
    made = {os.path.realpath(p) for p in made_before_start()}
    for path in paths:
        # "-": a missing path does not fail the namespace set-up (/run/cdi after a boot).
        assert path.startswith("-"), f"{path}: without '-' a missing dir fails the start"
        assert os.path.realpath(path[1:]) in made, f"{path} is not created before the start"
    assert "/run/cdi" in made and "/var/lib/kubelet/device-plugins" in made


def test_the_mkdir_command_makes_the_dirs_on_an_empty_root(tmp_path: Path) -> None:
    """The ExecStartPre line, run against an empty root, leaves every writable dir there."""
    (command,) = directives("ExecStartPre")
    words = shlex.split(command[1:])
    assert Path(words[0]).is_file(), f"{words[0]} does not exist on this system"
    rooted = [words[0], *(w if w.startswith("-") else str(tmp_path) + w for w in words[1:])]
    subprocess.run(rooted, check=True, timeout=30)
    for path in writable_paths():
        assert (tmp_path / path[1:].lstrip("/").replace("var/run/", "run/")).is_dir(), path


def test_the_fd_limit_is_raised() -> None:
    (limit,) = directives("LimitNOFILE")
    soft, _, hard = limit.partition(":")
    assert int(soft) >= 65536 and int(hard or soft) >= 65536


def test_documentation_points_at_real_documents() -> None:
    uris = [uri for value in directives("Documentation") for uri in value.split()]
    assert uris and not any("example.invalid" in uri for uri in uris)
    installed = "/usr/local/share/doc/devplug/"
    for uri in uris:
        scheme = uri.split(":", 1)[0]
        assert scheme in ("file", "https", "man"), uri
        if uri.startswith("file:" + installed):
            shipped = ROOT / "docs" / uri.removeprefix("file:" + installed)
            assert shipped.is_file(), f"{uri}: no {shipped.relative_to(ROOT)} to install"
    assert f"-t {installed.rstrip('/')} README.md docs/*.md" in UNIT.read_text()


def timespan_s(value: str) -> float:
    """A systemd time span in seconds, as systemd itself reads it."""
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is missing: .ci/run installs the systemd package"
    result = subprocess.run(
        [tool, "timespan", value], capture_output=True, text=True, timeout=60, check=True
    )
    for line in result.stdout.splitlines():
        key, _, number = line.strip().partition(":")
        if key == "μs":
            return int(number) / 1_000_000
    raise AssertionError(f"{value!r}: no μs line in {result.stdout!r}")


def test_the_start_does_not_wait_for_the_kubelet() -> None:
    """devplug sends READY=1 without a kubelet (test_systemd.py); the unit neither pulls the
    kubelet in nor binds its start to it, and a start is bounded, so on a node whose kubelet
    comes after boot (kubeadm join from cloud-init) neither boot nor `systemctl start` waits."""
    (limit,) = directives("TimeoutStartSec")
    assert limit != "infinity" and 0 < timespan_s(limit) <= 300
    for dependency in ("Wants", "Requires", "Requisite", "BindsTo", "PartOf", "Upholds"):
        assert "kubelet.service" not in " ".join(directives(dependency)), dependency
    assert directives("WantedBy") == ["multi-user.target"]


def test_a_configuration_error_is_not_restarted(tmp_path: Path) -> None:
    """The exit status `devplug run` gives a configuration error stops the restarts, so the
    unit shows the error instead of cycling into start-limit-hit."""
    config = tmp_path / "config.yaml"
    config.write_text("scanners:\n  generic:\n    - {resource: no-domain, match: {}}\n")
    devplug = Path(sys.executable).with_name("devplug")
    result = subprocess.run(
        [devplug, "run", "--config", str(config), "--kubelet-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "configuration error" in result.stderr, result.stderr
    (restart,) = directives("Restart")
    assert restart == "always"
    prevented = {word for value in directives("RestartPreventExitStatus") for word in value.split()}
    assert str(result.returncode) in prevented, (result.returncode, prevented)
