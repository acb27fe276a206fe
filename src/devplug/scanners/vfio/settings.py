"""The ``scanners.vfio`` config section, validated with errors that name the fix."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import StrictBool, field_validator

from devplug.config import SectionSettings, StrictModel
from devplug.errors import ConfigError
from devplug.naming import DNS1123_SUBDOMAIN, resource_name_problem

VfioMode = Literal["auto", "legacy", "iommufd"]
_SELECTOR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}\Z")
_DRIVER = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}\Z")


class VfioDeviceEntry(StrictModel):
    selector: str  # "vendor:device", PCI ids in hex
    resource: str

    @field_validator("selector", mode="before")
    @classmethod
    def _pci_ids(cls, value: Any) -> Any:
        text = str(value).strip().lower().replace("0x", "")
        if not _SELECTOR.match(text):
            raise ValueError(
                f"a selector is '<vendor>:<device>' in hex, e.g. '8086:1572'; got {value!r}"
            )
        return text

    @field_validator("resource")
    @classmethod
    def _kubelet_name(cls, value: str) -> str:
        problem = resource_name_problem(value)
        if problem is not None:
            raise ValueError(f"invalid resource name {value!r}: {problem}")
        return value


class VfioSettings(SectionSettings):
    """VFIO scanner settings.

    ``drivers``: the drivers that make a function passable to a VM (``vfio-pci`` and vendor
    variants). ``mode``: ``legacy`` gives ``/dev/vfio/vfio`` and the group node; ``iommufd``
    gives ``/dev/iommu`` and each function's ``/dev/vfio/devices/vfioN``; ``auto`` the legacy
    nodes always and the iommufd ones where the host has them. ``allow_noiommu``: also serve
    groups without an IOMMU (``vfio-noiommu``; no DMA isolation). ``default_domain``: where
    groups that match no selector get their resource name, ``<domain>/<vendor>_<device>``.
    """

    drivers: tuple[str, ...] = ("vfio-pci",)
    mode: VfioMode = "auto"
    # Strict: a security switch takes true or false, not "yes" or "1".
    allow_noiommu: StrictBool = False
    default_domain: str = "vfio.devplug.io"
    devices: tuple[VfioDeviceEntry, ...] = ()

    @field_validator("devices", mode="before")
    @classmethod
    def _no_devices(cls, value: Any) -> Any:
        return () if value is None else value

    @field_validator("drivers")
    @classmethod
    def _driver_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one driver, e.g. [vfio-pci]")
        for name in value:
            if not _DRIVER.match(name):
                raise ValueError(f"{name!r} is not a kernel driver name")
        return tuple(dict.fromkeys(value))

    @field_validator("default_domain")
    @classmethod
    def _domain(cls, value: str) -> str:
        # At least two labels (vfio.example.com): a vendor's domain, not a bare host name.
        dotted = "." in value and DNS1123_SUBDOMAIN.match(value) is not None
        if len(value) > 200 or not dotted or "kubernetes.io" in value:
            raise ValueError(
                f"must be a DNS domain outside kubernetes.io, e.g. vfio.example.com; got {value!r}"
            )
        return value

    def check_section(self, field: str) -> None:
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.devices):
            if entry.selector in seen:
                raise ConfigError(
                    f"{field}.devices[{index}].selector",
                    f"{entry.selector} is already mapped by devices[{seen[entry.selector]}]; "
                    "a device can have one resource",
                )
            seen[entry.selector] = index

    def resource_for(self, vendor: str, device: str) -> str | None:
        """The configured resource for ``vendor:device`` (4 lower-case hex digits each)."""
        wanted = f"{vendor}:{device}"
        for entry in self.devices:
            if entry.selector == wanted:
                return entry.resource
        return None

    def selector_for(self, resource: str) -> frozenset[str]:
        """The selectors (``vendor:device``) mapped to ``resource``."""
        return frozenset(e.selector for e in self.devices if e.resource == resource)

    def default_resource(self, vendor: str, device: str) -> str:
        return f"{self.default_domain}/{vendor}_{device}"
