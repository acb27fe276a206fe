"""The names the DRA API asks for, made from what devplug already has.

**Device names.** A DRA device name is a DNS label (RFC 1123: at most 63 characters of
``a-z``, ``0-9`` and ``-``, starting and ending with an alphanumeric), unique in its pool, and
allocated claims refer to it: it must never change for a device nor pass to another one.
devplug ids are stable already (PCI addresses, never ``cardN``), so the name is a function of
the id alone, whatever else the pool holds. Three rules, whose results never meet:

1. an id that already is a DNS label is its own name, unless it has the shape of a rule 2 or
   rule 3 result (then rule 3 applies to it);
2. a PCI address, with an optional share suffix (``0000:03:00.0``, ``0000:03:00.0-1``), has
   ``:`` and ``.`` replaced by ``-`` (``0000-03-00-0-1``): the address's fixed shape keeps
   this one-to-one;
3. any other id is sanitised (lower case, every run of other characters to ``-``, cut to
   fit) and gets ``-`` and 10 hex digits of the SHA-256 of the raw id: sanitising lost
   something, and the hash keeps apart two ids that sanitise alike.

Two ids share a name only when 40 bits of their hashes do; :mod:`.slices` leaves out every
device of a name that still occurs twice rather than let one name stand for two devices. The
raw id is published beside the name, as the ``id`` attribute.

**Pool, driver and slice names.** One pool per node, named after the node (as Intel's and the
example driver do); the driver is a DNS subdomain of at most 63 characters; slices have
deterministic names (see :func:`slice_name`).
"""

from __future__ import annotations

import hashlib
import re

from devplug.errors import InvalidNameError
from devplug.naming import DNS1123_LABEL, DNS1123_SUBDOMAIN, MAX_LABEL, MAX_SUBDOMAIN
from devplug.naming import driver_name_problem as driver_name_problem  # one rule, config's too

HASH_DIGITS = 10

_PCI_ID = re.compile(
    r"(?P<domain>[0-9a-f]{4,8}):(?P<bus>[0-9a-f]{2}):(?P<device>[0-9a-f]{2})\.(?P<function>[0-7])"
    r"(?:-(?P<share>[0-9]{1,6}))?"
)
# What rule 2 and rule 3 produce: an id of either shape is hashed, so that rule 1 never
# hands out a name another id gets by rule 2 or 3.
_PCI_NAME = re.compile(r"[0-9a-f]{4,8}-[0-9a-f]{2}-[0-9a-f]{2}-[0-7](-[0-9]{1,6})?")
_HASHED_NAME = re.compile(rf"(^|.*-)[0-9a-f]{{{HASH_DIGITS}}}")
_NOT_LABEL_CHARS = re.compile(r"[^a-z0-9]+")


def id_hash(raw: str) -> str:
    """10 hex digits of the SHA-256 of ``raw`` (any string, lone surrogates included)."""
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:HASH_DIGITS]


def device_name(device_id: str) -> str:
    """The DRA device name (a DNS label) of the devplug device ``device_id``.

    Deterministic and independent of any other device: the same id always gets the same name.
    """
    if (
        DNS1123_LABEL.match(device_id)
        and len(device_id) <= MAX_LABEL
        and not _PCI_NAME.fullmatch(device_id)
        and not _HASHED_NAME.fullmatch(device_id)
    ):
        return device_id
    pci = _PCI_ID.fullmatch(device_id)
    if pci is not None:
        return device_id.replace(":", "-").replace(".", "-")
    cleaned = _NOT_LABEL_CHARS.sub("-", device_id.lower()).strip("-")
    prefix = cleaned[: MAX_LABEL - HASH_DIGITS - 1].rstrip("-")
    digest = id_hash(device_id)
    return f"{prefix}-{digest}" if prefix else digest


def pool_name_problem(node_name: str) -> str | None:
    """Why ``node_name`` cannot name this node's pool (and its slices' ``nodeName``), or None."""
    if not node_name:
        return "must not be empty (the node's name, from the NODE_NAME variable)"
    if len(node_name) > MAX_SUBDOMAIN or not DNS1123_SUBDOMAIN.match(node_name):
        return (
            "must be a DNS subdomain, as Kubernetes node names are: at most 253 lower-case "
            "alphanumerics, '-' and '.', starting and ending with an alphanumeric"
        )
    return None


def pool_name(node_name: str) -> str:
    """The pool of this node's devices: the node's name (one pool per node). InvalidNameError
    if it is not a valid node name."""
    problem = pool_name_problem(node_name)
    if problem is not None:
        raise InvalidNameError(f"invalid node name {node_name!r}: {problem}")
    return node_name


def validate_driver_name(driver: str) -> str:
    """Return ``driver`` if it is a valid DRA driver name, else raise InvalidNameError."""
    problem = driver_name_problem(driver)
    if problem is not None:
        raise InvalidNameError(f"invalid DRA driver name {driver!r}: {problem}")
    return driver


def slice_name(node_name: str, driver: str, index: int) -> str:
    """The name of the pool's ``index``-th ResourceSlice: ``<node>-<driver>-<index>``.

    Deterministic rather than ``generateName``: a create retried after a lost answer meets
    409 AlreadyExists instead of leaving a second slice that would break the pool's
    ``resourceSliceCount``; the publisher finds what to update by name, with no cache of
    what it created; a slice wiped by the kubelet comes back under the same name; and
    ``kubectl get resourceslices`` says whose slice it is. The driver is in the name, so two
    drivers on one node never meet. A name that would pass 253 characters keeps a cut prefix
    and a hash of the whole, so it stays unique and a valid DNS subdomain.
    """
    if index < 0:
        raise ValueError(f"slice index must be >= 0, got {index}")
    prefix = f"{node_name}-{driver}"
    suffix = f"-{index}"
    if len(prefix) + len(suffix) > MAX_SUBDOMAIN:
        room = MAX_SUBDOMAIN - len(suffix) - HASH_DIGITS - 1
        prefix = f"{prefix[:room].rstrip('.-')}-{id_hash(prefix)}"
    return prefix + suffix
