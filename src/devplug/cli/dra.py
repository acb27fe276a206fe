"""``devplug dra deviceclasses``: the DeviceClasses an admin applies for devplug's DRA resources.

The daemon writes nothing cluster-scoped (its ServiceAccount may touch only its own node's
ResourceSlices), so the classes that let claims and pods select its devices are printed here,
one per resource in the config's ``dra.resources``, for ``kubectl apply -f -``.

Each class selects the devices of one resource by CEL, on the driver and on the ``resource``
attribute every device of devplug's pool carries (a bare attribute name, so it lives in the
driver's domain: :mod:`devplug.dra.attributes`), and names the resource in
``extendedResourceName`` (KEP-5004), so that pods asking for ``gpu.intel.com/i915: 1`` are
served from these devices where the ``DRAExtendedResource`` gate is on (beta and on by default
from Kubernetes 1.36, GA in 1.37). With the gate off (1.34 and 1.35 by default) the API server
accepts the class and drops that field (``dropDisabledFields`` of its DeviceClass strategy):
the class then serves ResourceClaims only, and applying the same output again once the gate
is on sets the field.

**Class names.** A DeviceClass is cluster-wide and its name is a DNS subdomain. The name is
a function of the resource name alone, so the same config always prints the same classes:

1. ``<name>.<domain>`` for ``<domain>/<name>`` (``gpu.intel.com/i915`` ->
   ``i915.gpu.intel.com``) when ``<name>`` is a DNS label (lower-case alphanumerics and ``-``,
   no ``.``) that does not end in ``-`` and 10 hex digits, and the whole fits in 253
   characters; the first label is the name, the rest the domain, so two resources never meet;
2. otherwise ``<name, lower-cased, every run of other characters turned into '-', cut to
   fit>-<10 hex digits of the SHA-256 of the resource name>.<domain>`` (``example.com/Big_GPU``
   -> ``big-gpu-<hash>.example.com``), whose first label always ends in the hash, so it never
   meets a rule-1 name; when even ``<hash>.<domain>`` is too long, the domain's leading labels
   give way.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devplug.dra.attributes import RESOURCE
from devplug.dra.naming import HASH_DIGITS, id_hash
from devplug.dra.slices import resource_problem as attribute_problem
from devplug.naming import DNS1123_LABEL, MAX_LABEL, MAX_SUBDOMAIN, resource_name_problem

API_VERSION = "resource.k8s.io/v1"
LABELS = {"app.kubernetes.io/name": "devplug"}
# A first label that rule 2 could have made: rule 1 leaves such names to rule 2.
_HASHED_LABEL = re.compile(rf"(^|.*-)[0-9a-f]{{{HASH_DIGITS}}}")
_NOT_LABEL_CHARS = re.compile(r"[^a-z0-9]+")

YAML_HEADER = """\
# DeviceClasses for devplug's DRA driver {driver}: kubectl apply -f <this file>
# extendedResourceName: pods that ask for the resource by name are served through DRA where
# the DRAExtendedResource gate is on (by default from Kubernetes 1.36). With the gate off
# (the 1.34-1.35 default) the API server drops the field: the class serves ResourceClaims.
"""


def resource_problem(resource: str) -> str | None:
    """Why no DeviceClass can select ``resource``'s devices, or None."""
    problem = resource_name_problem(resource)
    if problem is not None:
        return f"invalid resource name {resource!r}: {problem}"
    problem = attribute_problem(resource)
    if problem is not None:
        return (
            f"{resource!r} cannot be the {RESOURCE!r} attribute that selectors find devplug's "
            f"devices by ({problem}); use a shorter resource name"
        )
    return None


def device_class_name(resource: str) -> str:
    """The DeviceClass name (a DNS subdomain) of the devplug resource ``resource``."""
    problem = resource_name_problem(resource)
    if problem is not None:
        raise ValueError(f"invalid resource name {resource!r}: {problem}")
    domain, _, name = resource.partition("/")
    plain = f"{name}.{domain}"
    if (
        len(name) <= MAX_LABEL
        and DNS1123_LABEL.match(name)
        and not _HASHED_LABEL.fullmatch(name)
        and len(plain) <= MAX_SUBDOMAIN
    ):
        return plain
    digest = id_hash(resource)
    labels = domain.split(".")
    while len(digest) + 1 + len(".".join(labels)) > MAX_SUBDOMAIN:
        labels.pop(0)  # a resource domain is at most 244 characters: a few labels at most
    tail = ".".join(labels)
    room = min(MAX_LABEL, MAX_SUBDOMAIN - len(tail) - 1) - HASH_DIGITS - 1
    prefix = _NOT_LABEL_CHARS.sub("-", name.lower()).strip("-")[: max(room, 0)].rstrip("-")
    return f"{prefix}-{digest}.{tail}" if prefix else f"{digest}.{tail}"


def selector(driver: str, resource: str) -> str:
    """The CEL expression for the devices of ``resource`` in ``driver``'s slices.

    The driver test comes first: ``&&`` stops there for another driver's device, whose
    attributes hold no ``resource`` in this driver's domain. Both names are validated (no
    quote or backslash can occur in them), so they go into CEL string literals as they are.
    """
    return (
        f"device.driver == '{driver}' && device.attributes['{driver}'].{RESOURCE} == '{resource}'"
    )


def device_class(driver: str, resource: str) -> dict[str, Any]:
    """One ``resource.k8s.io/v1`` DeviceClass for ``resource``, as the JSON the API takes."""
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": device_class_name(resource), "labels": dict(LABELS)},
        "spec": {
            "selectors": [{"cel": {"expression": selector(driver, resource)}}],
            "extendedResourceName": resource,
        },
    }


def device_classes(driver: str, resources: Sequence[str]) -> list[dict[str, Any]]:
    """One DeviceClass per resource, in the config's order, each once."""
    return [device_class(driver, resource) for resource in dict.fromkeys(resources)]


def render(driver: str, classes: Sequence[dict[str, Any]], output: str) -> str:
    """YAML documents (``---`` between them) under a comment, or one JSON ``v1`` List (what
    ``kubectl get -o json`` prints for several objects, and ``kubectl apply -f`` takes)."""
    if output == "json":
        listing = {"apiVersion": "v1", "kind": "List", "items": list(classes)}
        return json.dumps(listing, indent=2) + "\n"
    import yaml

    # Wide enough that no CEL expression is folded over lines.
    body = yaml.safe_dump_all(classes, sort_keys=False, width=1 << 16)
    return YAML_HEADER.format(driver=driver) + body


def deviceclasses_command(program: str, driver: str, resources: Sequence[str], output: str) -> int:
    """Print the classes; status 2 (one line on stderr) when one could never select its
    resource's devices."""
    from devplug.cli.parser import EXIT_OK, EXIT_USAGE

    problems = [
        f"dra.resources[{index}]: {problem}"
        for index, resource in enumerate(resources)
        if (problem := resource_problem(resource)) is not None
    ]
    if problems:
        print(f"{program}: configuration error: {problems[0]}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(render(driver, device_classes(driver, resources), output))
    return EXIT_OK


def deviceclasses_main(program: str, config: Path | None, output: str) -> int:
    """The command: the config's ``dra`` section (the file from ``--config`` or
    ``DEVPLUG_CONFIG``, as ``run`` reads it), printed as DeviceClasses; 2 with one line on
    stderr for a config that cannot be read or has no ``dra`` section."""
    from devplug._kits.pydantic_plugins import no_plugin_discovery
    from devplug.cli.parser import EXIT_USAGE
    from devplug.config import load_settings
    from devplug.errors import ConfigError

    source = "--config"
    if config is None and os.environ.get("DEVPLUG_CONFIG"):
        config, source = Path(os.environ["DEVPLUG_CONFIG"]), "DEVPLUG_CONFIG"
    try:
        if config is None:
            raise ConfigError(
                "--config",
                "no config file: name the one whose 'dra:' section lists the resources served "
                "through DRA (or set DEVPLUG_CONFIG)",
            )
        with no_plugin_discovery():
            settings = load_settings(config, {}, [], config_source=source)
        section = settings.dra
        if section is None:
            raise ConfigError(
                "dra",
                f"no 'dra:' section in {config}: add one naming the driver and the resources "
                "served through DRA (docs/dra.md)",
            )
    except ConfigError as exc:
        print(f"{program}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return deviceclasses_command(program, section.driver, section.resources, output)
