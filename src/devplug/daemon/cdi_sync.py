"""Keeping the CDI spec files in line with the advertised devices, off the RPC path.

After each scan the daemon hands the new tree to :class:`CdiSync`, whose task rebuilds the
specs of the resources that changed and writes those whose bytes changed, in a worker thread
(a spec of 10,000 devices takes tens of milliseconds to build). Specs are written when devices
are discovered, not inside Allocate; a resource that goes away takes its spec with it, and so
does an orderly shutdown unless ``keep_on_exit``. At start-up, specs devplug wrote earlier for
resources it no longer has are deleted; files without devplug's mark are never touched.

A write that fails (full disk, read-only or unwritable dir) is logged with its reason and
retried with back-off; meanwhile the daemon keeps serving, and Allocate names only devices of
the spec that is on disk (:class:`CdiCatalog`), giving device specs for the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from devplug.cdi.build import DEFAULT_INSTANCE, SpecRenderer
from devplug.cdi.files import (
    FileStamp,
    file_stamp,
    owned_specs,
    remove_owned_spec,
    remove_temp_files,
    write_spec_file,
)
from devplug.cdi.names import default_kind, spec_file_name
from devplug.config import CdiSettings
from devplug.daemon.values import LatestValue
from devplug.errors import CdiSpecError
from devplug.model import DeviceInfo, DeviceTree
from devplug.scanners.base import Scanner

log = structlog.get_logger("devplug.cdi")

RETRY_INITIAL_S = 1.0
# Temp files younger than this may be another instance's write in progress.
TEMP_FILE_MIN_AGE_S = 60.0
# How long after a change the specs are rebuilt (changes within it are written once).
SETTLE_S = 0.02
RETRY_MAX_S = 60.0


@dataclass(frozen=True, slots=True, eq=False)
class CdiResource:
    """What the spec file of one resource on disk defines."""

    kind: str
    file_name: str
    names: frozenset[str]
    # The devices the file was made from: a device whose nodes, mounts or CDI edits changed since
    # is not named in Allocate until its spec is rewritten (the runtime would inject the old).
    devices: Mapping[str, DeviceInfo]
    # The file as written (None: not checked), so Allocate can confirm it is still there.
    path: Path | None = None
    stamp: FileStamp | None = None

    def narrowed_to(self, devices: Mapping[str, DeviceInfo]) -> CdiResource:
        """This entry, naming only the devices whose DeviceInfo is the very one in
        ``devices`` too: what a file being replaced defines before and after alike."""
        same = frozenset(name for name in self.names if devices.get(name) is self.devices.get(name))
        return replace(self, names=same)

    def defines(self, device_id: str, now: DeviceInfo) -> bool:
        """Whether the spec on disk gives ``device_id`` what ``now`` says it should get."""
        if device_id not in self.names:
            return False
        then = self.devices.get(device_id)
        return then is now or (
            then is not None
            and then.nodes == now.nodes
            and then.mounts == now.mounts
            and then.cdi_edits == now.cdi_edits
        )


class CdiCatalog:
    """resource -> what its spec on disk defines; read by Allocate on the event loop."""

    def __init__(self) -> None:
        self._resources: dict[str, CdiResource] = {}
        # Bumped on every change, so cached Allocate answers know when they are stale.
        self.generation = 0
        # Called when Allocate finds a spec gone or replaced behind devplug's back.
        self.on_stale: Callable[[str], None] | None = None

    def resources(self) -> list[str]:
        """The resources whose spec is on disk (for status and tests)."""
        return sorted(self._resources)

    def confirm(self, resource: str) -> None:
        """Drop ``resource``'s entry if its file is no longer the one written (deleted, or
        replaced by someone else), so that no name the runtime cannot resolve is sent.

        One lstat per Allocate, on the event loop: the CDI dir is a tmpfs (/var/run/cdi) or a
        local dir, and a stale name would fail the container.
        """
        entry = self._resources.get(resource)
        if entry is None or entry.path is None or file_stamp(entry.path) == entry.stamp:
            return
        log.warning("cdi.spec.vanished", resource=resource, file=str(entry.path))
        self.set(resource, None)
        if self.on_stale is not None:
            self.on_stale(resource)

    def get(self, resource: str) -> CdiResource | None:
        return self._resources.get(resource)

    def set(self, resource: str, value: CdiResource | None) -> None:
        if self._resources.get(resource) is value:
            return
        if value is None:
            self._resources.pop(resource, None)
        else:
            self._resources[resource] = value
        self.generation += 1


@dataclass(slots=True)
class _Written:
    devices: Mapping[str, DeviceInfo] | None  # the device map last turned into this file
    data: bytes
    entry: CdiResource
    stamp: FileStamp | None  # the file as written, to recognise it without reading it


@dataclass(slots=True)
class _Plan:
    """One pass: specs to write (or confirm) and files to remove, decided on the loop."""

    # resource -> (its renderer, its spec file name, its devices now)
    write: dict[str, tuple[SpecRenderer, str, Mapping[str, DeviceInfo]]] = field(
        default_factory=dict
    )
    # resource -> (file name, the stamp of this process's write)
    remove: dict[str, tuple[str, FileStamp | None]] = field(default_factory=dict)
    forget: set[str] = field(default_factory=set)  # resources whose file another one took
    # Specs written before and unchanged: checked to be still there as written (someone may
    # have deleted or replaced them), rewritten if not. resource -> (file name, stamp, bytes)
    verify: dict[str, tuple[str, FileStamp | None, bytes]] = field(default_factory=dict)


class CdiSync:
    def __init__(
        self, settings: CdiSettings, catalog: CdiCatalog, instance: str = DEFAULT_INSTANCE
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.directory = settings.dir
        # Written into each spec; clean-ups touch only this instance's specs.
        self.instance = instance
        self._tree: LatestValue[DeviceTree | None] = LatestValue(None)
        self._written: dict[str, _Written] = {}
        self._failing: dict[str, str] = {}  # resource -> the reason of its last failure
        self._kind_problems: set[str] = set()
        self._clashes: set[tuple[str, str]] = set()
        self._renderers: dict[str, SpecRenderer] = {}
        catalog.on_stale = self._stale
        self.writes = 0  # counters for tests and metrics
        self.failures = 0

    def submit(self, tree: DeviceTree) -> None:
        """The devices now advertised; the task writes what changed."""
        self._tree.set(tree)

    def _stale(self, resource: str) -> None:
        """A spec vanished: a pass now checks every spec and writes the missing ones again."""
        if self._tree.value is not None:
            self._tree.set(self._tree.value)

    def kind_of(self, resource: str) -> str | None:
        kind = self.settings.kinds.get(resource)
        if kind is not None:
            return kind
        try:
            return default_kind(resource)
        except CdiSpecError as exc:
            if resource not in self._kind_problems:
                self._kind_problems.add(resource)
                log.error(
                    "cdi.kind.invalid",
                    resource=resource,
                    reason=str(exc),
                    fix=f"set cdi.kinds.{resource} to a valid kind",
                )
            return None

    async def run(self) -> None:
        """Reconcile at start, then follow the tree; retry failures with back-off."""
        delay = RETRY_INITIAL_S
        async for tree in self._tree.as_changed():
            if tree is not None:
                break
        reconciled = False
        while True:
            # Let the scan that submitted this tree finish reaching the kubelet first: the
            # spec is built in a thread that would compete with it for the interpreter.
            await asyncio.sleep(SETTLE_S)
            version = self._tree.version
            tree = self._tree.value
            trouble = False
            try:
                if not reconciled:
                    reconciled = await self._reconcile_start()
                if tree is not None:
                    await self._sync(tree)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Whatever the CDI dir holds must not stop the daemon: log, retry later.
                log.exception("cdi.sync.failed", dir=str(self.directory), retry="with back-off")
                trouble = True
            timeout: float | None = None
            if self._failing or trouble or not reconciled:
                timeout, delay = delay, min(delay * 2, RETRY_MAX_S)
            else:
                delay = RETRY_INITIAL_S
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._tree.wait_changed(version)

    async def _reconcile_start(self) -> bool:
        """Delete this instance's specs of earlier runs for resources not advertised now, and
        old temp files; True when done (False: the dir could not be read, try again)."""
        tree = self._tree.value or DeviceTree()
        wanted = {spec_file_name(k) for r in tree if (k := self.kind_of(r)) is not None}
        try:
            stale_temps = await asyncio.to_thread(
                remove_temp_files, self.directory, TEMP_FILE_MIN_AGE_S
            )
            owned = await asyncio.to_thread(owned_specs, self.directory, self.instance)
        except OSError as exc:
            log.warning("cdi.reconcile.failed", dir=str(self.directory), reason=_reason(exc))
            return False
        for name, resource in sorted(owned.items()):
            if name in wanted:
                continue
            try:
                removed = await asyncio.to_thread(
                    remove_owned_spec, self.directory, name, instance=self.instance
                )
            except OSError as exc:
                log.warning("cdi.spec.remove_failed", file=name, reason=_reason(exc))
                continue
            if removed:
                log.info("cdi.spec.removed", file=name, resource=resource, reason="stale")
        if stale_temps:
            log.info("cdi.temp_files.removed", count=stale_temps)
        return True

    def _plan(self, tree: DeviceTree) -> _Plan:
        plan = _Plan()
        claimed: dict[str, str] = {}  # spec file name -> the resource it belongs to
        for resource in sorted(tree):
            devices = tree[resource]
            kind = self.kind_of(resource)
            if kind is None:
                continue
            file_name = spec_file_name(kind)
            owner = claimed.setdefault(file_name, resource)
            if owner != resource:
                # Two kinds, one file (a/b-c and a-b/c), or a configured kind equal to another
                # resource's: the first resource (by name) keeps the file, the other gets none.
                if (resource, file_name) not in self._clashes:
                    self._clashes.add((resource, file_name))
                    log.error(
                        "cdi.spec.file_clash",
                        resource=resource,
                        file=file_name,
                        taken_by=owner,
                        fix=f"set cdi.kinds for {resource} to a kind of its own",
                    )
                continue
            done = self._written.get(resource)
            if done is not None and done.devices is devices and resource not in self._failing:
                # The same device map as last time: nothing to rebuild, only to check.
                plan.verify[resource] = (done.entry.file_name, done.stamp, done.data)
                continue
            renderer = self._renderers.get(resource)
            if renderer is None or renderer.kind != kind:
                renderer = self._renderers[resource] = SpecRenderer(resource, kind, self.instance)
            plan.write[resource] = (renderer, file_name, devices)
        for resource, done in self._written.items():
            if resource not in tree:
                plan.remove[resource] = (done.entry.file_name, done.stamp)
            elif claimed.get(done.entry.file_name) != resource:
                # Its file now belongs to another resource: forget it without deleting it.
                plan.forget.add(resource)
        for resource in list(self._failing):
            if resource not in tree and resource not in self._written:
                del self._failing[resource]  # gone before its spec was ever written
        for resource in list(self._renderers):
            if resource not in tree:
                del self._renderers[resource]
        return plan

    async def _sync(self, tree: DeviceTree) -> None:
        plan = self._plan(tree)
        for resource in plan.forget:
            self._written.pop(resource, None)
            self.catalog.set(resource, None)
        if not plan.write and not plan.remove and not plan.verify:
            return
        previous = {
            r: (self._written[r].data, self._written[r].stamp)
            for r in plan.write
            if r in self._written
        }
        # While the thread replaces files, Allocate may only name devices that the old file
        # and the new one define alike: those whose DeviceInfo did not change.
        before = {r: self.catalog.get(r) for r in (*plan.write, *plan.remove)}
        for resource in plan.remove:
            self.catalog.set(resource, None)
        for resource, (_, _, devices) in plan.write.items():
            old = before[resource]
            if old is not None:
                self.catalog.set(resource, old.narrowed_to(devices))
        work = asyncio.ensure_future(asyncio.to_thread(_carry_out, self.directory, plan, previous))
        try:
            outcomes = await asyncio.shield(work)
        except asyncio.CancelledError:
            # Stopping: the thread cannot be stopped, so wait for it and record what it wrote,
            # or close() would not know to remove a spec written in these last milliseconds.
            self._record(plan, await work, before)
            raise
        self._record(plan, outcomes, before)

    def _record(
        self,
        plan: _Plan,
        outcomes: Mapping[str, _Outcome],
        before: Mapping[str, CdiResource | None],
    ) -> None:
        for resource, outcome in outcomes.items():
            if isinstance(outcome, Exception):
                self.failures += 1
                reason = _reason(outcome)
                if self._failing.get(resource) != reason:
                    log.warning(
                        "cdi.spec.write_failed",
                        resource=resource,
                        dir=str(self.directory),
                        reason=reason,
                        retry="with back-off; Allocate gives device specs meanwhile",
                    )
                self._failing[resource] = reason
                if resource in before:
                    self.catalog.set(resource, before[resource])  # the old file is still there
                continue
            if resource in plan.remove:
                self._written.pop(resource, None)
                self.catalog.set(resource, None)
                log.info("cdi.spec.removed", resource=resource, reason="resource gone")
                self._failing.pop(resource, None)
                continue
            if outcome is None:
                continue  # unreachable: None is only a removal's outcome
            data, entry, wrote, stamp = outcome
            if resource in plan.verify:
                done = self._written[resource]
                if wrote:  # it had gone or been replaced: rewritten
                    self.writes += 1
                    done.stamp = stamp
                    done.entry = replace(done.entry, stamp=stamp)
                    log.warning("cdi.spec.rewritten", resource=resource, reason="changed on disk")
                self.catalog.set(resource, done.entry)  # back, if Allocate had dropped it
                continue
            devices = plan.write[resource][2]
            if entry is None:
                self._written.pop(resource, None)
                self.catalog.set(resource, None)
            else:
                entry = replace(entry, path=self.directory / entry.file_name, stamp=stamp)
                self._written[resource] = _Written(devices, data, entry, stamp)
                self.catalog.set(resource, entry)
            if wrote:
                self.writes += 1
                log.info("cdi.spec.written", resource=resource, file=plan.write[resource][1])
            if resource in self._failing:
                log.info("cdi.spec.recovered", resource=resource)
                del self._failing[resource]

    async def close(self) -> None:
        """On orderly shutdown: remove the specs written, unless told to keep them (a spec
        another instance has rewritten since is theirs and stays)."""
        if self.settings.keep_on_exit:
            return
        for resource, done in sorted(self._written.items()):
            self.catalog.set(resource, None)
            try:
                await asyncio.to_thread(
                    remove_owned_spec,
                    self.directory,
                    done.entry.file_name,
                    instance=self.instance,
                    stamp=done.stamp,
                )
            except OSError as exc:
                log.warning("cdi.spec.remove_failed", resource=resource, reason=_reason(exc))
        self._written.clear()


# (spec bytes, what it defines, whether it was written now, the file's stamp), or the error.
_Outcome = tuple[bytes, CdiResource | None, bool, FileStamp | None] | Exception | None


def _carry_out(
    directory: Path, plan: _Plan, previous: Mapping[str, tuple[bytes, FileStamp | None]]
) -> dict[str, _Outcome]:
    """Build, compare and write specs; remove files (worker thread). Never raises OSError:
    each resource's failure is its outcome."""
    outcomes: dict[str, _Outcome] = {}
    for resource, (renderer, file_name, devices) in plan.write.items():
        try:
            rendered = renderer.render(devices)
            if rendered is None:
                remove_owned_spec(directory, file_name)
                outcomes[resource] = (b"", None, False, None)
                continue
            entry = CdiResource(renderer.kind, file_name, rendered.names, devices)
            old_data, old_stamp = previous.get(resource, (None, None))
            if old_data == rendered.data and file_stamp(directory / file_name) == old_stamp:
                outcomes[resource] = (rendered.data, entry, False, old_stamp)  # still there
                continue
            on_disk = file_stamp(directory / file_name)
            stamp = write_spec_file(directory, file_name, rendered.data, ours=old_stamp)
            # The same stamp: the file already held these bytes (a restart) and was kept.
            outcomes[resource] = (rendered.data, entry, stamp != on_disk, stamp)
        except (OSError, CdiSpecError) as exc:
            outcomes[resource] = exc
    for resource, (file_name, stamp_then, data) in plan.verify.items():
        if file_stamp(directory / file_name) == stamp_then:
            continue
        try:
            stamp = write_spec_file(directory, file_name, data)
            outcomes[resource] = (data, None, True, stamp)
        except OSError as exc:
            outcomes[resource] = exc
    for resource, (file_name, file_stamp_then) in plan.remove.items():
        try:
            remove_owned_spec(directory, file_name, stamp=file_stamp_then)
            outcomes[resource] = None
        except OSError as exc:
            outcomes[resource] = exc
    return outcomes


def default_instance(scanners: Sequence[Scanner]) -> str:
    """The instance name of a daemon running ``scanners``: their names, sorted."""
    return ",".join(sorted({scanner.name for scanner in scanners})) or DEFAULT_INSTANCE


def _reason(exc: Exception) -> str:
    if not isinstance(exc, OSError):
        return str(exc)
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{name}: {exc.strerror or exc}" if name else str(exc)
