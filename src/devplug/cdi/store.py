"""Writing and removing spec files as their owner: the rules of a CDI dir shared by many.

A CDI dir (/var/run/cdi) is shared by every CDI writer on the node and possibly by several
devplug daemons (two DaemonSets with different scanners, or a second ``devplug run`` started
by mistake). The rules, in :meth:`SpecStore.write`'s order:

- a spec whose record names this daemon is ours: written, rewritten if changed behind our back;
- a spec whose record names another running daemon is theirs (:class:`SpecHeldError`): left
  alone, taken over only once that daemon is gone;
- a name with no file is free; a file whose record names a daemon that is gone, and that
  still holds what that daemon wrote, is taken over (identical content is kept as it is);
- a file that holds exactly the bytes devplug writes for the resource now is devplug's,
  wherever it came from (copied from another CDI dir, its record lost): recorded, and kept as
  it is only if it is a regular file of devplug's user that no one else can write, with one
  link (otherwise replaced atomically: a planted copy could be edited in place later);
- any other file is someone else's (:class:`ForeignSpecError`), never replaced or deleted.

Nothing here parses a file devplug did not write: records are small, and a spec file is read
only when its size is that of a content devplug wrote or writes now.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
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
    owner_alive,
    read_record,
    record_path,
    remove_dead_locks,
    remove_record,
    stale_candidates,
    write_record,
)
from devplug.cdi.stamps import FileStamp, stamp_of

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


class SpecConflictsError(FileExistsError):
    """Several spec names are held by others (:class:`ForeignSpecError`,
    :class:`SpecHeldError`): every one is named, and nothing was written."""

    def __init__(self, conflicts: Sequence[FileExistsError]) -> None:
        reasons = "".join(f"\n  {c.strerror or c}" for c in conflicts)
        super().__init__(
            errno.EEXIST,
            f"{len(conflicts)} spec files are taken by files devplug may not replace; nothing "
            f"was written:{reasons}",
        )
        self.conflicts = tuple(conflicts)


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
    no running owner, so any later devplug may take its specs over). ``config``: for ``cdi
    generate``, the config file it runs with ("" for none): kept in its records, and its
    stale-spec clean-up (``--prune``) takes only specs that same config wrote.
    """

    def __init__(
        self,
        directory: Path,
        instance: str = DEFAULT_INSTANCE,
        lock: OwnerLock | None = None,
        *,
        config: str | None = None,
    ) -> None:
        self.directory = directory
        self.instance = instance
        self.lock = lock
        self.owner = lock.owner if lock is not None else ""
        self.config = config
        # No wait for the state dir's mutex goes past this loop time (a stop, a shutdown's
        # budget: see limit_waits).
        self._waits_end = math.inf
        # The stamp of each spec this store wrote last: still ours if its record is lost (the
        # state dir deleted), since nobody else's file can have that stamp.
        self._last: dict[str, FileStamp] = {}
        # The records this store wrote, with their files' stamps: while the file is unchanged
        # the record need not be read again (a write costs one stat, not a read).
        self._records: dict[str, tuple[OwnerRecord, FileStamp]] = {}
        # The content id each spec file holds as far as this store knows (its last write
        # that succeeded): kept in the record until the file holds something else.
        self._on_disk: dict[str, tuple[str, int]] = {}

    def limit_waits(self, until: float) -> None:
        """From now on, give up waiting for the state dir's mutex at loop time ``until``
        (StateDirBusyError): waits already under way too. ``math.inf`` lifts the limit."""
        self._waits_end = until

    def _exclusive(self) -> contextlib.AbstractAsyncContextManager[None]:
        return exclusive(self.directory, lambda: self._waits_end)

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
        async with self._exclusive():
            return await self._write(file_name, resource, data)

    async def write_all(self, specs: Sequence[tuple[str, str, bytes]]) -> list[Written]:
        """:meth:`write` for several (file name, resource, data) at once: all or none. Every
        name is checked first, so a name someone else holds fails the lot before anything is
        written, and the error names every such name (ForeignSpecError or SpecHeldError for
        one, SpecConflictsError for more). The check runs once before anything is created in
        the dir (a refusal leaves no state dir behind) and again under the dir's mutex, held
        while the specs are written. (An OSError part-way, e.g. a full disk, still leaves the
        specs written before it.)"""
        for file_name, _, _ in specs:
            check_spec_file_name(file_name)
        await self._check_all(specs)
        async with self._exclusive():
            await self._check_all(specs)
            return [await self._write(name, resource, data) for name, resource, data in specs]

    async def _check_all(self, specs: Sequence[tuple[str, str, bytes]]) -> None:
        conflicts: list[FileExistsError] = []
        for file_name, _, data in specs:
            try:
                await self._decide(file_name, content_id(data))
            except (ForeignSpecError, SpecHeldError) as exc:
                conflicts.append(exc)
        if len(conflicts) == 1:
            raise conflicts[0]
        if conflicts:
            raise SpecConflictsError(conflicts)

    async def _write(self, file_name: str, resource: str, data: bytes) -> Written:
        new_id = content_id(data)
        junk = False
        for _ in range(2):  # a second round only if another daemon claimed the name meanwhile
            decision = await self._decide(file_name, new_id)
            if junk and decision.exclusive:
                decision = _Decision(decision.previous, exclusive=False)
            record = OwnerRecord(
                resource,
                self.instance,
                self.owner,
                (new_id, *decision.previous)[:2],
                self.config,
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
            same = held == new_id and await _keepable(path, current)
            return _Decision((held,), exclusive=False, keep=current if same else None)
        if await _holds(path, current, new_id):
            # Exactly the bytes devplug writes for this resource now: devplug's spec, wherever
            # it came from (copied from another CDI dir, its record lost). Kept as it is only
            # if nobody else can change it; otherwise replaced by a file of devplug's own.
            keep = current if await _keepable(path, current) else None
            return _Decision((), exclusive=record is None, keep=keep)
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
        async with self._exclusive():
            if self._ours(await read_record(self.directory, file_name)):
                return
            if await stamp(self.directory / file_name) != self._last.get(file_name):
                return
            record = OwnerRecord(
                resource, self.instance, self.owner, (content_id(data),), self.config
            )
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
        async with self._exclusive():
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
        """:func:`devplug.cdi.ownership.stale_candidates` of this store's dir."""
        return await stale_candidates(self.directory)

    async def remove_stale(self, file_name: str) -> str | None:
        """If ``file_name`` is a spec of this instance whose daemon is gone, delete it (and its
        record) and return its resource; records of gone daemons whose spec is missing are
        deleted too (returning None). Anything else is left alone."""
        check_spec_file_name(file_name)
        async with self._exclusive():
            return await self._remove_stale(file_name)

    async def _remove_stale(self, file_name: str) -> str | None:
        path = self.directory / file_name
        record = await read_record(self.directory, file_name)
        if record is None:
            return None
        if record.owner == self.owner and self.owner:
            return None  # ours now
        if await owner_alive(self.directory, record.owner):
            return None
        if await stamp(path) is None:
            await remove_record(self.directory, file_name)
            return None
        if record.instance != self.instance:
            return None
        if self.config is not None and record.config != self.config:
            return None  # another config's (cdi generate --prune takes only its own)
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


async def _keepable(path: Path, seen: FileStamp) -> bool:
    """Whether ``path``, still as ``seen``, may be kept as devplug's spec without rewriting
    it: a regular file of devplug's user, with one link, that no other user can write. A file
    with the right bytes but another owner or a group- or world-writable mode (planted, or
    copied by someone else) could be edited in place later, and a runtime watching the dir
    would load the edit before devplug rewrites it; a second link is a name elsewhere that
    edits the same file."""
    try:
        info = await aiofiles.os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (
        stamp_of(info) == seen
        and stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & 0o022
        and info.st_nlink == 1
    )


async def _holds(path: Path, seen: FileStamp, data_id: tuple[str, int]) -> bool:
    """Whether ``path``, as ``seen``, holds the content ``data_id`` names: read only when its
    size is that content's (never more than devplug would write), and only if it is still the
    file seen once read."""
    if seen.size != data_id[1]:
        return False
    data = await read_bounded(path, seen.size)
    return data is not None and content_id(data) == data_id and await stamp(path) == seen


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
