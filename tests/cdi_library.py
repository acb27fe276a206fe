"""The CDI library as a consumer: build ``cdicheck`` (``cdicheck/main.go``) and run it.

``cdicheck`` links the CDI library that Debian 12 ships (0.5.2, package
``golang-github-container-orchestrated-devices-container-device-interface-dev``), the 0.5.x line
that Debian 12's podman 4.3.1 links, and loads a spec dir as podman does (see main.go). The Go
build runs in GOPATH mode against ``/usr/share/gocode``, offline and without cgo (CI installs
golang-go without its recommended gcc).

Where Go or the library source is missing the consumer tests skip, naming what to install;
with ``CI=true`` they fail instead, so CI cannot pass without running them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

CHECKER_SOURCE = Path(__file__).resolve().parent / "consumers" / "cdicheck" / "main.go"
GOPATH = Path("/usr/share/gocode")
LIBRARY_PACKAGE = "github.com/container-orchestrated-devices/container-device-interface"
LIBRARY_DIR = GOPATH / "src" / LIBRARY_PACKAGE
LIBRARY_APT = "golang-github-container-orchestrated-devices-container-device-interface-dev"

# The suite runs under umockdev-wrapper: its preload (LD_PRELOAD) and testbed (UMOCKDEV_DIR)
# would redirect /sys and /dev for every child that inherits them. Go, podman, runc and the
# devplug processes of these tests must see the real machine.
UMOCKDEV_VARIABLES = ("LD_PRELOAD", "UMOCKDEV_DIR")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def unavailable(reason: str) -> NoReturn:
    """Skip (outside CI) or fail (``CI=true``) a test whose consumer cannot run here."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the CDI consumer tests must run, not skip)", pytrace=False)
    pytest.skip(reason)


def real_machine_env(**extra: str) -> dict[str, str]:
    """This process's environment without umockdev's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in UMOCKDEV_VARIABLES}
    env.update(extra)
    return env


def missing_toolchain() -> str | None:
    """Why the checker cannot be built here, or None."""
    if shutil.which("go") is None:
        return "the CDI checker needs Go: apt-get install golang-go"
    if not (LIBRARY_DIR / "pkg" / "cdi").is_dir():
        return f"the CDI checker needs the CDI library's source: apt-get install {LIBRARY_APT}"
    return None


def _cache_root() -> Path:
    # The user's cache, not /tmp: a binary another user could plant under a guessable /tmp
    # name would then run as whoever runs the tests (root, for the podman tests).
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "devplug-tests"


def _build_key() -> str:
    """A digest of what the binary is made from: our source, the toolchain, the library."""
    digest = hashlib.sha256(CHECKER_SOURCE.read_bytes())
    version = subprocess.run(
        ["go", "version"], capture_output=True, text=True, check=True, env=real_machine_env()
    ).stdout
    digest.update(version.encode())
    for source in sorted(LIBRARY_DIR.glob("**/*.go")):
        if not source.name.endswith("_test.go"):
            digest.update(str(source.relative_to(LIBRARY_DIR)).encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def go_build_env(gocache: Path) -> dict[str, str]:
    """The environment that builds the checker offline from Debian's Go packages."""
    return real_machine_env(
        GOPATH=str(GOPATH),  # the Debian -dev packages' source tree
        GO111MODULE="off",  # GOPATH mode: imports resolve in $GOPATH/src, no go.mod
        GOFLAGS="",  # an inherited -mod=... is an error outside module mode
        GOPROXY="off",  # never the network
        GOENV="off",  # ignore the user's `go env -w` settings
        GOTOOLCHAIN="local",  # a newer go must not fetch another toolchain
        CGO_ENABLED="0",  # no C compiler needed: golang-go's gcc is only recommended
        GOCACHE=str(gocache),
    )


@functools.cache
def build_checker() -> Path:
    """Build ``cdicheck`` once per source/toolchain/library digest; return the binary.

    Safe when two test processes build at once: each builds into its own temp dir and renames
    the binary into place (the rename is atomic; both binaries are the same).
    """
    problem = missing_toolchain()
    if problem is not None:
        raise RuntimeError(problem)
    root = _cache_root()
    binary = root / f"cdicheck-{_build_key()}"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    root.mkdir(parents=True, exist_ok=True)
    gocache = root / "go-build"  # go's own cache is safe for concurrent builds
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as scratch:
        built = Path(scratch) / "cdicheck"
        result = subprocess.run(
            ["go", "build", "-trimpath", "-o", str(built), CHECKER_SOURCE.name],
            cwd=CHECKER_SOURCE.parent,
            env=go_build_env(gocache),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"building the CDI checker failed:\n{result.stderr}")
        os.replace(built, binary)
    return binary


def require_checker() -> Path:
    """The checker binary, or skip/fail (see :func:`unavailable`) when it cannot be built."""
    problem = missing_toolchain()
    if problem is not None:
        unavailable(problem)
    return build_checker()


@dataclass(frozen=True, slots=True)
class InjectedNode:
    """A device node as the library hands it to the runtime (type and numbers from the host).

    ``file_mode`` (permission bits), ``uid`` and ``gid`` are None where the library leaves
    them to the runtime: runc then makes the node 0666, owned by 0:0."""

    path: str
    type: str
    major: int
    minor: int
    file_mode: int | None = None
    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True, slots=True)
class LoadedSpec:
    kind: str
    cdi_version: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What the CDI library made of a spec dir (and of the names given, if any)."""

    spec_dir: Path
    errors: Mapping[str, tuple[str, ...]]  # spec file path -> the library's errors for it
    specs: Mapping[str, LoadedSpec]  # spec file path -> the spec, for files that loaded
    devices: tuple[str, ...]  # every fully qualified name that resolves
    requested: tuple[str, ...]
    unresolved: tuple[str, ...]
    inject_error: str
    injected: tuple[InjectedNode, ...]
    injected_env: tuple[str, ...]
    returncode: int
    raw: str  # the checker's JSON, for assertion messages

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def errors_in(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The errors of the files whose base name contains one of ``names``."""
        return {
            path: errs
            for path, errs in self.errors.items()
            if any(name in Path(path).name for name in names)
        }

    def __str__(self) -> str:
        return self.raw


def _parse(directory: Path, returncode: int, stdout: str) -> CheckResult:
    document: dict[str, Any] = json.loads(stdout)
    return CheckResult(
        spec_dir=directory,
        errors={path: tuple(errs) for path, errs in document["errors"].items()},
        specs={
            path: LoadedSpec(spec["kind"], spec["cdiVersion"], tuple(spec["devices"]))
            for path, spec in document["specs"].items()
        },
        devices=tuple(document["devices"]),
        requested=tuple(document["requested"]),
        unresolved=tuple(document["unresolved"]),
        inject_error=document["inject_error"],
        injected=tuple(
            InjectedNode(
                n["path"], n["type"], n["major"], n["minor"], n["fileMode"], n["uid"], n["gid"]
            )
            for n in document["injected_device_nodes"]
        ),
        injected_env=tuple(document["injected_env"]),
        returncode=returncode,
        raw=stdout,
    )


def check_spec_dir(directory: Path, names: Sequence[str] = ()) -> CheckResult:
    """Load ``directory`` with the CDI library, inject ``names``; the library's verdict.

    Raises RuntimeError when the checker itself could not run (usage error, bad output).
    """
    result = subprocess.run(
        [str(require_checker()), str(directory), *names],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=real_machine_env(),  # the library stats host device nodes: the real /dev
    )
    if result.returncode not in (0, 1):
        raise RuntimeError(
            f"cdicheck {directory} failed ({result.returncode}): {result.stderr.strip()}"
        )
    checked = _parse(directory, result.returncode, result.stdout)
    # The exit status and the report must agree, or the checker has a bug.
    failed = bool(checked.errors or checked.unresolved or checked.inject_error)
    if failed != (result.returncode == 1):
        raise RuntimeError(f"cdicheck exit status {result.returncode} but reported {checked}")
    return checked
