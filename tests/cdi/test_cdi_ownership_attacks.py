"""The CDI ownership bookkeeping under attack: an adversarial review's findings, each a test
that failed before its fix.

- a corrupt record (``1e999``) is unreadable, not an exception that stops every pass;
- ``cdi generate`` checks its files by content (it names no running daemon);
- a daemon that cannot probe another's lock (EMFILE) takes it as alive;
- the file stamp has the ctime: a same-size rewrite in place with the mtime put back is seen;
- a start-up clean-up never deletes a spec another daemon took over meanwhile (the state
  dir's mutex serialises every check-then-act);
- the state dir deleted while running: the records are written again;
- a failed write (full disk) keeps naming what the file holds, so a restart still knows it;
- a holder that dies without a trace in the CDI dir (keep_on_exit, kill -9) is taken over
  at once, not at the next back-off retry;
- ``truncate(2)`` (IN_MODIFY only) is noticed;
- an unreadable record with no spec blocks nothing;
- a state dir others may write in is refused, in one line;
- nothing in the state dir holds up a stop: a frozen holder of its mutex, or a FIFO planted
  at the mutex's name (a real ``devplug run`` and SIGTERM, as a pod's stop sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from devplug.cdi import store as store_module
from devplug.cdi.files import read_bounded
from devplug.cdi.ownership import (
    MUTEX_FILE,
    STATE_DIR,
    OwnerLock,
    owner_alive,
    read_record,
    record_path,
)
from devplug.cdi.stamps import file_stamp
from devplug.cdi.store import ForeignSpecError, SpecHeldError, SpecStore
from devplug.config import CdiSettings, Settings
from devplug.model import DeviceInfo, DeviceNode, Health
from devplug.testing import eventually
from devplug.testing.harness import (
    StaticScanner,
    daemon_process,
    daemon_settings,
    in_process_daemon,
)
from devplug.testing.simulator import KubeletSimulator
from devplug.testing.umockdev import UmockdevHost, add_usb_serial

SERIAL = "example.com/serial"
NAME = "example.com-serial.json"
SPEC = (
    b'{"cdiVersion":"0.3.0","kind":"example.com/serial","devices":[{"name":"a",'
    b'"containerEdits":{"deviceNodes":[{"path":"/dev/null"}]}}]}\n'
)
FOREIGN = SPEC.replace(b'"a"', b'"X"').replace(b"/dev/null", b"/dev/zero")
# What a pod's stop allows before the kubelet's SIGKILL (terminationGracePeriodSeconds).
POD_GRACE_S = 30.0


def devices(count: int) -> dict[str, DeviceInfo]:
    return {
        f"dev{i}": DeviceInfo(health=Health.HEALTHY, nodes=(DeviceNode(f"/dev/ttyX{i}"),))
        for i in range(count)
    }


def settings(kubelet_dir: Path, cdi_dir: Path, **cdi: Any) -> Settings:
    return daemon_settings(kubelet_dir, cdi=CdiSettings(dir=cdi_dir, **cdi))


def overwrite_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.write(data)


@pytest.fixture
def cdi_dir(short_dir: Path) -> Path:
    return short_dir / "cdi"


# ------------------------------------------------------------------------- the store


async def test_a_record_with_an_overflowing_number_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / STATE_DIR).mkdir()
    record_path(tmp_path, NAME).write_text(
        '{"resource":"r","instance":"default","owner":"","contents":[["h",1e999]]}'
    )
    assert await read_record(tmp_path, NAME) is None


async def test_generate_does_not_overwrite_a_file_that_replaced_its_spec(tmp_path: Path) -> None:
    first = SpecStore(tmp_path, "default")  # as `devplug cdi generate` makes it: no lock
    await first.prepare()
    await first.write(NAME, SERIAL, SPEC)
    (tmp_path / NAME).write_bytes(FOREIGN)  # an operator's file now
    second = SpecStore(tmp_path, "default")  # the next `devplug cdi generate`
    await second.prepare()
    with pytest.raises(ForeignSpecError):
        await second.write(NAME, SERIAL, SPEC)
    assert (tmp_path / NAME).read_bytes() == FOREIGN


_HOLDER = """
import asyncio, sys
from pathlib import Path
from devplug.cdi.ownership import OwnerLock
from devplug.cdi.store import SpecStore
async def main():
    d = Path(sys.argv[1])
    s = SpecStore(d, "default", OwnerLock(d))
    await s.prepare()
    await s.write("example.com-serial.json", "example.com/serial", sys.argv[2].encode())
    print(s.owner, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.fixture
def live_holder(tmp_path: Path) -> Iterator[str]:
    """Another process that serves ``NAME`` in ``tmp_path`` and keeps running: its owner token."""
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), SPEC.decode()],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None
            yield holder.stdout.readline().strip()
        finally:
            holder.kill()


def exhaust_fds(directory: Path) -> list[int]:
    """Take every fd this process may still open (open() fails with EMFILE after this). A
    plain file, not /dev/null: umockdev's preload keeps fds of its own for paths under /dev."""
    target = directory / "fd-filler"
    target.touch()
    fds = []
    with contextlib.suppress(OSError):
        while True:
            fds.append(os.open(target, os.O_RDONLY))
    return fds


async def test_a_live_owner_is_alive_even_when_its_lock_cannot_be_opened(
    tmp_path: Path, live_holder: str
) -> None:
    assert await owner_alive(tmp_path, live_holder)
    fds = exhaust_fds(tmp_path)
    try:
        alive = await owner_alive(tmp_path, live_holder)
    finally:
        for fd in fds:
            os.close(fd)
    assert alive, "a probe that cannot open the lock must not declare its daemon dead"


async def test_a_same_size_rewrite_in_place_with_the_mtime_put_back_changes_the_stamp(
    tmp_path: Path,
) -> None:
    store = SpecStore(tmp_path, "default", OwnerLock(tmp_path))
    await store.prepare()
    written = await store.write(NAME, SERIAL, SPEC)
    path = tmp_path / NAME
    info = os.lstat(path)
    # cp -p, rsync -t --inplace, tar: same inode and size
    await asyncio.to_thread(overwrite_in_place, path, FOREIGN)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert file_stamp(path) != written.stamp
    await store.close()


async def test_a_clean_up_never_deletes_a_spec_another_daemon_took_over_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon that wrote the spec and died (kill -9: its lock is free).
    dead = SpecStore(tmp_path, "generic", OwnerLock(tmp_path))
    await dead.prepare()
    await dead.write(NAME, SERIAL, SPEC)
    assert dead.lock is not None
    await dead.lock._drop()
    # cleaner starts without the resource (its start-up clean-up removes stale specs); taker
    # starts with it and takes the spec over, between the cleaner's last check and its unlink.
    cleaner = SpecStore(tmp_path, "generic", OwnerLock(tmp_path))
    taker = SpecStore(tmp_path, "generic", OwnerLock(tmp_path))
    await cleaner.prepare()
    await taker.prepare()
    original = store_module._matching_content
    threads: list[threading.Thread] = []

    async def interleaved(*args: Any) -> Any:
        found = await original(*args)
        if not threads:
            write = taker.write(NAME, SERIAL, SPEC)
            threads.append(threading.Thread(target=asyncio.run, args=(write,)))
            threads[0].start()
            await asyncio.to_thread(threads[0].join, 0.5)  # done, or waiting for the mutex
        return found

    monkeypatch.setattr(store_module, "_matching_content", interleaved)
    await cleaner.remove_stale(NAME)
    monkeypatch.setattr(store_module, "_matching_content", original)
    await asyncio.to_thread(threads[0].join)
    record = await read_record(tmp_path, NAME)
    assert (tmp_path / NAME).exists()
    assert record is not None and record.owner == taker.owner


# ------------------------------------------------------------------------- the daemon


async def test_a_deleted_state_dir_gets_its_records_back_and_a_restart_serves_its_spec(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    config = settings(kubelet_dir, cdi_dir, keep_on_exit=True)
    async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as daemon:
        await kubelet.wait_for_plugin(SERIAL)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        shutil.rmtree(cdi_dir / STATE_DIR)  # a mistaken clean-up of hidden dirs
        await eventually(lambda: record_path(cdi_dir, NAME).exists())
    async with in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})]) as daemon:
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        assert SERIAL in daemon.cdi_catalog.resources()


async def test_a_holder_gone_without_a_trace_is_taken_over_at_once(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    # keep_on_exit: the holder's stop leaves the spec and its record, and only frees a lock
    # inside .devplug; nothing happens in the CDI dir (as after kill -9).
    config = settings(kubelet_dir, cdi_dir, keep_on_exit=True)
    async with contextlib.AsyncExitStack() as second_stack:
        async with contextlib.AsyncExitStack() as first_stack:
            first = await first_stack.enter_async_context(
                in_process_daemon(config, [StaticScanner({SERIAL: devices(2)})])
            )
            await kubelet.wait_for_plugin(SERIAL)
            await first.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            second = await second_stack.enter_async_context(
                in_process_daemon(config, [StaticScanner({SERIAL: devices(3)})])
            )
            # Several failures: its back-off has grown past a few seconds.
            await second.stats.wait_for(lambda s: s.cdi_failures >= 3, timeout=15)
        stopped = time.monotonic()  # the first daemon has stopped
        await second.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=30)
        # Generous for a loaded machine; the back-off it replaces waits 4 s and more here.
        assert time.monotonic() - stopped < 3.0


async def test_a_truncated_spec_is_noticed_and_written_again(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    async with in_process_daemon(
        settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(2)})]
    ) as daemon:
        await kubelet.wait_for_plugin(SERIAL)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
        writes = daemon.stats.value.cdi_writes
        os.truncate(cdi_dir / NAME, 0)  # IN_MODIFY only: no open, no close
        await daemon.stats.wait_for(lambda s: s.cdi_writes > writes, timeout=5)
        assert (cdi_dir / NAME).stat().st_size > 0


async def test_an_in_place_rewrite_with_the_mtime_put_back_is_noticed(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(2)})]
        ) as daemon:
            await kubelet.wait_for_plugin(SERIAL)
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            path = cdi_dir / NAME
            original = path.read_bytes()
            info = os.lstat(path)
            forged = original.replace(b'"name":"dev1"', b'"name":"devX"')
            assert len(forged) == len(original) and forged != original
            await asyncio.to_thread(overwrite_in_place, path, forged)
            os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
            await eventually(lambda: path.read_bytes() == original)
    assert any(entry["event"] == "cdi.spec.rewritten" for entry in logs)


async def test_a_corrupt_record_of_another_file_does_not_stop_the_specs(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    (cdi_dir / STATE_DIR).mkdir(parents=True)
    record_path(cdi_dir, "vendor.example-other.json").write_text(
        '{"resource":"r","instance":"static","owner":"","contents":[["h",1e999]]}'
    )
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(2)})]
        ) as daemon:
            await kubelet.wait_for_plugin(SERIAL)
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)
            assert (cdi_dir / NAME).exists()
    assert not [entry for entry in logs if entry["event"] == "cdi.sync.failed"]


@pytest.mark.parametrize("kind", ["empty", "symlink", "huge"])
async def test_an_unreadable_record_without_its_spec_blocks_nothing(
    kind: str, kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    (cdi_dir / STATE_DIR).mkdir(parents=True)
    record = record_path(cdi_dir, NAME)
    if kind == "empty":
        record.write_bytes(b"")
    elif kind == "symlink":
        os.symlink("/nonexistent", record)
    else:
        record.write_bytes(b" " * (1 << 20) + b"{}")
    async with in_process_daemon(
        settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(2)})]
    ) as daemon:
        await kubelet.wait_for_plugin(SERIAL)
        await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=5)


# ------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_tmpfs(short_dir: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs as the CDI dir (root only: skipped elsewhere)."""
    mount_point = short_dir / "cdi"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """Fill ``directory``'s file system but for ``leave`` bytes."""
    filler = directory / ".filler"
    handle = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(handle, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(handle)
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


async def test_failed_writes_on_a_full_disk_keep_the_file_ours_after_a_crash(
    small_tmpfs: Path,
) -> None:
    first = SpecStore(small_tmpfs, "generic", OwnerLock(small_tmpfs))
    await first.prepare()
    await first.write(NAME, SERIAL, SPEC)
    filler = fill(small_tmpfs, 8192)  # room for a record, not for the new spec
    bigger = SPEC.replace(b'"a"', b'"' + b"a" * 30_000 + b'"')
    for _ in range(2):  # the first try and one retry of the same content
        with pytest.raises(OSError, match="No space left") as failed:
            await first.write(NAME, SERIAL, bigger)
        assert failed.value.errno == errno.ENOSPC
    assert first.lock is not None
    await first.lock._drop()  # kill -9
    filler.unlink()
    second = SpecStore(small_tmpfs, "generic", OwnerLock(small_tmpfs))
    await second.prepare()
    try:
        await second.write(NAME, SERIAL, SPEC.replace(b'"a"', b'"b"'))
    finally:
        await second.close()


async def test_a_held_spec_refused_while_the_holder_lives(tmp_path: Path, live_holder: str) -> None:
    """The fixes above loosen nothing: a live holder's spec stays its own."""
    store = SpecStore(tmp_path, "default", OwnerLock(tmp_path))
    await store.prepare()
    with pytest.raises(SpecHeldError):
        await store.write(NAME, SERIAL, FOREIGN)
    await store.close()
    assert (tmp_path / NAME).read_bytes() == SPEC


async def test_a_state_dir_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lock_like = elsewhere / ("0" * 32 + ".lock")  # what a clean-up of dead locks would delete
    lock_like.write_bytes(b"")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / STATE_DIR).symlink_to(elsewhere)
    store = SpecStore(cdi, "default", OwnerLock(cdi))
    with pytest.raises(NotADirectoryError, match="symlink"):
        await store.prepare()
    with pytest.raises(NotADirectoryError, match="symlink"):
        await store.write(NAME, SERIAL, SPEC)
    assert sorted(os.listdir(elsewhere)) == [lock_like.name]
    assert not (cdi / NAME).exists()


async def test_a_device_node_named_like_a_spec_is_never_opened(tmp_path: Path) -> None:
    # A FIFO stands in for a device: opening it for reading would block without O_NONBLOCK,
    # and a process reading it shows it was opened; lstat alone must refuse it.
    fifo = tmp_path / NAME
    os.mkfifo(fifo)
    opened: list[str] = []
    real_open = os.open

    def watching(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", watching)
        assert await read_bounded(fifo, 4096) is None
    assert str(fifo) not in opened


# ------------------------------------------------------------------------- the state dir


async def test_a_state_dir_others_may_write_in_is_refused_in_one_line(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """Accepted as it was, anyone could plant records there that make a foreign file
    devplug's to replace or delete. Refused with its reason and the fix; removed, the next
    retry writes the spec."""
    state = cdi_dir / STATE_DIR
    state.mkdir(parents=True)
    state.chmod(0o777)
    with structlog.testing.capture_logs() as logs:
        async with in_process_daemon(
            settings(kubelet_dir, cdi_dir), [StaticScanner({SERIAL: devices(1)})]
        ) as daemon:
            await kubelet.wait_for_plugin(SERIAL)
            await daemon.stats.wait_for(lambda s: s.cdi_failures >= 1, timeout=5)
            assert not (cdi_dir / NAME).exists() and os.listdir(state) == []
            shutil.rmtree(state)  # the fix the line gives
            await daemon.stats.wait_for(lambda s: SERIAL in s.cdi_specs, timeout=6)
            assert (state.stat().st_mode & 0o777) == 0o700
    reason = (
        f"EPERM: {state} is writable by other users (mode 0777): refused; remove it and "
        "devplug makes it again (mode 0700)"
    )
    told = [e for e in logs if reason in str(e.get("reason", "")) and e["log_level"] != "debug"]
    assert [(e["event"], e["log_level"]) for e in told] == [("cdi.spec.write_failed", "warning")]
    assert told[0]["reason"] == reason
    assert [e for e in logs if e["event"] == "cdi.sync.failed"] == []


async def test_a_frozen_holder_of_the_state_dirs_mutex_cannot_hold_up_the_shutdown(
    kubelet: KubeletSimulator, kubelet_dir: Path, cdi_dir: Path
) -> None:
    """Each removal used to wait 5 s for the mutex: 8 specs took 40 s, past a pod's 30 s grace.
    Now the whole close has CLOSE_TIMEOUT_S; what it could not remove stays, named in one
    line, and the next start of the instance removes it."""
    resources = {f"example.com/s{i}": devices(1) for i in range(8)}
    files = sorted(f"example.com-s{i}.json" for i in range(8))
    config = settings(kubelet_dir, cdi_dir)
    holder: int | None = None
    try:
        with structlog.testing.capture_logs() as logs:
            async with asyncio.timeout(POD_GRACE_S):  # a bound on the stop, not a latency
                async with in_process_daemon(config, [StaticScanner(resources)]) as daemon:
                    await daemon.stats.wait_for(lambda s: len(s.cdi_specs) == 8, timeout=10)
                    holder = os.open(cdi_dir / STATE_DIR / MUTEX_FILE, os.O_RDONLY)
                    fcntl.flock(holder, fcntl.LOCK_EX)  # another process's, frozen
        (incomplete,) = [e for e in logs if e["event"] == "cdi.close.incomplete"]
        assert incomplete["log_level"] == "warning" and sorted(incomplete["left"]) == files
        assert all(r.startswith("EAGAIN: ") for r in incomplete["left"].values()), incomplete
        assert sorted(p.name for p in cdi_dir.glob("*.json")) == files
    finally:
        if holder is not None:
            os.close(holder)
    async with in_process_daemon(config, [StaticScanner({})]):
        await eventually(lambda: not list(cdi_dir.glob("*.json")))


PROBE_CONFIG = """
hotplug: {source: kernel, coalesce_ms: 2, poll_s: 3600, resync_s: 3600}
scanners:
  generic:
"""
PROBE_RESOURCES = 7  # 7 x 5 s: past a pod's grace on the code that waited per spec


@pytest.mark.parametrize("planted", ["fifo-at-the-mutex", "held-mutex"])
async def test_sigterm_with_a_fifo_or_a_held_lock_in_the_state_dir(
    host: UmockdevHost,
    kubelet: KubeletSimulator,
    kubelet_dir: Path,
    short_dir: Path,
    tmp_path: Path,
    planted: str,
) -> None:
    """A probe of the whole daemon, as a pod's stop meets it: a FIFO at ``.devplug/.mutex``
    (opened without O_NONBLOCK, it hung the stop for good) or another process holding the
    mutex. SIGTERM still ends ``devplug run`` with status 0 within the grace period, its
    plugin sockets gone, and the specs it could not remove are named."""
    config = short_dir / "config.yaml"
    match = '{subsystem: tty, devnode: "/dev/ttyUSB%d"}'
    entries = "".join(
        f"    - {{resource: example.com/s{i}, match: {match % i}}}\n"
        for i in range(PROBE_RESOURCES)
    )
    config.write_text(PROBE_CONFIG + entries)
    for index in range(PROBE_RESOURCES):
        add_usb_serial(host, index=index)
    cdi_dir = kubelet_dir.parent / "cdi"  # daemon_process's
    files = sorted(f"example.com-s{i}.json" for i in range(PROBE_RESOURCES))
    log = tmp_path / "run.log"
    mutex = cdi_dir / STATE_DIR / MUTEX_FILE
    holder: int | None = None
    try:
        async with daemon_process(config, kubelet_dir, env=host.env(), output=log) as process:
            for index in range(PROBE_RESOURCES):
                await kubelet.wait_for_plugin(f"example.com/s{index}", timeout=30)
            await eventually(
                lambda: sorted(p.name for p in cdi_dir.glob("*.json")) == files, timeout=30
            )
            if planted == "fifo-at-the-mutex":
                mutex.unlink()
                os.mkfifo(mutex, 0o600)
            else:
                holder = os.open(mutex, os.O_RDONLY)
                fcntl.flock(holder, fcntl.LOCK_EX)
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(POD_GRACE_S):  # the kubelet's SIGKILL comes then
                    status = await process.wait()
            finally:
                if planted == "fifo-at-the-mutex":
                    with contextlib.suppress(OSError):  # a reader stuck in open() gets a writer
                        os.close(os.open(mutex, os.O_WRONLY | os.O_NONBLOCK))
    finally:
        if holder is not None:
            os.close(holder)
    assert status == 0
    assert [n for n in os.listdir(kubelet_dir) if n.startswith("devplug")] == []
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    events = [e["event"] for e in lines]
    assert "daemon.stopped" in events
    (incomplete,) = [e for e in lines if e["event"] == "cdi.close.incomplete"]
    assert sorted(incomplete["left"]) == files
    expected = "EPERM: " if planted == "fifo-at-the-mutex" else "EAGAIN: "
    assert all(r.startswith(expected) for r in incomplete["left"].values()), incomplete
