"""A package's names loaded from their modules on first use (PEP 562's module ``__getattr__``).

A package that re-exports names from heavy modules keeps ``import package`` light this way:
the name's module loads when the name is first read, and the value is then stored in the
package, so later reads are plain attribute reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_names(
    package: str, sources: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``), loading each
    name of ``sources`` (name -> the module defining it) on first use:
    ``__getattr__, __dir__ = lazy_names(__name__, {...})``."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(source), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *sources})

    return __getattr__, __dir__
