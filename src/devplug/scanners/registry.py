"""Built-in scanners by config name, and building them from settings.

The names are known without importing a scanner (the command line's ``--help`` lists them);
each factory's module loads when the factory is first looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any

from devplug.errors import ConfigError

if TYPE_CHECKING:
    from devplug.scanners.base import Scanner

# name -> (module, class) whose ``from_config(raw section or None, field path)`` builds it.
_BUILTIN: Mapping[str, tuple[str, str]] = {
    "generic": ("devplug.scanners.generic", "GenericScanner"),
    "intel_gpu": ("devplug.scanners.intel_gpu", "IntelGpuScanner"),
    "vfio": ("devplug.scanners.vfio", "VfioScanner"),
}

BUILTIN_SCANNER_NAMES: tuple[str, ...] = tuple(_BUILTIN)


class _Factories(Mapping[str, "Callable[[Any, str], Scanner]"]):
    """The built-in factories by name, each imported on first lookup, after ``extra`` (a
    plugin author's, which win over a built-in of the same name)."""

    def __init__(self, extra: Mapping[str, Callable[[Any, str], Scanner]] | None = None) -> None:
        self._extra = dict(extra or {})

    def __getitem__(self, name: str) -> Callable[[Any, str], Scanner]:
        if name in self._extra:
            return self._extra[name]
        module, cls = _BUILTIN[name]
        factory: Callable[[Any, str], Scanner] = getattr(import_module(module), cls).from_config
        return factory

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(_BUILTIN), **self._extra})

    def __len__(self) -> int:
        return len({*_BUILTIN, *self._extra})

    def __contains__(self, name: object) -> bool:
        return name in _BUILTIN or name in self._extra


# name -> factory(raw config section or None for defaults, field path) -> Scanner
BUILTIN_SCANNERS: Mapping[str, Callable[[Any, str], Scanner]] = _Factories()


def with_builtins(
    extra: Mapping[str, Callable[[Any, str], Scanner]] | None,
) -> Mapping[str, Callable[[Any, str], Scanner]]:
    """``extra`` factories and the built-in ones (loaded when looked up), ``extra`` first."""
    return _Factories(extra)


def build_scanners(sections: Mapping[str, Any]) -> list[Scanner]:
    """One scanner per configured section, validated; unknown names list the known ones."""
    scanners: list[Scanner] = []
    for name, raw in sections.items():
        if name not in BUILTIN_SCANNERS:
            known = ", ".join(sorted(BUILTIN_SCANNERS))
            raise ConfigError(f"scanners.{name}", f"unknown scanner; known scanners: {known}")
        scanners.append(BUILTIN_SCANNERS[name](raw, f"scanners.{name}"))
    return scanners
