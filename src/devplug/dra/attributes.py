"""What a device says about itself in its pool: the ``attributes`` of a ResourceSlice device.

devplug's own attributes (bare names are in the driver's domain, so CEL reads them as
``device.attributes["<driver>"].resource``):

- ``resource`` (string): the devplug resource, ``gpu.intel.com/i915``; DeviceClasses select by it;
- ``id`` (string): devplug's device id as it is (the device's name is a DNS label made from it);
- ``numaNode`` (int): the NUMA node, when the device sits on exactly one;
- ``resource.kubernetes.io/pciBusID`` (string): the address of the device's PCI function;
- ``resource.kubernetes.io/pcieRoot`` (string): ``pci<domain>:<bus>``, its PCIe root complex.

The PCI ones come from ``DeviceInfo.sources``, the sysfs paths a scanner read: a PCI function
is ``/sys/devices/pci<domain>:<bus>/.../<domain>:<bus>:<device>.<function>``, and the root is
the first component under ``/sys/devices``, as kubernetes/dynamic-resource-allocation
``deviceattribute/pci_linux.go`` (``resolvePCIeRoot``) finds it through
``/sys/bus/pci/devices/<address>``; addresses are held to that file's BDF pattern. The device's
function is the one its id starts with (``0000:03:00.0``, ``0000:03:00.0-1`` for a share), or
the only one among its sources; a device over several functions (a VFIO group) without one of
them in its id gets ``pcieRoot`` alone, when they share it.

Then a scanner's own (``DeviceInfo.attributes``). Every attribute is checked with the API
server's rules before it is published, and one that breaks them is left out with the reason,
never the device: a name devplug uses itself (bare or under the driver's domain), a name that
is not a C identifier of at most 32 characters after an optional domain, a string of more than
64 bytes, an integer outside int64, or one past the limit of 32 per device (scanner attributes
are taken in name order).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devplug.dra.validate_device import MAX_ATTRIBUTES_AND_CAPACITIES, attribute_errors
from devplug.model import AttributeValue, DeviceInfo

RESOURCE = "resource"
ID = "id"
NUMA_NODE = "numaNode"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
OWN_NAMES = frozenset({RESOURCE, ID, NUMA_NODE, PCI_BUS_ID, PCIE_ROOT})

# verifyPCIBDFFormat in deviceattribute/pci_linux.go, and the root complex directory above it.
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")
_ROOT = re.compile(r"pci[0-9a-f]{4}:[0-9a-f]{2}")

WireAttribute = dict[str, str | int | bool]


@dataclass(frozen=True, slots=True)
class PciFunction:
    address: str  # "0000:03:00.0"
    root: str  # "pci0000:00"


@dataclass(frozen=True, slots=True)
class DeviceAttributes:
    """A device's attributes in wire form, and what was left out (name -> why)."""

    attributes: dict[str, WireAttribute]
    omitted: dict[str, str]


def pci_functions(sources: Iterable[str]) -> list[PciFunction]:
    """The PCI functions among sysfs ``sources``, in order, each once."""
    found: dict[str, PciFunction] = {}
    for path in sources:
        parts = path.split("/")
        if len(parts) < 5 or parts[:3] != ["", "sys", "devices"]:
            continue
        if _ROOT.fullmatch(parts[3]) and _BDF.fullmatch(parts[-1]):
            found.setdefault(parts[-1], PciFunction(parts[-1], parts[3]))
    return list(found.values())


def pci_attributes(device_id: str, sources: Iterable[str]) -> dict[str, str]:
    """``pciBusID`` and ``pcieRoot`` of a device, as far as its sources tell them."""
    functions = pci_functions(sources)
    own = next(
        (f for f in functions if device_id == f.address or device_id.startswith(f.address + "-")),
        functions[0] if len(functions) == 1 else None,
    )
    if own is not None:
        return {PCI_BUS_ID: own.address, PCIE_ROOT: own.root}
    roots = {f.root for f in functions}
    return {PCIE_ROOT: roots.pop()} if len(roots) == 1 else {}


def wire_value(value: AttributeValue) -> WireAttribute:
    """``{"bool": ...}``, ``{"int": ...}`` or ``{"string": ...}`` (bool before int: it is one)."""
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def own_attributes(resource: str, device_id: str, info: DeviceInfo) -> dict[str, AttributeValue]:
    own: dict[str, AttributeValue] = {RESOURCE: resource, ID: device_id}
    if len(info.numa_nodes) == 1:
        own[NUMA_NODE] = info.numa_nodes[0]
    own.update(pci_attributes(device_id, info.sources))
    return own


def device_attributes(
    resource: str, device_id: str, info: DeviceInfo, driver: str
) -> DeviceAttributes:
    """The attributes to publish for one device, each valid; the others in ``omitted``."""
    attributes: dict[str, WireAttribute] = {}
    omitted: dict[str, str] = {}
    _add_checked(own_attributes(resource, device_id, info), attributes, omitted)
    extras: dict[str, AttributeValue] = {}
    for name in sorted(info.attributes):
        bare = name.removeprefix(driver + "/")
        if bare in OWN_NAMES:
            omitted[name] = f"{bare!r} is devplug's own attribute"
        elif bare != name and bare in info.attributes:
            omitted[name] = f"the same attribute as {bare!r} (bare names are in {driver})"
        else:
            extras[name] = info.attributes[name]
    _add_checked(extras, attributes, omitted)
    return DeviceAttributes(attributes, omitted)


def _add_checked(
    candidates: Mapping[str, AttributeValue],
    attributes: dict[str, WireAttribute],
    omitted: dict[str, str],
) -> None:
    for name, value in candidates.items():
        wire = wire_value(value)
        errors = attribute_errors(name, wire, "attributes")
        if errors:
            omitted[name] = "; ".join(str(error) for error in errors)
        elif len(attributes) >= MAX_ATTRIBUTES_AND_CAPACITIES:
            limit = MAX_ATTRIBUTES_AND_CAPACITIES
            omitted[name] = f"a device has at most {limit} attributes and capacities"
        else:
            attributes[name] = wire


def wire_attributes(attributes: Mapping[str, WireAttribute]) -> dict[str, Any]:
    """The ``attributes`` map of a device, names sorted so equal devices give equal JSON."""
    return {name: dict(attributes[name]) for name in sorted(attributes)}
