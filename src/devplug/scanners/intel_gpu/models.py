"""Intel's names for its GPUs by PCI device id: the ``model`` and ``family`` its DRA driver
publishes, so that a DeviceClass selector such as
``device.attributes["gpu.intel.com"].model == "A770"`` means the same GPUs under devplug.

Data, not code: the id -> (model, family) pairs of ``ModelDetails`` in
intel/intel-resource-drivers-for-kubernetes ``pkg/gpu/device/models.go`` at commit 1f234e3
(read 2026-11-26; the version whose entries also carry the default driver, which the same
repository's ``pkg/gpu/discovery/discovery-pci.go`` reads). An id that is not listed is
``Unknown`` in both, as Intel's ``DeviceInfo.SetModelInfo`` has it. Keys are the PCI device id
as sysfs prints it (``0x`` and four lower-case hex digits), the form Intel looks them up by.
"""

from __future__ import annotations

from typing import Final

UNKNOWN: Final = "Unknown"

# PCI device id -> (model, family).
MODELS: Final[dict[str, tuple[str, str]]] = {
    "0x4626": ("Alder Lake-P", "Iris Xe"),
    "0x56a0": ("A770", "Arc A-Series"),
    "0x56a1": ("A750", "Arc A-Series"),
    "0x56a2": ("A580", "Arc A-Series"),
    "0x56a5": ("A380", "Arc A-Series"),
    "0x56a6": ("A310", "Arc A-Series"),
    "0x56b0": ("A30M", "Arc Pro A-Series"),
    "0x56b1": ("A40/A50", "Arc Pro A-Series"),
    "0x56b2": ("A60M", "Arc Pro A-Series"),
    "0x56b3": ("A60", "Arc Pro A-Series"),
    "0x56c0": ("Flex 170", "Data Center Flex"),
    "0x56c1": ("Flex 140", "Data Center Flex"),
    "0x7d67": ("Arrow Lake-S", "Intel Graphics"),
    "0x0b69": ("Max 1550", "Data Center Max"),
    "0x0bd0": ("Max 1550", "Data Center Max"),
    "0x0bd5": ("Max 1550", "Data Center Max"),
    "0x0bd6": ("Max 1450", "Data Center Max"),
    "0x0bd9": ("Max 1100", "Data Center Max"),
    "0x0bda": ("Max 1100", "Data Center Max"),
    "0x0bdb": ("Max 1100", "Data Center Max"),
    # Intel marks these five as temporary, until the products' names are announced.
    "0x674c": ("CRI", "CRI"),
    "0x674d": ("CRI", "CRI"),
    "0x674e": ("CRI", "CRI"),
    "0x674f": ("CRI", "CRI"),
    "0x6750": ("CRI", "CRI"),
    "0xa7a0": ("Raptor Lake-P", "Iris Xe"),
    "0xb080": ("B390", "Arc B-Series"),
    "0xb081": ("B370", "Arc B-Series"),
    "0xb082": ("B390", "Arc B-Series"),
    "0xb083": ("B370", "Arc B-Series"),
    "0xb084": ("B390", "Arc B-Series"),
    "0xb085": ("B370", "Arc B-Series"),
    "0xb086": ("B390", "Arc B-Series"),
    "0xb087": ("B370", "Arc B-Series"),
    "0xe20b": ("B580", "Arc B-Series"),
    "0xe20c": ("B570", "Arc B-Series"),
    "0xe211": ("B60", "Arc Pro B-Series"),
    "0xe212": ("B50", "Arc Pro B-Series"),
    "0xe222": ("B65", "Arc Pro B-Series"),
    "0xe223": ("B70", "Arc Pro B-Series"),
}


def model_and_family(pci_device_id: str | None) -> tuple[str, str]:
    """``(model, family)`` of a PCI device id (``0x56a0``), ``Unknown`` for an unlisted one."""
    if pci_device_id is None:
        return UNKNOWN, UNKNOWN
    return MODELS.get(pci_device_id, (UNKNOWN, UNKNOWN))
