"""The VFIO scanner (``scanners.vfio``, ``--scanner vfio``)."""

from devplug.scanners.vfio.scanner import VfioScanner, kubevirt_variable
from devplug.scanners.vfio.settings import VfioSettings

__all__ = ["VfioScanner", "VfioSettings", "kubevirt_variable"]
