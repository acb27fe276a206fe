"""Watching one directory with inotify: a counter that bumps when a file of interest changes.

Used for the kubelet's device plugin dir (sockets: the kubelet restarted) and for the CDI dir
(specs deleted or replaced behind devplug's back). Followers wait on :attr:`DirWatcher.changes`
and look for themselves what changed; the watcher only says "look now". The dir itself being
removed or replaced counts as a change; while a watch cannot be set (inotify limits) it bumps
every ``DIR_POLL_S``, so followers fall back to checking on a timer; while the dir is missing
it looks for it every ``DIR_POLL_S``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog
from asyncinotify import Inotify, Mask

from devplug._kits.problems import ProblemLog
from devplug._kits.values import LatestValue

log = structlog.get_logger(__name__)

# While the dir is missing or cannot be watched, look again this often.
DIR_POLL_S = 1.0

_WATCH_MASK = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.CLOSE_WRITE
    | Mask.MODIFY
    | Mask.DELETE_SELF
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
)
_GONE = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED | Mask.UNMOUNT
_PARENT_MASK = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ONLYDIR


class DirWatcher:
    """Watches ``directory``; ``changes`` bumps on every event about a name ``relevant``
    accepts. ``topic`` prefixes the log events (``<topic>.dir.missing``, ...)."""

    def __init__(
        self,
        directory: Path,
        relevant: Callable[[str], bool],
        topic: str,
        *,
        attributes: bool = False,
        missing_level: str = "warning",
    ) -> None:
        self.directory = directory
        # How loud a missing dir is: info where its absence is a setup devplug serves
        # without (a pod without the kubelet's pod-resources mount).
        self.missing_level = missing_level
        # ``attributes``: a chmod, chown or touch is a change too (it moves a file's ctime).
        self.mask = _WATCH_MASK | Mask.ATTRIB if attributes else _WATCH_MASK
        self.relevant = relevant
        self.topic = topic
        self.changes: LatestValue[int] = LatestValue(0)
        # True while the inotify watch is set: then every change bumps ``changes``.
        self.watching = False

    def _bump(self) -> None:
        self.changes.set(self.changes.value + 1)

    def token(self) -> int | None:
        """While the dir is watched, a number that changes whenever a relevant file may have
        (``changes.version``): a follower that saw a file at one token and sees the same token
        now knows the file is as it saw it, up to events the event loop has not read yet.
        None while there is no watch (nothing would tell of a change)."""
        return self.changes.version if self.watching else None

    def poke(self) -> None:
        """Wake every follower to look for itself, as if something changed."""
        self._bump()

    async def run(self) -> None:
        problems = ProblemLog()
        while True:
            if not self.directory.is_dir():
                problems.report(
                    log,
                    f"{self.topic}.dir.missing",
                    "missing",
                    key="dir",
                    level=self.missing_level,
                    field="state",
                    dir=str(self.directory),
                )
                await asyncio.sleep(DIR_POLL_S)
                continue
            if problems.solved("dir"):
                log.info(f"{self.topic}.dir.found", dir=str(self.directory))
            try:
                await self._watch()
                problems.solved("watch")
            except OSError as exc:
                # inotify limits (ENOSPC, EMFILE) must not stop the daemon: poll instead, and
                # say so once rather than on every retry.
                problems.report(
                    log,
                    f"{self.topic}.watch.failed",
                    str(exc.strerror),
                    key="watch",
                    field="error",
                    dir=str(self.directory),
                    fallback=f"stat checks every {DIR_POLL_S}s until a watch can be set",
                )
                await asyncio.sleep(DIR_POLL_S)
                self._bump()

    async def _watch(self) -> None:
        """Watch the dir, and its parent for the dir itself being removed or replaced.

        The parent watch matters: a removed dir's own DELETE_SELF arrives only once nothing
        references it any more, and a listening unix socket bound in it keeps it referenced.
        """
        with Inotify() as inotify:
            inotify.add_watch(self.directory, self.mask)
            parent = inotify.add_watch(self.directory.parent, _PARENT_MASK)
            self.watching = True
            try:
                # Anything may have happened before the watch existed: let followers re-check.
                self._bump()
                async for event in inotify:
                    about_dir = event.watch is parent and str(event.name) == self.directory.name
                    if about_dir or (event.watch is not parent and event.mask & _GONE):
                        log.warning(f"{self.topic}.dir.gone", dir=str(self.directory))
                        return
                    if event.mask & Mask.Q_OVERFLOW or (
                        event.watch is not parent
                        and event.name is not None
                        and self.relevant(str(event.name))
                    ):
                        self._bump()
            finally:
                # Bumped as the watch ends: whatever happens from now on goes unseen until
                # the next watch, so a follower's token from before must not stay valid.
                self.watching = False
                self._bump()
