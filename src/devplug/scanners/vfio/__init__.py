"""The VFIO scanner (``scanners.vfio``, ``--scanner vfio``): PCI functions bound to a VFIO
driver, one device per IOMMU group, for VMs (KubeVirt among them).

May use: the udev source's views (:mod:`devplug.scanners.udev`, never pyudev), config, the
model, naming and errors.
"""

from devplug.scanners.vfio.scanner import VfioScanner, kubevirt_variable
from devplug.scanners.vfio.settings import VfioSettings

__all__ = ["VfioScanner", "VfioSettings", "kubevirt_variable"]
