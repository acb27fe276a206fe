"""The DRA attributes of an Intel GPU: those Intel's own DRA driver publishes, named and
formatted as it does (intel/intel-resource-drivers-for-kubernetes
``cmd/kubelet-gpu-plugin/node_state.go`` ``GetResources``), so that a DeviceClass or claim
selector written for Intel's driver (which also calls itself ``gpu.intel.com``) selects the
same GPUs under devplug. Bare names: they are in the DRA driver's domain.

- ``model``, ``family`` (string): Intel's names for the PCI device id (:mod:`.models`),
  ``Unknown`` for an id Intel does not list;
- ``driver`` (string): the kernel driver bound now (``i915``, ``xe``);
- ``sriov`` (bool): the function can have SR-IOV virtual functions (``sriov_totalvfs`` > 0,
  with ``sriov_drivers_autoprobe`` on, as Intel reads them);
- ``type`` (string): ``vf`` for an SR-IOV virtual function, ``gpu`` otherwise;
- ``pciId`` (string): the PCI device id as sysfs prints it, ``0x56a0``;
- ``health`` (string): ``Healthy`` or ``Unhealthy``. devplug leaves unhealthy devices out of
  the pool (Intel's driver keeps them, tainted), so a published device always says
  ``Healthy``; a selector that asks for it still matches;
- ``pciAddress`` (string) and ``pciRoot`` (string, the root complex's bus, ``00``): names
  Intel keeps for selectors written before the standard
  ``resource.kubernetes.io/pciBusID`` and ``pcieRoot`` (which devplug publishes for every PCI
  device) and marks deprecated. Published while Intel's driver publishes them.

Not published: Intel's capacities (``memory``, ``millicores``): devplug's devices are whole
GPUs and carry no capacity.
"""

from __future__ import annotations

import re

from devplug.model import AttributeValue, Health
from devplug.scanners.intel_gpu.discovery import GpuFunction
from devplug.scanners.intel_gpu.models import model_and_family

# /sys/devices/pci<domain>:<bus>/...: the PCI root complex a function sits under.
_ROOT = re.compile(r"pci[0-9a-f]{4}:([0-9a-f]{2})")


def intel_attributes(function: GpuFunction, health: Health) -> dict[str, AttributeValue]:
    """What Intel's DRA driver says of ``function``, as devplug advertises it with ``health``."""
    model, family = model_and_family(function.pci_device_id)
    attributes: dict[str, AttributeValue] = {
        "model": model,
        "family": family,
        "sriov": function.sriov_capable,
        "type": "vf" if function.is_virtual_function else "gpu",
        "health": "Healthy" if health is Health.HEALTHY else "Unhealthy",
        "pciAddress": function.address,
    }
    if function.driver is not None:
        attributes["driver"] = function.driver
    if function.pci_device_id is not None:
        attributes["pciId"] = function.pci_device_id
    root = _root_bus(function.sys_path)
    if root is not None:
        attributes["pciRoot"] = root
    return attributes


def _root_bus(sys_path: str) -> str | None:
    parts = sys_path.split("/")
    if len(parts) < 5 or parts[:3] != ["", "sys", "devices"]:
        return None
    match = _ROOT.fullmatch(parts[3])
    return match[1] if match is not None else None
