"""The Intel GPU scanner (``scanners.intel_gpu``, ``--scanner intel-gpu``): Intel GPUs as
``gpu.intel.com/<driver>`` resources, shared or not, plus the monitoring device, as Intel's
own GPU plugin advertises them.

May use: the udev source's views (:mod:`devplug.scanners.udev`, never pyudev), the incremental
helpers, config, the model, the preferred-allocation policy, naming, sizing and errors.
"""

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
