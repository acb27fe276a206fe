"""Spec files on real filesystems: atomic replacement, a crash mid-write, full and read-only
filesystems, ownership records and locks, and never touching a file devplug did not write.

The full and read-only filesystems are real tmpfs mounts when the tests run as root; without
root, a read-only dir is a chmod 0555 dir (EACCES) and the full-disk test is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiofiles.os
import pytest

from devplug.cdi.files import SPEC_SUFFIXES, UnsafeDirError, remove_temp_files
from devplug.cdi.ownership import (
    MUTEX_FILE,
    MUTEX_TIMEOUT_S,
    STATE_DIR,
    OwnerLock,
    OwnerRecord,
    StateDirBusyError,
    content_id,
    owner_alive,
    read_record,
    record_path,
    write_record,
)
from devplug.cdi.stamps import file_stamp
from devplug.cdi.store import ForeignSpecError, SpecConflictsError, SpecHeldError, SpecStore
from devplug.naming import TEMP_PREFIX

RESOURCE = "example.com/serial"
NAME = "example.com-serial.json"
INSTANCE = "generic"
ROOT = os.geteuid() == 0


def spec(pad: int = 0, kind: str = RESOURCE) -> bytes:
    """A spec document as devplug writes it now: no annotations."""
    document = {
        "cdiVersion": "0.3.0",
        "kind": kind,
        "devices": [
            {"name": "dev0", "containerEdits": {"deviceNodes": [{"path": "/dev/x" + "y" * pad}]}}
        ],
    }
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


def annotated_spec(instance: str | None = INSTANCE, resource: str = RESOURCE) -> bytes:
    """A spec whose annotations say devplug wrote it: no proof, since anyone can write them
    (only a record, or exactly the bytes devplug writes now, make a file devplug's)."""
    annotations = {"devplug.io/managed-by": "devplug", "devplug.io/resource": resource}
    if instance is not None:
        annotations["devplug.io/instance"] = instance
    head = {"cdiVersion": "0.6.0", "kind": resource, "annotations": annotations}
    device = {"name": "dev0", "containerEdits": {"deviceNodes": [{"path": "/dev/x"}]}}
    compact = json.dumps(head, separators=(",", ":")).encode()
    return compact[:-1] + b',"devices":[' + json.dumps(device).encode() + b"]}\n"


FOREIGN = b'{"cdiVersion":"0.6.0","kind":"vendor.example/gpu","devices":[]}\n'


def temp_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX))


def listing(directory: Path) -> list[str]:
    """What a runtime sees in the dir: everything but devplug's state dir."""
    return sorted(n for n in os.listdir(directory) if n != STATE_DIR)


StoreFactory = Callable[..., Awaitable[SpecStore]]


@pytest.fixture
async def store_of() -> AsyncIterator[StoreFactory]:
    """Factory: a daemon's SpecStore (holding a lock of its own) on a dir, prepared."""
    made: list[SpecStore] = []

    async def make(directory: Path, instance: str = INSTANCE, *, lock: bool = True) -> SpecStore:
        store = SpecStore(directory, instance, OwnerLock(directory) if lock else None)
        await store.prepare()
        made.append(store)
        return store

    try:
        yield make
    finally:
        for store in made:
            with contextlib.suppress(OSError):
                await store.close()


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted on ``path`` for the block (root only: skips otherwise)."""
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


# ------------------------------------------------------------------------- writing


async def test_write_creates_the_dir_and_the_file_with_mode_0644_and_exact_content(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    directory = tmp_path / "etc" / "cdi"
    old_umask = os.umask(0o077)  # the modes must not depend on the umask
    try:
        store = await store_of(directory)
        written = await store.write(NAME, RESOURCE, spec(100))
    finally:
        os.umask(old_umask)
    target = directory / NAME
    assert target.read_bytes() == spec(100)
    info = os.lstat(target)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
    assert written.changed and written.stamp == file_stamp(target)
    assert written.stamp == (
        info.st_dev,
        info.st_ino,
        info.st_size,
        info.st_mtime_ns,
        info.st_ctime_ns,
    )
    assert listing(directory) == [NAME]  # no temp file left
    # The bookkeeping sits where no runtime looks, readable by devplug alone.
    state = directory / STATE_DIR
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o700
    record_file = record_path(directory, NAME)
    assert stat.S_IMODE(os.lstat(record_file).st_mode) == 0o600
    record = await read_record(directory, NAME)
    assert record == OwnerRecord(RESOURCE, INSTANCE, store.owner, (content_id(spec(100)),))
    # Besides: the daemon's lock, and the mutex that serialises daemons' check-then-act.
    expected = [record_file.name, f"{store.owner}.lock", MUTEX_FILE]
    assert sorted(os.listdir(state)) == sorted(expected)


async def test_replacing_a_spec_keeps_the_other_files(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    other = tmp_path / "example.com-other.json"
    other.write_bytes(FOREIGN)
    notes = tmp_path / "README"
    notes.write_text("hands off")
    store = await store_of(tmp_path)
    first = await store.write(NAME, RESOURCE, spec(10))
    second = await store.write(NAME, RESOURCE, spec(20))
    assert (tmp_path / NAME).read_bytes() == spec(20)
    assert second.stamp.inode != first.stamp.inode  # a new file, renamed over the old
    record = await read_record(tmp_path, NAME)
    assert record is not None and record.contents == (content_id(spec(20)), content_id(spec(10)))
    assert other.read_bytes() == FOREIGN and notes.read_text() == "hands off"
    assert listing(tmp_path) == sorted([NAME, other.name, notes.name])


@pytest.mark.parametrize(
    "name", ["../x.json", "a/b.json", ".hidden.json", "x.yaml", "x", "x.json\0", ""]
)
async def test_names_that_are_not_spec_file_names_are_refused(
    tmp_path: Path, store_of: StoreFactory, name: str
) -> None:
    store = await store_of(tmp_path)
    with pytest.raises(ValueError, match="not a spec file name"):
        await store.write(name, RESOURCE, spec())
    with pytest.raises(ValueError, match="not a spec file name"):
        await store.remove(name)
    assert listing(tmp_path) == []


async def test_a_failed_write_removes_its_temp_file_and_keeps_the_old_spec(
    tmp_path: Path, store_of: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await store_of(tmp_path)
    await store.write(NAME, RESOURCE, spec(1))
    temps: list[str] = []
    real_replace = aiofiles.os.replace

    async def failing_replace(source: str, target: Path) -> None:
        if Path(target).name != NAME:
            return await real_replace(source, target)  # the record goes through
        temps.append(os.path.basename(source))
        assert Path(source).read_bytes() == spec(2)  # written and complete before the rename
        assert stat.S_IMODE(os.stat(source).st_mode) == 0o644
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(aiofiles.os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        await store.write(NAME, RESOURCE, spec(2))
    monkeypatch.undo()
    assert (tmp_path / NAME).read_bytes() == spec(1)
    assert listing(tmp_path) == [NAME]
    (temp,) = temps
    assert temp.startswith(TEMP_PREFIX) and not temp.endswith(SPEC_SUFFIXES)
    # The record names both contents, so the old file is still recognised as ours.
    record = await read_record(tmp_path, NAME)
    assert record is not None and content_id(spec(1)) in record.contents
    assert (await store.write(NAME, RESOURCE, spec(3))).changed


# A child that writes a spec and is killed once the temp file holds all of it but before the
# rename: the fchmod after the write announces it and hangs until the SIGKILL.
CRASHING_WRITER = """
import asyncio, sys, time
from pathlib import Path
from devplug.cdi import files
from devplug.cdi.store import SpecStore

real_fchmod = files._fchmod

async def announce_and_hang(handle, mode):
    if mode == files.SPEC_MODE:
        sys.stdout.write("written\\n")
        sys.stdout.flush()
        time.sleep(60)
    await real_fchmod(handle, mode)

files._fchmod = announce_and_hang

async def main():
    store = SpecStore(Path(sys.argv[1]), "generic")
    await store.prepare()
    await store.write(sys.argv[2], "example.com/serial", Path(sys.argv[3]).read_bytes())

asyncio.run(main())
"""


async def test_a_crash_mid_write_leaves_the_old_spec_and_a_temp_file_runtimes_skip(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    directory = tmp_path / "cdi"
    old = spec(10)
    first = await store_of(directory)
    await first.write(NAME, RESOURCE, old)
    await first.close()  # that daemon is gone; its spec stays
    new = spec(4 * 1024 * 1024)
    payload = tmp_path / "payload"
    payload.write_bytes(new)
    # Driven by blocking line reads: nothing else runs on this test's loop meanwhile.
    child = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", CRASHING_WRITER, str(directory), NAME, str(payload)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "written\n", child.stderr.read() if child.stderr else ""
        (temp,) = temp_files(directory)
        assert (directory / temp).stat().st_size == len(new)
        assert (directory / NAME).read_bytes() == old
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()
    assert (directory / NAME).read_bytes() == old
    assert temp_files(directory) == [temp]  # left behind by the crash...
    assert not temp.endswith(SPEC_SUFFIXES)  # ...under a name runtimes do not load
    # The record written before the crash names the new content and the old: the file is
    # still recognised as devplug's, and the next daemon of the instance takes it over.
    record = await read_record(directory, NAME)
    assert record is not None and record.contents == (content_id(new), content_id(old))
    assert await remove_temp_files(directory) == 1
    assert listing(directory) == [NAME]
    assert await remove_temp_files(directory) == 0
    after = await store_of(directory)
    assert (await after.write(NAME, RESOURCE, spec(5))).changed


async def test_remove_temp_files_touches_only_regular_temp_files(tmp_path: Path) -> None:
    (tmp_path / f"{TEMP_PREFIX}a").write_bytes(b"partial")
    (tmp_path / f"{TEMP_PREFIX}b").write_bytes(b"")
    (tmp_path / f"{TEMP_PREFIX}dir").mkdir()
    (tmp_path / "elsewhere").write_text("target")
    (tmp_path / f"{TEMP_PREFIX}link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "x-devplug-tmp-c").write_text("not a prefix")
    (tmp_path / NAME).write_bytes(spec())
    assert await remove_temp_files(tmp_path) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{TEMP_PREFIX}dir", f"{TEMP_PREFIX}link", "elsewhere", "x-devplug-tmp-c", NAME]
    )
    assert await remove_temp_files(tmp_path / "absent") == 0


# ------------------------------------------------------------------------- full and read-only


async def test_a_full_filesystem_raises_enospc_and_keeps_the_old_spec(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    with tmpfs(tmp_path / "full", "size=16k,mode=0755") as directory:
        store = await store_of(directory)
        old = spec(10)
        await store.write(NAME, RESOURCE, old)
        with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)) as failed:
            await store.write(NAME, RESOURCE, spec(256 * 1024))
        assert failed.value.errno == errno.ENOSPC
        assert not isinstance(failed.value, FileExistsError)
        assert (directory / NAME).read_bytes() == old
        assert listing(directory) == [NAME]  # the temp file is gone
        # The space came back: a spec that fits is written.
        await store.write(NAME, RESOURCE, spec(20))
        assert (directory / NAME).read_bytes() == spec(20)
        await store.close()


async def test_an_unwritable_dir_raises_and_keeps_the_old_spec(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    directory = tmp_path / "cdi"
    with contextlib.ExitStack() as stack:
        if ROOT:
            stack.enter_context(tmpfs(directory, "size=1m,mode=0755"))
        store = await store_of(directory)
        await store.write(NAME, RESOURCE, spec(1))
        if ROOT:
            remount(directory, "ro")
            expected = errno.EROFS
        else:
            directory.chmod(0o555)
            stack.callback(directory.chmod, 0o755)
            expected = errno.EACCES
        with pytest.raises(OSError, match=os.strerror(expected)) as failed:
            await store.write(NAME, RESOURCE, spec(2))
        assert failed.value.errno == expected
        assert (directory / NAME).read_bytes() == spec(1)
        assert listing(directory) == [NAME]
        # A dir that has to be created below it fails the same way.
        below = SpecStore(directory / "sub")
        with pytest.raises(OSError, match=os.strerror(expected)) as nested:
            await below.prepare()
        assert nested.value.errno == expected
        # Removing is refused too, and the file stays.
        with pytest.raises(OSError, match=os.strerror(expected)) as removing:
            await store.remove(NAME)
        assert removing.value.errno in (expected, errno.EACCES)
        assert (directory / NAME).read_bytes() == spec(1)
        if ROOT:
            remount(directory, "rw")
        await store.close()


# ------------------------------------------------------------------------- ownership


@pytest.mark.parametrize(
    "content",
    [
        FOREIGN,
        b'{"kind":"example.com/serial","annotations":{"vendor.example/owner":"x"}}',
        annotated_spec(),  # claims to be devplug's, of this very instance
        b"cdiVersion: 0.6.0\nkind: example.com/serial\n",  # YAML in a .json file
        b"",
        b"\xff\xfe not text",
        # devplug's shape, but not the bytes it writes now, and no record: not provably its own.
        spec(1),
        spec().replace(b"dev0", b"dev1"),  # the size of the bytes devplug writes, not them
    ],
    ids=[
        "json",
        "other-annotations",
        "claims-devplug",
        "yaml",
        "empty",
        "binary",
        "lookalike",
        "same-size",
    ],
)
async def test_a_file_devplug_did_not_write_is_never_replaced(
    tmp_path: Path, store_of: StoreFactory, content: bytes
) -> None:
    target = tmp_path / NAME
    target.write_bytes(content)
    before = file_stamp(target)
    store = await store_of(tmp_path)
    with pytest.raises(ForeignSpecError) as refused:
        await store.write(NAME, RESOURCE, spec())
    assert refused.value.errno == errno.EEXIST
    assert "not written by devplug" in str(refused.value)
    assert target.read_bytes() == content and file_stamp(target) == before
    assert await store.remove(NAME) is False
    assert await store.remove_stale(NAME) is None
    assert target.read_bytes() == content
    assert listing(tmp_path) == [NAME]


async def test_a_symlink_at_the_spec_name_is_not_followed(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    looks_ours = tmp_path / "elsewhere.json"
    looks_ours.write_bytes(spec(5))  # the link points at exactly the bytes devplug writes
    link = tmp_path / NAME
    link.symlink_to(looks_ours)
    store = await store_of(tmp_path)
    with pytest.raises(ForeignSpecError):
        await store.write(NAME, RESOURCE, spec(5))
    assert await store.remove_stale(NAME) is None
    assert link.is_symlink() and looks_ours.read_bytes() == spec(5)
    looks_ours.unlink()  # a dangling link is not ours either
    with pytest.raises(ForeignSpecError):
        await store.write(NAME, RESOURCE, spec())
    assert link.is_symlink()


async def test_a_gone_daemons_spec_is_taken_over_and_identical_content_kept(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    first = await store_of(tmp_path)
    written = await first.write(NAME, RESOURCE, spec(7))
    await first.close()  # keep_on_exit, or a crash: the spec stays, its owner is gone
    second = await store_of(tmp_path)
    kept = await second.write(NAME, RESOURCE, spec(7))
    assert not kept.changed and kept.stamp == written.stamp  # runtimes see no change
    record = await read_record(tmp_path, NAME)
    assert record is not None and record.owner == second.owner
    assert (await second.write(NAME, RESOURCE, spec(8))).changed


async def test_a_running_daemons_spec_is_left_to_it_until_it_goes(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    serving = await store_of(tmp_path, "intel_gpu")
    written = await serving.write(NAME, RESOURCE, spec(1))
    second = await store_of(tmp_path, "intel_gpu")  # the same config, started again
    with pytest.raises(SpecHeldError) as held:
        await second.write(NAME, RESOURCE, spec(2))
    assert held.value.instance == "intel_gpu" and held.value.resource == RESOURCE
    assert "another running devplug" in str(held.value)
    assert await second.remove(NAME) is False
    assert await second.remove_stale(NAME) is None
    assert file_stamp(tmp_path / NAME) == written.stamp
    await serving.close()  # it stopped (keeping its spec): now the second takes over
    assert (await second.write(NAME, RESOURCE, spec(2))).changed


# A child that holds a daemon's lock and is then killed: the kernel drops the flock.
LOCK_HOLDER = """
import asyncio, sys, time
from pathlib import Path
from devplug.cdi.ownership import OwnerLock

async def main():
    lock = OwnerLock(Path(sys.argv[1]))
    await lock.ensure()
    sys.stdout.write(lock.owner + "\\n")
    sys.stdout.flush()
    time.sleep(60)

asyncio.run(main())
"""


async def test_a_killed_daemon_reads_as_gone(tmp_path: Path, store_of: StoreFactory) -> None:
    child = subprocess.Popen(  # noqa: ASYNC220 - as above: a blocking line read, nothing else runs
        [sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        owner = child.stdout.readline().strip()
        assert await owner_alive(tmp_path, owner)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert not await owner_alive(tmp_path, owner)
    assert not await owner_alive(tmp_path, "")  # cdi generate's records: never alive
    assert not await owner_alive(tmp_path, "../../etc/passwd")
    store = await store_of(tmp_path)
    assert await store.remove_dead_locks() == 1
    assert not (tmp_path / STATE_DIR / f"{owner}.lock").exists()
    assert (tmp_path / STATE_DIR / f"{store.owner}.lock").exists()  # the living one stays


async def test_a_deleted_state_dir_is_made_again_and_the_spec_stays_ours(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    store = await store_of(tmp_path)
    await store.write(NAME, RESOURCE, spec(1))
    for path in sorted((tmp_path / STATE_DIR).iterdir()):
        path.unlink()
    (tmp_path / STATE_DIR).rmdir()
    other = await store_of(tmp_path)
    await store.prepare()  # the daemon's next pass: its lock is back
    assert await owner_alive(tmp_path, store.owner)
    with pytest.raises(ForeignSpecError):  # no record: not the other's to take
        await other.write(NAME, RESOURCE, spec(2))
    assert (await store.write(NAME, RESOURCE, spec(3))).changed  # still ours
    assert await store.remove(NAME) is True
    assert not (tmp_path / NAME).exists()


async def test_a_record_whose_file_someone_replaced_no_longer_covers_it(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    gone = await store_of(tmp_path)
    await gone.write(NAME, RESOURCE, spec(1))
    await gone.close()
    (tmp_path / NAME).write_bytes(FOREIGN)  # another writer, while no devplug ran
    store = await store_of(tmp_path)
    with pytest.raises(ForeignSpecError):
        await store.write(NAME, RESOURCE, spec(2))
    assert await store.remove_stale(NAME) is None
    assert (tmp_path / NAME).read_bytes() == FOREIGN
    assert await read_record(tmp_path, NAME) is None  # the wrong record is dropped


async def test_remove_takes_only_this_daemons_spec(tmp_path: Path, store_of: StoreFactory) -> None:
    store = await store_of(tmp_path)
    written = await store.write(NAME, RESOURCE, spec())
    (tmp_path / "vendor-foreign.json").write_bytes(FOREIGN)
    assert await store.remove("vendor-foreign.json") is False
    assert (tmp_path / "vendor-foreign.json").read_bytes() == FOREIGN
    # Changed behind our back since it was written: the content is someone else's now.
    replaced = tmp_path / "replacement"
    replaced.write_bytes(spec(9))
    os.replace(replaced, tmp_path / NAME)
    assert await store.remove(NAME, expected=written.stamp) is True
    assert (tmp_path / NAME).read_bytes() == spec(9)  # left, only our record is gone
    assert await read_record(tmp_path, NAME) is None
    # Ours and unchanged: spec and record go.
    again = await store_of(tmp_path, "other")
    (tmp_path / NAME).unlink()
    second = await again.write(NAME, RESOURCE, spec(2))
    assert await again.remove(NAME, expected=second.stamp) is True
    assert not (tmp_path / NAME).exists() and await read_record(tmp_path, NAME) is None
    assert await again.remove(NAME) is False  # nothing of ours left


async def test_stale_specs_of_this_instance_are_found_and_removed(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    earlier = await store_of(tmp_path, INSTANCE)
    await earlier.write("example.com-gone.json", "example.com/gone", spec(kind="example.com/gone"))
    theirs = await store_of(tmp_path, "intel_gpu")
    await theirs.write(
        "gpu.intel.com-i915.json", "gpu.intel.com/i915", spec(kind="gpu.intel.com/i915")
    )
    await earlier.close()
    await theirs.close()  # both gone; each instance cleans up only its own
    # Files that claim to be this instance's spec, without a record: not candidates.
    (tmp_path / "example.com-claimed.json").write_bytes(annotated_spec())
    (tmp_path / "vendor-foreign.json").write_bytes(FOREIGN)
    (tmp_path / "vendor.yaml").write_bytes(b"kind: vendor.example/y\n")
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")  # must not block the scan
    orphan = OwnerRecord("example.com/orphan", INSTANCE, "", ())
    await write_record(tmp_path, "example.com-orphan.json", orphan)  # its spec is gone
    # Stray files in the state dir name no spec file: nothing to judge, nothing to stop on.
    (tmp_path / STATE_DIR / "foreign.owner").write_bytes(orphan.to_bytes())
    (tmp_path / STATE_DIR / "notes.txt").write_text("hands off")
    store = await store_of(tmp_path, INSTANCE)
    candidates = await store.stale_candidates()
    assert candidates == [
        "example.com-gone.json",
        "example.com-orphan.json",
        "gpu.intel.com-i915.json",
    ]
    removed = {name: await store.remove_stale(name) for name in candidates}
    assert {n: r for n, r in removed.items() if r is not None} == {
        "example.com-gone.json": "example.com/gone",
    }
    assert listing(tmp_path) == sorted(
        [
            "gpu.intel.com-i915.json",
            "example.com-claimed.json",
            "vendor-foreign.json",
            "vendor.yaml",
            "dir.json",
            "fifo.json",
        ]
    )
    assert await read_record(tmp_path, "example.com-orphan.json") is None
    assert await read_record(tmp_path, "gpu.intel.com-i915.json") is not None
    assert (tmp_path / STATE_DIR / "foreign.owner").exists()
    assert (tmp_path / STATE_DIR / "notes.txt").read_text() == "hands off"


async def test_cdi_generate_records_name_no_running_owner(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    generated = SpecStore(tmp_path, INSTANCE)  # `devplug cdi generate`: no lock
    await generated.prepare()
    await generated.write(NAME, RESOURCE, spec(1))
    record = await read_record(tmp_path, NAME)
    assert record is not None and record.owner == ""
    assert not (tmp_path / STATE_DIR / ".lock").exists()
    daemon = await store_of(tmp_path, INSTANCE)
    assert (await daemon.write(NAME, RESOURCE, spec(2))).changed
    # A later generate run may not take a running daemon's spec.
    with pytest.raises(SpecHeldError):
        await generated.write(NAME, RESOURCE, spec(3))


@pytest.mark.parametrize("lock", [True, False], ids=["daemon", "generate"])
async def test_a_copy_of_devplugs_spec_without_its_record_is_recognised_by_content(
    tmp_path: Path, store_of: StoreFactory, lock: bool
) -> None:
    """A spec copied from another CDI dir (its record stays behind there) holds exactly the
    bytes devplug writes: it is devplug's, kept as it is, and recorded."""
    source = tmp_path / "from"
    source.mkdir()
    await (await store_of(source)).write(NAME, RESOURCE, spec(4))
    copy = tmp_path / "to"
    copy.mkdir()
    shutil.copy2(source / NAME, copy / NAME)
    before = file_stamp(copy / NAME)
    store = await store_of(copy, lock=lock)
    kept = await store.write(NAME, RESOURCE, spec(4))
    assert not kept.changed and kept.stamp == before == file_stamp(copy / NAME)
    record = await read_record(copy, NAME)
    assert record is not None and record.owner == store.owner
    assert record.contents == (content_id(spec(4)),)
    assert (await store.write(NAME, RESOURCE, spec(5))).changed  # ours from now on


def plant_foreign_owner(path: Path) -> None:
    os.chown(path, 1000, 1000)


def plant_writable_mode(path: Path) -> None:
    path.chmod(0o666)


def plant_second_link(path: Path) -> None:
    os.link(path, path.parent.parent / "elsewhere.json")


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(
            plant_foreign_owner, marks=pytest.mark.skipif(not ROOT, reason="chown needs root")
        ),
        plant_writable_mode,
        plant_second_link,
    ],
)
@pytest.mark.parametrize("recorded", [False, True], ids=["no record", "a dead daemon's record"])
async def test_devplugs_bytes_that_others_can_change_are_replaced_not_kept(
    tmp_path: Path, store_of: StoreFactory, plant: Callable[[Path], None], recorded: bool
) -> None:
    """Issue 25 review: devplug's exact bytes planted in the CDI dir as uid 1000, mode 0666
    were adopted with their inode; a later in-place edit adding a createContainer hook was
    rewritten only within 1 s, long enough for a runtime that reloads on inotify. Now a file
    with the right bytes is kept only if it is a regular file of devplug's user, with one
    link, that no one else can write; otherwise it is replaced atomically by devplug's own."""
    directory = tmp_path / "cdi"
    directory.mkdir()
    if recorded:
        gone = await store_of(directory, INSTANCE)  # wrote it, then went away
        await gone.write(NAME, RESOURCE, spec(4))
        await gone.close()
    else:
        (directory / NAME).write_bytes(spec(4))
    plant(directory / NAME)
    planted = file_stamp(directory / NAME)
    store = await store_of(directory, INSTANCE)
    written = await store.write(NAME, RESOURCE, spec(4))
    assert written.changed, "the planted file was kept"
    info = os.lstat(directory / NAME)
    assert planted is not None and info.st_ino != planted.inode
    assert (info.st_uid, stat.S_IMODE(info.st_mode), info.st_nlink) == (os.geteuid(), 0o644, 1)
    assert (directory / NAME).read_bytes() == spec(4)
    record = await read_record(directory, NAME)
    assert record is not None and record.owner == store.owner


async def test_write_all_names_every_name_taken_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    names = ["example.com-a.json", "example.com-b.json", "example.com-c.json"]
    (tmp_path / names[0]).write_bytes(FOREIGN)
    (tmp_path / names[2]).write_bytes(annotated_spec(instance="vfio"))
    generated = SpecStore(tmp_path, INSTANCE)  # `devplug cdi generate`: no lock
    with pytest.raises(SpecConflictsError) as refused:
        await generated.write_all([(n, RESOURCE, spec(i)) for i, n in enumerate(names)])
    message = str(refused.value.strerror)
    assert message.startswith("2 spec files are taken") and "nothing was written" in message
    assert f"{tmp_path / names[0]} exists and was not written by devplug" in message
    assert f"{tmp_path / names[2]} exists and was not written by devplug" in message
    assert len(refused.value.conflicts) == 2 and refused.value.errno == errno.EEXIST
    # Nothing written, nothing made: no spec, no state dir, no lock or mutex file.
    assert sorted(os.listdir(tmp_path)) == [names[0], names[2]]


async def test_a_generate_prune_takes_only_what_its_own_config_wrote(tmp_path: Path) -> None:
    """Two configs with the same scanners (so the same instance) generate into one dir: each
    one's prune leaves the other's specs, and specs whose config is not known, alone."""
    serial = SpecStore(tmp_path, INSTANCE, config="/etc/devplug/serial.yaml")
    dry_run = SpecStore(tmp_path, INSTANCE, config="/etc/devplug/dry-run.yaml")
    await serial.write_all([("example.com-serial.json", RESOURCE, spec(1))])
    await dry_run.write_all([("example.com-null.json", "example.com/null", spec(2))])
    daemon_like = SpecStore(tmp_path, INSTANCE)  # no config: a record of a daemon's kind
    await daemon_like.write("example.com-kept.json", "example.com/kept", spec(3))
    (tmp_path / "example.com-claimed.json").write_bytes(annotated_spec())  # no record
    record = await read_record(tmp_path, "example.com-serial.json")
    assert record is not None and record.config == "/etc/devplug/serial.yaml"

    candidates = await serial.stale_candidates()
    assert candidates == [
        "example.com-kept.json",
        "example.com-null.json",
        "example.com-serial.json",
    ]
    # The serial config still makes its resource: everything else is tried, nothing goes.
    assert [n for n in candidates[:2] if await serial.remove_stale(n) is not None] == []
    # The serial config no longer makes its resource: its own prune takes its spec.
    assert await serial.remove_stale("example.com-serial.json") == RESOURCE
    assert listing(tmp_path) == [
        "example.com-claimed.json",
        "example.com-kept.json",
        "example.com-null.json",
    ]


@pytest.mark.parametrize("wrong", ["mode", "owner"])
async def test_a_state_dir_others_may_write_in_is_refused_with_its_reason(
    tmp_path: Path, wrong: str
) -> None:
    state = tmp_path / STATE_DIR
    state.mkdir(mode=0o700)
    if wrong == "mode":
        state.chmod(0o777)
        expected = f"{state} is writable by other users (mode 0777): refused"
    else:
        if not ROOT:
            pytest.skip("giving the state dir to another user needs root")
        os.chown(state, 65534, 65534)
        expected = f"{state} belongs to uid 65534, not to devplug's uid 0: refused"
    store = SpecStore(tmp_path, INSTANCE, OwnerLock(tmp_path))
    for attempt in (store.prepare(), store.write(NAME, RESOURCE, spec())):
        with pytest.raises(UnsafeDirError) as refused:
            await attempt
        assert str(refused.value.strerror).startswith(expected)
        assert "remove it and devplug makes it again" in str(refused.value.strerror)
    generated = SpecStore(tmp_path, INSTANCE)
    with pytest.raises(UnsafeDirError):
        await generated.write_all([(NAME, RESOURCE, spec())])
    assert os.listdir(state) == [] and not (tmp_path / NAME).exists()


# Opens a FIFO for writing if a reader waits on it, and exits.
_FIFO_WRITER = """
import os, sys
try:
    os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
except OSError:
    pass
"""


def open_writer_elsewhere(fifo: Path) -> None:
    """Give a reader stuck in open() on ``fifo`` a writer, from another process: under
    umockdev's preload, an open() stuck in one thread holds up every open() of this process.
    (No pipes or /dev/null for the child: opening them here would wait too.)"""
    subprocess.run(
        [sys.executable, "-c", _FIFO_WRITER, str(fifo)], close_fds=False, check=False, timeout=30
    )


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
async def test_a_mutex_that_is_not_a_file_is_refused_without_waiting_on_it(
    tmp_path: Path, store_of: StoreFactory, planted: str
) -> None:
    """Opening a FIFO for reading waits for a writer: without O_NONBLOCK the CDI work (and
    a shutdown awaiting it) would hang on it for ever."""
    store = await store_of(tmp_path)
    mutex = tmp_path / STATE_DIR / MUTEX_FILE
    with contextlib.suppress(FileNotFoundError):
        mutex.unlink()
    if planted == "fifo":
        os.mkfifo(mutex, 0o600)
    else:
        mutex.symlink_to(tmp_path / "elsewhere")
    try:
        async with asyncio.timeout(10):  # a bound on a hang
            with pytest.raises(UnsafeDirError) as refused:
                await store.write(NAME, RESOURCE, spec())
    finally:
        if planted == "fifo":
            open_writer_elsewhere(mutex)  # a reader stuck in open() gets its writer
    kind = "a FIFO" if planted == "fifo" else "a symlink"
    assert str(refused.value.strerror) == (
        f"{mutex} is not a regular file ({kind}): refused; remove it and devplug makes it again"
    )
    assert not (tmp_path / NAME).exists() and not (tmp_path / "elsewhere").exists()


async def test_waits_for_a_held_mutex_end_at_the_stores_limit(
    tmp_path: Path, store_of: StoreFactory
) -> None:
    store = await store_of(tmp_path)
    await store.write(NAME, RESOURCE, spec())
    holder = os.open(tmp_path / STATE_DIR / MUTEX_FILE, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process's check-then-act, frozen
        store.limit_waits(-math.inf)  # stopping: no more waiting
        async with asyncio.timeout(MUTEX_TIMEOUT_S / 2):  # a bound on a hang
            with pytest.raises(StateDirBusyError, match="held by another process"):
                await store.remove(NAME)
        assert (tmp_path / NAME).exists()
        store.limit_waits(math.inf)
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert await store.remove(NAME)
    finally:
        os.close(holder)


def test_an_owner_record_that_is_not_one_reads_as_none() -> None:
    for data in (b"", b"[]", b'{"resource":1}', b"\xff", b'{"resource":"a","instance":"b"}'):
        assert OwnerRecord.from_bytes(data) is None
    record = OwnerRecord("a/b", "i", "0" * 32, (("ab", 3),))
    assert OwnerRecord.from_bytes(record.to_bytes()) == record
