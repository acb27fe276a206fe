"""CDI names, with the rules the CDI Go library applies (``pkg/parser``, ``pkg/cdi``).

- A kind is ``<vendor>/<class>``. Vendor and class each start with a letter, end with a
  letter or digit, and hold letters, digits, ``_``, ``-`` and ``.`` in between.
- A device name starts and ends with a letter or digit and holds letters, digits, ``_``,
  ``-``, ``.`` and ``:`` in between. devplug's device ids use the same alphabet, so an id is
  its own CDI name.
- A qualified name is ``<vendor>/<class>=<name>``.
- The Kubernetes annotation for runtimes that predate CDI fields in the CRI is
  ``cdi.k8s.io/<plugin>_<device>``: the part after the prefix is at most 63 characters of
  letters, digits, ``_``, ``-`` and ``.``, starting and ending with a letter or digit.
"""

from __future__ import annotations

import hashlib
import re

from devplug.errors import CdiSpecError
from devplug.naming import DEVICE_ID, cdi_kind_problem, device_id_problem

_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
ANNOTATION_PREFIX = "cdi.k8s.io/"
MAX_ANNOTATION_NAME = 63


def parse_kind(kind: str) -> tuple[str, str]:
    """``"vendor.com/class"`` -> ``("vendor.com", "class")``; raises CdiSpecError if invalid."""
    problem = cdi_kind_problem(kind)
    if problem is not None:
        raise CdiSpecError(f"invalid kind {kind!r}: {problem}")
    vendor, _, cls = kind.partition("/")
    return vendor, cls


def device_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid CDI device name, or None."""
    if not name:
        return "empty device name"
    if not DEVICE_ID.match(name):
        return (
            f"device name {name!r} must start and end with a letter or digit and hold only "
            "letters, digits, '_', '-', '.' and ':'"
        )
    return None


def cdi_device_name(device_id: str) -> str:
    """The CDI device name of a device id: the id itself.

    Device ids are checked against the CDI device-name alphabet when a tree is built
    (:func:`devplug.naming.device_id_problem`), so this never has to map anything; it raises
    rather than invent a name if that ever stops being true.
    """
    problem = device_id_problem(device_id) or device_name_problem(device_id)
    if problem is not None:
        raise CdiSpecError(f"device id {device_id!r} is not a CDI device name: {problem}")
    return device_id


def qualified_name(kind: str, name: str) -> str:
    return f"{kind}={name}"


def parse_qualified_name(text: str) -> tuple[str, str, str]:
    """``"vendor/class=name"`` -> (vendor, class, name); raises CdiSpecError if invalid."""
    kind, sep, name = text.partition("=")
    if not sep:
        raise CdiSpecError(f"unqualified device {text!r}, missing '='")
    vendor, cls = parse_kind(kind)
    problem = device_name_problem(name)
    if problem is not None:
        raise CdiSpecError(f"invalid device {text!r}: {problem}")
    return vendor, cls, name


def default_kind(resource: str) -> str:
    """The kind for a resource: the resource name itself when it is a valid kind (as
    ``gpu.intel.com/i915`` is). A vendor or class that starts with a digit, or is a single
    character (both allowed in resource names, not in kinds), gets an ``x`` in front:
    ``3d.example.com/cam`` -> ``x3d.example.com/cam``, ``example.com/a`` -> ``example.com/xa``.
    Resource names hold no other character a kind refuses."""
    vendor, _, cls = resource.partition("/")
    fixed = "/".join(
        part if part[:1].isalpha() and len(part) > 1 else "x" + part for part in (vendor, cls)
    )
    parse_kind(fixed)
    return fixed


def annotation_key(plugin: str, device: str) -> str:
    """``cdi.k8s.io/<plugin>_<device>`` following the CDI library's AnnotationKey rules.

    Characters the rules refuse (":" in PCI-address ids, "/" in resource names) become "_";
    a name longer than 63 characters keeps a prefix and a hash, so keys stay distinct.
    """
    raw = f"{plugin}_{device}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", raw).strip("_.-")
    if len(name) > MAX_ANNOTATION_NAME or not name:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
        prefix = name[: MAX_ANNOTATION_NAME - len(digest) - 1].rstrip("_.-")
        name = f"{prefix}_{digest}" if prefix else f"h{digest}"
    if not _ANNOTATION_NAME.match(name):
        raise CdiSpecError(f"cannot make a CDI annotation key from {raw!r}")
    return ANNOTATION_PREFIX + name
