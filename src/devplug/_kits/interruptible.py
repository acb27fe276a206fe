"""Reading a whole file in a way a signal can cut short, in the main thread.

Python runs a signal's handler between bytecodes. A signal that comes after the last such
point and before a blocking ``read(2)`` begins is only handled once that read returns: a
config path that is a FIFO nobody writes (or a slow pipe) then holds the process through a
SIGTERM for good. Here the wait for data is a ``select()`` that also watches the signals'
wakeup fd (:func:`signal.set_wakeup_fd`): the C-level handler writes to it whenever a
signal comes, before or during the wait, so the wait ends and the handler runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import stat
import threading
from pathlib import Path

__all__ = ["read_bytes"]

_CHUNK = 1 << 16


def read_bytes(path: Path) -> bytes:
    """The file's bytes, as :meth:`Path.read_bytes` gives them; raises what it raises
    (OSError and its kinds). A regular file is read as it is: its reads never wait."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode) or threading.current_thread() is not (
            threading.main_thread()
        ):
            with os.fdopen(fd, "rb", closefd=False) as file:
                return file.read()
        return _read_waking_on_signals(fd)
    finally:
        os.close(fd)


def _read_waking_on_signals(fd: int) -> bytes:
    wake_reader, wake_writer = socket.socketpair()
    with wake_reader, wake_writer:
        wake_reader.setblocking(False)
        wake_writer.setblocking(False)
        previous = signal.set_wakeup_fd(wake_writer.fileno(), warn_on_full_buffer=False)
        try:
            chunks: list[bytes] = []
            wake = wake_reader.fileno()
            while True:
                ready, _, _ = select.select([fd, wake], [], [])
                if wake in ready:  # a signal: its handler runs before the next read
                    with contextlib.suppress(BlockingIOError):
                        wake_reader.recv(_CHUNK)
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        finally:
            signal.set_wakeup_fd(previous)
