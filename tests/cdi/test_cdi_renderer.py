"""SpecRenderer gives byte for byte what spec_json(resource_spec(...)) gives, reusing the
fragments of devices whose DeviceInfo did not change."""

from __future__ import annotations

import json
import os
import random
import stat
from collections.abc import Generator, Iterable
from pathlib import Path

import pytest

from devplug import naming
from devplug.cdi import render
from devplug.cdi.render import SpecRenderer, resource_spec
from devplug.cdi.spec import spec_json
from devplug.errors import CdiSpecError
from devplug.model import CdiEdits, CdiHook, DeviceInfo, DeviceNode, DeviceTree, Mount
from devplug.naming import NaturalKey

KIND = "gpu.intel.com/i915"
RESOURCE = "gpu.intel.com/i915"


def gpu(index: int, *, host_path: bool = False, gids: bool = False) -> DeviceInfo:
    node = f"/dev/dri/card{index}"
    return DeviceInfo(
        nodes=(
            DeviceNode(f"/host{node}" if host_path else node, node),
            DeviceNode(f"/dev/dri/renderD{128 + index}"),
        ),
        mounts=(Mount(f"/dev/dri/by-path/pci-0000:{index:02x}:00.0-card"),),
        env={"ZE_ENABLE": "1"} if index % 2 else {},
        cdi_edits=CdiEdits(
            hooks=(CdiHook("createContainer", "/usr/bin/hook", ("hook", str(index))),),
            additional_gids=(44,) if gids else (),
        ),
    )


def expected(devices: dict[str, DeviceInfo]) -> bytes | None:
    spec = resource_spec(KIND, devices)
    return None if spec is None else spec_json(spec)


def test_same_bytes_as_the_plain_path_through_random_changes() -> None:
    rng = random.Random(5)
    renderer = SpecRenderer(KIND)
    devices: dict[str, DeviceInfo] = {}
    for step in range(60):
        action = rng.choice(["add", "add", "remove", "change", "share"])
        index = rng.randrange(12)
        address = f"0000:{index:02x}:00.0"
        if action == "add":
            devices[address] = gpu(index, host_path=rng.random() < 0.3, gids=rng.random() < 0.2)
        elif action == "remove":
            devices.pop(address, None)
        elif action == "change" and address in devices:
            devices[address] = gpu(index, host_path=True)
        elif action == "share":
            shared = gpu(index)
            for share in range(3):
                devices[f"{address}-{share}"] = shared
        rendered = renderer.render(dict(devices))
        want = expected(devices)
        if want is None:
            assert rendered is None, step
        else:
            assert rendered is not None and rendered.data == want, step
            assert rendered.names == set(devices)


def test_devices_with_nothing_to_give_are_left_out_and_none_is_none() -> None:
    renderer = SpecRenderer(KIND)
    empty = {"0000:01:00.0": DeviceInfo(), "0000:02:00.0": DeviceInfo()}
    assert renderer.render(empty) is None
    mixed = {**empty, "0000:03:00.0": gpu(3)}
    rendered = renderer.render(mixed)
    assert rendered is not None and rendered.names == {"0000:03:00.0"}
    assert rendered.data == expected(mixed)


def test_an_unchanged_device_is_not_rebuilt() -> None:
    renderer = SpecRenderer(KIND)
    first = {"0000:01:00.0": gpu(1), "0000:02:00.0": gpu(2)}
    renderer.render(first)
    made = dict(renderer._made)
    second = {**first, "0000:03:00.0": gpu(3)}
    renderer.render(second)
    # The two old devices keep their very fragments; only the new one was made.
    for name in first:
        assert renderer._made[name][1] is made[name][1]
    assert set(renderer._made) == set(second)


def test_the_version_follows_the_fields_of_the_devices_present() -> None:
    renderer = SpecRenderer(KIND)
    with_gids = renderer.render({"0000:01:00.0": gpu(1, gids=True)})
    assert with_gids is not None and b'"cdiVersion":"0.7.0"' in with_gids.data
    plain = renderer.render({"0000:02:00.0": gpu(2)})
    # Nothing but the device content sets it: a name that starts with a digit needs 0.5.0.
    assert plain is not None and b'"cdiVersion":"0.5.0"' in plain.data
    lettered = renderer.render({"gpu2": gpu(2)})
    assert lettered is not None and b'"cdiVersion":"0.3.0"' in lettered.data


def test_an_invalid_kind_is_refused() -> None:
    with pytest.raises(CdiSpecError, match="kind"):
        SpecRenderer("3dvendor/gpu")


def test_rendering_from_edits_gives_the_bytes_of_a_full_render() -> None:
    """A random walk of tree edits (adds, removals, re-reads, shares, devices with nothing to
    give): rendering only what each edit changed gives what rendering every device gives, and
    the same names."""
    rng = random.Random(16)
    renderer = SpecRenderer(KIND)
    tree = DeviceTree({RESOURCE: {"0000:00:00.0": gpu(0)}})
    assert renderer.render(tree[RESOURCE]) is not None
    edited = 0
    for step in range(300):
        devices = tree.get(RESOURCE, {})
        removed = [(RESOURCE, i) for i in devices if rng.random() < 0.1]
        added: dict[str, DeviceInfo] = {}
        for _ in range(rng.randrange(4)):
            index = rng.randrange(40)
            address = f"0000:{index:02x}:00.0"
            if address in devices and (RESOURCE, address) not in removed:
                continue
            choice = rng.random()
            if choice < 0.15:
                added[address] = DeviceInfo()  # nothing to put in a container
            elif choice < 0.3:
                shared = gpu(index)
                added.update({f"{address}-{share}": shared for share in range(2)})
            else:
                added[address] = gpu(index, host_path=rng.random() < 0.3, gids=rng.random() < 0.2)
        added = {
            i: info for i, info in added.items() if i not in devices or (RESOURCE, i) in removed
        }
        new = tree.with_changes(removed, {RESOURCE: added} if added else {})
        if RESOURCE not in new:
            tree = DeviceTree({RESOURCE: {"0000:00:00.0": gpu(0)}})
            renderer.render(tree[RESOURCE])
            continue
        last = renderer.rendered
        edit = None if last is None else new.edit_since(RESOURCE, last)
        edited += edit is not None
        rendered = renderer.render(new[RESOURCE], edit)
        want = expected(dict(new[RESOURCE]))
        if want is None:
            assert rendered is None, step
        else:
            assert rendered is not None and rendered.data == want, step
            spec = resource_spec(KIND, new[RESOURCE])
            assert spec is not None and rendered.names == {d.name for d in spec.devices}
            assert renderer.spec_devices() == spec.devices
        tree = new
    assert edited > 200  # the walk went through the edit path


def test_a_tree_skipped_between_renders_costs_its_difference_not_a_sort_of_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CDI sync renders the latest tree of a burst, whose edit is from a tree it skipped:
    the renderer finds the difference itself (same bytes as a full render) and never sorts
    every id again."""
    rng = random.Random(25)
    renderer = SpecRenderer(KIND)
    tree = DeviceTree({RESOURCE: {f"0000:{i:02x}:00.0": gpu(i) for i in range(30)}})
    assert renderer.render(tree[RESOURCE]) is not None

    sorts: list[int] = []
    sort_all = render._natural_order

    def counted(ids: Iterable[str], due: render.Due) -> Generator[None, None, list[str]]:
        sorts.append(1)
        return (yield from sort_all(ids, due))

    monkeypatch.setattr(render, "_natural_order", counted)
    for step in range(100):
        for _ in range(rng.randrange(2, 5)):  # the trees before the last: never rendered
            devices = before = tree[RESOURCE]
            gone = rng.choice(sorted(devices))
            index = rng.randrange(30, 60)
            fresh = {f"0000:{index:02x}:00.0": gpu(index)}
            reread = {gone: gpu(int(gone[5:7], 16), gids=True)} if rng.random() < 0.5 else {}
            added = {i: d for i, d in {**fresh, **reread}.items() if i not in devices or i == gone}
            tree = tree.with_changes([(RESOURCE, gone)], {RESOURCE: added})
        last = renderer.rendered
        assert last is not None and tree.edit_since(RESOURCE, last) is None
        edit = tree.edit_since(RESOURCE, before)  # from a tree the renderer skipped
        assert edit is not None
        rendered = renderer.render(tree[RESOURCE], edit)
        assert not sorts, step
        assert rendered is not None and rendered.data == expected(dict(tree[RESOURCE])), step
        sorts.clear()  # expected()'s own renderer sorts


def test_a_tree_made_anew_is_rendered_whole_not_edited_id_by_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full scan makes every DeviceInfo anew: edited in place, each id would be found by a
    bisect of natural keys in a last step that never yields (~0.4 s at 10,000 ids)."""
    renderer = SpecRenderer(KIND)
    ids = [f"0000:{i // 256:02x}:{i % 256 // 8:02x}.{i % 8}" for i in range(2000)]
    renderer.render({i: gpu(n % 200) for n, i in enumerate(ids)})
    keys: list[str] = []
    key = naming.natural_key

    def counted(device_id: str) -> NaturalKey:
        keys.append(device_id)
        return key(device_id)

    monkeypatch.setattr(render, "natural_key", counted)
    anew = {i: gpu(n % 200) for n, i in enumerate(ids)}
    rendered = renderer.render(anew)
    assert len(keys) < len(ids)  # no key made per id
    assert rendered is not None and rendered.data == expected(anew)


def test_an_invalid_device_in_an_edit_changes_nothing() -> None:
    renderer = SpecRenderer(KIND)
    tree = DeviceTree({RESOURCE: {"0000:01:00.0": gpu(1)}})
    first = renderer.render(tree[RESOURCE])
    bad = DeviceInfo(cdi_edits=CdiEdits(hooks=(CdiHook("noSuchHook", "/usr/bin/hook"),)))
    new = tree.with_changes([], {RESOURCE: {"0000:02:00.0": bad}})
    with pytest.raises(CdiSpecError):
        renderer.render(new[RESOURCE], new.edit_since(RESOURCE, tree[RESOURCE]))
    assert renderer.rendered is None  # the next render is a full one
    again = renderer.render(tree[RESOURCE])
    assert first is not None and again is not None and again.data == first.data


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_node_back_after_a_render_without_it_is_rendered_with_its_mode(tmp_path: Path) -> None:
    """Gone at one render (its device going away): no crash, and no mode for the node. Back,
    the uevent's re-read gives the device a new DeviceInfo, and the render told the tree's
    edit reads the node again."""
    host = tmp_path / "card0"

    def card() -> DeviceInfo:
        return DeviceInfo(nodes=(DeviceNode(str(host), "/dev/dri/card0"),))

    renderer = SpecRenderer(KIND)
    tree = DeviceTree({RESOURCE: {"0000:01:00.0": card(), "0000:02:00.0": gpu(2)}})
    first = renderer.render(tree[RESOURCE])
    assert first is not None and first.data == expected(dict(tree[RESOURCE]))
    (gone,) = json.loads(first.data)["devices"][0]["containerEdits"]["deviceNodes"]
    assert "fileMode" not in gone and "gid" not in gone

    os.mknod(host, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    new = tree.with_changes([(RESOURCE, "0000:01:00.0")], {RESOURCE: {"0000:01:00.0": card()}})
    edit = new.edit_since(RESOURCE, tree[RESOURCE])
    assert edit is not None
    again = renderer.render(new[RESOURCE], edit)
    assert again is not None and again.data == expected(dict(new[RESOURCE]))
    (back,) = json.loads(again.data)["devices"][0]["containerEdits"]["deviceNodes"]
    assert (back["fileMode"], back["gid"]) == (0o600, 0)
