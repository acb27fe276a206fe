"""``devplug scan --replay FILE``: the scan, run by the same code, on a recorded host.

The record (``devplug capture``, or ``umockdev-record``) is built into a umockdev testbed in a
temporary directory, and this process's umockdev preload is pointed at it: every read of /sys
and /dev the scanners make goes there. The preload must be in the process from its start;
when it is not, :func:`need_preload` starts the command again under it (the same
interpreter, arguments and environment, plus ``LD_PRELOAD``), as ``umockdev-wrapper`` would.
A command line run from a program's own call (``devplug.cli.main(argv)``) is not restarted:
it is refused with the fix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from devplug.cli.commands import fail, scan
from devplug.cli.parser import EXIT_USAGE
from devplug.scanners.base import Scanner
from devplug.scanners.udev import UdevSource
from devplug.scanners.udev.record import RecordError
from devplug.testing.umockdev.host import PRELOAD_LIBRARY, preload_active
from devplug.testing.umockdev.replay import host_from_record

INSTALL_HINT = (
    "install umockdev (Debian and Ubuntu: apt install umockdev; Fedora: dnf install umockdev)"
)


def need_preload(program: str, may_restart: bool) -> str | None:
    """None when this process can replay; else, when ``may_restart``, restarts the command
    under the preload (no return), or returns why it cannot replay and the fix, one line."""
    if preload_active():
        return None
    asked = PRELOAD_LIBRARY in os.environ.get("LD_PRELOAD", "")
    if asked:
        # Already restarted (or started with it) and the loader could not load the library.
        return (
            f"--replay needs umockdev's {PRELOAD_LIBRARY}, which could not be loaded: "
            f"{INSTALL_HINT}"
        )
    if not may_restart or not sys.executable:
        return (
            f"--replay needs umockdev's {PRELOAD_LIBRARY} in the process: run the command under "
            f"umockdev-wrapper ('umockdev-wrapper {program} scan ... --replay FILE')"
        )
    preload = os.environ.get("LD_PRELOAD", "")
    environment = {**os.environ, "LD_PRELOAD": f"{PRELOAD_LIBRARY}:{preload}".rstrip(":")}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.contextmanager
def replayed(record: Path) -> Iterator[None]:
    """This process sees the host ``record`` describes while the block runs.

    Raises RecordError for a record that cannot be loaded, OSError when it cannot be read.
    """
    # libudev first, while /dev is this host's: making its context runs ldconfig with stdin
    # on /dev/null, and a recorded /dev/null is a mock node, which umockdev's preload ends the
    # process for opening. The scan's UdevSource takes the same (per-thread) context.
    UdevSource()
    scratch = Path(tempfile.mkdtemp(prefix="devplug-replay-"))
    try:
        try:
            host = host_from_record(scratch / "host", record)
        except ValueError as exc:
            if isinstance(exc, RecordError):
                raise
            raise RecordError(f"cannot build the replayed host in {scratch}: {exc}") from None
        with host.activated():
            yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def scan_replayed(program: str, scanners: Sequence[Scanner], output: str, record: Path) -> int:
    """``devplug scan`` on the host ``record`` describes; status 2 for a record that cannot
    be loaded (nothing was scanned)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(replayed(record))
        except RecordError as exc:
            fail(program, f"--replay: {exc}")
            return EXIT_USAGE
        except OSError as exc:
            fail(program, f"--replay: cannot read {record}: {exc.strerror or exc}")
            return EXIT_USAGE
        return scan(program, scanners, output, replayed=True)
