"""CDI work gives way to the hotplug path: renders in slices that give the same bytes as a
whole render, and a sync that waits for the hotplug path's quiet before each slice."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import random
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from devplug.cdi import spec as spec_module
from devplug.cdi import sync as sync_module
from devplug.cdi.allocate import CdiCatalog
from devplug.cdi.render import (
    SORT_RUN,
    RenderedSpec,
    SpecRenderer,
    _natural_order,
    finish,
    resource_spec,
)
from devplug.cdi.spec import ContainerEdits, MountEdit, spec_json
from devplug.cdi.sync import CdiSync
from devplug.config import CdiSettings
from devplug.model import DeviceInfo, DeviceNode, DeviceTree, MapEdit, Mount
from devplug.naming import natural_key
from devplug.testing import eventually

KIND = RESOURCE = "example.com/serial"
SPEC_FILE = "example.com-serial.json"


def device(index: int, variant: int = 0) -> DeviceInfo:
    return DeviceInfo(
        nodes=(DeviceNode(f"/dev/ttyX{index}" if not variant else f"/dev/ttyV{variant}.{index}"),),
        mounts=(Mount(f"/run/serial/{index}"),),
    )


def always_due() -> bool:
    return True


def sliced(
    renderer: SpecRenderer, devices: Mapping[str, DeviceInfo], edit: MapEdit | None
) -> RenderedSpec | None:
    """The render, one step per yield (the most slices a render can have)."""
    return finish(renderer.render_steps(devices, edit, always_due))


def test_a_render_in_slices_gives_what_a_whole_render_gives_through_random_edits() -> None:
    """A random walk of edits, rendered in the most slices possible, some renders abandoned
    half-way (the CDI task cancelled): each finished render gives the bytes and names of a
    plain render, and an abandoned one leaves nothing wrong behind."""
    rng = random.Random(1605)
    renderer = SpecRenderer(KIND)
    tree = DeviceTree({RESOURCE: {f"dev{i}": device(i) for i in range(40)}})
    abandoned = edited = 0
    for step in range(400):
        devices = tree[RESOURCE]
        removed = [(RESOURCE, i) for i in devices if rng.random() < 0.05]
        added = {
            f"dev{i}": device(i, variant=rng.randrange(3))
            for i in rng.sample(range(80), rng.randrange(5))
            if f"dev{i}" not in devices or (RESOURCE, f"dev{i}") in removed
        }
        new = tree.with_changes(removed, {RESOURCE: added} if added else {})
        if RESOURCE not in new:
            continue
        last = renderer.rendered
        edit = None if last is None else new.edit_since(RESOURCE, last)
        if rng.random() < 0.1:
            steps = renderer.render_steps(new[RESOURCE], edit, always_due)
            for _ in range(rng.randrange(1, 4)):
                next(steps, None)
            steps.close()
            abandoned += 1
            tree = new  # the tree moves on; the next render looks at every device
            continue
        edited += edit is not None
        rendered = sliced(renderer, new[RESOURCE], edit)
        spec = resource_spec(KIND, new[RESOURCE])
        assert spec is not None
        assert rendered is not None and rendered.data == spec_json(spec), step
        assert rendered.names == {d.name for d in spec.devices}
        tree = new
    assert abandoned > 20 and edited > 200


def test_a_render_yields_between_slices() -> None:
    renderer = SpecRenderer(KIND)
    steps = renderer.render_steps({f"dev{i}": device(i) for i in range(600)}, None, always_due)
    assert sum(1 for _ in steps) > 600  # keys, sorted runs, merge and devices, each a slice


def test_the_natural_order_in_slices_is_sorted_by_natural_key() -> None:
    rng = random.Random(16)
    for size in (0, 1, SORT_RUN - 1, SORT_RUN, SORT_RUN * 3 + 7):
        ids = [
            rng.choice(["gpu", "dev", "0000:0a:00.", "x-", ""]) + str(rng.randrange(10_000))
            for _ in range(size)
        ]
        ids = list(dict.fromkeys(ids))
        steps = _natural_order(ids, always_due)
        order: list[str] | None = None
        while order is None:
            try:
                next(steps)
            except StopIteration as done:
                order = done.value
        assert order == sorted(ids, key=natural_key)


def _absolute_by_normpath(value: str) -> bool:
    """The rule as the CDI library's Clean has it, without the fast path."""
    return (
        value.startswith("/")
        and not value.startswith("//")
        and "\0" not in value
        and posixpath.normpath(value) == value
    )


def test_the_fast_path_check_agrees_with_normpath() -> None:
    rng = random.Random(7)
    parts = ["/", ".", "..", "a", "dev", ".x", "x.", "\0", "//"]
    for _ in range(20_000):
        value = "".join(rng.choice(parts) for _ in range(rng.randrange(1, 7)))
        assert spec_module._absolute(value) == _absolute_by_normpath(value), value


def test_bad_mount_options_are_refused_after_good_ones_were_seen() -> None:
    good = ContainerEdits(mounts=(MountEdit("/a", "/a", ("ro", "bind")),))
    bad = ContainerEdits(mounts=(MountEdit("/a", "/a", ("ro", "")),))
    comma = ContainerEdits(mounts=(MountEdit("/a", "/a", ("ro,bind",)),))
    assert not list(spec_module._edits_problems(good, "x"))
    assert not list(spec_module._edits_problems(good, "x"))  # now known good
    assert list(spec_module._edits_problems(bad, "x")) == [
        "x.mounts['/a']: invalid options ['ro', '']"
    ]
    assert list(spec_module._edits_problems(comma, "x"))


class Gate:
    """Stands in for the scan loop's quiet(): closed while a hotplug pass is under way."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.waits = 0

    async def __call__(self) -> None:
        self.waits += 1
        await self.open.wait()


@contextlib.asynccontextmanager
async def running_sync(
    cdi_dir: Path, catalog: CdiCatalog, quiet: Gate | None = None
) -> AsyncIterator[CdiSync]:
    """A CdiSync task on ``cdi_dir``, cancelled and closed (its specs removed) on exit."""
    sync = CdiSync(CdiSettings(dir=cdi_dir), catalog, "test", quiet=quiet)
    task = asyncio.create_task(sync.run())
    try:
        yield sync
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sync.close()


async def test_a_pass_waits_for_the_hotplug_path_and_renders_in_slices(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    gate = Gate()
    catalog = CdiCatalog()
    async with running_sync(cdi_dir, catalog, gate) as sync:
        gate.open.clear()  # a hotplug pass is under way
        sync.submit(DeviceTree({RESOURCE: {f"dev{i}": device(i) for i in range(3000)}}))
        await asyncio.sleep(0.3)
        assert not (cdi_dir / SPEC_FILE).exists() and catalog.get(RESOURCE) is None
        assert gate.waits >= 1
        gate.open.set()
        async with asyncio.timeout(10):
            while catalog.get(RESOURCE) is None:  # noqa: ASYNC110 - the task exposes state
                await asyncio.sleep(0.005)
        assert (cdi_dir / SPEC_FILE).exists()
        # 3,000 devices are more than one slice's work: the gate was asked between slices.
        assert gate.waits > 3


async def test_a_pass_ends_under_a_storm_with_a_slice_every_storm_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storm of uevents that never lets the scan loop park must not starve the specs: a
    pause waits QUIET_WAIT_MAX_S at most, and once one has run out the next ones are short
    until quiet comes back, so a render of a few hundred slices ends in seconds (with the long
    wait before every slice it would take a hundred times that)."""
    monkeypatch.setattr(sync_module, "QUIET_WAIT_MAX_S", 1.0)
    monkeypatch.setattr(sync_module, "STORM_WAIT_S", 0.005)
    cdi_dir = tmp_path / "cdi"
    gate = Gate()
    gate.open.clear()  # never quiet
    catalog = CdiCatalog()
    async with running_sync(cdi_dir, catalog, gate) as sync:
        sync.submit(DeviceTree({RESOURCE: {f"dev{i}": device(i) for i in range(10_000)}}))
        await eventually(lambda: catalog.get(RESOURCE) is not None, timeout=30)
        assert (cdi_dir / SPEC_FILE).exists()
        assert gate.waits > 100  # a pass of that many slices: at 1 s each, minutes
        # Quiet again: the long bound is back (a wait that ends by quiet resets it).
        gate.open.set()
        sync.submit(DeviceTree({RESOURCE: {f"dev{i}": device(i) for i in range(3)}}))

        def names() -> int:
            entry = catalog.get(RESOURCE)
            return -1 if entry is None else len(entry.names)

        await eventually(lambda: names() == 3, timeout=10)
        assert not sync._storm


async def test_a_renderer_bug_costs_its_resource_only_and_what_was_written_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug raised by one resource's render (not an OSError) must not lose the outcome of a
    spec already written in the same pass: it is recorded, so the orderly close removes it."""
    cdi_dir = tmp_path / "cdi"
    broken = "example.com/zzz"
    real_steps = SpecRenderer.render_steps

    def steps(self: SpecRenderer, *args: Any, **kwargs: Any) -> Any:
        if self.kind == broken:
            raise RuntimeError("a bug in a renderer")
        return real_steps(self, *args, **kwargs)

    monkeypatch.setattr(SpecRenderer, "render_steps", steps)
    catalog = CdiCatalog()
    async with running_sync(cdi_dir, catalog) as sync:
        sync.submit(DeviceTree({RESOURCE: {"dev0": device(0)}, broken: {"d": device(1)}}))
        await eventually(lambda: catalog.get(RESOURCE) is not None, timeout=10)
        assert catalog.get(broken) is None
    assert sorted(p.name for p in cdi_dir.glob("*.json")) == []


async def test_no_pass_starts_after_stop(tmp_path: Path) -> None:
    """Stopping: a tree handed over afterwards (a publish during shutdown) starts no pass: the
    catalog and the files stay as they were until close()."""
    cdi_dir = tmp_path / "cdi"
    catalog = CdiCatalog()
    async with running_sync(cdi_dir, catalog) as sync:
        sync.submit(DeviceTree({RESOURCE: {f"dev{i}": device(i) for i in range(3)}}))
        await eventually(lambda: catalog.get(RESOURCE) is not None, timeout=10)
        sync.stop()
        sync.submit(DeviceTree())  # the resource went away during shutdown
        await asyncio.sleep(0.2)  # a pass would settle 20 ms, then plan and drop the entry
        assert catalog.get(RESOURCE) is not None
        assert (cdi_dir / SPEC_FILE).exists()
