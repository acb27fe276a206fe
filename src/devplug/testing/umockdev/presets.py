"""Presets: common devices (PCI functions, Intel GPUs, USB serial adapters) in one call."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

from devplug.testing.umockdev.files import _hex_id
from devplug.testing.umockdev.host import _EMPTY, MockNode, UmockdevHost

_PCI_ADDRESS_RE: Final = re.compile(
    r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$"
)


def add_pci_device(
    host: UmockdevHost,
    address: str = "0000:00:02.0",
    *,
    vendor: str,
    device: str,
    driver: str | None,
    numa_node: int = -1,
    cls: str = "0x030000",
    iommu_group: int | None = None,
    extra_attributes: Mapping[str, str] = _EMPTY,
    extra_links: Mapping[str, str] = _EMPTY,
    parent: str | None = None,
) -> str:
    """Add a PCI function below ``/sys/devices/pci<domain>:<bus>/<address>``, or below
    ``parent`` (a bridge's path) when given."""
    match = _PCI_ADDRESS_RE.match(address)
    if match is None:
        raise ValueError(f"invalid PCI address: {address!r}")
    address = address.lower()
    domain, bus_no = match.group(1).lower(), match.group(2).lower()
    vendor_id, device_id = _hex_id(vendor, "vendor"), _hex_id(device, "device")
    class_id = _hex_id(cls, "class")
    attributes: dict[str, str] = {
        "vendor": f"0x{vendor_id:04x}",
        "device": f"0x{device_id:04x}",
        "subsystem_vendor": f"0x{vendor_id:04x}",
        "subsystem_device": "0x0000",
        "class": f"0x{class_id:06x}",
        "numa_node": str(numa_node),
        **extra_attributes,
    }
    sub_vendor = _hex_id(attributes["subsystem_vendor"], "subsystem_vendor")
    sub_device = _hex_id(attributes["subsystem_device"], "subsystem_device")
    # The kernel's PCI uevent (drivers/pci/pci-driver.c), formats included.
    properties = {
        "PCI_CLASS": f"{class_id:X}",
        "PCI_ID": f"{vendor_id:04X}:{device_id:04X}",
        "PCI_SUBSYS_ID": f"{sub_vendor:04X}:{sub_device:04X}",
        "PCI_SLOT_NAME": address,
        "MODALIAS": (
            f"pci:v{vendor_id:08X}d{device_id:08X}sv{sub_vendor:08X}sd{sub_device:08X}"
            f"bc{class_id >> 16 & 0xFF:02X}sc{class_id >> 8 & 0xFF:02X}i{class_id & 0xFF:02X}"
        ),
    }
    base = parent if parent is not None else f"/sys/devices/pci{domain}:{bus_no}"
    links: dict[str, str] = dict(extra_links)
    if iommu_group is not None:
        # Relative, as in sysfs, from wherever the function sits (below bridges, too). The
        # target exists only when add_vfio_group made it (trap 7: read the link's basename).
        links["iommu_group"] = os.path.relpath(
            f"/sys/kernel/iommu_groups/{iommu_group}", f"{base}/{address}"
        )
    return host.add_device(
        f"{base}/{address}",
        "pci",
        attributes=attributes,
        properties=properties,
        links=links,
        driver=driver,
    )


def add_drm_minors(
    host: UmockdevHost,
    parent: str,
    *,
    card: int,
    render: int | None,
    by_path: str | None = None,
) -> list[str]:
    """Add drm ``cardN`` (and ``renderDN``) minors below ``parent``; return their paths.

    ``by_path`` (a PCI address) adds udev's ``/dev/dri/by-path/pci-<address>-card|render``
    links, as udev's rules make them for PCI GPUs.
    """
    minors = [(f"card{card}", card, "card")]
    if render is not None:
        minors.append((f"renderD{render}", render, "render"))
    paths = []
    for name, minor, suffix in minors:
        links = [f"dri/by-path/pci-{by_path.lower()}-{suffix}"] if by_path is not None else []
        paths.append(
            host.add_device(
                f"{parent}/drm/{name}",
                "drm",
                properties={"DEVTYPE": "drm_minor"},
                node=MockNode(f"dri/{name}", 226, minor),
                devlinks=links,
            )
        )
    return paths


def add_intel_gpu(
    host: UmockdevHost,
    address: str,
    *,
    card: int,
    render: int | None,
    device_id: str = "0x56a0",
    driver: str | None = "i915",
    numa_node: int = -1,
    iommu_group: int | None = None,
    extra_attributes: Mapping[str, str] = _EMPTY,
    physfn: str | None = None,
    parent: str | None = None,
) -> str:
    """Add an Intel GPU (PCI function + drm card/render minors); return the PCI path.

    ``physfn`` (the physical function's address) makes it an SR-IOV virtual function: a
    sibling of its PF with a ``physfn`` link, as the kernel lays VFs out. A PF with VFs
    enabled has ``sriov_numvfs`` > 0; give it in ``extra_attributes``.
    """
    links = {"physfn": f"../{physfn.lower()}"} if physfn is not None else {}
    pci = add_pci_device(
        host,
        address,
        vendor="0x8086",
        device=device_id,
        driver=driver,
        numa_node=numa_node,
        cls="0x030000",
        iommu_group=iommu_group,
        extra_attributes=extra_attributes,
        extra_links=links,
        parent=parent,
    )
    add_drm_minors(host, pci, card=card, render=render, by_path=address)
    return pci


def add_intel_sriov_gpu(
    host: UmockdevHost,
    address: str,
    *,
    card: int,
    render: int,
    vfs: int,
    device_id: str = "0x56c0",
    driver: str = "i915",
    numa_node: int = -1,
    parent: str | None = None,
) -> tuple[str, list[str]]:
    """An SR-IOV physical function with ``vfs`` virtual functions enabled (functions 1..vfs
    of the same slot, cards and render minors numbered on from the PF's). Returns the PF's
    path and the VFs' paths."""
    if not 1 <= vfs <= 7:
        raise ValueError(f"vfs must be 1..7 (functions of one slot), got {vfs}")
    pf = add_intel_gpu(
        host,
        address,
        card=card,
        render=render,
        device_id=device_id,
        driver=driver,
        numa_node=numa_node,
        extra_attributes={
            "sriov_numvfs": str(vfs),
            "sriov_totalvfs": "7",
            "sriov_drivers_autoprobe": "1",
        },
        parent=parent,
    )
    stem = address.lower()[:-1]
    vf_paths = [
        add_intel_gpu(
            host,
            f"{stem}{index}",
            card=card + index,
            render=render + index,
            device_id=device_id,
            driver=driver,
            numa_node=numa_node,
            physfn=address,
            parent=parent,
        )
        for index in range(1, vfs + 1)
    ]
    return pf, vf_paths


def add_usb_serial(
    host: UmockdevHost,
    *,
    index: int,
    vendor_id: str = "0403",
    model_id: str = "6001",
    serial: str | None = None,
) -> str:
    """Add a USB serial adapter (controller/hub created once); return the tty's path."""
    if index < 0 or index > 125:
        raise ValueError(f"USB serial index out of range: {index}")
    vid, pid = _hex_id(vendor_id, "vendor_id"), _hex_id(model_id, "model_id")
    controller = "/sys/devices/pci0000:00/0000:00:14.0"
    if not host.has_device(controller):
        add_pci_device(
            host,
            "0000:00:14.0",
            vendor="0x8086",
            device="0xa36d",
            driver="xhci_hcd",
            cls="0x0c0330",
        )
    hub = f"{controller}/usb1"
    if not host.has_device(hub):
        host.add_device(
            hub,
            "usb",
            attributes={"idVendor": "1d6b", "idProduct": "0002", "busnum": "1", "devnum": "1"},
            properties={"DEVTYPE": "usb_device", "BUSNUM": "001", "DEVNUM": "001"},
            node=MockNode("bus/usb/001/001", 189, 0),
            driver="usb",
        )
    port = f"1-{index + 1}"
    devnum = index + 2
    usb_attrs = {"idVendor": f"{vid:04x}", "idProduct": f"{pid:04x}", "busnum": "1"}
    usb_attrs["devnum"] = str(devnum)
    if serial is not None:
        usb_attrs["serial"] = serial
    usb_dev = host.add_device(
        f"{hub}/{port}",
        "usb",
        attributes=usb_attrs,
        properties={
            "DEVTYPE": "usb_device",
            "PRODUCT": f"{vid:x}/{pid:x}/600",
            "TYPE": "0/0/0",
            "BUSNUM": "001",
            "DEVNUM": f"{devnum:03d}",
        },
        node=MockNode(f"bus/usb/001/{devnum:03d}", 189, devnum - 1),
        driver="usb",
    )
    interface = host.add_device(
        f"{usb_dev}/{port}:1.0",
        "usb",
        attributes={"bInterfaceNumber": "00", "bInterfaceClass": "ff"},
        properties={
            "DEVTYPE": "usb_interface",
            "PRODUCT": f"{vid:x}/{pid:x}/600",
            "INTERFACE": "255/255/255",
            "MODALIAS": f"usb:v{vid:04X}p{pid:04X}d0600dc00dsc00dp00icFFiscFFipFFin00",
        },
        driver="ftdi_sio",
    )
    tty_name = f"ttyUSB{index}"
    port_dev = host.add_device(
        f"{interface}/{tty_name}",
        "usb-serial",
        attributes={"port_number": "0"},
        driver="ftdi_sio",
    )
    tty_props = {"ID_VENDOR_ID": f"{vid:04x}", "ID_MODEL_ID": f"{pid:04x}", "ID_BUS": "usb"}
    devlinks: list[str] = []
    if serial is not None:
        tty_props["ID_SERIAL_SHORT"] = serial
        devlinks.append(f"serial/by-id/usb-{vid:04x}_{pid:04x}_{serial}-if00-port0")
    return host.add_device(
        f"{port_dev}/tty/{tty_name}",
        "tty",
        properties=tty_props,
        node=MockNode(tty_name, 188, index),
        devlinks=devlinks,
    )


# ---------------------------------------------------------------------------------- VFIO

VFIO_GROUP_MAJOR = 243  # dynamic on real hosts; any fixed value does here
VFIO_DEVICE_MAJOR = 509


def add_vfio_container(host: UmockdevHost) -> str:
    """``/dev/vfio/vfio``, the legacy VFIO container node (misc 10:196); once per host."""
    path = "/sys/devices/virtual/misc/vfio"
    if host.has_device(path):
        return path
    return host.add_device(path, "misc", node=MockNode("vfio/vfio", 10, 196))


def add_iommufd(host: UmockdevHost) -> str:
    """``/dev/iommu``, present on kernels with iommufd (misc 10:123); once per host."""
    path = "/sys/devices/virtual/misc/iommu"
    if host.has_device(path):
        return path
    return host.add_device(path, "misc", node=MockNode("iommu", 10, 123))


def add_vfio_group(host: UmockdevHost, group: int, *, noiommu: bool = False) -> str:
    """An IOMMU group's VFIO node (``/dev/vfio/<group>``, or ``noiommu-<group>``) and the
    group's sysfs ``name`` file (``vfio-noiommu`` for a no-IOMMU group)."""
    if group < 0:
        raise ValueError(f"IOMMU group numbers are not negative: {group}")
    group_dir = os.path.join(host.root, "sys", "kernel", "iommu_groups", str(group))
    os.makedirs(os.path.join(group_dir, "devices"), exist_ok=True)
    if noiommu:
        with open(os.path.join(group_dir, "name"), "w", encoding="ascii") as handle:
            handle.write("vfio-noiommu\n")
    name = f"noiommu-{group}" if noiommu else str(group)
    return host.add_device(
        f"/sys/devices/virtual/vfio/{name}",
        "vfio",
        node=MockNode(f"vfio/{name}", VFIO_GROUP_MAJOR, group),
    )


def add_vfio_function(
    host: UmockdevHost,
    address: str,
    *,
    vendor: str,
    device: str,
    group: int,
    driver: str | None = "vfio-pci",
    numa_node: int = -1,
    cls: str = "0x030000",
    vfio_dev: int | None = None,
    parent: str | None = None,
) -> str:
    """A PCI function in IOMMU ``group``; with ``vfio_dev`` (N) also its iommufd character
    device ``<function>/vfio-dev/vfioN`` and ``/dev/vfio/devices/vfioN``. Add the group's node
    with :func:`add_vfio_group` (once per group)."""
    pci = add_pci_device(
        host,
        address,
        vendor=vendor,
        device=device,
        driver=driver,
        numa_node=numa_node,
        cls=cls,
        iommu_group=group,
        parent=parent,
    )
    if vfio_dev is not None:
        host.add_device(
            f"{pci}/vfio-dev/vfio{vfio_dev}",
            "vfio-dev",
            node=MockNode(f"vfio/devices/vfio{vfio_dev}", VFIO_DEVICE_MAJOR, vfio_dev),
        )
    return pci
