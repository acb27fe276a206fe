"""Writing and removing spec files as their owner: the rules of a CDI dir shared by many.

A CDI dir (/var/run/cdi) is shared by every CDI writer on the node and possibly by several
devplug daemons (two DaemonSets with different scanners, or a second ``devplug run`` started
by mistake). The rules, in :meth:`SpecStore.write`'s order:

- a spec whose record names this daemon is ours: written, rewritten if changed behind our back;
- a spec whose record names another running daemon is theirs (:class:`SpecHeldError`): left
  alone, taken over only once that daemon is gone;
- a name with no file is free; a file whose record names a daemon that is gone, and that
  still holds what that daemon wrote, is taken over (identical content is kept as it is);
- a spec devplug wrote before it kept records (0.6.0, ownership annotations) is taken over by
  the same instance;
- any other file is someone else's (:class:`ForeignSpecError`), never replaced or deleted.

Nothing here parses a file devplug did not write: records are small, foreign specs are at
most read for their first few KiB (to recognise an old devplug spec).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import aiofiles.os

from devplug.cdi.files import (
    check_spec_file_name,
    ensure_dir,
    read_bounded,
    remove_file,
    stamp,
    write_atomically,
)
from devplug.cdi.ownership import (
    OwnerLock,
    OwnerRecord,
    content_id,
    exclusive,
    legacy_owner,
    owner_alive,
    read_record,
    record_path,
    recorded_specs,
    remove_dead_locks,
    remove_record,
    write_record,
)
from devplug.cdi.stamps import FileStamp

DEFAULT_INSTANCE = "default"


class ForeignSpecError(FileExistsError):
    """The spec's file name is taken by a file devplug did not write; it is left alone."""


class SpecHeldError(FileExistsError):
    """Another running devplug daemon owns the spec file; it is left alone until it goes."""

    def __init__(self, path: Path, instance: str, resource: str, owner: str = "") -> None:
        super().__init__(
            errno.EEXIST,
            f"{path} is served by another running devplug (instance {instance!r}, resource "
            f"{resource!r}); left alone, taken over when that daemon stops",
        )
        self.instance = instance
        self.resource = resource
        self.owner = owner  # the holder's owner token (its lock's name), "" if unknown


class Written(NamedTuple):
    stamp: FileStamp  # the spec file as it is now
    changed: bool  # False: the file already held these bytes and was kept


@dataclass(frozen=True, slots=True)
class _Decision:
    previous: tuple[tuple[str, int], ...]  # contents the file may still hold (for the record)
    exclusive: bool  # claim a free name: fail if another daemon claims it first
    keep: FileStamp | None = None  # the file already holds the new bytes: do not rewrite


class SpecStore:
    """One daemon's (or one ``cdi generate`` run's) view of a CDI dir's devplug specs.

    ``lock`` is the daemon's :class:`OwnerLock` (None for ``cdi generate``: its records name
    no running owner, so any later devplug may take its specs over).
    """

    def __init__(
        self, directory: Path, instance: str = DEFAULT_INSTANCE, lock: OwnerLock | None = None
    ) -> None:
        self.directory = directory
        self.instance = instance
        self.lock = lock
        self.owner = lock.owner if lock is not None else ""
        # The stamp of each spec this store wrote last: still ours if its record is lost (the
        # state dir deleted), since nobody else's file can have that stamp.
        self._last: dict[str, FileStamp] = {}
        # The records this store wrote, with their files' stamps: while the file is unchanged
        # the record need not be read again (a write costs one stat, not a read).
        self._records: dict[str, tuple[OwnerRecord, FileStamp]] = {}
        # The content id each spec file holds as far as this store knows (its last write
        # that succeeded): kept in the record until the file holds something else.
        self._on_disk: dict[str, tuple[str, int]] = {}

    async def prepare(self) -> None:
        """Create the dir and hold this daemon's lock (again, if someone deleted it). Once per
        pass over the specs, before writing or removing any."""
        await ensure_dir(self.directory)
        if self.lock is not None:
            await self.lock.ensure()

    def _ours(self, record: OwnerRecord | None) -> bool:
        # "" (cdi generate) names no running daemon: its files are checked by content.
        return (
            bool(self.owner)
            and record is not None
            and (record.owner, record.instance)
            == (
                self.owner,
                self.instance,
            )
        )

    async def write(self, file_name: str, resource: str, data: bytes) -> Written:
        """Make ``file_name`` hold ``data`` as this daemon's spec of ``resource``.

        Raises ForeignSpecError or SpecHeldError (see the module's rules), or OSError (full
        disk, read-only dir, ...) with the old file left as it was.
        """
        check_spec_file_name(file_name)
        async with exclusive(self.directory):
            return await self._write(file_name, resource, data)

    async def write_all(self, specs: Sequence[tuple[str, str, bytes]]) -> list[Written]:
        """:meth:`write` for several (file name, resource, data) at once: all or none. Every
        name is checked first, under the dir's mutex held throughout, so a name someone else
        holds (ForeignSpecError, SpecHeldError) fails the lot before anything is written. (An
        OSError part-way, e.g. a full disk, still leaves the specs written before it.)"""
        for file_name, _, _ in specs:
            check_spec_file_name(file_name)
        async with exclusive(self.directory):
            for file_name, _, data in specs:
                await self._decide(file_name, content_id(data))
            return [await self._write(name, resource, data) for name, resource, data in specs]

    async def _write(self, file_name: str, resource: str, data: bytes) -> Written:
        new_id = content_id(data)
        junk = False
        for _ in range(2):  # a second round only if another daemon claimed the name meanwhile
            decision = await self._decide(file_name, new_id)
            if junk and decision.exclusive:
                decision = _Decision(decision.previous, exclusive=False)
            record = OwnerRecord(
                resource, self.instance, self.owner, (new_id, *decision.previous)[:2]
            )
            # The record names the new content before the file holds it: a crash in between
            # leaves a record naming both, never a devplug file that looks foreign.
            record_stamp = await write_record(
                self.directory, file_name, record, exclusive=decision.exclusive
            )
            if record_stamp is None:
                # Taken: by another daemon's claim, or by a record nobody can read (empty,
                # too big, a symlink or a dir); the latter is replaced in the next round.
                junk = await read_record(self.directory, file_name) is None
                continue
            self._records[file_name] = (record, record_stamp)
            if decision.keep is not None:
                self._last[file_name] = decision.keep
                self._on_disk[file_name] = new_id
                return Written(decision.keep, changed=False)
            written = await write_atomically(self.directory, file_name, data)
            self._last[file_name] = written
            self._on_disk[file_name] = new_id
            return Written(written, changed=True)
        raise SpecHeldError(self.directory / file_name, "unknown", resource)

    async def _record(self, file_name: str) -> OwnerRecord | None:
        cached = self._records.get(file_name)
        if cached is not None:
            if await stamp(record_path(self.directory, file_name)) == cached[1]:
                return cached[0]
            del self._records[file_name]
        return await read_record(self.directory, file_name)

    async def _decide(self, file_name: str, new_id: tuple[str, int]) -> _Decision:
        path = self.directory / file_name
        record = await self._record(file_name)
        if self._ours(record):
            assert record is not None
            # Keep naming what the file holds: a write that failed (full disk) must not
            # drop it from the record, or the file reads as foreign after a crash.
            on_disk = self._on_disk.get(file_name)
            return _Decision((on_disk,) if on_disk else record.contents[:1], exclusive=False)
        if record is not None and await owner_alive(self.directory, record.owner):
            raise SpecHeldError(path, record.instance, record.resource, record.owner)
        current = await stamp(path)
        if current is None:
            return _Decision((), exclusive=record is None)
        if record is None and current == self._last.get(file_name):
            return _Decision((), exclusive=True)  # our file; its record was lost
        held = await _matching_content(path, record) if record is not None else None
        if held is not None:
            return _Decision((held,), exclusive=False, keep=current if held == new_id else None)
        legacy = await legacy_owner(path)
        if legacy is not None and legacy.instance == self.instance:
            return _Decision((), exclusive=False)
        if legacy is not None:
            raise ForeignSpecError(
                errno.EEXIST,
                f"{path} was written by an earlier devplug of instance {legacy.instance!r}; "
                "that instance takes it over when it runs again: remove the file, or give "
                "the resource another kind in cdi.kinds",
            )
        raise ForeignSpecError(
            errno.EEXIST,
            f"{path} exists and was not written by devplug; it is left alone: remove it, or "
            "give the resource another kind in cdi.kinds",
        )

    async def reclaim(self, file_name: str, resource: str, data: bytes) -> None:
        """For a spec still as this store wrote it: write its record again if it was lost
        (the state dir deleted), or the file would read as foreign after a crash."""
        cached = self._records.get(file_name)
        if cached is not None and await stamp(record_path(self.directory, file_name)) == cached[1]:
            return
        async with exclusive(self.directory):
            if self._ours(await read_record(self.directory, file_name)):
                return
            if await stamp(self.directory / file_name) != self._last.get(file_name):
                return
            record = OwnerRecord(resource, self.instance, self.owner, (content_id(data),))
            record_stamp = await write_record(self.directory, file_name, record, exclusive=True)
            if record_stamp is not None:
                self._records[file_name] = (record, record_stamp)

    async def owns(self, file_name: str) -> bool:
        """Whether this daemon's record still names ``file_name`` as its own."""
        return self._ours(await read_record(self.directory, file_name))

    async def remove(self, file_name: str, *, expected: FileStamp | None = None) -> bool:
        """Delete this daemon's spec ``file_name`` and its record; True if it was ours.

        A spec another daemon has taken over is left to it; a file changed behind our back
        since ``expected`` (someone else's content now) loses only its record.
        """
        check_spec_file_name(file_name)
        async with exclusive(self.directory):
            return await self._remove(file_name, expected)

    async def _remove(self, file_name: str, expected: FileStamp | None) -> bool:
        last = self._last.pop(file_name, None)
        self._on_disk.pop(file_name, None)
        record = await self._record(file_name)
        self._records.pop(file_name, None)
        current = await stamp(self.directory / file_name)
        if record is None and current is not None and current == last:
            await remove_file(self.directory, file_name)  # ours; its record was lost
            return True
        if not self._ours(record):
            return False
        if current is not None and (expected is None or current == expected):
            await remove_file(self.directory, file_name)
        await remove_record(self.directory, file_name)
        return True

    async def stale_candidates(self) -> list[str]:
        """Spec file names that may be devplug's from an earlier run: recorded ones, and
        ``*.json`` files without a record (old devplug specs)."""
        recorded = await recorded_specs(self.directory)
        try:
            names = await aiofiles.os.listdir(self.directory)
        except FileNotFoundError:
            names = []
        return sorted(n for n in {*recorded, *names} if _spec_file_name(n))

    async def remove_stale(self, file_name: str) -> str | None:
        """If ``file_name`` is a spec of this instance whose daemon is gone, delete it (and its
        record) and return its resource; records of gone daemons whose spec is missing are
        deleted too (returning None). Anything else is left alone."""
        check_spec_file_name(file_name)
        async with exclusive(self.directory):
            return await self._remove_stale(file_name)

    async def _remove_stale(self, file_name: str) -> str | None:
        path = self.directory / file_name
        record = await read_record(self.directory, file_name)
        if record is None:
            legacy = await legacy_owner(path)
            if legacy is None or legacy.instance != self.instance:
                return None
            await remove_file(self.directory, file_name)
            return legacy.resource
        if record.owner == self.owner and self.owner:
            return None  # ours now
        if await owner_alive(self.directory, record.owner):
            return None
        if await stamp(path) is None:
            await remove_record(self.directory, file_name)
            return None
        if record.instance != self.instance:
            return None
        if await _matching_content(path, record) is None:
            # Someone else's content now: the file is theirs, the record is wrong.
            await remove_record(self.directory, file_name)
            return None
        await remove_file(self.directory, file_name)
        await remove_record(self.directory, file_name)
        return record.resource

    async def remove_dead_locks(self) -> int:
        return await remove_dead_locks(self.directory)

    async def close(self) -> None:
        if self.lock is not None:
            await self.lock.release()


def _spec_file_name(name: str) -> bool:
    try:
        check_spec_file_name(name)
    except ValueError:
        return False  # anything else in the dir, or in the state dir, is not ours to judge
    return True


async def _matching_content(path: Path, record: OwnerRecord) -> tuple[str, int] | None:
    """The content id of ``path`` if it is one ``record`` names; the file is read only when
    its size is one of those (so never more than devplug itself wrote)."""
    try:
        info = await aiofiles.os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if info.st_size not in record.sizes():
        return None
    data = await read_bounded(path, info.st_size)
    if data is None:
        return None
    found = content_id(data)
    return found if record.names(found) else None
