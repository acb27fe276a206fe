"""Shared fixtures: short socket dirs, a kubelet simulator, mock hardware, leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

# grpc-core prints an informational line for every GOAWAY a simulated kubelet's channel gets
# when a plugin server stops; failing tests' captured stderr stays readable without them. Set
# before grpc is first imported (the imports below).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from cdi_library import check_spec_dir, in_ci, missing_toolchain
from helpers import UEVENTS, UeventDaemon

from devplug.cdi import files as cdi_files
from devplug.cdi import store as cdi_store
from devplug.cdi.stamps import FileStamp
from devplug.config import Settings
from devplug.daemon import Daemon
from devplug.scanners.base import Scanner
from devplug.testing import daemon_settings
from devplug.testing.harness import DaemonStarter, in_process_daemon
from devplug.testing.simulator import KubeletSimulator
from devplug.testing.umockdev import UmockdevHost, preload_active

RUN_TESTS = "umockdev-wrapper .venv/bin/python -m pytest"


def pytest_configure(config: pytest.Config) -> None:
    """udev tests need umockdev's preload in this process; refuse to run (not skip) without it.

    A run started in the background by a shell without job control (``.ci/run &`` from a
    script) inherits SIGINT ignored, as POSIX has it, and so would every devplug it starts:
    devplug then rightly keeps ignoring Ctrl-C, and the Ctrl-C tests fail. A handler here is
    reset to the default in each child at exec, as a terminal's would be."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not preload_active() and not os.environ.get("DEVPLUG_TESTS_WITHOUT_UMOCKDEV"):
        raise pytest.UsageError(
            "the tests run real pyudev code against mock hardware and need umockdev's preload: "
            f"install the Debian package 'umockdev' and run `{RUN_TESTS}` "
            "(or set DEVPLUG_TESTS_WITHOUT_UMOCKDEV=1 to skip those tests)"
        )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory under /tmp: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet_dir(short_dir: Path) -> Path:
    path = short_dir / "device-plugins"
    path.mkdir()
    return path


@pytest.fixture
async def kubelet(kubelet_dir: Path) -> AsyncIterator[KubeletSimulator]:
    async with KubeletSimulator(kubelet_dir) as simulator:
        yield simulator


@pytest.fixture
def host(short_dir: Path) -> Iterator[UmockdevHost]:
    """An empty umockdev testbed, active in this process for the test's duration."""
    if not preload_active():
        pytest.skip("needs umockdev's preload (run under umockdev-wrapper)")
    testbed = UmockdevHost(short_dir / "testbed")
    with testbed.activated():
        yield testbed


@pytest.fixture
async def start_daemon(kubelet: KubeletSimulator) -> AsyncIterator[DaemonStarter]:
    """Factory: in-process daemons (``in_process_daemon``: the daemon itself, for tests that
    look at its parts), stopped in reverse order at the end of the test, before the kubelet
    simulator they talk to."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(settings: Settings, scanners: Sequence[Scanner], **options: Any) -> Daemon:
            return await stack.enter_async_context(in_process_daemon(settings, scanners, **options))

        yield start


@pytest.fixture
def uevent_daemon(
    host: UmockdevHost, kubelet_dir: Path, start_daemon: DaemonStarter
) -> UeventDaemon:
    """Factory: an in-process daemon serving ``scanners`` from the mock host and driven by
    its uevents (``helpers.UEVENTS``, with the keys of ``hotplug`` over them)."""

    def start(
        scanners: Sequence[Scanner], hotplug: Mapping[str, object] | None = None, **options: Any
    ) -> Awaitable[Daemon]:
        settings = daemon_settings(kubelet_dir, hotplug={**UEVENTS, **(hotplug or {})})
        return start_daemon(settings, scanners, **options)

    return start


# Contents already loaded by the CDI library in this session (tests write the same specs often).
_LIBRARY_CHECKED: set[str] = set()


@pytest.fixture(autouse=True)
def _specs_pass_the_cdi_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Every spec file the code under test writes (in this process) is also loaded by the
    official CDI library, the 0.5.2 that Debian 12's podman links: a spec it rejects fails the
    test. Our own model and schema are not the judge of what runtimes accept.

    Outside CI, a machine without Go or the library's source skips the check (CI must run it).
    """
    written: dict[str, tuple[str, bytes]] = {}  # content digest -> (file name, content)
    real_write = cdi_files.write_atomically  # what the store calls, under its own name

    async def observed(directory: Path, file_name: str, data: bytes, *args: Any) -> FileStamp:
        stamp = await real_write(directory, file_name, data, *args)
        written.setdefault(hashlib.sha256(data).hexdigest(), (file_name, data))
        return stamp

    monkeypatch.setattr(cdi_store, "write_atomically", observed)
    yield
    new = {digest: spec for digest, spec in written.items() if digest not in _LIBRARY_CHECKED}
    if not new or (missing_toolchain() is not None and not in_ci()):
        return
    # Several versions of one spec file conflict in one dir (the same devices twice): each
    # version goes to the first dir that does not hold its file name yet.
    root = tmp_path_factory.mktemp("cdi-library")
    dirs: list[Path] = []
    for file_name, data in new.values():
        target = next((d for d in dirs if not (d / file_name).exists()), None)
        if target is None:
            target = root / str(len(dirs))
            target.mkdir()
            dirs.append(target)
        (target / file_name).write_bytes(data)
    for directory in dirs:
        result = check_spec_dir(directory)
        if not result.ok:
            pytest.fail(f"the CDI library (0.5.2) rejects a spec this test wrote: {result}")
    _LIBRARY_CHECKED.update(new)


@pytest.fixture(autouse=True)
def _logging_config_restored() -> Iterator[None]:
    """A test that runs a command in-process (``devplug.cli.main``) configures structlog to
    print to that test's captured stderr; later tests must not write to the closed capture."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves tasks running on its loop (a leaked server, stream or watcher)."""
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    for _ in range(50):
        leaked = {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}
        if not leaked:
            return
        await asyncio.sleep(0.01)
    names = sorted(t.get_name() for t in leaked)
    pytest.fail(f"tasks leaked by the test: {names}")


# The reliability suite (tests/reliability/): CI runs the short versions;
# DEVPLUG_RELIABILITY_LONG=1 runs the long ones its issue names (100 kubelet restarts, 10,000
# fuzzed RPC cases, ...).
RELIABILITY_LONG = os.environ.get("DEVPLUG_RELIABILITY_LONG", "") not in ("", "0")


@pytest.fixture
def scaled() -> Callable[[int, int], int]:
    """``scaled(short, long)``: ``long`` under DEVPLUG_RELIABILITY_LONG=1, else ``short``."""

    def pick(short: int, long: int) -> int:
        return long if RELIABILITY_LONG else short

    return pick
