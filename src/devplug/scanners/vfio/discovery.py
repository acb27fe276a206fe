"""Reading PCI functions and their IOMMU groups from udev and sysfs.

The group number is the basename of the function's ``iommu_group`` link (validated as a
number); a group is a no-IOMMU group when its ``name`` says ``vfio-noiommu``. A function's
iommufd character devices are the ``vfioN`` entries of its ``vfio-dev/`` directory. Nothing
read here becomes a path before it is checked against a strict pattern.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from devplug.naming import PCI_ADDRESS
from devplug.scanners.udev import UdevDevice, UdevSource

# Domains are 4 hex digits, or more behind VMD (10000:...).
_VFIO_DEV = re.compile(r"vfio[0-9]+")
_GROUP = re.compile(r"[0-9]{1,9}")
NOIOMMU_NAME = "vfio-noiommu"
# PCI class 0x0604xx: PCI-to-PCI bridges, which stay with the host when a group is passed on.
_BRIDGE_CLASS = 0x0604


@dataclass(frozen=True, slots=True)
class PciFunction:
    sys_path: str
    address: str  # "0000:03:00.0"
    vendor: str  # "8086" (four lower-case hex digits)
    device: str
    pci_class: int
    driver: str | None  # from udev's DRIVER
    group: int | None  # IOMMU group, None without one
    noiommu: bool
    numa_node: int | None
    vfio_devs: tuple[str, ...]  # "vfio0": the iommufd nodes under /dev/vfio/devices/

    @property
    def is_bridge(self) -> bool:
        return self.pci_class >> 8 == _BRIDGE_CLASS


def _hex4(device: UdevDevice, name: str) -> str | None:
    value = device.int_attribute(name, 16)
    return None if value is None or not 0 <= value <= 0xFFFF else f"{value:04x}"


def _vfio_devs(sys_path: str) -> tuple[str, ...]:
    try:
        with os.scandir(f"{sys_path}/vfio-dev") as entries:
            names = [e.name for e in entries if _VFIO_DEV.fullmatch(e.name)]
    except OSError:
        return ()
    return tuple(sorted(names, key=lambda name: int(name[4:])))


def _is_noiommu(sys_path: str) -> bool:
    try:
        with open(f"{sys_path}/iommu_group/name", "rb") as handle:
            return handle.read(64).strip() == NOIOMMU_NAME.encode()
    except OSError:
        return False


def read_function(source: UdevSource, device: UdevDevice) -> PciFunction | None:
    """One PCI function, or None if it vanished or its identity does not read cleanly."""
    address = device.sys_name.lower()
    vendor, product = _hex4(device, "vendor"), _hex4(device, "device")
    pci_class = device.int_attribute("class", 16)
    if not PCI_ADDRESS.fullmatch(address) or vendor is None or product is None:
        return None
    group_name = device.link_basename("iommu_group")
    group = int(group_name) if group_name is not None and _GROUP.fullmatch(group_name) else None
    return PciFunction(
        sys_path=device.sys_path,
        address=address,
        vendor=vendor,
        device=product,
        pci_class=pci_class or 0,
        driver=device.driver,
        group=group,
        noiommu=group is not None and _is_noiommu(device.sys_path),
        numa_node=source.numa_node(device),
        vfio_devs=_vfio_devs(device.sys_path),
    )


def read_functions(source: UdevSource) -> list[PciFunction]:
    """Every PCI function with an IOMMU group, in address order."""
    found = []
    for device in source.devices("pci"):
        function = read_function(source, device)
        if function is not None and function.group is not None:
            found.append(function)
    found.sort(key=lambda f: f.address)
    return found
