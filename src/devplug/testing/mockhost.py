"""``python -m devplug.testing mock-host DIR --preset NAME``: the README's mock hosts, on disk.

Each preset builds a umockdev testbed in DIR with the hardware a README sample describes. Any
program run under ``umockdev-wrapper`` with ``UMOCKDEV_DIR=DIR`` then sees that hardware
instead of the machine's (real pyudev and libudev code, no root needed):

    python -m devplug.testing mock-host /tmp/gpu-node --preset intel-gpu
    UMOCKDEV_DIR=/tmp/gpu-node umockdev-wrapper devplug scan --scanner intel-gpu
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from devplug.testing.umockdev import (
    UmockdevHost,
    add_drm_minors,
    add_intel_gpu,
    add_intel_sriov_gpu,
    add_iommufd,
    add_pci_device,
    add_usb_serial,
    add_vfio_container,
    add_vfio_function,
    add_vfio_group,
)


def serial_host(host: UmockdevHost) -> None:
    """Two FTDI USB serial adapters (ttyUSB0, ttyUSB1) and one from another vendor."""
    add_usb_serial(host, index=0)
    add_usb_serial(host, index=1)
    add_usb_serial(host, index=2, vendor_id="10c4")


def intel_gpu_host(host: UmockdevHost) -> None:
    """The README's GPU node: an integrated GPU, an SR-IOV card with two VFs enabled on NUMA
    node 1, an xe card on NUMA node 1, and an NVIDIA card."""
    add_intel_gpu(host, "0000:00:02.0", card=0, render=128)
    add_intel_sriov_gpu(host, "0000:03:00.0", card=1, render=129, vfs=2, numa_node=1)
    add_intel_gpu(host, "0000:83:00.0", card=4, render=132, device_id="0xe20b", driver="xe",
                  numa_node=1)  # fmt: skip
    nvidia = add_pci_device(host, "0000:a1:00.0", vendor="0x10de", device="0x2204", driver="nvidia")
    add_drm_minors(host, nvidia, card=5, render=133)


def vfio_host(host: UmockdevHost) -> None:
    """The README's VFIO node: an X710 NIC's two functions in IOMMU group 12 on vfio-pci, a GPU
    whose audio function is still on snd_hda_intel (group 13), and /dev/iommu."""
    add_vfio_container(host)
    add_iommufd(host)
    add_vfio_group(host, 12)
    for index, address in enumerate(("0000:18:00.0", "0000:18:00.1")):
        add_vfio_function(
            host,
            address,
            vendor="0x8086",
            device="0x1572",
            group=12,
            numa_node=0,
            cls="0x020000",
            vfio_dev=index,
        )
    add_vfio_group(host, 13)
    add_vfio_function(
        host, "0000:65:00.0", vendor="0x10de", device="0x2204", group=13, numa_node=1, vfio_dev=2
    )
    add_vfio_function(
        host,
        "0000:65:00.1",
        vendor="0x10de",
        device="0x1aef",
        group=13,
        driver="snd_hda_intel",
        numa_node=1,
        cls="0x040300",
    )


PRESETS: Mapping[str, Callable[[UmockdevHost], None]] = {
    "serial": serial_host,
    "intel-gpu": intel_gpu_host,
    "vfio": vfio_host,
}


def build_mock_host(directory: Path, preset: str) -> UmockdevHost:
    """A testbed in ``directory`` (which must be empty or missing) holding ``preset``."""
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty: give a new directory")
    host = UmockdevHost(directory)
    PRESETS[preset](host)
    return host
