"""What KubeVirt's virt-launcher makes of an Allocate answer, for tests of VFIO-style scanners.

virt-launcher reads ``PCI_RESOURCE_<RESOURCE>`` for each resource its VM's ``hostDevices``
name, drops one trailing comma, splits the value on commas, and gives each host device of a
resource, in spec order, the first address left in that resource's list; an address once
given is taken out of every resource's list (two resources may list the same one). A host
device with no address left makes the VM fail to start. :func:`virt_launcher_assignment`
applies that rule (written from KubeVirt's description of its address pool, not its code).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["VirtLauncherError", "pci_resource_variable", "virt_launcher_assignment"]


class VirtLauncherError(AssertionError):
    """virt-launcher would refuse to start the VM."""


def pci_resource_variable(resource: str) -> str:
    """KubeVirt's variable for ``resource``: ``PCI_RESOURCE_`` + the name upper-cased, with
    ``.`` and ``/`` as ``_``."""
    return "PCI_RESOURCE_" + resource.upper().replace(".", "_").replace("/", "_")


def virt_launcher_assignment(env: Mapping[str, str], host_devices: Sequence[str]) -> list[str]:
    """The PCI address each host device gets; ``host_devices`` are the ``deviceName`` (resource)
    of each entry of the VM's ``hostDevices``, in spec order; ``env`` is the container's.

    Raises :class:`VirtLauncherError` when a host device gets no address.
    """
    pool: dict[str, list[str]] = {}
    for resource in dict.fromkeys(host_devices):
        value = env.get(pci_resource_variable(resource))
        if value is not None:
            value = value.removesuffix(",")
            pool[resource] = value.split(",") if value else []
    assigned = []
    for resource in host_devices:
        if resource not in pool:
            raise VirtLauncherError(f"{pci_resource_variable(resource)} is not set")
        if not pool[resource]:
            raise VirtLauncherError(f"no more addresses to allocate for resource {resource}")
        chosen = pool[resource][0]
        for name, addresses in pool.items():
            pool[name] = [a for a in addresses if a != chosen]
        assigned.append(chosen)
    return assigned
