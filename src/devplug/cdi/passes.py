"""One pass of the CDI sync: its plan, carrying it out, and the ledger of what passes came to.

The sync (:mod:`devplug.cdi.sync`) decides a pass on the loop: a :class:`Plan` of specs to
write, check or remove (no I/O). :func:`carry_out` builds, compares and writes specs and
removes files: all the pass's file I/O is here, through the
:class:`~devplug.cdi.store.SpecStore`. Each job's outcome then goes to the
:class:`SpecLedger`, once, whatever ended the pass: it is logged, counted for stats and
metrics, and handed to the catalog Allocate reads. The sync reads the ledger back to plan the
next pass, to retry failures and to clean up at shutdown.

The pass yields to the hotplug path: renders run on the event loop in slices of SLICE_S, and
before each slice and each spec's file work the pass awaits ``pause`` (the sync's: until the
hotplug path is quiet, or QUIET_WAIT_MAX_S at most). A uevent that arrives while a pass
runs therefore waits for the rest of one slice at most, and its scan and publish (a few
milliseconds) do not share the interpreter with CDI work; only a hotplug path busy for
longer than QUIET_WAIT_MAX_S (a full scan of a big host, a storm of uevents) lets slices in,
one per STORM_WAIT_S until it is quiet again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Container, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from devplug._kits.problems import ProblemLog, error_reason
from devplug.cdi.allocate import CdiCatalog, CdiResource
from devplug.cdi.files import stamp
from devplug.cdi.render import RenderedSpec, SpecRenderer
from devplug.cdi.stamps import FileStamp
from devplug.cdi.store import SpecHeldError, SpecStore
from devplug.errors import CdiSpecError
from devplug.model import DeviceInfo, MapEdit

log = structlog.get_logger(__name__)

# A resource's spec as last written: its bytes and the file's stamp.
Previous = tuple[bytes, FileStamp | None]
# Awaited between slices of CPU work and before each spec's file work.
Pause = Callable[[], Awaitable[None]]

# The longest a render runs on the loop before it lets others in (a uevent's read among them).
SLICE_S = 0.001


# ------------------------------------------------------------------------- the plan


@dataclass(slots=True)
class WrittenSpec:
    devices: Mapping[str, DeviceInfo] | None  # the device map last turned into this file
    data: bytes
    entry: CdiResource
    stamp: FileStamp | None  # the file as written, to recognise it without reading it


@dataclass(frozen=True, slots=True)
class Write:
    renderer: SpecRenderer
    file_name: str
    devices: Mapping[str, DeviceInfo]  # the resource's devices now
    # How ``devices`` was made from the map the renderer rendered last, if the tree knows.
    edit: MapEdit | None = None


@dataclass(frozen=True, slots=True)
class Removal:
    file_name: str
    stamp: FileStamp | None  # the file as this daemon wrote it


@dataclass(frozen=True, slots=True)
class Check:
    """A spec written before and unchanged since: still there as written, or written again."""

    file_name: str
    stamp: FileStamp | None
    data: bytes


@dataclass(slots=True)
class Plan:
    """One pass: specs to write, check or remove, decided on the loop (resource -> job)."""

    write: dict[str, Write] = field(default_factory=dict)
    remove: dict[str, Removal] = field(default_factory=dict)
    forget: set[str] = field(default_factory=set)  # resources whose file another one took
    verify: dict[str, Check] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Done:
    data: bytes  # the spec's bytes (empty: the resource has no spec)
    entry: CdiResource | None  # what it defines (None: unchanged, for a check)
    wrote: bool  # whether the file was written now
    stamp: FileStamp | None


# A job's outcome: done, removed (None), or why it failed.
Outcome = Done | Exception | None


# ------------------------------------------------------------------------- carrying it out


class PassAbandoned(Exception):
    """Raised by a pause once the daemon stops: the pass ends there, before its next render
    slice or spec's file work (never inside one: a write is never cut half way)."""


async def yield_to_loop() -> None:
    """Let everything ready on the loop run first: one iteration to take our turn after the
    callbacks of the file descriptors found ready (a uevent's read), one more so those run
    before our next slice does."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def carry_out(
    store: SpecStore,
    plan: Plan,
    previous: Mapping[str, Previous],
    pause: Pause,
    outcomes: dict[str, Outcome],
) -> None:
    """Build, compare and write specs; remove files; each resource's outcome goes into
    ``outcomes`` as soon as it is known, so that the caller has them however this ends. Each
    resource's failure is its outcome, a bug's too (logged with its traceback). A pass
    abandoned (:class:`PassAbandoned`) ends early; the resources it did not reach have no
    outcome."""
    try:
        await store.prepare()
    except OSError as exc:
        outcomes.update({r: exc for r in (*plan.write, *plan.verify, *plan.remove)})
        return
    # Stopping: what was done is recorded, the rest is left as it is.
    with contextlib.suppress(PassAbandoned):
        await _carry_out_each(store, plan, previous, pause, outcomes)


async def _carry_out_each(
    store: SpecStore,
    plan: Plan,
    previous: Mapping[str, Previous],
    pause: Pause,
    outcomes: dict[str, Outcome],
) -> None:
    for resource, job in plan.write.items():
        try:
            outcomes[resource] = await _write(store, resource, job, previous.get(resource), pause)
        except PassAbandoned:
            raise
        except (OSError, CdiSpecError) as exc:
            outcomes[resource] = exc
        except Exception as exc:
            # A bug (a renderer's, say) costs this resource its spec, not the others theirs.
            log.exception("cdi.spec.render_failed", resource=resource)
            outcomes[resource] = exc
    for resource, check in plan.verify.items():
        await pause()
        if await stamp(store.directory / check.file_name) == check.stamp:
            try:
                await store.reclaim(check.file_name, resource, check.data)
            except OSError as exc:
                outcomes[resource] = exc
            continue
        try:
            written = await store.write(check.file_name, resource, check.data)
            outcomes[resource] = Done(check.data, None, written.changed, written.stamp)
        except OSError as exc:
            outcomes[resource] = exc
    for resource, removal in plan.remove.items():
        await pause()
        try:
            await store.remove(removal.file_name, expected=removal.stamp)
            outcomes[resource] = None
        except OSError as exc:
            outcomes[resource] = exc


async def render_in_slices(job: Write, pause: Pause) -> RenderedSpec | None:
    """``job``'s render on the loop, SLICE_S at a time, ``pause`` awaited before each slice.

    Not in a worker thread: a thread holding the GIL for a render lets the loop (and the
    scan's own thread) in only every switch interval (5 ms), and cannot be paused."""
    clock = time.perf_counter
    deadline = 0.0

    def due() -> bool:
        return clock() >= deadline

    steps = job.renderer.render_steps(job.devices, job.edit, due)
    try:
        while True:
            await pause()
            deadline = clock() + SLICE_S
            next(steps)
    except StopIteration as done:
        result: RenderedSpec | None = done.value
        return result
    finally:
        steps.close()  # cancelled between slices: the renderer's state is left as it was


async def _write(
    store: SpecStore, resource: str, job: Write, previous: Previous | None, pause: Pause
) -> Done:
    rendered = await render_in_slices(job, pause)
    await pause()  # the file work too waits for a quiet hotplug path
    if rendered is None:
        await store.remove(job.file_name)
        return Done(b"", None, False, None)
    entry = CdiResource(job.renderer.kind, job.file_name, rendered.names, job.devices)
    old_data, old_stamp = previous or (None, None)
    if (
        old_data == rendered.data
        and old_stamp is not None
        and await stamp(store.directory / job.file_name) == old_stamp
    ):
        return Done(rendered.data, entry, False, old_stamp)  # still there as written
    written = await store.write(job.file_name, resource, rendered.data)
    return Done(rendered.data, entry, written.changed, written.stamp)


# ------------------------------------------------------------------------- the ledger


class SpecLedger:
    """resource -> the spec this daemon has on disk, the reason it has none, or the daemon
    that serves it instead; with the counts of writes and failures."""

    def __init__(self, directory: Path, catalog: CdiCatalog) -> None:
        self.directory = directory
        self.catalog = catalog
        self.written: dict[str, WrittenSpec] = {}
        self.failing = ProblemLog()  # resource -> the reason of its last failure
        # resource -> the owner token of the running daemon that serves its spec
        self.held: dict[str, str] = {}
        self.writes = 0  # counters for stats and metrics
        self.failures = 0

    def forget(self, resource: str) -> None:
        """No spec of ``resource`` on disk is this daemon's now: Allocate names none."""
        self.written.pop(resource, None)
        self.catalog.set(resource, None)

    def drop_gone(self, advertised: Container[str]) -> None:
        """Forget the failures and holders of resources no longer ``advertised``; a resource
        whose spec this daemon wrote keeps its failure until the spec's removal is done."""
        for key in self.failing.unsolved():
            if key not in advertised and key not in self.written:
                self.failing.solved(key)  # gone before its spec was ever written
        for resource in [r for r in self.held if r not in advertised]:
            del self.held[resource]

    def record(
        self,
        plan: Plan,
        outcomes: Mapping[str, Outcome],
        before: Mapping[str, CdiResource | None],
    ) -> None:
        """Take in what came of ``plan``'s jobs; ``before``: the catalog's entries as they
        were when the pass began (what a failed write leaves on disk)."""
        for resource, outcome in outcomes.items():
            if not isinstance(outcome, SpecHeldError):
                self.held.pop(resource, None)
            if isinstance(outcome, Exception):
                self._record_failure(resource, outcome, before)
                continue
            if resource in plan.remove:
                self.forget(resource)
                log.info("cdi.spec.removed", resource=resource, reason="resource gone")
                self.failing.solved(resource)
                continue
            if outcome is None:
                continue  # unreachable: None is only a removal's outcome
            if resource in plan.verify:
                done = self.written[resource]
                if outcome.wrote:  # it had gone or been replaced: rewritten
                    self.writes += 1
                    log.warning("cdi.spec.rewritten", resource=resource, reason="changed on disk")
                done.stamp = outcome.stamp
                done.entry = replace(done.entry, stamp=outcome.stamp)
                self.catalog.set(resource, done.entry)  # back, if Allocate had dropped it
                continue
            job = plan.write[resource]
            if outcome.entry is None:
                self.forget(resource)
            else:
                entry = replace(
                    outcome.entry, path=self.directory / job.file_name, stamp=outcome.stamp
                )
                self.written[resource] = WrittenSpec(
                    job.devices, outcome.data, entry, outcome.stamp
                )
                self.catalog.set(resource, entry)
            if outcome.wrote:
                self.writes += 1
                log.info("cdi.spec.written", resource=resource, file=job.file_name)
            if self.failing.solved(resource):
                log.info("cdi.spec.recovered", resource=resource)

    def _record_failure(
        self, resource: str, error: Exception, before: Mapping[str, CdiResource | None]
    ) -> None:
        self.failures += 1
        reason = error_reason(error)
        if isinstance(error, SpecHeldError):
            self.held[resource] = error.owner
            # Another running daemon serves this spec (a second `devplug run` on the same
            # dirs, say): leave it to that one; the dir watch says when it lets go.
            self.forget(resource)
            self.failing.report(
                log,
                "cdi.spec.held_elsewhere",
                reason,
                key=resource,
                level="warning",
                resource=resource,
                dir=str(self.directory),
                held_by=error.instance,
                retry="when that daemon lets go; Allocate gives device specs meanwhile",
            )
            return
        self.failing.report(
            log,
            "cdi.spec.write_failed",
            reason,
            key=resource,
            level="warning",
            resource=resource,
            dir=str(self.directory),
            retry="with back-off; Allocate gives device specs meanwhile",
        )
        if resource in before:
            self.catalog.set(resource, before[resource])  # the old file is still there
