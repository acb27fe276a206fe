"""Building devplug's settings models without pydantic's plugin discovery.

Each pydantic model asks ``pydantic.plugin._loader.get_plugins()`` for plugins when its class
is built; the first call imports ``importlib.metadata`` and reads every installed
distribution's entry points: 12-15 ms of CPU in ``devplug run``'s start-up, whose goal is
250 ms, for plugins (observability tools such as logfire) that have no business with a
daemon's config models. Within :func:`no_plugin_discovery` that module is a stand-in saying
"no plugins"; on exit the stand-in is gone, so models built later discover plugins as usual.

Setting ``PYDANTIC_DISABLE_PLUGINS`` (any value, even empty) leaves discovery to pydantic.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

LOADER = "pydantic.plugin._loader"


def _no_plugins() -> Iterable[Any]:
    return ()


def _real(name: str) -> Any:
    """Anything but ``get_plugins`` (a pydantic that asks for more): the real module's. Not
    dunders: the import system probes for ``__path__`` and the like on every import."""
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    sys.modules.pop(LOADER, None)
    return getattr(importlib.import_module(LOADER), name)


@contextlib.contextmanager
def no_plugin_discovery() -> Iterator[None]:
    if "PYDANTIC_DISABLE_PLUGINS" in os.environ or LOADER in sys.modules:
        yield
        return
    stand_in = types.ModuleType(LOADER, __doc__)
    stand_in.get_plugins = _no_plugins  # type: ignore[attr-defined]
    stand_in.__getattr__ = _real  # type: ignore[method-assign]
    sys.modules[LOADER] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(LOADER) is stand_in:
            del sys.modules[LOADER]
