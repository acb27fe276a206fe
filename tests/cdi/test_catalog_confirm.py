"""CdiCatalog.confirm: Allocate never names a spec that is gone or replaced, with one lstat per
call while nothing watches the CDI dir and none while a watch has seen no change."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from devplug._kits.dirwatch import DirWatcher
from devplug.cdi import allocate as allocate_module
from devplug.cdi.allocate import CdiCatalog, CdiResource
from devplug.cdi.stamps import FileStamp, file_stamp
from devplug.model import DeviceInfo, DeviceNode
from devplug.testing import eventually

RESOURCE = "example.com/serial"
SPEC = "devplug-example.com_serial.json"


@pytest.fixture
def lstats(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths the catalog stats, in order."""
    seen: list[Path] = []

    def counted(path: Path) -> FileStamp | None:
        seen.append(path)
        return file_stamp(path)

    monkeypatch.setattr(allocate_module, "file_stamp", counted)
    return seen


def catalog_with_spec(directory: Path) -> tuple[CdiCatalog, list[str]]:
    """A catalog whose entry is a spec file just written in ``directory``, and the resources
    it reported stale."""
    path = directory / SPEC
    path.write_text('{"cdiVersion": "0.6.0"}')
    devices = {"dev0": DeviceInfo(nodes=(DeviceNode("/dev/null"),))}
    stale: list[str] = []
    catalog = CdiCatalog()
    catalog.on_stale = stale.append
    catalog.set(
        RESOURCE,
        CdiResource(RESOURCE, SPEC, frozenset(devices), devices, path, file_stamp(path)),
    )
    return catalog, stale


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[DirWatcher]:
    """A running watch on tmp_path, as CdiSync runs one on the CDI dir."""
    watcher = DirWatcher(tmp_path, lambda name: name.endswith(".json"), "cdi", attributes=True)
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: watcher.watching)
    try:
        yield watcher
    finally:
        task.cancel()
        await asyncio.wait({task})


async def events_read(watcher: DirWatcher) -> None:
    """Return once the watch has read every event so far: inotify keeps their order, so once
    a marker's event (a dir made: exactly one event) has bumped the token, the earlier ones
    have too, and none is left to come."""
    before = watcher.token()
    os.mkdir(watcher.directory / f"marker-{before}.json")
    await eventually(lambda: watcher.token() != before, timeout=5)


async def confirmed_while_watched(
    directory: Path, watcher: DirWatcher, lstats: list[Path]
) -> tuple[CdiCatalog, list[str]]:
    """catalog_with_spec's catalog, following ``watcher``, its spec confirmed twice: one lstat."""
    catalog, stale = catalog_with_spec(directory)
    catalog.dir_token = watcher.token
    await events_read(watcher)
    catalog.confirm(RESOURCE)
    catalog.confirm(RESOURCE)
    assert len(lstats) == 1
    return catalog, stale


class FakeClock:
    """The catalog's clock (it reads time.monotonic()), moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_without_a_watch_every_confirm_stats_the_file_and_a_deletion_is_seen_at_once(
    tmp_path: Path, lstats: list[Path]
) -> None:
    catalog, stale = catalog_with_spec(tmp_path)
    for _ in range(3):
        catalog.confirm(RESOURCE)
    assert len(lstats) == 3 and catalog.get(RESOURCE) is not None
    (tmp_path / SPEC).unlink()
    catalog.confirm(RESOURCE)  # no event loop turn in between: the lstat sees it
    assert catalog.get(RESOURCE) is None and stale == [RESOURCE]


async def test_a_watch_that_saw_no_change_spares_the_lstat(
    tmp_path: Path, lstats: list[Path], watched: DirWatcher
) -> None:
    catalog, stale = catalog_with_spec(tmp_path)
    catalog.dir_token = watched.token
    await events_read(watched)  # the write's own events
    for _ in range(5):
        catalog.confirm(RESOURCE)
    assert len(lstats) == 1 and catalog.get(RESOURCE) is not None and stale == []


def replace_by_rename(spec: Path) -> None:
    """An editor's save: a new file renamed over the spec."""
    other = spec.with_name("other.json")
    other.write_text("{}")
    os.replace(other, spec)


async def spec_change_seen(watcher: DirWatcher, change: Callable[[], object]) -> None:
    before = watcher.token()
    change()
    await eventually(lambda: watcher.token() != before, timeout=5)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda spec: spec.unlink(), id="deleted"),
        pytest.param(lambda spec: spec.write_text("{}"), id="rewritten in place"),
        pytest.param(lambda spec: os.chmod(spec, 0o000), id="chmod"),
        pytest.param(lambda spec: replace_by_rename(spec), id="replaced by a rename"),
    ],
)
async def test_any_change_the_watch_sees_makes_the_next_confirm_look_again(
    tmp_path: Path, lstats: list[Path], watched: DirWatcher, change: Callable[[Path], object]
) -> None:
    catalog, stale = await confirmed_while_watched(tmp_path, watched, lstats)
    await spec_change_seen(watched, lambda: change(tmp_path / SPEC))
    catalog.confirm(RESOURCE)
    assert len(lstats) == 2
    assert catalog.get(RESOURCE) is None and stale == [RESOURCE]


async def test_once_the_watch_ends_every_confirm_stats_again(
    tmp_path: Path, lstats: list[Path]
) -> None:
    watcher = DirWatcher(tmp_path, lambda name: name.endswith(".json"), "cdi", attributes=True)
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: watcher.watching)
    catalog, _ = await confirmed_while_watched(tmp_path, watcher, lstats)
    task.cancel()
    await asyncio.wait({task})
    assert watcher.token() is None
    catalog.confirm(RESOURCE)
    catalog.confirm(RESOURCE)
    assert len(lstats) == 3


async def test_a_change_no_event_tells_of_is_seen_once_the_lstat_is_old(
    tmp_path: Path, lstats: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write through a hard link in another dir raises no event in the CDI dir: the spec's
    lstat stands only CONFIRM_MAX_AGE_S, after which the change is seen."""
    cdi_dir, elsewhere = tmp_path / "cdi", tmp_path / "elsewhere"
    cdi_dir.mkdir()
    elsewhere.mkdir()
    clock = FakeClock()
    monkeypatch.setattr(allocate_module, "time", clock)
    watcher = DirWatcher(cdi_dir, lambda name: name.endswith(".json"), "cdi", attributes=True)
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: watcher.watching)
        catalog, stale = catalog_with_spec(cdi_dir)
        catalog.dir_token = watcher.token
        os.link(cdi_dir / SPEC, elsewhere / "link.json")
        entry = catalog.get(RESOURCE)
        assert entry is not None  # as written: its stamp with the link (ctime, link count)
        catalog.set(RESOURCE, dataclasses.replace(entry, stamp=file_stamp(cdi_dir / SPEC)))
        await events_read(watcher)  # the write's and the link's
        token = watcher.token()
        catalog.confirm(RESOURCE)
        link = elsewhere / "link.json"
        link.write_text(link.read_text() + " ")  # the spec's own inode, changed in place
        clock.now += allocate_module.CONFIRM_MAX_AGE_S - 0.01
        catalog.confirm(RESOURCE)
        assert catalog.get(RESOURCE) is not None  # within the age, the name stands
        clock.now += 0.02
        catalog.confirm(RESOURCE)
        # No event came (none is due: the write went through another dir), so the age alone
        # made it look again.
        assert watcher.token() == token
        assert catalog.get(RESOURCE) is None and stale == [RESOURCE]
        assert len(lstats) == 2
    finally:
        task.cancel()
        await asyncio.wait({task})
