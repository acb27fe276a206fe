"""The Intel GPU scanner (``scanners.intel_gpu``, ``--scanner intel-gpu``)."""

from devplug.scanners.intel_gpu.monitoring import MONITORING_ID, MONITORING_RESOURCE
from devplug.scanners.intel_gpu.scanner import IntelGpuScanner
from devplug.scanners.intel_gpu.settings import IntelGpuSettings, ListTooLargeError

__all__ = [
    "MONITORING_ID",
    "MONITORING_RESOURCE",
    "IntelGpuScanner",
    "IntelGpuSettings",
    "ListTooLargeError",
]
