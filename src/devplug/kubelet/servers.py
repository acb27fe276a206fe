"""Keeps one ResourceServer per resource of the advertised DeviceTree.

``follow(advertised)`` applies each tree the scan loop publishes (the latest one: a tree
overtaken while the previous one was applied is skipped, and the diff covers both), less the
resources another front serves (``served_elsewhere``: the DRA front's); :attr:`applied` says
which publication is in place. ``apply(tree, owners)`` diffs the new tree against the current
one: a new resource gets a server task (named, inside the daemon's TaskGroup, so a crash reaches
the supervisor instead of vanishing), which first awaits the scanner's start hook (retried until
it returns: the resource stays unregistered meanwhile), then serves; a changed one gets its new
list pushed; a removed one first sends an empty list, then its server stops and its socket goes,
then the scanner's stop hook runs. At the end of ``serving`` every server stops, then every stop
hook owed runs. A resource whose scanner was replaced (a reload) gets the new scanner's RPC
hooks; its start and stop stay with the scanner that started it (see
:mod:`devplug.kubelet.lifecycle`). At shutdown the stop hooks run together, each bounded by the
hook timeout or by ``stop_hooks_bound()`` (the daemon's: what is left of its stop budget),
whichever is shorter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from devplug._kits.values import LatestValue, Watchable
from devplug.kubelet.diff import diff
from devplug.kubelet.lifecycle import Lifecycle
from devplug.kubelet.registration import KubeletDirWatcher
from devplug.kubelet.seams import AdvertisedTree, AnswerExtension, ServingEvents
from devplug.kubelet.server import DEFAULT_TIMING, ResourceServer, ServerTiming
from devplug.model import DeviceInfo, DeviceTree

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Running:
    server: ResourceServer
    lifecycle: Lifecycle
    task: asyncio.Task[None]


class ResourceServers:
    def __init__(
        self,
        kubelet_dir: Path,
        watcher: KubeletDirWatcher,
        timing: ServerTiming = DEFAULT_TIMING,
        *,
        extension: AnswerExtension | None = None,
        events: ServingEvents | None = None,
        stop_hooks_bound: Callable[[], float] | None = None,
        served_elsewhere: frozenset[str] = frozenset(),
    ) -> None:
        self.kubelet_dir = kubelet_dir
        # Resources another front serves: never served nor registered here, whatever the tree.
        self.served_elsewhere = served_elsewhere
        # At shutdown: the seconds the stop hooks may take (None: the hook timeout alone).
        self.stop_hooks_bound = stop_hooks_bound
        self.extension = extension
        self.events = events
        self.watcher = watcher
        self.timing = timing
        self._task_group: asyncio.TaskGroup | None = None
        self._running: dict[str, _Running] = {}
        # Removed resources whose stop hook has not run yet (it is owed even if the removal
        # is cancelled by a shutdown).
        self._owed: set[Lifecycle] = set()
        # resource -> the thread of a removed resource's hook that still runs: the hooks of
        # its next lifecycle wait for it (a resource's hook calls never overlap).
        self._leftovers: dict[str, asyncio.Future[Any]] = {}
        self.tree = DeviceTree()
        # The version of the publication followed that is in place (see follow()).
        self._applied = LatestValue(0)

    @contextlib.asynccontextmanager
    async def serving(self, task_group: asyncio.TaskGroup) -> AsyncIterator[None]:
        """Servers run as tasks of ``task_group`` during the block; all stop at its end (their
        sockets are removed), then the stop hooks owed run (each bounded by its timeout and
        the stop budget)."""
        self._task_group = task_group
        try:
            yield
        finally:
            self._task_group = None
            running, self._running = self._running, {}
            await asyncio.gather(*(_cancel(r.task) for r in running.values()))
            owed = [*self._owed, *(r.lifecycle for r in running.values())]
            self._owed.clear()
            bound = None if self.stop_hooks_bound is None else self.stop_hooks_bound()
            await asyncio.gather(*(lifecycle.stop(bound) for lifecycle in owed))

    @property
    def applied(self) -> Watchable[int]:
        """The version of the last publication :meth:`follow` applied (0: none yet)."""
        return self._applied

    async def follow(self, advertised: Watchable[AdvertisedTree | None]) -> None:
        """Apply every tree ``advertised`` publishes, until cancelled (inside :meth:`serving`)."""
        async for published in advertised.as_changed():
            version = advertised.version  # the value's own: nothing ran since it was yielded
            if published is not None:
                await self.apply(self._served_here(published.tree), published.owners)
            self._applied.set(version)

    def _served_here(self, tree: DeviceTree) -> DeviceTree:
        """``tree`` less the resources another front serves (the others' edits kept)."""
        elsewhere: dict[str, Mapping[str, DeviceInfo]] = {
            name: {} for name in self.served_elsewhere if name in tree
        }
        return tree.narrowed(elsewhere) if elsewhere else tree

    @property
    def servers(self) -> Mapping[str, ResourceServer]:
        return {name: running.server for name, running in self._running.items()}

    @property
    def lifecycles(self) -> Mapping[str, Lifecycle]:
        return {name: running.lifecycle for name, running in self._running.items()}

    def unregistered(self) -> list[str]:
        """The resources served but not registered with the kubelet (now)."""
        return sorted(n for n, r in self._running.items() if not r.server.registered.is_set())

    async def wait_registered(self) -> int:
        """Wait until every resource served now is registered; how many there are."""
        servers = [r.server for r in self._running.values()]
        await asyncio.gather(*(server.registered.wait() for server in servers))
        return len(servers)

    async def apply(self, tree: DeviceTree, hooks: Mapping[str, object]) -> None:
        """Bring the servers in line with ``tree``; ``hooks`` maps resource -> its scanner."""
        if self._task_group is None:
            return  # not serving (stopping): nothing may start
        for name, running in self._running.items():
            if name in tree and hooks.get(name) is not running.server.hooks:
                running.server.rebind(hooks.get(name))  # a reload replaced its scanner
        change = diff(self.tree, tree)
        before, self.tree = self.tree, tree
        for name, devices in tree.items():
            old = before.get(name)
            served = self._running.get(name)
            if old is None or old is devices or name in change.changed or served is None:
                continue
            edit = tree.edit_since(name, old)
            if edit is not None:
                # An equal list is not sent, but the next list may be an edit of this one.
                served.server.servicer.edited(devices, edit)
        if not change:
            return
        log.info(
            "servers.tree.changed",
            added=sorted(change.added),
            removed=sorted(change.removed),
            changed=sorted(change.changed),
        )
        for name in change.changed:
            # The edit from the list published before, when the tree knows it: the message
            # then re-encodes only the edited devices.
            self._running[name].server.update(tree[name], tree.edit_since(name, before[name]))
        for name in sorted(change.added):
            server = ResourceServer(
                name,
                tree[name],
                hooks.get(name),
                kubelet_dir=self.kubelet_dir,
                watcher=self.watcher,
                timing=self.timing,
                extension=self.extension,
                events=self.events,
            )
            lifecycle = Lifecycle(
                name,
                hooks.get(name),
                timeout_s=self.timing.hook_timeout_s,
                retry_initial_s=self.timing.start_retry_initial_s,
                retry_max_s=self.timing.start_retry_max_s,
                leftover=self._leftovers.pop(name, None),
            )
            task = self._task_group.create_task(_serve(server, lifecycle), name=f"server:{name}")
            self._running[name] = _Running(server, lifecycle, task)
        if change.removed:
            await asyncio.gather(*(self._retire(name) for name in change.removed))

    async def _retire(self, name: str) -> None:
        running = self._running[name]
        log.info("servers.resource.removed", resource=name)
        try:
            await running.server.retire()
        finally:
            # Even when cancelled mid-drain (SIGTERM), the server must not outlive its entry.
            self._running.pop(name, None)
            self._owed.add(running.lifecycle)
            await _cancel(running.task)
        self._owed.discard(running.lifecycle)
        await running.lifecycle.stop()
        leftover = running.lifecycle.leftover
        if leftover is not None:
            self._leftovers[name] = leftover


async def _serve(server: ResourceServer, lifecycle: Lifecycle) -> None:
    """The resource's task: its start hook returns before the server listens or registers."""
    await lifecycle.start()
    await server.run()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
