"""Keeping the CDI spec files in line with the advertised devices, off the RPC path.

:class:`CdiSync` follows the advertised tree (``run(trees)``: the scan loop's publications;
or trees handed over with :meth:`CdiSync.submit`), and its task rebuilds the specs of the
resources that changed and writes those whose bytes changed (through aiofiles).
Specs are written when devices are discovered, not inside Allocate; a resource that goes away
takes its spec with it, and so does an orderly shutdown unless ``keep_on_exit``. What each
pass came to is kept in a :class:`~devplug.cdi.passes.SpecLedger`. At start-up, once the
first pass has written the current specs, what earlier runs left is cleared
(:func:`remove_leftovers`): a daemon killed or restarted with fewer resources leaves specs
nobody serves (a runtime would still inject their devices), temp files of writes cut half
way, and the locks of daemons gone. A shutdown's :meth:`CdiSync.close` takes CLOSE_TIMEOUT_S
at most, whatever the CDI dir holds.

CDI work never delays a hotplug event's ListAndWatch message: a pass starts SETTLE_S after the
tree it follows was handed over, renders on the event loop in slices (a first render of
10,000 devices is ~0.3 s of CPU), and before each slice and each spec's file work it awaits
``quiet`` (the daemon passes the scan loop's: no event, scan or publish under way), for
QUIET_WAIT_MAX_S at most. A pass that meets a uevent is paused until that event's list has
been published, and resumes then; a storm of uevents slows it (one slice per STORM_WAIT_S
once a wait has run out) but cannot stop it.

The CDI dir is shared (:mod:`devplug.cdi.store` has the rules): files of other writers are
never touched, and a spec another running devplug serves is left to it until it stops. One
inotify watch on the dir notices a spec deleted or replaced behind this daemon's back, or
released by another daemon, within milliseconds.

A write that fails (full disk, read-only or unwritable dir) is logged with its reason and
retried with back-off; meanwhile the daemon keeps serving, and Allocate names only devices of
the spec that is on disk (:class:`CdiCatalog`), giving device specs for the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Sequence, Set
from typing import Protocol

import structlog

from devplug._kits.backoff import Backoff
from devplug._kits.dirwatch import DirWatcher
from devplug._kits.problems import ProblemLog, error_reason
from devplug._kits.values import LatestValue, Watchable
from devplug.cdi.allocate import CdiCatalog
from devplug.cdi.files import remove_temp_files
from devplug.cdi.ownership import STATE_DIR, OwnerLock, owner_alive, state_dir
from devplug.cdi.passes import (
    SLICE_S,
    Check,
    Outcome,
    PassAbandoned,
    Plan,
    Removal,
    SpecLedger,
    Write,
    carry_out,
    yield_to_loop,
)
from devplug.cdi.render import SpecRenderer, default_kind
from devplug.cdi.store import DEFAULT_INSTANCE, SpecStore
from devplug.config import CdiSettings
from devplug.errors import CdiSpecError
from devplug.model import DeviceTree
from devplug.naming import spec_files
from devplug.scanners.base import Scanner

log = structlog.get_logger(__name__)

RETRY_INITIAL_S = 1.0
# How long after a change the specs are rebuilt (changes within it are written once).
SETTLE_S = 0.02
RETRY_MAX_S = 60.0
# How often the lock of a daemon holding one of our specs is probed (one open and flock).
HELD_RECHECK_S = 0.5
# The longest a slice waits for the hotplug path's quiet: a full scan (0.4 s at 1,000 GPUs)
# or a reload rarely lasts long enough to meet a slice, and an event's scan and publish
# (~5 ms) never do.
QUIET_WAIT_MAX_S = 0.5
# Once a wait has run out (a storm of uevents that never lets the scan loop park, a scan of a
# very big host), the next ones wait this long at most, until the hotplug path is seen quiet
# again: CDI then has one slice (SLICE_S) per this much, ~5 % of the loop, and a first render
# of 10,000 devices (~300 slices) reaches disk in seconds rather than minutes.
STORM_WAIT_S = 0.02
# The most close() takes, whatever the CDI dir holds (a frozen or hostile holder of the state
# dir's mutex, a slow disk): the daemon's shutdown fits it into the kubelet's grace period.
# What it could not remove in that time stays, and is logged (cdi.close.incomplete); the next
# start removes it.
CLOSE_TIMEOUT_S = 3.0
# Within it: waits for the state dir's mutex end this long before the end (the removals
# left then fail at once), and the removals themselves half of it before the end (a file
# operation that hangs, on a stuck disk), which leaves time to let go of the lock.
CLOSE_SPARE_S = 1.0
# Temp files younger than this may be another instance's write in progress.
TEMP_FILE_MIN_AGE_S = 60.0


class PublishedTree(Protocol):
    """One publication of the tree CDI follows (the scan loop's ``Advertised``)."""

    @property
    def tree(self) -> DeviceTree: ...


def _relevant(name: str) -> bool:
    """Names in the CDI dir whose changes may concern our specs."""
    return (name.endswith(".json") and not name.startswith(".")) or name == STATE_DIR


class CdiSync:
    def __init__(
        self,
        settings: CdiSettings,
        catalog: CdiCatalog,
        instance: str = DEFAULT_INSTANCE,
        *,
        on_change: Callable[[], None] | None = None,
        quiet: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.directory = settings.dir
        # Clean-ups touch only this instance's specs; the lock tells other daemons this one
        # is alive, so they leave its specs alone.
        self.instance = instance
        self.store = SpecStore(self.directory, instance, OwnerLock(self.directory))
        # Attribute changes too: a spec's stamp (what Allocate's confirm compares) has its ctime.
        self.watcher = DirWatcher(self.directory, _relevant, "cdi", attributes=True)
        self._tree: LatestValue[DeviceTree | None] = LatestValue(None)
        # Set whenever a pass has recorded what it did (the specs held elsewhere may change).
        self._recorded = asyncio.Event()
        # The tree the last pass ended on without trouble (None: none yet).
        self._passed: LatestValue[DeviceTree | None] = LatestValue(None)
        # What each pass came to: the specs on disk, failures, specs served elsewhere.
        self._ledger = SpecLedger(self.directory, catalog)
        self._kind_problems = ProblemLog()  # resource -> why it has no valid kind
        self._clashes = ProblemLog()  # (resource, file name) -> the resource that has the file
        self._renderers: dict[str, SpecRenderer] = {}
        catalog.on_stale = self._stale
        catalog.dir_token = self.watcher.token
        # Told after every pass that recorded something (the daemon's stats).
        self._on_change = on_change
        # Returns once the hotplug path is quiet; awaited before each slice of a pass.
        self._quiet = quiet
        # The last wait for quiet ran out: the hotplug path has been busy for a while.
        self._storm = False
        self._stopping = False
        self._reconcile_problem = ProblemLog()

    @property
    def writes(self) -> int:
        """Specs written so far (for stats and metrics)."""
        return self._ledger.writes

    @property
    def failures(self) -> int:
        """Spec jobs failed so far, a spec served elsewhere too (for stats and metrics)."""
        return self._ledger.failures

    @property
    def passed(self) -> Watchable[DeviceTree | None]:
        """The tree the last pass ended on without trouble: the specs on disk are made from
        it (None: no such pass yet)."""
        return self._passed

    def submit(self, tree: DeviceTree) -> None:
        """The devices now advertised; the task writes what changed."""
        self._tree.set(tree)

    def _stale(self, resource: str | None = None) -> None:
        """Something in the dir changed: a pass now checks every spec and writes again the
        missing ones (and takes over those another daemon released)."""
        if self._tree.value is not None:
            self._tree.set(self._tree.value)

    def stop(self) -> None:
        """The daemon is stopping: a pass under way ends at its next pause, before any render
        slice or file work it has not begun, and no pass starts after it. Specs on disk stay
        until :meth:`close`."""
        self._stopping = True
        # A wait for the state dir's mutex under way ends now (its pass is abandoned anyway).
        self.store.limit_waits(-math.inf)

    async def _pause(self) -> None:
        """Between slices of a pass: let the loop run what is ready (a uevent's read), then
        wait while the hotplug path is busy (QUIET_WAIT_MAX_S at most, then STORM_WAIT_S
        while it stays busy). Raises PassAbandoned once stopping."""
        await yield_to_loop()
        if self._stopping:
            raise PassAbandoned
        if self._quiet is not None:
            try:
                async with asyncio.timeout(STORM_WAIT_S if self._storm else QUIET_WAIT_MAX_S):
                    await self._quiet()
                self._storm = False
            except TimeoutError:
                self._storm = True
        else:
            # Nobody says when the hotplug path is busy: leave the loop idle as long as a slice
            # lasts, so that a scan's worker thread gets the interpreter at once.
            await asyncio.sleep(SLICE_S)
        if self._stopping:
            raise PassAbandoned

    def kind_of(self, resource: str) -> str | None:
        kind = self.settings.kinds.get(resource)
        if kind is not None:
            return kind
        try:
            return default_kind(resource)
        except CdiSpecError as exc:
            self._kind_problems.report(
                log,
                "cdi.kind.invalid",
                str(exc),
                key=resource,
                resource=resource,
                fix=f"set cdi.kinds.{resource} to a valid kind",
            )
            return None

    async def run(self, trees: Watchable[PublishedTree | None] | None = None) -> None:
        """Follow the tree (``trees``' publications, or what :meth:`submit` hands over) and the
        CDI dir until cancelled."""
        with contextlib.suppress(OSError):  # failures are logged by the passes that follow
            await self.store.prepare()  # the dir exists before it is watched
        async with asyncio.TaskGroup() as group:
            if trees is not None:
                group.create_task(self._follow_trees(trees), name="cdi-tree-follow")
            group.create_task(self.watcher.run(), name="cdi-dir-watch")
            group.create_task(self._follow_dir(), name="cdi-dir-follow")
            group.create_task(self._follow_holders(), name="cdi-holders-follow")
            await self._passes()

    async def _follow_trees(self, trees: Watchable[PublishedTree | None]) -> None:
        async for published in trees.as_changed():
            if published is not None:
                self.submit(published.tree)

    async def _follow_dir(self) -> None:
        version = self.watcher.changes.version
        while True:
            version = await self.watcher.changes.wait_changed(version)
            self._stale()

    async def _follow_holders(self) -> None:
        """A daemon that serves one of our specs and dies (kill -9, OOM) makes no event in the
        CDI dir: while any spec is held elsewhere, probe the holders' locks and take over as
        soon as one is gone. (Watching the lock files would wake on this probe's own close.)
        While none is, it sleeps until a pass has recorded what it did: an idle daemon does
        not wake for it."""
        while True:
            if not self._ledger.held:  # nothing to probe: no wake-ups until a pass records
                self._recorded.clear()
                await self._recorded.wait()
                continue
            await asyncio.sleep(HELD_RECHECK_S)
            for owner in set(self._ledger.held.values()):
                if not await owner_alive(self.directory, owner):
                    self._stale()
                    break

    async def _passes(self) -> None:
        """Reconcile at start, then follow the tree; retry failures with back-off."""
        backoff = Backoff(RETRY_INITIAL_S, RETRY_MAX_S, jitter=False)
        async for tree in self._tree.as_changed():
            if tree is not None:
                break
        reconciled = False
        while True:
            # Changes in a burst are written once. (The list of the scan that submitted this
            # tree reaches the kubelet first: see _pause.)
            await asyncio.sleep(SETTLE_S)
            if self._stopping:
                await asyncio.get_running_loop().create_future()  # no pass after stop()
            version = self._tree.version
            tree = self._tree.value
            trouble = False
            try:
                if tree is not None:
                    await self._sync(tree)
                if not reconciled:
                    # After the pass: what earlier runs left (and the others' files, however
                    # many, looked through to find it) never holds this daemon's specs back.
                    await self._pause()
                    reconciled = await self._reconcile_start()
            except PassAbandoned:
                await asyncio.get_running_loop().create_future()  # stopping: until cancelled
            except asyncio.CancelledError:
                raise
            except Exception:
                # Whatever the CDI dir holds must not stop the daemon: log, retry later.
                log.exception("cdi.sync.failed", dir=str(self.directory), retry="with back-off")
                trouble = True
            if tree is not None and not trouble:
                self._passed.set(tree)
            timeout: float | None = None
            if self._ledger.failing.unsolved() or trouble or not reconciled:
                timeout = backoff.next()
            else:
                backoff.reset()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._tree.wait_changed(version)

    async def _reconcile_start(self) -> bool:
        """Delete what earlier runs left but the specs of the resources advertised now; True
        when done (False: the dir could not be read, try again)."""
        tree = self._tree.value or DeviceTree()
        wanted = set(spec_files(self._kinds(tree))[0].values())
        try:
            await remove_leftovers(self.store, wanted, self._pause)
        except OSError as exc:
            reason = error_reason(exc)
            failing = self._ledger.failing
            # A spec's write that failed the same way has said it already (the dir as a whole
            # is unusable): one line per problem, not one more from the clean-up.
            if reason not in {failing.current(key) for key in failing.unsolved()}:
                self._reconcile_problem.report(
                    log,
                    "cdi.reconcile.failed",
                    reason,
                    level="warning",
                    dir=str(self.directory),
                    retry="with back-off",
                )
            return False
        self._reconcile_problem.solved()
        return True

    def _kinds(self, tree: DeviceTree) -> dict[str, str]:
        """resource -> its CDI kind, for the resources of ``tree`` that have a valid one."""
        return {r: kind for r in sorted(tree) if (kind := self.kind_of(r)) is not None}

    def _plan(self, tree: DeviceTree) -> Plan:
        plan = Plan()
        kinds = self._kinds(tree)
        files, clashes = spec_files(kinds)
        for clash in clashes:
            self._clashes.report(
                log,
                "cdi.spec.file_clash",
                clash.taken_by,
                key=(clash.resource, clash.file_name),
                field="taken_by",
                resource=clash.resource,
                file=clash.file_name,
                fix=f"set cdi.kinds for {clash.resource} to a kind of its own",
            )
        for resource, file_name in files.items():
            devices = tree[resource]
            kind = kinds[resource]
            done = self._ledger.written.get(resource)
            failing = self._ledger.failing.current(resource) is not None
            if done is not None and done.devices is devices and not failing:
                # The same device map as last time: nothing to rebuild, only to check.
                plan.verify[resource] = Check(done.entry.file_name, done.stamp, done.data)
                continue
            renderer = self._renderers.get(resource)
            if renderer is None or renderer.kind != kind:
                renderer = self._renderers[resource] = SpecRenderer(kind)
            edit = (
                None if renderer.rendered is None else tree.edit_since(resource, renderer.rendered)
            )
            plan.write[resource] = Write(renderer, file_name, devices, edit)
        for resource, done in self._ledger.written.items():
            if resource not in tree:
                plan.remove[resource] = Removal(done.entry.file_name, done.stamp)
            elif files.get(resource) != done.entry.file_name:
                # Its file now belongs to another resource: forget it without deleting it.
                plan.forget.add(resource)
        self._ledger.drop_gone(tree)
        for resource in list(self._renderers):
            if resource not in tree:
                del self._renderers[resource]
        return plan

    async def _sync(self, tree: DeviceTree) -> None:
        plan = self._plan(tree)
        for resource in plan.forget:
            self._ledger.forget(resource)
        if not plan.write and not plan.remove and not plan.verify:
            return
        previous = {
            r: (self._ledger.written[r].data, self._ledger.written[r].stamp)
            for r in plan.write
            if r in self._ledger.written
        }
        # While files are replaced, Allocate may only name devices that the old file and the
        # new one define alike: those whose DeviceInfo did not change.
        before = {r: self.catalog.get(r) for r in (*plan.write, *plan.remove)}
        for resource in plan.remove:
            self.catalog.set(resource, None)
        for resource, job in plan.write.items():
            old = before[resource]
            if old is not None:
                self.catalog.set(resource, old.narrowed_to(job.devices, job.edit))
        # Filled as the work goes: whatever ends it (a failure, a stop), what it did is
        # recorded, or close() would not know to remove a spec written before the end.
        outcomes: dict[str, Outcome] = {}
        work = asyncio.ensure_future(carry_out(self.store, plan, previous, self._pause, outcomes))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            # Stopping: a rename may be under way in a worker thread, so let the work end (at
            # its next pause, which never waits long) before recording. The work stays
            # shielded from every further cancel: one reaching it would cut a write.
            self.stop()
            while not work.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(work)
            if not work.cancelled() and work.exception() is not None:
                log.error("cdi.sync.failed", dir=str(self.directory), exc_info=work.exception())
            raise
        finally:
            self._ledger.record(plan, outcomes, before)
            self._recorded.set()
        if self._on_change is not None:
            self._on_change()

    async def close(self) -> None:
        """On orderly shutdown: remove the specs written, unless told to keep them (a spec
        another daemon has taken over since is theirs and stays), then let go of the lock.

        Takes CLOSE_TIMEOUT_S at most in all, however many specs and whatever holds the state
        dir: what is not removed by then stays, logged as ``cdi.close.incomplete``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_TIMEOUT_S
        left: dict[str, str] = {}  # spec file -> why it stayed
        try:
            if not self.settings.keep_on_exit:
                await self._remove_all(deadline, left)
        finally:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self.store.close()
        if left:
            log.warning(
                "cdi.close.incomplete",
                dir=str(self.directory),
                left=left,
                fix="the next start of this instance removes them",
            )

    async def _remove_all(self, deadline: float, left: dict[str, str]) -> None:
        """Remove every spec written, by ``deadline`` less CLOSE_SPARE_S / 2 at the latest;
        what stays goes into ``left`` with the reason."""
        self.store.limit_waits(deadline - CLOSE_SPARE_S)
        pending = sorted(self._ledger.written.items())
        for resource, _ in pending:
            self.catalog.set(resource, None)
        self._ledger.written.clear()
        try:
            async with asyncio.timeout_at(deadline - CLOSE_SPARE_S / 2):
                while pending:
                    done = pending[0][1]
                    try:
                        await self.store.remove(done.entry.file_name, expected=done.stamp)
                    except OSError as exc:
                        left[done.entry.file_name] = error_reason(exc)
                    pending.pop(0)
        except TimeoutError:
            reason = f"not removed within the {CLOSE_TIMEOUT_S:g} s allowed at shutdown"
            left.update({done.entry.file_name: reason for _, done in pending})


async def remove_leftovers(
    store: SpecStore, wanted: Set[str], pause: Callable[[], Awaitable[None]]
) -> None:
    """Delete this instance's specs of earlier runs but those named in ``wanted`` (the spec
    files of the resources advertised now), old temp files and the locks of daemons gone.
    Only this instance's specs whose daemon is gone go (:mod:`devplug.cdi.store` has the
    rules); those of the resources advertised now stay, for the passes to check.

    Raises OSError when the dir cannot be used (to be tried again). ``pause`` is awaited
    before each spec's removal (the sync's: it ends the clean-up once the daemon stops). Each
    look through a dir is one worker-thread hop, so that thousands of other writers' files
    cost little (their names only: candidates come from devplug's records).
    """
    directory = store.directory
    await store.prepare()
    stale_temps = await remove_temp_files(directory, TEMP_FILE_MIN_AGE_S)
    stale_temps += await remove_temp_files(state_dir(directory), TEMP_FILE_MIN_AGE_S)
    await store.remove_dead_locks()
    candidates = await store.stale_candidates()
    for name in candidates:
        if name in wanted:
            continue
        await pause()
        try:
            resource = await store.remove_stale(name)
        except OSError as exc:
            log.warning("cdi.spec.remove_failed", file=name, reason=error_reason(exc))
            continue
        if resource is not None:
            log.info("cdi.spec.removed", file=name, resource=resource, reason="stale")
    if stale_temps:
        log.info("cdi.temp_files.removed", count=stale_temps)


def default_instance(scanners: Sequence[Scanner]) -> str:
    """The instance name of a daemon running ``scanners``: their names, sorted."""
    return ",".join(sorted({scanner.name for scanner in scanners})) or DEFAULT_INSTANCE
