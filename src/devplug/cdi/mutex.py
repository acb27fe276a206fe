"""The state dir's mutex: one check-then-act on ownership at a time, across daemons.

Deciding that a spec is free, dead or stale and then writing or deleting it must not
interleave with another devplug doing the same on the same CDI dir: every such step holds an
``flock`` on ``.devplug/.mutex`` for its few milliseconds. Whatever else is in the state dir,
taking it never blocks the event loop or a stop: the file is opened without waiting on it
(a FIFO planted at its name is refused), and the wait for another holder is bounded, by
MUTEX_TIMEOUT_S and by the caller's own limit (a stop, a shutdown's budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiofiles.os

from devplug.cdi.files import UnsafeDirError, ensure_dir_now
from devplug.cdi.ownership import STATE_DIR_MODE, state_dir

_close = aiofiles.os.wrap(os.close)

MUTEX_FILE = ".mutex"
# The longest one check-then-act waits for another's (held for milliseconds by a live one).
MUTEX_TIMEOUT_S = 5.0
MUTEX_POLL_S = 0.005


class StateDirBusyError(BlockingIOError):
    """The state dir's mutex stayed held (a frozen or hostile holder) past the wait allowed."""


def _open_mutex_now(cdi_dir: Path) -> int:
    """The state dir, checked (:func:`devplug.cdi.files.ensure_dir`), and its mutex file open.

    Never blocks: a FIFO or device planted at the name is refused from its lstat and opened,
    if it appears in between, without waiting (O_NONBLOCK), then refused from its fstat."""
    directory = state_dir(cdi_dir)
    ensure_dir_now(cdi_dir)
    ensure_dir_now(directory, STATE_DIR_MODE, own=True)
    path = directory / MUTEX_FILE
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    with contextlib.suppress(FileNotFoundError):
        _check_regular(path, os.stat(path, follow_symlinks=False))
    try:
        handle = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _check_regular(path, os.stat(path, follow_symlinks=False))
        raise
    try:
        _check_regular(path, os.fstat(handle))
    except BaseException:
        os.close(handle)
        raise
    return handle


def _check_regular(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeDirError(
            errno.EPERM,
            f"{path} is not a regular file ({_file_type(info.st_mode)}): refused; remove it "
            "and devplug makes it again",
        )


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a file"


_open_mutex = aiofiles.os.wrap(_open_mutex_now)


def _no_cap() -> float:
    return math.inf


@contextlib.asynccontextmanager
async def exclusive(cdi_dir: Path, cap: Callable[[], float] = _no_cap) -> AsyncIterator[None]:
    """Hold the state dir's mutex (flock on ``.devplug/.mutex``) for one check-then-act on
    ownership: deciding a spec is free, dead or stale and then writing or deleting it must
    not interleave with another daemon doing the same. Held for milliseconds; the kernel drops
    it if the holder dies.

    Waits MUTEX_TIMEOUT_S at most, and never past ``cap()`` (a loop time, read at every try:
    the caller's stop or shutdown budget), then raises :class:`StateDirBusyError`. Raises
    :class:`~devplug.cdi.files.UnsafeDirError` for a state dir or mutex file that cannot be
    trusted. Nothing here blocks the loop or waits on a file."""
    handle: int = await _open_mutex(cdi_dir)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = loop.time()
                if now >= min(started + MUTEX_TIMEOUT_S, cap()):
                    raise StateDirBusyError(
                        errno.EAGAIN,
                        f"{state_dir(cdi_dir) / MUTEX_FILE} is held by another process "
                        f"(waited {now - started:.1f} s)",
                    ) from None
                await asyncio.sleep(MUTEX_POLL_S)
        yield
    finally:
        await _close(handle)
