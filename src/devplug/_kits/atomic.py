"""Replacing a small file atomically and durably, from a worker thread.

A crash, a full disk or a kill at any moment leaves the old file or the new one, never a mix
and never an empty file: the data goes to a temporary name in the same dir (created
exclusively, with the final mode from the start), is fsynced, renamed over the old name, and
the dir is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def replace_file(path: Path, data: bytes, mode: int, temp_prefix: str) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``); the temporary name starts with
    ``temp_prefix``. Blocking: run it in a thread. Raises OSError with nothing left behind but
    the old file."""
    directory = path.parent
    temporary = directory / f"{temp_prefix}{secrets.token_hex(6)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            # The mode given to open is masked by the umask; the file must have it exactly.
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
