"""The udev source: its subsystem listing finds exactly what libudev's enumerator finds."""

from __future__ import annotations

import os

import pytest
import pyudev

from devplug.scanners.udev import UdevSource
from devplug.testing.umockdev import UmockdevHost, add_intel_gpu, add_pci_device, add_usb_serial


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
    with pytest.raises(ValueError, match="plain file names"):
        gpu.attribute("../../etc/passwd")
    with pytest.raises(ValueError, match="plain file names"):
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
