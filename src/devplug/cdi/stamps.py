"""What tells a file devplug wrote from any other, without reading it or importing aiofiles.

Its own module, below :mod:`devplug.cdi.files`, so that Allocate's catalog, loaded at start,
does not pull in aiofiles and its thread pool plumbing for one lstat.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class FileStamp(NamedTuple):
    """Tells "the file we wrote" from any other without reading it."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int  # no utime() can set it back: an in-place rewrite always changes it


def stamp_of(info: os.stat_result) -> FileStamp:
    return FileStamp(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def file_stamp(path: Path) -> FileStamp | None:
    """The stamp of ``path`` (not followed through a symlink), None if it is missing.

    Synchronous on purpose: Allocate confirms its spec with this lstat on the event loop
    (when the CDI dir watch has seen a change since the last one, when that one is 1 s old,
    or when there is no watch: see CdiCatalog.confirm).
    """
    try:
        return stamp_of(os.lstat(path))
    except OSError:
        return None


__all__ = ["FileStamp", "file_stamp", "stamp_of"]
