"""SpecRenderer gives byte for byte what spec_json(resource_spec(...)) gives, reusing the
fragments of devices whose DeviceInfo did not change."""

from __future__ import annotations

import random

import pytest

from devplug.cdi.build import SpecRenderer, resource_spec
from devplug.cdi.spec import spec_json
from devplug.errors import CdiSpecError
from devplug.model import CdiEdits, CdiHook, DeviceInfo, DeviceNode, Mount

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
