"""Built-in scanners by config name, and building them from settings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from devplug.errors import ConfigError
from devplug.scanners.base import Scanner
from devplug.scanners.generic import GenericScanner
from devplug.scanners.intel_gpu import IntelGpuScanner
from devplug.scanners.vfio import VfioScanner

# name -> factory(raw config section or None for defaults, field path) -> Scanner
BUILTIN_SCANNERS: Mapping[str, Callable[[Any, str], Scanner]] = {
    "generic": GenericScanner.from_config,
    "intel_gpu": IntelGpuScanner.from_config,
    "vfio": VfioScanner.from_config,
}


def build_scanners(sections: Mapping[str, Any]) -> list[Scanner]:
    """One scanner per configured section, validated; unknown names list the known ones."""
    scanners: list[Scanner] = []
    for name, raw in sections.items():
        factory = BUILTIN_SCANNERS.get(name)
        if factory is None:
            known = ", ".join(sorted(BUILTIN_SCANNERS))
            raise ConfigError(f"scanners.{name}", f"unknown scanner; known scanners: {known}")
        scanners.append(factory(raw, f"scanners.{name}"))
    return scanners
