"""Keeps one ResourceServer per resource of the latest DeviceTree.

``apply(tree)`` diffs the new tree against the current one: a new resource gets a server task
(named, inside the daemon's TaskGroup, so a crash reaches the supervisor instead of vanishing);
a changed one gets its new list pushed; a removed one first sends an empty list, then its
server stops and its socket goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from devplug.kubelet.diff import diff
from devplug.kubelet.registration import KubeletDirWatcher
from devplug.kubelet.seams import AnswerExtension, ServingEvents
from devplug.kubelet.server import DEFAULT_TIMING, ResourceServer, ServerTiming
from devplug.model import DeviceTree

log = structlog.get_logger("devplug.manager")


@dataclass(slots=True)
class _Running:
    server: ResourceServer
    task: asyncio.Task[None]


class Manager:
    def __init__(
        self,
        kubelet_dir: Path,
        watcher: KubeletDirWatcher,
        task_group: asyncio.TaskGroup,
        timing: ServerTiming = DEFAULT_TIMING,
        extension: AnswerExtension | None = None,
        events: ServingEvents | None = None,
    ) -> None:
        self.kubelet_dir = kubelet_dir
        self.extension = extension
        self.events = events
        self.watcher = watcher
        self.timing = timing
        self._task_group = task_group
        self._running: dict[str, _Running] = {}
        self.tree = DeviceTree()
        self._closed = False

    @property
    def servers(self) -> Mapping[str, ResourceServer]:
        return {name: running.server for name, running in self._running.items()}

    async def apply(self, tree: DeviceTree, hooks: Mapping[str, object]) -> None:
        """Bring the servers in line with ``tree``; ``hooks`` maps resource -> its scanner."""
        if self._closed:
            return
        change = diff(self.tree, tree)
        self.tree = tree
        if not change:
            return
        log.info(
            "manager.tree.changed",
            added=sorted(change.added),
            removed=sorted(change.removed),
            changed=sorted(change.changed),
        )
        for name in change.changed:
            self._running[name].server.update(tree[name])
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
            task = self._task_group.create_task(server.run(), name=f"server:{name}")
            self._running[name] = _Running(server, task)
        if change.removed:
            await asyncio.gather(*(self._retire(name) for name in change.removed))

    async def _retire(self, name: str) -> None:
        running = self._running[name]
        log.info("manager.resource.removed", resource=name)
        try:
            await running.server.retire()
        finally:
            # Even when cancelled mid-drain (SIGTERM), the server must not outlive its entry.
            self._running.pop(name, None)
            await _cancel(running.task)

    async def shutdown(self) -> None:
        """Stop every server (their sockets are removed); used on SIGTERM. Final."""
        self._closed = True
        running, self._running = self._running, {}
        await asyncio.gather(*(_cancel(r.task) for r in running.values()))


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
