"""Carrying out one pass of the CDI sync: build, compare and write specs, remove files.

All the pass's file I/O is here (through the :class:`~devplug.cdi.store.SpecStore`); the sync
decides what to do (:mod:`devplug.cdi.plan`) and records what came of it.

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
from collections.abc import Awaitable, Callable, Mapping

import structlog

from devplug.cdi.build import RenderedSpec
from devplug.cdi.catalog import CdiResource
from devplug.cdi.files import stamp
from devplug.cdi.plan import Done, Outcome, Plan, Write
from devplug.cdi.stamps import FileStamp
from devplug.cdi.store import SpecStore
from devplug.errors import CdiSpecError

log = structlog.get_logger("devplug.cdi")

# A resource's spec as last written: its bytes and the file's stamp.
Previous = tuple[bytes, FileStamp | None]
# Awaited between slices of CPU work and before each spec's file work.
Pause = Callable[[], Awaitable[None]]

# The longest a render runs on the loop before it lets others in (a uevent's read among them).
SLICE_S = 0.001


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
