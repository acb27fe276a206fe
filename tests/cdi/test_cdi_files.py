"""Spec files on real filesystems: atomic replacement, a crash mid-write, full and read-only
filesystems, and never touching a file devplug did not write.

The full and read-only filesystems are real tmpfs mounts when the tests run as root; without
root, a read-only dir is a chmod 0555 dir (EACCES) and the full-disk test is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devplug.cdi.build import OWNER_ANNOTATION, OWNER_VALUE, RESOURCE_ANNOTATION
from devplug.cdi.files import (
    SPEC_SUFFIXES,
    TEMP_PREFIX,
    ForeignSpecError,
    file_stamp,
    owned_specs,
    owner_of,
    remove_owned_spec,
    remove_temp_files,
    write_spec_file,
)

RESOURCE = "example.com/serial"
NAME = "example.com-serial.json"
ROOT = os.geteuid() == 0


def owned(resource: str | None = RESOURCE, pad: int = 0, **extra: object) -> bytes:
    """A spec document carrying devplug's owner annotation (``resource`` None: unnamed)."""
    annotations = {OWNER_ANNOTATION: OWNER_VALUE}
    if resource is not None:
        annotations[RESOURCE_ANNOTATION] = resource
    document: dict[str, object] = {
        "cdiVersion": "0.3.0",
        "kind": resource or "example.com/unnamed",
        "annotations": annotations,
        "devices": [{"name": "dev0", "containerEdits": {"env": ["PAD=" + "x" * pad]}}],
        **extra,
    }
    return json.dumps(document).encode() + b"\n"


FOREIGN = b'{"cdiVersion":"0.6.0","kind":"vendor.example/gpu","devices":[]}\n'


def temp_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX))


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


def test_write_creates_the_dir_and_the_file_with_mode_0644_and_exact_content(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "etc" / "cdi"
    data = owned(pad=100)
    old_umask = os.umask(0o077)  # the mode must not depend on the umask
    try:
        stamp = write_spec_file(directory, NAME, data)
    finally:
        os.umask(old_umask)
    target = directory / NAME
    assert target.read_bytes() == data
    info = os.lstat(target)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
    assert stamp == file_stamp(target)
    assert stamp == (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    assert directory.is_dir()
    assert os.listdir(directory) == [NAME]  # no temp file left


def test_replacing_a_spec_keeps_the_other_files(tmp_path: Path) -> None:
    other = tmp_path / "example.com-other.json"
    other.write_bytes(owned("example.com/other"))
    notes = tmp_path / "README"
    notes.write_text("hands off")
    first = write_spec_file(tmp_path, NAME, owned(pad=10))
    second = write_spec_file(tmp_path, NAME, owned(pad=20), ours=first)
    assert (tmp_path / NAME).read_bytes() == owned(pad=20)
    assert second is not None and first is not None and second[1] != first[1]  # a new inode
    assert other.read_bytes() == owned("example.com/other")
    assert notes.read_text() == "hands off"
    assert sorted(os.listdir(tmp_path)) == sorted([NAME, other.name, notes.name])


def test_a_file_devplug_wrote_earlier_is_replaced_without_a_stamp(tmp_path: Path) -> None:
    (tmp_path / NAME).write_bytes(owned(pad=1))  # from an earlier run: recognised by reading
    write_spec_file(tmp_path, NAME, owned(pad=2))
    assert (tmp_path / NAME).read_bytes() == owned(pad=2)


@pytest.mark.parametrize(
    "name", ["../x.json", "a/b.json", ".hidden.json", "x.yaml", "x", "x.json\0", ""]
)
def test_names_that_are_not_spec_file_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="not a spec file name"):
        write_spec_file(tmp_path, name, owned())
    with pytest.raises(ValueError, match="not a spec file name"):
        remove_owned_spec(tmp_path, name)
    assert os.listdir(tmp_path) == []


def test_a_failed_write_removes_its_temp_file_and_keeps_the_old_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_spec_file(tmp_path, NAME, owned(pad=1))
    temps: list[str] = []

    def failing_replace(source: str, target: object) -> None:
        temps.append(os.path.basename(source))
        assert os.path.exists(source)  # written and complete before the rename
        assert Path(source).read_bytes() == owned(pad=2)
        assert stat.S_IMODE(os.stat(source).st_mode) == 0o644
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        write_spec_file(tmp_path, NAME, owned(pad=2))
    monkeypatch.undo()
    assert (tmp_path / NAME).read_bytes() == owned(pad=1)
    assert os.listdir(tmp_path) == [NAME]
    (temp,) = temps
    assert temp.startswith(TEMP_PREFIX) and not temp.endswith(SPEC_SUFFIXES)


# A child that writes a spec and is killed with half of it written: os.write writes half,
# says so, and hangs until the SIGKILL.
CRASHING_WRITER = """
import os, sys, time
from pathlib import Path
from devplug.cdi import files

real_write = os.write

def half_write(handle, data):
    written = real_write(handle, data[: len(data) // 2])
    sys.stdout.write("half\\n")
    sys.stdout.flush()
    time.sleep(60)
    return written

os.write = half_write
files.write_spec_file(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).read_bytes())
"""


def test_a_crash_mid_write_leaves_the_old_spec_and_a_temp_file_runtimes_skip(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "cdi"
    old = owned(pad=10)
    write_spec_file(directory, NAME, old)
    new = owned(pad=4 * 1024 * 1024)
    payload = tmp_path / "payload"
    payload.write_bytes(new)
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(directory), NAME, str(payload)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "half\n", child.stderr.read() if child.stderr else ""
        (temp,) = temp_files(directory)
        assert (directory / temp).stat().st_size == len(new) // 2  # it was partway
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
    assert owned_specs(directory) == {NAME: RESOURCE}
    assert remove_temp_files(directory) == 1
    assert os.listdir(directory) == [NAME]
    assert remove_temp_files(directory) == 0


def test_remove_temp_files_touches_only_regular_temp_files(tmp_path: Path) -> None:
    (tmp_path / f"{TEMP_PREFIX}a").write_bytes(b"partial")
    (tmp_path / f"{TEMP_PREFIX}b").write_bytes(b"")
    (tmp_path / f"{TEMP_PREFIX}dir").mkdir()
    (tmp_path / "elsewhere").write_text("target")
    (tmp_path / f"{TEMP_PREFIX}link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "x-devplug-tmp-c").write_text("not a prefix")
    (tmp_path / NAME).write_bytes(owned())
    assert remove_temp_files(tmp_path) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{TEMP_PREFIX}dir", f"{TEMP_PREFIX}link", "elsewhere", "x-devplug-tmp-c", NAME]
    )
    assert remove_temp_files(tmp_path / "absent") == 0


# ------------------------------------------------------------------------- full and read-only


def test_a_full_filesystem_raises_enospc_and_keeps_the_old_spec(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "full", "size=16k,mode=0755") as directory:
        old = owned(pad=10)
        write_spec_file(directory, NAME, old)
        with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)) as failed:
            write_spec_file(directory, NAME, owned(pad=256 * 1024))
        assert failed.value.errno == errno.ENOSPC
        assert not isinstance(failed.value, ForeignSpecError)
        assert (directory / NAME).read_bytes() == old
        assert os.listdir(directory) == [NAME]  # the temp file is gone
        # The space came back: a spec that fits is written.
        write_spec_file(directory, NAME, owned(pad=20))
        assert (directory / NAME).read_bytes() == owned(pad=20)


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[int]:
    """``directory`` (holding a spec written before) made unwritable; yields the errno."""
    if ROOT:
        with tmpfs(directory, "size=1m,mode=0755"):
            write_spec_file(directory, NAME, owned(pad=1))
            remount(directory, "ro")
            yield errno.EROFS
    else:
        write_spec_file(directory, NAME, owned(pad=1))
        directory.chmod(0o555)
        try:
            yield errno.EACCES
        finally:
            directory.chmod(0o755)


def test_an_unwritable_dir_raises_and_keeps_the_old_spec(tmp_path: Path) -> None:
    directory = tmp_path / "cdi"
    with unwritable(directory) as expected:
        with pytest.raises(OSError, match=os.strerror(expected)) as failed:
            write_spec_file(directory, NAME, owned(pad=2))
        assert failed.value.errno == expected
        assert (directory / NAME).read_bytes() == owned(pad=1)
        assert os.listdir(directory) == [NAME]
        # A dir that has to be created below it fails the same way.
        with pytest.raises(OSError, match=os.strerror(expected)) as nested:
            write_spec_file(directory / "sub", NAME, owned())
        assert nested.value.errno == expected
        # Removing is refused too, and the file stays.
        with pytest.raises(OSError, match=os.strerror(expected)) as removing:
            remove_owned_spec(directory, NAME)
        assert removing.value.errno == expected
        assert (directory / NAME).read_bytes() == owned(pad=1)


# ------------------------------------------------------------------------- ownership


@pytest.mark.parametrize(
    "content",
    [
        FOREIGN,
        # Another writer's JSON with annotations, but not devplug's mark.
        b'{"kind":"example.com/serial","annotations":{"vendor.example/owner":"x"}}',
        # The owner key with another value.
        b'{"kind":"example.com/serial","annotations":{"devplug.io/managed-by":"someone"}}',
        b"cdiVersion: 0.6.0\nkind: example.com/serial\n",  # YAML in a .json file
        b"",
        b"\xff\xfe not text",
    ],
    ids=["json", "other-annotations", "other-owner", "yaml", "empty", "binary"],
)
def test_a_file_devplug_did_not_write_is_never_replaced(tmp_path: Path, content: bytes) -> None:
    target = tmp_path / NAME
    target.write_bytes(content)
    before = file_stamp(target)
    with pytest.raises(ForeignSpecError) as refused:
        write_spec_file(tmp_path, NAME, owned())
    assert isinstance(refused.value, FileExistsError)
    assert refused.value.errno == errno.EEXIST
    assert "not written by devplug" in str(refused.value)
    assert target.read_bytes() == content
    assert file_stamp(target) == before
    assert os.listdir(tmp_path) == [NAME]
    # A stamp of some other file does not make it ours either.
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, NAME, owned(), ours=(0, 0, 0, 0))
    assert target.read_bytes() == content


def test_a_symlink_at_the_spec_name_is_not_followed(tmp_path: Path) -> None:
    ours = tmp_path / "elsewhere.json"
    ours.write_bytes(owned())  # the link points at a file that looks like ours
    link = tmp_path / NAME
    link.symlink_to(ours)
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, NAME, owned(pad=5))
    assert link.is_symlink() and ours.read_bytes() == owned()
    assert owner_of(link) is None
    assert remove_owned_spec(tmp_path, NAME) is False
    assert link.is_symlink() and ours.read_bytes() == owned()
    # A dangling link is not ours either.
    ours.unlink()
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, NAME, owned())
    assert link.is_symlink()


def test_a_matching_stamp_skips_the_ownership_read(tmp_path: Path) -> None:
    """``ours`` is the stamp of the file this process wrote last: while it matches, the file
    is taken as ours without being read (so without its annotation it is still replaced)."""
    target = tmp_path / NAME
    stamp = write_spec_file(tmp_path, NAME, owned())
    assert stamp is not None
    # Same inode, size and mtime, but no owner annotation any more.
    unmarked = owned().replace(OWNER_ANNOTATION.encode(), b"x" * len(OWNER_ANNOTATION))
    assert len(unmarked) == len(owned())
    with target.open("r+b") as handle:
        handle.write(unmarked)
    os.utime(target, ns=(stamp[3], stamp[3]))
    assert file_stamp(target) == stamp
    assert owner_of(target) is None
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, NAME, owned(pad=3))  # read, and refused, without the stamp
    assert write_spec_file(tmp_path, NAME, owned(pad=3), ours=stamp) is not None
    assert target.read_bytes() == owned(pad=3)


def test_the_stamp_is_the_written_files_even_when_it_is_deleted_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone deletes the spec right after the rename: the stamp returned is still the
    written file's, so the caller sees the name no longer matches it (a missing stamp would
    compare equal to a missing file, and the loss would go unnoticed)."""
    target = tmp_path / NAME
    rename = os.replace

    def rename_then_lose(source: str, destination: Path) -> None:
        rename(source, destination)
        written_now.append(file_stamp(target))
        target.unlink()

    written_now: list[object] = []
    monkeypatch.setattr(os, "replace", rename_then_lose)
    stamp = write_spec_file(tmp_path, NAME, owned())
    assert written_now == [stamp]
    assert file_stamp(target) is None
    assert file_stamp(target) != stamp


def test_a_stale_stamp_does_not_cover_a_file_someone_else_put_there(tmp_path: Path) -> None:
    target = tmp_path / NAME
    stamp = write_spec_file(tmp_path, NAME, owned())
    target.unlink()
    target.write_bytes(FOREIGN)  # another writer's file: a new inode
    assert file_stamp(target) != stamp
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, NAME, owned(pad=1), ours=stamp)
    assert target.read_bytes() == FOREIGN


def test_owned_specs_finds_only_devplugs_json_specs(tmp_path: Path) -> None:
    (tmp_path / "example.com-serial.json").write_bytes(owned())
    (tmp_path / "example.com-unnamed.json").write_bytes(owned(None))
    (tmp_path / "example.com-odd.json").write_bytes(
        json.dumps(
            {"annotations": {OWNER_ANNOTATION: OWNER_VALUE, RESOURCE_ANNOTATION: 7}}
        ).encode()
    )
    (tmp_path / "vendor-foreign.json").write_bytes(FOREIGN)
    # A YAML file, even one carrying devplug's mark: devplug writes JSON only.
    (tmp_path / "example.com-yaml.yaml").write_text(
        f"kind: example.com/yaml\nannotations:\n  {OWNER_ANNOTATION}: {OWNER_VALUE}\n"
    )
    (tmp_path / "garbage.json").write_bytes(b"\x00\x01{not json")
    (tmp_path / "list.json").write_bytes(b"[1, 2]")
    (tmp_path / "annotations-list.json").write_bytes(b'{"annotations": ["x"]}')
    (tmp_path / "dir.json").mkdir()
    (tmp_path / ".hidden.json").write_bytes(owned("example.com/hidden"))
    (tmp_path / f"{TEMP_PREFIX}abc").write_bytes(owned("example.com/temp"))
    (tmp_path / "notes.txt").write_bytes(owned("example.com/txt"))
    (tmp_path / "link.json").symlink_to(tmp_path / "example.com-serial.json")
    os.mkfifo(tmp_path / "fifo.json")  # must not block the scan
    assert owned_specs(tmp_path) == {
        "example.com-serial.json": RESOURCE,
        "example.com-unnamed.json": "",
        "example.com-odd.json": "",
    }
    assert resource_of(tmp_path / "example.com-serial.json") == RESOURCE
    assert resource_of(tmp_path / "example.com-unnamed.json") == ""
    assert owner_of(tmp_path / "absent.json") is None
    assert owner_of(tmp_path / "dir.json") is None
    assert owned_specs(tmp_path / "absent") == {}


def test_a_file_bigger_than_the_read_limit_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 4096
    monkeypatch.setattr("devplug.cdi.files.MAX_READ_BYTES", limit)
    at_limit = tmp_path / "at-limit.json"
    at_limit.write_bytes(owned().ljust(limit))  # trailing blanks: still valid JSON
    over = tmp_path / "over.json"
    over.write_bytes(owned().ljust(limit + 1))
    assert resource_of(at_limit) == RESOURCE
    assert owner_of(over) is None
    assert owned_specs(tmp_path) == {"at-limit.json": RESOURCE}
    with pytest.raises(ForeignSpecError):
        write_spec_file(tmp_path, "over.json", owned())


def test_remove_owned_spec_removes_ours_and_refuses_the_rest(tmp_path: Path) -> None:
    write_spec_file(tmp_path, NAME, owned())
    foreign = tmp_path / "vendor-foreign.json"
    foreign.write_bytes(FOREIGN)
    assert remove_owned_spec(tmp_path, "vendor-foreign.json") is False
    assert foreign.read_bytes() == FOREIGN
    assert remove_owned_spec(tmp_path, NAME) is True
    assert not (tmp_path / NAME).exists()
    assert remove_owned_spec(tmp_path, NAME) is True  # already gone
    assert remove_owned_spec(tmp_path / "absent", NAME) is True
    assert os.listdir(tmp_path) == ["vendor-foreign.json"]


def resource_of(path: Path) -> str:
    owner = owner_of(path)
    assert owner is not None, f"{path} is not devplug's"
    return owner.resource
