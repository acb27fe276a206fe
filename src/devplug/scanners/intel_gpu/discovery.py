"""Reading one Intel GPU PCI function from udev and sysfs into a plain record.

A GPU is found through its drm card (``/sys/class/drm/cardN``); its PCI function is the
directory above the card's ``drm/``. Everything the scanner decides on is read here, once per
function per scan; nothing read becomes a path before it is checked against a strict pattern
(PCI addresses, minor names).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from devplug.naming import PCI_ADDRESS
from devplug.scanners.udev import UdevSource, is_sys_device_path

INTEL_VENDOR = "0x8086"
CARD_NAME = re.compile(r"card[0-9]+")
# The minors a container gets. controlD nodes (old kernels) are left out, as Intel's plugin does.
_MINOR_NAME = re.compile(r"(card|renderD)[0-9]+")
_DRIVER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,30}")
DRI_DIR = "/dev/dri"
BY_PATH_DIR = "/dev/dri/by-path"


@dataclass(frozen=True, slots=True)
class DrmMinor:
    sys_path: str
    name: str  # "card0", "renderD128"

    @property
    def dev_path(self) -> str:
        return f"{DRI_DIR}/{self.name}"

    @property
    def is_card(self) -> bool:
        return self.name.startswith("card")


@dataclass(frozen=True, slots=True)
class GpuFunction:
    """What one Intel PCI function looks like now."""

    sys_path: str
    address: str  # "0000:03:00.0": the stable id
    pci_device_id: str | None  # "0x56a0"
    driver: str | None  # from udev's DRIVER; None when unbound or not a plain name
    numa_node: int | None
    vfs_enabled: int  # sriov_numvfs; > 0 means a physical function with VFs
    # sriov_totalvfs > 0 with sriov_drivers_autoprobe on: VFs can be made and get a driver.
    sriov_capable: bool
    is_virtual_function: bool  # it has a physfn link
    physical_function: str | None  # that link's PF address, when it is a valid one
    minors: tuple[DrmMinor, ...]  # card and render minors in sysfs, cards first
    present_nodes: frozenset[str]  # the /dev paths of ``minors`` that exist
    by_path_links: tuple[str, ...]  # /dev/dri/by-path/pci-<address>-card|render that exist

    @property
    def has_card(self) -> bool:
        return any(minor.is_card for minor in self.minors)

    @property
    def physical_function_path(self) -> str | None:
        """The PF's sysfs path: the kernel puts VFs beside their PF, under the same parent."""
        if self.physical_function is None:
            return None
        return f"{self.sys_path.rsplit('/', 1)[0]}/{self.physical_function}"

    @property
    def sriov_involved(self) -> bool:
        return self.vfs_enabled > 0 or self.is_virtual_function


def pci_path_of_card(card_sys_path: str) -> str | None:
    """``/sys/devices/.../0000:03:00.0/drm/card1`` -> the PCI function's path, else None."""
    head, sep, tail = card_sys_path.rpartition("/drm/")
    if not sep or not CARD_NAME.fullmatch(tail):
        return None
    return head if is_sys_device_path(head) else None


def pci_path_of_event(sys_path: str) -> str:
    """The function an event concerns: the part above ``/drm/`` for a minor, else the path."""
    head, sep, _ = sys_path.partition("/drm/")
    return head if sep else sys_path


def _drm_minors(pci_path: str) -> tuple[DrmMinor, ...]:
    try:
        with os.scandir(f"{pci_path}/drm") as entries:
            names = [entry.name for entry in entries if _MINOR_NAME.fullmatch(entry.name)]
    except OSError:
        return ()
    # Cards first, then render nodes, each in minor order.
    names.sort(key=lambda name: (not name.startswith("card"), len(name), name))
    return tuple(DrmMinor(f"{pci_path}/drm/{name}", name) for name in names)


def read_function(source: UdevSource, pci_path: str) -> GpuFunction | None:
    """The Intel PCI function at ``pci_path``, or None if it is gone or not an Intel PCI device."""
    device = source.device(pci_path)
    if device is None or device.subsystem != "pci":
        return None
    vendor = device.attribute("vendor")
    if vendor is None or vendor.lower() != INTEL_VENDOR:
        return None
    address = device.sys_name.lower()
    if not PCI_ADDRESS.fullmatch(address):
        return None
    raw_id = device.int_attribute("device", 16)
    driver = device.driver
    numvfs = device.int_attribute("sriov_numvfs", 10)
    total_vfs = device.int_attribute("sriov_totalvfs", 10) or 0
    autoprobe = device.attribute("sriov_drivers_autoprobe") if total_vfs > 0 else None
    physfn = device.link_basename("physfn")
    minors = _drm_minors(device.sys_path)
    present = frozenset(m.dev_path for m in minors if source.node_exists(m.dev_path))
    links = tuple(
        link
        for link in (f"{BY_PATH_DIR}/pci-{address}-card", f"{BY_PATH_DIR}/pci-{address}-render")
        if source.node_exists(link)
    )
    return GpuFunction(
        sys_path=device.sys_path,
        address=address,
        pci_device_id=None if raw_id is None else f"0x{raw_id:04x}",
        driver=driver if driver is not None and _DRIVER_NAME.fullmatch(driver) else None,
        numa_node=source.numa_node(device),
        vfs_enabled=max(numvfs or 0, 0),
        sriov_capable=autoprobe is not None and autoprobe != "0",
        is_virtual_function=physfn is not None,
        physical_function=physfn if physfn is not None and PCI_ADDRESS.fullmatch(physfn) else None,
        minors=minors,
        present_nodes=present,
        by_path_links=links,
    )
