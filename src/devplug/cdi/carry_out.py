"""Carrying out one pass of the CDI sync: build, compare and write specs, remove files.

All the pass's file I/O is here (through the :class:`~devplug.cdi.store.SpecStore`); the sync
decides what to do (:mod:`devplug.cdi.plan`) and records what came of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from devplug.cdi.catalog import CdiResource
from devplug.cdi.files import FileStamp, stamp
from devplug.cdi.plan import Done, Outcome, Plan, Write
from devplug.cdi.store import SpecStore
from devplug.errors import CdiSpecError

# A resource's spec as last written: its bytes and the file's stamp.
Previous = tuple[bytes, FileStamp | None]


async def carry_out(
    store: SpecStore, plan: Plan, previous: Mapping[str, Previous]
) -> dict[str, Outcome]:
    """Build, compare and write specs; remove files. Never raises OSError: each
    resource's failure is its outcome."""
    outcomes: dict[str, Outcome] = {}
    try:
        await store.prepare()
    except OSError as exc:
        return {r: exc for r in (*plan.write, *plan.verify, *plan.remove)}
    for resource, job in plan.write.items():
        try:
            outcomes[resource] = await _write(store, resource, job, previous.get(resource))
        except (OSError, CdiSpecError) as exc:
            outcomes[resource] = exc
    for resource, check in plan.verify.items():
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
        try:
            await store.remove(removal.file_name, expected=removal.stamp)
            outcomes[resource] = None
        except OSError as exc:
            outcomes[resource] = exc
    return outcomes


async def _write(store: SpecStore, resource: str, job: Write, previous: Previous | None) -> Done:
    # Rendering is CPU work (validating thousands of devices on a first render): a thread.
    rendered = await asyncio.to_thread(job.renderer.render, job.devices, job.edit)
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
