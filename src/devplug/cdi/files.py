"""Spec files on disk: atomic writes, and telling devplug's files from everyone else's.

Blocking; the daemon calls these through ``asyncio.to_thread``. A spec is written to a temp
file in the same directory (named without a ``.json``/``.yaml`` extension, which runtimes
skip), fsynced, given mode 0644 and renamed over the spec's name, then the directory is
fsynced: a runtime sees the old file or the new one, never a part. A file is devplug's when
its spec carries the owner annotation; no other file is ever replaced or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from devplug.cdi.build import (
    DEFAULT_INSTANCE,
    INSTANCE_ANNOTATION,
    OWNER_ANNOTATION,
    OWNER_VALUE,
    RESOURCE_ANNOTATION,
)

TEMP_PREFIX = ".devplug-tmp-"
SPEC_MODE = 0o644
DIR_MODE = 0o755
SPEC_SUFFIXES = (".json", ".yaml")
# Specs of 10,000 devices are a few MiB; anything far bigger is not one of ours.
MAX_READ_BYTES = 64 * 1024 * 1024


def _check_file_name(file_name: str) -> None:
    if (
        "/" in file_name
        or "\0" in file_name
        or file_name.startswith(".")
        or not file_name.endswith(".json")
    ):
        raise ValueError(f"not a spec file name: {file_name!r}")


class ForeignSpecError(FileExistsError):
    """The spec's file name is taken by a file devplug did not write; it is left alone."""


# (device, inode, size, mtime in ns) of a file: tells "the file we wrote" without reading it.
FileStamp = tuple[int, int, int, int]


def file_stamp(path: Path) -> FileStamp | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return _stamp_of(info)


def _stamp_of(info: os.stat_result) -> FileStamp:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def write_spec_file(
    directory: Path, file_name: str, data: bytes, *, ours: FileStamp | None = None
) -> FileStamp:
    """Replace ``directory/file_name`` with ``data`` atomically (creating the directory);
    return the file's stamp.

    Raises OSError (ENOSPC, EACCES, EROFS, ...) with nothing left behind but the old file, and
    ForeignSpecError when the name belongs to a file devplug did not write. ``ours`` is the
    stamp of the file this process wrote last: when it still matches, the file is not read
    again to check its owner (a spec of 10,000 devices takes ~30 ms to parse). A devplug file
    that already holds ``data`` (after a restart, say) is left as it is.
    """
    _check_file_name(file_name)
    target = directory / file_name
    current = file_stamp(target)
    if current is not None and current != ours:
        existing = _read_small_regular(target)
        if existing is None or spec_owner(existing) is None:
            raise ForeignSpecError(
                errno.EEXIST,
                f"{target} exists and was not written by devplug (no {OWNER_ANNOTATION} "
                "annotation); it is left alone: remove it, or give the resource another kind "
                "in cdi.kinds",
            )
        if existing == data:
            return current
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(handle, view)
                view = view[written:]
            os.fchmod(handle, SPEC_MODE)
            os.fsync(handle)
            # Stamped from the open file, not from the name after the rename: someone may
            # delete the file in between, and a missing stamp would read as "still there".
            stamp = _stamp_of(os.fstat(handle))
        finally:
            os.close(handle)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_dir(directory)
    return stamp


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; best effort (some filesystems refuse fsync on a directory)."""
    try:
        handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(handle)
    finally:
        os.close(handle)


def _read_small_regular(path: Path) -> bytes | None:
    """The file's bytes if it is a regular file (not followed through a symlink) that is not
    too big, else None."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_READ_BYTES:
            return None
        chunks = []
        while chunk := os.read(handle, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(handle)


class SpecOwner(NamedTuple):
    resource: str  # "" if the spec does not say
    instance: str  # the devplug instance that wrote it


def spec_owner(data: bytes) -> SpecOwner | None:
    """Who wrote a spec, if devplug did; None for anyone else's (or anything unparsable)."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # YAML specs are never ours: devplug writes JSON
    if not isinstance(document, dict):
        return None
    annotations = document.get("annotations")
    if not isinstance(annotations, dict) or annotations.get(OWNER_ANNOTATION) != OWNER_VALUE:
        return None
    resource = annotations.get(RESOURCE_ANNOTATION, "")
    instance = annotations.get(INSTANCE_ANNOTATION, DEFAULT_INSTANCE)
    return SpecOwner(
        resource if isinstance(resource, str) else "",
        instance if isinstance(instance, str) else "",
    )


def owner_of(path: Path) -> SpecOwner | None:
    data = _read_small_regular(path)
    return None if data is None else spec_owner(data)


def owned_specs(directory: Path, instance: str | None = None) -> dict[str, str]:
    """file name -> resource of devplug's spec files in ``directory`` (of ``instance`` only,
    when given); empty if the directory is absent. Only ``.json`` files: devplug writes no
    other kind."""
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            owner = owner_of(directory / name)
            if owner is not None and instance in (None, owner.instance):
                found[name] = owner.resource
    return found


def remove_owned_spec(
    directory: Path,
    file_name: str,
    *,
    instance: str | None = None,
    stamp: FileStamp | None = None,
) -> bool:
    """Delete ``file_name`` if it is (still) devplug's, of ``instance`` when given, and still
    the very file of ``stamp`` when given (not one another instance wrote since); True if the
    name is free afterwards."""
    _check_file_name(file_name)
    path = directory / file_name
    current = file_stamp(path)
    if current is None:
        return True
    if stamp is not None and current != stamp:
        return False  # rewritten by someone else since: theirs now
    owner = owner_of(path)
    if owner is None or instance not in (None, owner.instance):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _fsync_dir(directory)
    return True


def remove_temp_files(directory: Path, min_age_s: float = 0.0) -> int:
    """Delete temp files an interrupted devplug left behind, older than ``min_age_s`` (a
    younger one may be another instance's write in progress); return how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < min_age_s:
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return removed
