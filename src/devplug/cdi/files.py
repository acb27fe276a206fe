"""Files in the CDI dir: atomic replacement, removal and bounded reads, through aiofiles.

A file is written to a temp file in the same directory (named without a ``.json``/``.yaml``
extension, which runtimes skip), fsynced, given its mode and renamed over its name, then the
directory is fsynced: a runtime sees the old file or the new one, never a part. Every read is
bounded and never follows a symlink: the CDI dir is shared with other writers, and one of
their files may be huge (parsing a 57 MB foreign spec costs 1.5 GB of RSS).

Who owns which file is :mod:`devplug.cdi.ownership`'s job; this module only moves bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import aiofiles
import aiofiles.os
import aiofiles.tempfile

from devplug.cdi.stamps import FileStamp, stamp_of
from devplug.naming import TEMP_PREFIX

SPEC_MODE = 0o644
DIR_MODE = 0o755
SPEC_SUFFIXES = (".json", ".yaml")

_fsync = aiofiles.os.wrap(os.fsync)
_fchmod = aiofiles.os.wrap(os.fchmod)
_fstat = aiofiles.os.wrap(os.fstat)
_open = aiofiles.os.wrap(os.open)
_close = aiofiles.os.wrap(os.close)


async def stamp(path: Path) -> FileStamp | None:
    """:func:`devplug.cdi.stamps.file_stamp`, off the event loop."""
    try:
        return stamp_of(await aiofiles.os.stat(path, follow_symlinks=False))
    except OSError:
        return None


def check_spec_file_name(file_name: str) -> None:
    """Refuse anything but a plain ``*.json`` name in the dir (devplug writes nothing else)."""
    if (
        "/" in file_name
        or "\0" in file_name
        or file_name.startswith(".")
        or not file_name.endswith(".json")
    ):
        raise ValueError(f"not a spec file name: {file_name!r}")


class _Aside(NamedTuple):
    path: str  # the temp file's name
    fd: int  # its descriptor, open while the block runs


@contextlib.asynccontextmanager
async def _written_aside(directory: Path, data: bytes, mode: int) -> AsyncIterator[_Aside]:
    """``data`` in a new temp file in ``directory``, flushed, given ``mode`` and fsynced; the
    block puts it into place. The temp name is removed if the block fails."""
    async with aiofiles.tempfile.NamedTemporaryFile(
        "wb", dir=directory, prefix=TEMP_PREFIX, delete=False
    ) as temp:
        aside = _Aside(str(temp.name), temp.fileno())
        try:
            await temp.write(data)
            await temp.flush()
            await _fchmod(aside.fd, mode)
            await _fsync(aside.fd)
            yield aside
        except BaseException:
            await _discard(aside.path)
            raise


async def write_atomically(
    directory: Path, file_name: str, data: bytes, mode: int = SPEC_MODE
) -> FileStamp:
    """Replace ``directory/file_name`` with ``data`` atomically; return the new file's stamp.

    Raises OSError (ENOSPC, EACCES, EROFS, ...) with nothing left behind but the old file.
    Not safe to cancel half way (the rename may still happen in its worker thread): callers
    that can be cancelled shield it.
    """
    async with _written_aside(directory, data, mode) as aside:
        await aiofiles.os.replace(aside.path, directory / file_name)
        # Stamped from the open file after the rename (which sets its ctime), not from the
        # name: someone may delete the file in between.
        written = stamp_of(await _fstat(aside.fd))
    await fsync_dir(directory)
    return written


async def create_exclusively(
    directory: Path, file_name: str, data: bytes, mode: int
) -> FileStamp | None:
    """Create ``directory/file_name`` holding ``data`` unless the name exists (atomically:
    written aside, then hard-linked into place); return its stamp, None if it existed."""
    async with _written_aside(directory, data, mode) as aside:
        try:
            await aiofiles.os.link(aside.path, directory / file_name)
        except FileExistsError:
            return None
        finally:
            await _discard(aside.path)
        # After link and unlink (both set the inode's ctime).
        written = stamp_of(await _fstat(aside.fd))
    await fsync_dir(directory)
    return written


async def _discard(path: str) -> None:
    with contextlib.suppress(OSError):
        await aiofiles.os.unlink(path)


async def fsync_dir(directory: Path) -> None:
    """Make a rename durable; best effort (some filesystems refuse fsync on a directory)."""
    try:
        handle = await _open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            await _fsync(handle)
    finally:
        await _close(handle)


async def remove_file(directory: Path, file_name: str) -> None:
    """Delete ``directory/file_name`` (gone already is fine) and make it durable."""
    with contextlib.suppress(FileNotFoundError):
        await aiofiles.os.unlink(directory / file_name)
    await fsync_dir(directory)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)


def read_bounded_now(path: Path, limit: int) -> bytes | None:
    """:func:`read_bounded`, in the calling thread (for a worker thread's batch of files)."""
    try:
        # Looked at before it is opened: opening some devices acts (a watchdog node arms).
        named = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(named.st_mode):
            return None
        handle = _no_follow(str(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_ino != named.st_ino:
            return None
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(handle, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(handle)


_read_bounded = aiofiles.os.wrap(read_bounded_now)


async def read_bounded(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes from the start of ``path``, if it is a regular file (a symlink,
    FIFO or device is never opened through); None if it cannot be read. Reads ``limit + 1``
    at most, so callers can tell a file that fits from one that is longer. One worker-thread
    hop: a clean-up may look at thousands of files."""
    data: bytes | None = await _read_bounded(path, limit)
    return data


class UnsafeDirError(PermissionError):
    """devplug's own dir is not safe to trust: another user owns it, or others may write in it
    (they could forge the records that say which specs are devplug's). Refused, not repaired:
    what such a dir holds may already be someone else's."""


def ensure_dir_now(directory: Path, mode: int = DIR_MODE, *, own: bool = False) -> None:
    """:func:`ensure_dir`, in the calling thread."""
    try:
        os.makedirs(directory, mode=mode, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory)) from None
    if not own:
        return
    info = os.stat(directory, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "a symlink, not a directory", str(directory))
    if info.st_uid != os.geteuid():
        raise UnsafeDirError(
            errno.EPERM,
            f"{directory} belongs to uid {info.st_uid}, not to devplug's uid {os.geteuid()}: "
            "refused; remove it and devplug makes it again",
        )
    if info.st_mode & 0o022:
        raise UnsafeDirError(
            errno.EPERM,
            f"{directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"refused; remove it and devplug makes it again (mode {mode:04o})",
        )


_ensure_dir = aiofiles.os.wrap(ensure_dir_now)


async def ensure_dir(directory: Path, mode: int = DIR_MODE, *, own: bool = False) -> None:
    """Create ``directory`` (and its parents) if missing; raise OSError if it cannot be, or
    is not a directory. ``own``: devplug's own dir, which must be a real directory (not a
    symlink: whatever it points at would get devplug's records, and lose its lock-like and
    temp-like files) of devplug's user that no other user may write in
    (:class:`UnsafeDirError`)."""
    await _ensure_dir(directory, mode, own=own)


def _remove_temp_files_now(directory: Path, min_age_s: float) -> int:
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    now = time.time()
    for name in names:
        if not name.startswith(TEMP_PREFIX):
            continue
        path = directory / name
        try:
            info = os.stat(path, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return removed


_remove_temp_files = aiofiles.os.wrap(_remove_temp_files_now)


async def remove_temp_files(directory: Path, min_age_s: float = 0.0) -> int:
    """Delete temp files an interrupted devplug left behind, older than ``min_age_s`` (a
    younger one may be another instance's write in progress); return how many. One
    worker-thread hop for the whole dir, however many files it holds."""
    removed: int = await _remove_temp_files(directory, min_age_s)
    return removed
