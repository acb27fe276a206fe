"""The generic scanner through real pyudev against umockdev hosts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from devplug.errors import ConfigError
from devplug.model import DeviceNode, Health
from devplug.scanners.generic import GenericScanner
from devplug.scanners.udev import UdevSource
from devplug.testing.umockdev import (
    MockNode,
    UmockdevHost,
    add_intel_gpu,
    add_pci_device,
    add_usb_serial,
)


def scanner(*entries: dict[str, object]) -> GenericScanner:
    return GenericScanner.from_config(list(entries))


def test_subsystem_and_devnode_glob_select_nodes(host: UmockdevHost) -> None:
    for index in range(3):
        add_usb_serial(host, index=index)
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    tree = scanner(
        {
            "resource": "example.com/serial",
            "match": {"subsystem": "tty", "devnode": "/dev/ttyUSB[01]"},
        }
    ).scan(UdevSource())
    devices = tree["example.com/serial"]
    assert sorted(devices) == ["ttyUSB0", "ttyUSB1"]
    info = devices["ttyUSB1"]
    assert info.nodes == (DeviceNode("/dev/ttyUSB1", "/dev/ttyUSB1", "rw"),)
    assert info.health is Health.HEALTHY
    assert info.sources[0].endswith("/tty/ttyUSB1")


def test_properties_and_attributes_narrow_the_match(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0, vendor_id="0403")
    add_usb_serial(host, index=1, vendor_id="10c4", model_id="ea60")
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128, device_id="0x56a0")
    add_intel_gpu(host, "0000:00:03.0", card=1, render=129, device_id="0x56a1")
    ftdi = scanner(
        {
            "resource": "example.com/ftdi",
            "match": {"subsystem": "tty", "properties": {"ID_VENDOR_ID": "0403"}},
        }
    ).scan(UdevSource())
    assert list(ftdi["example.com/ftdi"]) == ["ttyUSB0"]
    globbed = scanner(
        {
            "resource": "example.com/usb",
            "match": {"subsystem": "tty", "properties": {"ID_MODEL_ID": "ea*"}},
        }
    ).scan(UdevSource())
    assert list(globbed["example.com/usb"]) == ["ttyUSB1"]
    # Attributes are the matched device's own: the dev attribute of a drm minor is "226:<minor>".
    render = scanner(
        {
            "resource": "example.com/render",
            "match": {
                "subsystem": "drm",
                "devnode": "/dev/dri/renderD*",
                "attributes": {"dev": "226:129"},
            },
        }
    ).scan(UdevSource())
    assert list(render["example.com/render"]) == ["dri_renderD129"]
    none = scanner(
        {
            "resource": "example.com/none",
            "match": {"subsystem": "tty", "properties": {"ID_VENDOR_ID": "ffff"}},
        }
    ).scan(UdevSource())
    assert "example.com/none" not in none


def test_shares_give_each_device_several_ids(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    tree = scanner(
        {
            "resource": "example.com/serial",
            "match": {"subsystem": "tty"},
            "shares": 3,
            "permissions": "r",
        }
    ).scan(UdevSource())
    devices = tree["example.com/serial"]
    assert sorted(devices) == ["ttyUSB0-0", "ttyUSB0-1", "ttyUSB0-2"]
    assert {d.nodes[0].permissions for d in devices.values()} == {"r"}


def test_id_property_gives_stable_ids(host: UmockdevHost) -> None:
    add_usb_serial(host, index=4, serial="A50285BI")
    add_usb_serial(host, index=5)  # no serial: falls back to the node name
    tree = scanner(
        {
            "resource": "example.com/serial",
            "match": {"subsystem": "tty"},
            "id_property": "ID_SERIAL_SHORT",
        }
    ).scan(UdevSource())
    assert sorted(tree["example.com/serial"]) == ["A50285BI", "ttyUSB5"]


def test_numa_node_comes_from_the_pci_parent(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128, numa_node=1)
    add_intel_gpu(host, "0000:00:03.0", card=1, render=129, numa_node=-1)
    tree = scanner(
        {"resource": "example.com/render", "match": {"devnode": "/dev/dri/renderD*"}}
    ).scan(UdevSource())
    devices = tree["example.com/render"]
    assert devices["dri_renderD128"].numa_nodes == (1,)
    assert devices["dri_renderD129"].numa_nodes == ()


def test_a_device_whose_node_is_missing_is_not_advertised(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    os.unlink(host.root / "dev" / "ttyUSB1")  # udev knows it; the node is not there (yet)
    tree = scanner({"resource": "example.com/serial", "match": {"subsystem": "tty"}}).scan(
        UdevSource()
    )
    assert list(tree["example.com/serial"]) == ["ttyUSB0"]


def test_a_devnode_that_is_not_a_clean_dev_path_is_ignored(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_pci_device(host, "0000:00:05.0", vendor="0x1234", device="0x0001", driver=None)
    # A DEVNAME with ".." that resolves to a real node must still not become a path we hand out.
    host.add_device(
        "/sys/devices/pci0000:00/0000:00:05.0/tty/evil",
        "tty",
        properties={"DEVNAME": "/dev/../dev/ttyUSB0", "MAJOR": "188", "MINOR": "0"},
    )
    tree = scanner({"resource": "example.com/tty", "match": {"subsystem": "tty"}}).scan(
        UdevSource()
    )
    assert list(tree["example.com/tty"]) == ["ttyUSB0"]


def test_an_empty_host_gives_an_empty_tree(host: UmockdevHost) -> None:
    tree = scanner({"resource": "example.com/serial", "match": {"subsystem": "tty"}}).scan(
        UdevSource()
    )
    assert len(tree) == 0


def test_each_subsystem_is_enumerated_once_and_matched_entry_by_entry(
    host: UmockdevHost,
) -> None:
    """Many entries over one subsystem: its devices are listed once, and the tree is the one
    the entries give scanned one by one (same devices, same order in each resource)."""
    for index in range(4):
        add_intel_gpu(host, f"0000:00:{index + 2:02x}.0", card=index, render=128 + index)
    add_usb_serial(host, index=0, vendor_id="0403")
    add_usb_serial(host, index=1, vendor_id="10c4")
    entries: list[dict[str, object]] = [
        {
            "resource": f"example.com/render{index}",
            "match": {"subsystem": "drm", "devnode": f"/dev/dri/renderD{128 + index}"},
        }
        for index in range(4)
    ]
    entries += [
        {"resource": "example.com/cards", "match": {"subsystem": "drm", "devnode": "/dev/dri/c*"}},
        {"resource": "example.com/tty", "match": {"subsystem": "tty"}, "shares": 2},
        {
            "resource": "example.com/ftdi",
            "match": {"devnode": "/dev/ttyUSB*", "properties": {"ID_VENDOR_ID": "0403"}},
        },
        {"resource": "example.com/nodes", "match": {"devnode": "/dev/ttyUSB1"}},
    ]
    source = UdevSource()
    listed: list[str | None] = []
    plain = source.devices

    def counted(subsystem: str | None = None, *args: object, **kwargs: object) -> object:
        listed.append(subsystem)
        return plain(subsystem, *args, **kwargs)  # type: ignore[arg-type]

    source.devices = counted  # type: ignore[method-assign, assignment]
    tree = scanner(*entries).scan(source)
    assert sorted(listed, key=str) == sorted(["drm", "tty", None, None], key=str)
    for entry in entries:
        alone = scanner(entry).scan(UdevSource())
        resource = str(entry["resource"])
        assert list(tree.get(resource, {}).items()) == list(alone.get(resource, {}).items())
    assert len(tree["example.com/cards"]) == 4 and len(tree["example.com/tty"]) == 4
    assert list(tree["example.com/ftdi"]) == ["ttyUSB0"]
    assert list(tree["example.com/nodes"]) == ["ttyUSB1"]


def test_attributes_may_name_paths_below_the_device_dir(host: UmockdevHost) -> None:
    """Issue 25 review: UdevDevice.attribute takes sub-paths (``queue/rotational``,
    ``device/vendor`` through sysfs's link to the parent), but the generic config refused
    them as not plain file names."""
    add_pci_device(host, "0000:00:1f.0", vendor="0x8086", device="0x1234", driver=None)
    for index, rotational in ((0, "0"), (1, "1")):
        host.add_device(
            f"/sys/devices/virtual/block/loop{index}",
            "block",
            attributes={"queue/rotational": f"{rotational}\n"},
            links={"device": "../../../pci0000:00/0000:00:1f.0"},
            node=MockNode(f"loop{index}", 7, index, "b"),
        )
    tree = scanner(
        {
            "resource": "example.com/ssd",
            "match": {
                "subsystem": "block",
                "attributes": {"queue/rotational": "0", "device/vendor": "0x8086"},
            },
        }
    ).scan(UdevSource())
    assert list(tree["example.com/ssd"]) == ["loop0"]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "empty"),
        ("/sys/class/net/eth0/address", "absolute"),
        ("../0000:00:1f.0/vendor", "'..'"),
        ("queue//rotational", "empty"),
        ("vendor\0", "NUL"),
    ],
)
def test_an_attribute_name_that_leaves_the_device_dir_is_a_config_error(bad: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        scanner(
            {"resource": "example.com/x", "match": {"subsystem": "block", "attributes": {bad: "0"}}}
        )
    message = str(refused.value)
    assert message.startswith("scanners.generic[0].match.attributes: attribute names are paths")
    assert "'queue/rotational'" in message  # the fix, by example
    assert repr(bad) in message and why in message


def test_an_enumeration_is_read_as_it_comes_not_held_whole(host: UmockdevHost) -> None:
    """Each device of an entry's enumeration is taken before the next is read, so a full
    scan never holds a whole subsystem's devices at once (~30 MiB more at 10,000 GPUs); a
    later entry of the same subsystem keeps only the devices it matches."""
    for index in range(6):
        add_intel_gpu(host, f"0000:00:{index + 2:02x}.0", card=index, render=128 + index)
    entries: list[dict[str, object]] = [
        {"resource": "example.com/render", "match": {"subsystem": "drm", "devnode": "/dev/dri/r*"}},
        {
            "resource": "example.com/card1",
            "match": {"subsystem": "drm", "devnode": "/dev/dri/card1"},
        },
    ]
    source = UdevSource()
    read: list[str] = []  # the enumeration's devices, as they were read
    plain = source.devices

    def traced(*args: object, **kwargs: object) -> Iterator[object]:
        for device in plain(*args, **kwargs):  # type: ignore[arg-type]
            read.append(device.sys_path)
            yield device

    source.devices = traced  # type: ignore[method-assign, assignment]
    generic = scanner(*entries)
    taken: list[tuple[str, int]] = []  # (entry's resource, devices read by then)
    add = generic._add_device

    def counted(source: UdevSource, entry: Any, device: Any, builder: Any) -> None:
        taken.append((entry.resource, len(read)))
        add(source, entry, device, builder)

    generic._add_device = counted  # type: ignore[method-assign]
    tree = generic.scan(source)
    firsts = [count for resource, count in taken if resource == "example.com/render"]
    assert len(read) >= 12 and firsts == list(range(1, len(read) + 1))  # one read, one taken
    assert [r for r, _ in taken].count("example.com/card1") == 1  # only what it matches, kept
    assert list(tree["example.com/card1"]) == ["dri_card1"] and len(tree["example.com/render"]) == 6
