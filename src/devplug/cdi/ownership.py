"""Which spec files devplug wrote, whether the devplug that wrote one still runs, and the
mutex that keeps two daemons' decisions about them apart.

Runtimes parse every ``*.json`` and ``*.yaml`` file in a CDI dir, and CDI libraries before 0.6
refuse a whole spec that carries annotations. So devplug's bookkeeping lives where no runtime
looks: the ``.devplug`` subdirectory of the CDI dir (the CDI library skips subdirectories
and files of other extensions). It holds

- one **record** per spec file devplug wrote (``<spec file name>.owner``, a small JSON
  object): the resource, the instance (config) that wrote it, the running daemon that owns it,
  and the SHA-256 and size of the last two contents written. A spec file counts as devplug's
  only while its content is one its record names: a file someone else put there since is
  theirs.
- one **lock file** per running daemon (``<owner>.lock``), created already locked with
  ``flock`` and held open for the daemon's life. "Is the owner alive" is a non-blocking
  ``flock`` attempt: the kernel drops the lock when the process dies, however it dies, across
  containers and PID namespaces.
- the **mutex** (``.mutex``): deciding that a spec is free, dead or stale and then writing or
  deleting it must not interleave with another devplug doing the same on the same CDI dir, so
  every such step holds an ``flock`` on it for its few milliseconds (:func:`exclusive`).
  Whatever else is in the state dir, taking it never blocks the event loop or a stop: the file
  is opened without waiting on it (a FIFO planted at its name is refused), and the wait for
  another holder is bounded, by MUTEX_TIMEOUT_S and by the caller's own limit (a stop, a
  shutdown's budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiofiles.os

from devplug.cdi.files import (
    UnsafeDirError,
    check_spec_file_name,
    create_exclusively,
    ensure_dir,
    ensure_dir_now,
    fsync_dir,
    read_bounded,
    write_atomically,
)
from devplug.cdi.stamps import FileStamp, stamp_of
from devplug.naming import TEMP_PREFIX

STATE_DIR = ".devplug"
STATE_DIR_MODE = 0o700
RECORD_SUFFIX = ".owner"
RECORD_MODE = 0o600
LOCK_SUFFIX = ".lock"
MUTEX_FILE = ".mutex"
# The longest one check-then-act waits for another's (held for milliseconds by a live one).
MUTEX_TIMEOUT_S = 5.0
MUTEX_POLL_S = 0.005
MAX_RECORD_BYTES = 16 * 1024
# Owners are uuid4 hex; anything else in a record is not a lock file name.
_OWNER = re.compile(r"[0-9a-f]{32}\Z")

_flock = aiofiles.os.wrap(fcntl.flock)
_open = aiofiles.os.wrap(os.open)
_close = aiofiles.os.wrap(os.close)
_fstat = aiofiles.os.wrap(os.fstat)


def content_id(data: bytes) -> tuple[str, int]:
    return hashlib.sha256(data).hexdigest(), len(data)


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    resource: str
    instance: str
    owner: str  # the running daemon's lock name; "" for `devplug cdi generate` (no daemon)
    contents: tuple[tuple[str, int], ...]  # (sha256, size) of the last contents, newest first
    # The config file that `devplug cdi generate` ran with ("" for none given, None for a
    # daemon's record): its --prune removes only what that same config wrote.
    config: str | None = None

    def to_bytes(self) -> bytes:
        document: dict[str, object] = {
            "resource": self.resource,
            "instance": self.instance,
            "owner": self.owner,
            "contents": [list(c) for c in self.contents],
        }
        if self.config is not None:
            document["config"] = self.config
        return json.dumps(document, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> OwnerRecord | None:
        try:
            document = json.loads(data)
            resource, instance, owner = (document[k] for k in ("resource", "instance", "owner"))
            contents = tuple((h, n) for h, n in document["contents"])
            config = document.get("config")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
            return None
        if not all(isinstance(h, str) and type(n) is int and 0 <= n < 1 << 40 for h, n in contents):
            return None
        if not all(isinstance(v, str) for v in (resource, instance, owner)):
            return None
        if config is not None and not isinstance(config, str):
            return None
        return cls(resource, instance, owner, contents, config)

    def names(self, data_id: tuple[str, int]) -> bool:
        return data_id in self.contents

    def sizes(self) -> set[int]:
        return {size for _, size in self.contents}


def state_dir(cdi_dir: Path) -> Path:
    return cdi_dir / STATE_DIR


def record_name(spec_file: str) -> str:
    return spec_file + RECORD_SUFFIX


def record_path(cdi_dir: Path, spec_file: str) -> Path:
    return state_dir(cdi_dir) / record_name(spec_file)


async def read_record(cdi_dir: Path, spec_file: str) -> OwnerRecord | None:
    data = await read_bounded(record_path(cdi_dir, spec_file), MAX_RECORD_BYTES)
    if data is None or len(data) > MAX_RECORD_BYTES:
        return None
    return OwnerRecord.from_bytes(data)


async def write_record(
    cdi_dir: Path, spec_file: str, record: OwnerRecord, *, exclusive: bool = False
) -> FileStamp | None:
    """Store ``record``; with ``exclusive``, only if the spec has no record yet (False then).

    Returns the record file's stamp (None when ``exclusive`` found one already there).
    """
    directory = state_dir(cdi_dir)
    data = record.to_bytes()
    for attempt in range(2):
        try:
            if exclusive:
                return await create_exclusively(
                    directory, record_name(spec_file), data, RECORD_MODE
                )
            return await write_atomically(directory, record_name(spec_file), data, RECORD_MODE)
        except FileNotFoundError:
            if attempt:
                raise
            await ensure_dir(directory, STATE_DIR_MODE, own=True)  # deleted since: once more
    raise AssertionError("unreachable")


async def remove_record(cdi_dir: Path, spec_file: str) -> None:
    directory = state_dir(cdi_dir)
    with contextlib.suppress(FileNotFoundError):
        await aiofiles.os.unlink(directory / record_name(spec_file))
    await fsync_dir(directory)


def _spec_file_name(name: str) -> bool:
    try:
        check_spec_file_name(name)
    except ValueError:
        return False  # anything else in the dir, or in the state dir, is not ours to judge
    return True


def _stale_candidates_now(cdi_dir: Path) -> list[str]:
    try:
        names = os.listdir(state_dir(cdi_dir))
    except OSError:
        return []
    recorded = (n[: -len(RECORD_SUFFIX)] for n in names if n.endswith(RECORD_SUFFIX))
    return sorted(n for n in recorded if _spec_file_name(n))


_stale_candidates = aiofiles.os.wrap(_stale_candidates_now)


async def stale_candidates(cdi_dir: Path) -> list[str]:
    """Spec file names in ``cdi_dir`` that may be devplug's from an earlier run: those with a
    record. One worker-thread hop, however many records the state dir holds; the files of
    other writers in ``cdi_dir`` are not looked at."""
    found: list[str] = await _stale_candidates(cdi_dir)
    return found


def _owner_alive_now(cdi_dir: Path, owner: str) -> bool:
    if not _OWNER.match(owner):
        return False
    path = state_dir(cdi_dir) / (owner + LOCK_SUFFIX)
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # cannot tell (EMFILE, EACCES, ...): never take a live daemon's files
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # EWOULDBLOCK: held; anything else: cannot tell
    finally:
        os.close(handle)  # closing drops the shared lock taken just now
    return False


_owner_alive = aiofiles.os.wrap(_owner_alive_now)


async def owner_alive(cdi_dir: Path, owner: str) -> bool:
    """Whether the daemon ``owner`` still runs (holds its lock)."""
    alive: bool = await _owner_alive(cdi_dir, owner)
    return alive


class OwnerLock:
    """This daemon's mark of life in the state dir: a lock file held for the process's life."""

    def __init__(self, cdi_dir: Path) -> None:
        self.cdi_dir = cdi_dir
        self.owner = uuid.uuid4().hex
        self._handle: int | None = None

    @property
    def path(self) -> Path:
        return state_dir(self.cdi_dir) / (self.owner + LOCK_SUFFIX)

    async def ensure(self) -> None:
        """Hold the lock, with its file in place (created again if the state dir or the file
        was deleted: others would take this daemon for dead). Raises OSError if it cannot."""
        if self._handle is not None:
            try:
                on_disk = stamp_of(await aiofiles.os.stat(self.path, follow_symlinks=False))
                held = stamp_of(await _fstat(self._handle))
                if (on_disk.device, on_disk.inode) == (held.device, held.inode):
                    return
            except FileNotFoundError:
                pass
            await self._drop()
        directory = state_dir(self.cdi_dir)
        await ensure_dir(self.cdi_dir)
        await ensure_dir(directory, STATE_DIR_MODE, own=True)
        # Locked before it gets its name, so nobody ever sees the file unlocked while we live.
        temp = directory / f"{TEMP_PREFIX}{self.owner}"
        with contextlib.suppress(FileNotFoundError):
            await aiofiles.os.unlink(temp)  # an earlier try's, or anything planted there
        # Read-only: an fd open for writing would keep a read-only remount of the dir from
        # working. A new file (O_EXCL), never opened through what someone put at the name.
        flags = os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
        handle = await _open(temp, flags, 0o600)
        try:
            await _flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            await aiofiles.os.replace(temp, self.path)
        except BaseException:
            await _close(handle)
            with contextlib.suppress(OSError):
                await aiofiles.os.unlink(temp)
            raise
        self._handle = handle

    async def release(self) -> None:
        """Give the lock up (orderly shutdown): this daemon's records now read as dead."""
        if self._handle is None:
            return
        with contextlib.suppress(FileNotFoundError):
            await aiofiles.os.unlink(self.path)
        await self._drop()

    async def _drop(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            await _close(handle)


def _remove_dead_locks_now(cdi_dir: Path) -> int:
    directory = state_dir(cdi_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        owner = name[: -len(LOCK_SUFFIX)]
        if not name.endswith(LOCK_SUFFIX) or not _OWNER.match(owner):
            continue
        if _owner_alive_now(cdi_dir, owner):
            continue
        try:
            os.unlink(directory / name)
            removed += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return removed


_remove_dead_locks = aiofiles.os.wrap(_remove_dead_locks_now)


async def remove_dead_locks(cdi_dir: Path) -> int:
    """Delete lock files whose daemon is gone (killed, say); return how many. One
    worker-thread hop for the whole state dir, however many files it holds."""
    removed: int = await _remove_dead_locks(cdi_dir)
    return removed


# ------------------------------------------------------------------------- the mutex


class StateDirBusyError(BlockingIOError):
    """The state dir's mutex stayed held (a frozen or hostile holder) past the wait allowed."""


def _open_mutex_now(cdi_dir: Path) -> int:
    """The state dir, checked (:func:`~devplug.cdi.files.ensure_dir`), and its mutex file open.

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
