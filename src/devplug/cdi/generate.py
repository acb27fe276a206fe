"""Specs for a whole tree at once: ``devplug cdi generate`` (no daemon, no kubelet)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from devplug.cdi.render import default_kind, resource_spec
from devplug.cdi.spec import Spec, spec_document, spec_json
from devplug.cdi.store import DEFAULT_INSTANCE, SpecStore
from devplug.errors import CdiSpecError
from devplug.model import DeviceTree
from devplug.naming import spec_files

# Where static specs go: runtimes read it besides /var/run/cdi (which wins on conflicts).
STATIC_CDI_DIR = Path("/etc/cdi")


class ResourceSpec(NamedTuple):
    resource: str
    spec: Spec


def tree_specs(tree: DeviceTree, kinds: Mapping[str, str]) -> dict[str, ResourceSpec]:
    """spec file name -> (resource, spec), for every resource with something to put in a
    container.

    Raises CdiSpecError for a resource without a valid kind, or two resources with a spec on
    one file.
    """
    made: dict[str, Spec] = {}
    for resource in sorted(tree):
        spec = resource_spec(kinds.get(resource) or default_kind(resource), tree[resource])
        if spec is not None:
            made[resource] = spec
    files, clashes = spec_files({resource: spec.kind for resource, spec in made.items()})
    if clashes:
        raise CdiSpecError(f"{clashes[0].problem}; set cdi.kinds for one of them")
    return {files[resource]: ResourceSpec(resource, spec) for resource, spec in made.items()}


def config_identity(config_file: Path | None) -> str:
    """What names the config of a ``cdi generate`` run in its records: the config file's
    absolute path as given (not resolved: a symlink flipped to a new version is still the same
    config), "" when none was given (flags and environment only)."""
    return os.path.abspath(config_file) if config_file is not None else ""


async def write_tree_specs(
    directory: Path,
    specs: Mapping[str, ResourceSpec],
    instance: str = DEFAULT_INSTANCE,
    *,
    prune: bool = False,
    config: str = "",
) -> tuple[list[str], list[str]]:
    """Write ``specs`` into ``directory`` as ``instance``'s, made from ``config`` (see
    :func:`config_identity`); with ``prune``, also delete the specs there that the same
    instance and config wrote before and makes no more (resources the host no longer has,
    entries taken out of the config), whose daemon, if any, is gone. Return (written,
    removed) file names.

    Raises ForeignSpecError / SpecHeldError (devplug.cdi.store) for a name someone else
    holds, SpecConflictsError naming every one for several, before anything is written or
    created in ``directory``.
    """
    store = SpecStore(directory, instance, config=config)
    ordered = sorted(specs.items())
    if ordered:
        # All or none: a name someone else holds fails the run before any spec is written.
        data = [(name, resource, spec_json(spec)) for name, (resource, spec) in ordered]
        await store.write_all(data)  # checks every name before it creates anything
    written = [name for name, _ in ordered]
    removed = []
    if prune:
        for name in await store.stale_candidates():
            if name not in specs and await store.remove_stale(name) is not None:
                removed.append(name)
    return written, removed


def write_tree_specs_blocking(
    directory: Path,
    specs: Mapping[str, ResourceSpec],
    instance: str = DEFAULT_INSTANCE,
    *,
    prune: bool = False,
    config: str = "",
) -> tuple[list[str], list[str]]:
    """:func:`write_tree_specs` for a command line without a running loop."""
    return asyncio.run(write_tree_specs(directory, specs, instance, prune=prune, config=config))


def specs_text(specs: Mapping[str, ResourceSpec]) -> str:
    """The specs as one JSON object, file name -> spec, for ``--stdout``."""
    for _, spec in specs.values():
        spec_json(spec)  # validates
    document = {name: spec_document(spec) for name, (_, spec) in sorted(specs.items())}
    return json.dumps(document, indent=2) + "\n"
