"""The udev source: its subsystem listing finds exactly what libudev's enumerator finds."""

from __future__ import annotations

import os
import re

import pytest
import pyudev

from devplug.scanners.udev import UdevSource
from devplug.testing.umockdev import (
    MockNode,
    UmockdevHost,
    add_intel_gpu,
    add_pci_device,
    add_usb_serial,
)


def libudev_paths(subsystem: str, **properties: str) -> set[str]:
    enumerator = pyudev.Context().list_devices(subsystem=subsystem)
    for key, value in properties.items():
        enumerator = enumerator.match_property(key, value)
    return {d.sys_path for d in enumerator}


def source_paths(subsystem: str, **properties: str) -> set[str]:
    return {d.sys_path for d in UdevSource().devices(subsystem, properties)}


def test_same_devices_as_libudev_on_a_mock_host(host: UmockdevHost) -> None:
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    add_intel_gpu(host, "0000:00:03.0", card=1, render=None)
    add_pci_device(host, "0000:00:1f.0", vendor="0x8086", device="0x1234", driver=None)
    for index in range(3):
        add_usb_serial(host, index=index, vendor_id="0403" if index else "10c4")
    for subsystem in ("drm", "pci", "usb", "tty", "usb-serial", "nonexistent"):
        assert source_paths(subsystem) == libudev_paths(subsystem), subsystem
    assert source_paths("tty", ID_VENDOR_ID="0403") == libudev_paths("tty", ID_VENDOR_ID="0403")
    assert len(source_paths("tty", ID_VENDOR_ID="0403")) == 2


def test_same_devices_as_libudev_on_this_machine() -> None:
    """The real /sys of the machine running the tests (no testbed active)."""
    assert "UMOCKDEV_DIR" not in os.environ
    subsystems = {d.subsystem for d in pyudev.Context().list_devices() if d.subsystem}
    assert subsystems  # every Linux machine has some
    for subsystem in sorted(subsystems):
        assert source_paths(subsystem) == libudev_paths(subsystem), subsystem


def test_a_vanished_device_is_skipped_not_fatal(host: UmockdevHost) -> None:
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    source = UdevSource()
    found = source.devices("tty")
    first = next(found)
    host.remove_device("/sys/devices/pci0000:00/0000:00:14.0/usb1/1-2")
    rest = list(found)  # the second adapter vanished between listing and reading
    assert first.sys_name == "ttyUSB0"
    assert rest == []


@pytest.mark.parametrize("bad", ["", "..", "a/b", "x\0"])
def test_subsystem_names_cannot_escape_sysfs(bad: str) -> None:
    with pytest.raises(ValueError, match="not a subsystem name"):
        list(UdevSource().devices(bad))


def test_the_device_view_reads_parents_children_links_and_attributes(host: UmockdevHost) -> None:
    pci = add_intel_gpu(host, "0000:00:02.0", card=0, render=128, numa_node=1, iommu_group=7)
    host.set_attribute(pci, "garbage", "twelve\n")
    host.set_attribute(pci, "huge", "x" * 5000)
    source = UdevSource()
    gpu = source.device(pci)
    assert gpu is not None
    assert gpu.driver == "i915"
    assert gpu.int_attribute("vendor") == 0x8086
    assert gpu.int_attribute("numa_node", 10) == 1
    assert gpu.link_basename("iommu_group") == "7"
    assert gpu.link_basename("no_such_link") is None
    assert gpu.attribute("garbage") == "twelve"  # stripped of the newline real sysfs adds
    assert gpu.int_attribute("garbage") is None  # not a number: None, not an exception
    assert gpu.attribute("huge") is None  # larger than a sysfs page
    assert gpu.int_attribute("class") == 0x030000
    with pytest.raises(ValueError, match="relative to the device's sysfs dir"):
        gpu.attribute("../../etc/passwd")
    with pytest.raises(ValueError, match="relative to the device's sysfs dir"):
        gpu.link_basename("../x")
    assert sorted(child.sys_name for child in gpu.children("drm")) == ["card0", "renderD128"]
    (render,) = [c for c in gpu.children("drm") if c.sys_name == "renderD128"]
    parent = render.parent("pci")
    assert parent is not None and parent.sys_path == pci
    assert render.numa_node() == 1 and source.numa_node(render) == 1
    assert render.device_node == "/dev/dri/renderD128"
    host.remove_device(pci)
    assert source.device(pci) is None  # gone: None, not an exception
    with pytest.raises(ValueError, match="not a sysfs device path"):
        source.device("/etc/../sys/x")


LOOP = "/sys/devices/virtual/block/loop0"


def test_attributes_below_the_device_dir_read_as_pyudev_reads_them(host: UmockdevHost) -> None:
    pci = add_pci_device(host, "0000:00:1f.0", vendor="0x8086", device="0x1234", driver=None)
    host.add_device(
        LOOP,
        "block",
        attributes={
            "loop/backing_file": "/var/lib/images/disk.img\n",
            "queue/rotational": "0\n",
            "power/runtime_status": "unsupported\n",
        },
        # sysfs's own link to another device (as a block device's ``device`` link is), and one
        # out of /sys that only a tampered or mock sysfs can hold.
        links={"device": "../../../pci0000:00/0000:00:1f.0", "outside": "/etc"},
        node=MockNode("loop0", 7, 0, "b"),
    )
    source = UdevSource()
    loop = source.device(LOOP)
    assert loop is not None
    assert loop.attribute("loop/backing_file") == "/var/lib/images/disk.img"
    assert loop.int_attribute("queue/rotational") == 0
    assert loop.attribute("power/runtime_status") == "unsupported"
    assert loop.attribute("device/vendor") == "0x8086"  # through sysfs's link, as libudev reads
    assert loop.link_basename("device/subsystem") == "pci"
    # Failed reads return None, as the guide promises: a missing file or dir, a dir itself, a
    # link as the last component (libudev reads none of them).
    assert loop.attribute("loop/offset") is None
    assert loop.attribute("no_such_dir/x") is None
    assert loop.attribute("queue") is None
    assert loop.attribute("device/subsystem") is None
    assert source.problems == {}
    # A link out of /sys reads as absent, never the file behind it (pyudev would read it).
    assert os.path.exists("/etc/hostname")
    assert loop.attribute("outside/hostname") is None
    assert loop.link_basename("outside/os-release") is None
    assert "leads out of /sys" in source.problems[LOOP]
    assert pci == "/sys/devices/pci0000:00/0000:00:1f.0"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../0000:00:1f.0/vendor", "'..'"),
        ("queue/../../x", "'..'"),
        ("queue//rotational", "empty"),
        ("queue/", "empty"),
        ("./vendor", "'.'"),
        ("vendor\0", "NUL"),
        ("x" * 256, "longer than 255"),
        ("\udcff", "not UTF-8"),
    ],
)
def test_attribute_names_must_stay_below_the_device_dir(
    host: UmockdevHost, bad: str, why: str
) -> None:
    host.add_device(LOOP, "block", attributes={"queue/rotational": "0"})
    loop = UdevSource().device(LOOP)
    assert loop is not None
    for read in (loop.attribute, loop.int_attribute, loop.link_basename):
        with pytest.raises(ValueError, match="relative to the device's sysfs dir") as refused:
            read(bad)
        assert why in str(refused.value) and repr(bad) in str(refused.value)


def test_sys_name_takes_what_pyudev_takes(host: UmockdevHost) -> None:
    for index in range(3):
        add_usb_serial(host, index=index)
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)

    def names(sys_name: str | re.Pattern[str], subsystem: str | None = "tty") -> list[str]:
        return sorted(d.sys_name for d in UdevSource().devices(subsystem, sys_name=sys_name))

    def pyudev_names(sys_name: str, subsystem: str | None = "tty") -> list[str]:
        found = pyudev.Context().list_devices(subsystem=subsystem, sys_name=sys_name)
        return sorted(d.sys_name for d in found)

    # A string is libudev's glob, as pyudev's list_devices(sys_name=...) reads it ...
    for glob in ("ttyUSB1", "ttyUSB[02]", "ttyUSB*", "tty?SB1", "ttyUSB", "ttyUSB[!0]"):
        assert names(glob) == pyudev_names(glob), glob
    assert names("ttyUSB[02]") == ["ttyUSB0", "ttyUSB2"]
    assert names("card*", "drm") == pyudev_names("card*", "drm") == ["card0"]
    assert names("renderD128", None) == pyudev_names("renderD128", None) == ["renderD128"]
    # ... and a compiled pattern matches the whole name.
    assert names(re.compile(r"ttyUSB[12]")) == ["ttyUSB1", "ttyUSB2"]
    assert names(re.compile(r"ttyUSB")) == []


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (7, TypeError, "sys_name must be a kernel name or glob"),
        (["ttyUSB0"], TypeError, "sys_name must be a kernel name or glob"),
        (re.compile(rb"ttyUSB0"), TypeError, "bytes pattern"),
        ("", ValueError, "matches no device"),
        ("usb1/ttyUSB0", ValueError, "matches no device"),
    ],
)
def test_a_bad_sys_name_fails_at_the_call_not_in_the_scan(
    bad: object, error: type[Exception], message: str
) -> None:
    source = UdevSource()
    with pytest.raises(error, match=message):
        source.devices("tty", sys_name=bad)  # type: ignore[arg-type]  # not iterated
    with pytest.raises(ValueError, match="not a subsystem name"):
        source.devices("a/b")
