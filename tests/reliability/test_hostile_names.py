"""Names and paths from outside (sysfs, udev events, requests, config) with "/", "..", NUL or
over-long values are refused by every validator that turns them into a path or a name."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from devplug.cdi.render import cdi_device_name
from devplug.cdi.spec import device_name_problem, parse_kind
from devplug.errors import CdiSpecError, InvalidNameError
from devplug.model import DeviceNode, Mount, is_device_node_path
from devplug.naming import (
    PCI_ADDRESS,
    cdi_kind_problem,
    device_id_problem,
    resource_name_problem,
    socket_file_name,
    spec_file_name,
)
from devplug.scanners.intel_gpu.discovery import pci_path_of_card
from devplug.scanners.udev import is_sys_device_path

HOSTILE_NAMES = [
    "../etc",
    "a/../b",
    "a/b",
    "/abs",
    "a\0b",
    "a\n",
    "",
    ".",
    "..",
    "x" * 300,
    "é",
    "a b",
]


@pytest.mark.parametrize("value", HOSTILE_NAMES)
def test_device_ids_refuse_hostile_values(value: str) -> None:
    assert device_id_problem(value) is not None
    assert device_name_problem(value) is not None or value == "x" * 300  # CDI has no length cap
    with pytest.raises((InvalidNameError, CdiSpecError)):
        cdi_device_name(value)


@pytest.mark.parametrize(
    "value", [v for v in HOSTILE_NAMES if v != "a/b"] + ["example.com/../x", "example.com/a/b"]
)
def test_resource_names_refuse_hostile_values(value: str) -> None:
    assert resource_name_problem(value) is not None
    with pytest.raises(InvalidNameError):
        socket_file_name(value)


@pytest.mark.parametrize(
    "kind", ["../x/y", "a/..", "vendor.com/cl/ass", "vendor\0.com/x", "vendor.com/x\n", "/x"]
)
def test_cdi_kinds_refuse_hostile_values(kind: str) -> None:
    assert cdi_kind_problem(kind) is not None
    with pytest.raises(CdiSpecError):
        parse_kind(kind)
    with pytest.raises(CdiSpecError):
        spec_file_name(kind)


@pytest.mark.parametrize(
    "path",
    [
        "/sys/devices/../etc/passwd",
        "/sys/devices/a/../../etc",
        "/sys/class/drm/card0",
        "/sys/devices/a\0b",
        "sys/devices/a",
        "/sys/devices//a",
        "/sys/devices/a/",
        "/etc/passwd",
    ],
)
def test_sysfs_paths_from_events_refuse_hostile_values(path: str) -> None:
    assert not is_sys_device_path(path)


@pytest.mark.parametrize(
    "path", ["/dev/../etc/passwd", "/dev/a/../../b", "dev/null", "/dev/a\0b", "/etc/x", "/dev//x"]
)
def test_device_node_paths_refuse_hostile_values(path: str) -> None:
    assert not is_device_node_path(path)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DeviceNode("relative/path"),
        lambda: DeviceNode("/dev/../etc/shadow"),
        lambda: DeviceNode("/dev/null\0"),
        lambda: Mount("/etc/x", "relative"),
        lambda: Mount("/a/../b"),
    ],
)
def test_model_paths_refuse_hostile_values(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="must"):
        make()


@pytest.mark.parametrize(
    "address",
    [
        "0000:00:02.0/..",
        "../0000:00:02.0",
        "0000:00:02.8",
        "0000:0g:00.0",
        "0000:00:02.0\n",
        "000:00:02.0",
        "123456789:00:02.0",
    ],
)
def test_pci_addresses_from_sysfs_refuse_hostile_values(address: str) -> None:
    """The one pattern both PCI scanners check sysfs names with."""
    assert not PCI_ADDRESS.fullmatch(address)


def test_a_card_path_outside_sysfs_devices_has_no_pci_function() -> None:
    assert pci_path_of_card("/sys/devices/../x/drm/card0") is None
    assert pci_path_of_card("/sys/devices/pci0000:00/0000:00:02.0/drm/card0/../card1") is None
    assert pci_path_of_card("/sys/devices/pci0000:00/0000:00:02.0/drm/card0") == (
        "/sys/devices/pci0000:00/0000:00:02.0"
    )
