"""Specs for a whole tree at once: ``devplug cdi generate`` (no daemon, no kubelet)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from devplug.cdi.build import DEFAULT_INSTANCE, resource_spec
from devplug.cdi.files import owned_specs, remove_owned_spec, write_spec_file
from devplug.cdi.names import default_kind, spec_file_name
from devplug.cdi.spec import Spec, spec_document, spec_json
from devplug.errors import CdiSpecError
from devplug.model import DeviceTree

# Where static specs go: runtimes read it besides /var/run/cdi (which wins on conflicts).
STATIC_CDI_DIR = Path("/etc/cdi")


def tree_specs(
    tree: DeviceTree, kinds: Mapping[str, str], instance: str = DEFAULT_INSTANCE
) -> dict[str, Spec]:
    """spec file name -> spec, for every resource with something to put in a container.

    Raises CdiSpecError for a resource without a valid kind, or two resources on one file.
    """
    specs: dict[str, Spec] = {}
    owners: dict[str, str] = {}
    for resource in sorted(tree):
        kind = kinds.get(resource) or default_kind(resource)
        name = spec_file_name(kind)
        if name in owners:
            raise CdiSpecError(
                f"{owners[name]} and {resource} would both be written to {name}; "
                "set cdi.kinds for one of them"
            )
        spec = resource_spec(resource, kind, tree[resource], instance)
        if spec is not None:
            specs[name] = spec
            owners[name] = resource
    return specs


def write_tree_specs(
    directory: Path, specs: Mapping[str, Spec], prune_instance: str | None = None
) -> tuple[list[str], list[str]]:
    """Write ``specs`` into ``directory``; with ``prune_instance``, also delete that devplug
    instance's other specs there (resources the host no longer has). Return (written,
    removed) file names."""
    written = []
    for name, spec in sorted(specs.items()):
        write_spec_file(directory, name, spec_json(spec))
        written.append(name)
    removed = []
    if prune_instance is not None:
        for name in sorted(owned_specs(directory, prune_instance)):
            if name not in specs and remove_owned_spec(directory, name, instance=prune_instance):
                removed.append(name)
    return written, removed


def specs_text(specs: Mapping[str, Spec]) -> str:
    """The specs as one JSON object, file name -> spec, for ``--stdout``."""
    document = {name: spec_document(spec) for name, spec in sorted(specs.items())}
    for spec in specs.values():
        spec_json(spec)  # validates
    return json.dumps(document, indent=2) + "\n"
