"""Naming rules shared by config, scanners, the fronts and the kubelet simulator.

Resource names follow the kubelet's ``IsExtendedResourceName``: the name must contain a "/",
must not be in the ``kubernetes.io`` namespace, must not start with ``requests.``, and
``"requests." + name`` must be a qualified name (a DNS-1123 subdomain prefix of at most 253
characters, then a name of at most 63 alphanumerics, "-", "_" or "." starting and ending with
an alphanumeric). Device ids are kept to the CDI device-name alphabet so that one id serves as
the kubelet's device ID, the CDI device name and a log field without escaping. A CDI kind's
spec file, and which resource has a file two kinds give, are decided here too: config refuses
configured kinds that share one, and the CDI front writes by the same rule.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import NamedTuple

from devplug.errors import CdiSpecError, InvalidNameError

# The Kubernetes name formats, written as apimachinery writes them: the DRA front quotes these
# strings in the API server's own messages, so they stay character for character the same.
# Every check of a DNS label, a DNS subdomain or a qualified name in devplug (config, CDI, DRA,
# the VFIO domain, the kubelet stand-in) uses these.
DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN_FMT = DNS1123_LABEL_FMT + r"(\." + DNS1123_LABEL_FMT + ")*"
QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
DNS1123_LABEL = re.compile(rf"^{DNS1123_LABEL_FMT}\Z")
DNS1123_SUBDOMAIN = re.compile(rf"^{DNS1123_SUBDOMAIN_FMT}\Z")
QUALIFIED_NAME = re.compile(rf"^{QUALIFIED_NAME_FMT}\Z")
# The kubelet takes any id; devplug keeps ids to the CDI device-name alphabet.
DEVICE_ID = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")

# At least two characters: the CDI library slices name[1:len(name)-1], which panics in Go for
# a one-character vendor or class.
_CDI_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]\Z")

REQUESTS_PREFIX = "requests."
NATIVE_NAMESPACE = "kubernetes.io/"
MAX_SUBDOMAIN = 253
MAX_LABEL = 63
MAX_NAME = 63  # the name part of a qualified name
MAX_DEVICE_ID = 63
MAX_DRIVER_NAME = 63  # DriverNameMaxLength in k8s.io/api resource/v1 types.go
# sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107
# The name of every temp file devplug makes beside a file it then puts into place (a CDI spec,
# an ownership record, a plugin socket): hidden, and with no ".json", ".yaml" or ".sock" end,
# so runtimes and the kubelet skip it; a clean-up knows devplug's leftovers by it.
TEMP_PREFIX = ".devplug-tmp-"


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would refuse ``name`` as an extended resource name, or None."""
    if "/" not in name:
        return "must be '<domain>/<name>' (an extended resource name contains a '/')"
    if NATIVE_NAMESPACE in name:
        return "the kubernetes.io namespace is reserved for native resources"
    if name.startswith(REQUESTS_PREFIX):
        return f"must not start with {REQUESTS_PREFIX!r}"
    domain, _, short = (REQUESTS_PREFIX + name).partition("/")
    if "/" in short:
        return "must contain exactly one '/'"
    if len(domain) > MAX_SUBDOMAIN or not DNS1123_SUBDOMAIN.match(domain):
        return (
            "the domain must be a DNS-1123 subdomain: lower-case alphanumerics, '-' and '.', "
            f"starting and ending with an alphanumeric, at most {MAX_SUBDOMAIN - 9} characters"
        )
    if len(short) > MAX_NAME or not QUALIFIED_NAME.match(short):
        return (
            "the part after '/' must be 1-63 characters of alphanumerics, '-', '_' or '.', "
            "starting and ending with an alphanumeric"
        )
    return None


def validate_resource_name(name: str) -> str:
    """Return ``name`` if the kubelet would accept it, else raise InvalidNameError."""
    problem = resource_name_problem(name)
    if problem is not None:
        raise InvalidNameError(f"invalid resource name {name!r}: {problem}")
    return name


def device_id_problem(device_id: str) -> str | None:
    """Why ``device_id`` is not a valid device id, or None."""
    if not device_id:
        return "must not be empty"
    if len(device_id) > MAX_DEVICE_ID:
        return f"must be at most {MAX_DEVICE_ID} characters (the kubelet's limit)"
    if not DEVICE_ID.match(device_id):
        return (
            "must be alphanumerics, '_', '-', '.' or ':', starting and ending with an "
            "alphanumeric (the CDI device-name alphabet)"
        )
    return None


def validate_device_id(device_id: str) -> str:
    problem = device_id_problem(device_id)
    if problem is not None:
        raise InvalidNameError(f"invalid device id {device_id!r}: {problem}")
    return device_id


def sanitize_device_id(raw: str, max_length: int = MAX_DEVICE_ID) -> str:
    """Map any string to a valid device id of at most ``max_length`` characters, deterministically.

    Characters outside the id alphabet become "_"; leading and trailing non-alphanumerics are
    dropped. A result that is empty or too long is replaced by a prefix plus a short hash of
    ``raw``, so two different long inputs do not collide.
    """
    cleaned = re.sub(r"[^A-Za-z0-9_.:-]", "_", raw).strip("_.:-")
    if cleaned and len(cleaned) <= max_length:
        return cleaned
    digest = hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    prefix = cleaned[: max_length - len(digest) - 1].rstrip("_.:-")
    return f"{prefix}-{digest}" if prefix else f"dev-{digest}"


def socket_file_name(resource: str) -> str:
    """The plugin socket's file name for ``resource``: readable, one path component.

    ``example.com/serial`` becomes ``devplug-example.com_serial.sock``. Resource names are
    validated first, so the result holds only ``[A-Za-z0-9._-]``.
    """
    validate_resource_name(resource)
    return "devplug-" + resource.replace("/", "_") + ".sock"


def short_socket_file_name(resource: str) -> str:
    """A short, stable socket file name for resources whose readable name is too long."""
    digest = hashlib.sha256(resource.encode()).hexdigest()[:16]
    return f"devplug-{digest}.sock"


# A PCI address as the kernel names devices: domain (%04x, so 4 digits or more), bus, device
# and function, in lower-case hex.
PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# In natural_key: a PCI address that does not start inside a longer word, or a decimal number.
_NATURAL_PARTS = re.compile(rf"(?<![0-9A-Za-z])({PCI_ADDRESS.pattern})|(\d+)")

# The parts of a text (numbers as numbers), then the text itself.
NaturalKey = tuple[tuple[tuple[int, int | str], ...], str]


def _pci_number(address: str) -> int:
    domain, bus, rest = address.split(":")
    device, function = rest.split(".")
    return int(domain, 16) << 20 | int(bus, 16) << 12 | int(device, 16) << 4 | int(function)


def natural_key(text: str) -> NaturalKey:
    """Sort key that orders "gpu2" before "gpu10", and PCI addresses (hex) in bus order:
    "0000:09:00.0" before "0000:0a:00.0". A text sorts before its extensions ("gpu" before
    "gpu1"); texts whose parts are equal ("gpu01", "gpu1") are ordered by the text itself,
    so the order never depends on the order of the input."""
    parts: list[tuple[int, int | str]] = []
    end = 0
    for match in _NATURAL_PARTS.finditer(text):
        if match.start() > end:
            parts.append((1, text[end : match.start()]))
        pci, digits = match.groups()
        parts.append((0, _pci_number(pci) if pci is not None else int(digits)))
        end = match.end()
    if end < len(text):
        parts.append((1, text[end:]))
    return tuple(parts), text


def cdi_kind_problem(kind: str) -> str | None:
    """Why ``kind`` is not a CDI kind (``<vendor>/<class>``, as the CDI library checks it:
    each part starts with a letter, ends with a letter or digit, and holds only letters,
    digits, "_", "-" and "."; and, because the library's check panics on them, is at least two
    characters long), or None."""
    vendor, sep, cls = kind.partition("/")
    if not sep:
        return "must be '<vendor>/<class>', e.g. example.com/serial"
    for what, part in (("vendor", vendor), ("class", cls)):
        if not part:
            return f"the {what} part is empty"
        if not _CDI_VENDOR_OR_CLASS.match(part):
            return (
                f"the {what} {part!r} must be at least two characters, start with a letter, "
                "end with a letter or digit, and hold only letters, digits, '_', '-' and '.'"
            )
    return None


def driver_name_problem(driver: str) -> str | None:
    """Why ``driver`` cannot be a DRA driver name, or None.

    Stricter than the API server, which lower-cases the name before its DNS check: the name
    is also compared exactly (DeviceClass CEL ``device.driver == "..."``, the kubelet's plugin
    directory), so devplug asks for the lower-case form the API documents.
    """
    if not driver:
        return "must not be empty"
    if len(driver) > MAX_DRIVER_NAME:
        return f"must be at most {MAX_DRIVER_NAME} characters, got {len(driver)}"
    if not DNS1123_SUBDOMAIN.match(driver):
        return (
            "must be a DNS subdomain: lower-case alphanumerics, '-' and '.', starting and "
            "ending with an alphanumeric (a domain the driver's vendor owns, e.g. gpu.intel.com)"
        )
    return None


def spec_file_name(kind: str) -> str:
    """The CDI spec file of ``kind``: ``<vendor>-<class>.json``, the CDI library's
    GenerateSpecName plus the extension. Raises CdiSpecError for an invalid kind."""
    problem = cdi_kind_problem(kind)
    if problem is not None:
        raise CdiSpecError(f"invalid kind {kind!r}: {problem}")
    vendor, _, cls = kind.partition("/")
    return f"{vendor}-{cls}.json"


class SpecFileClash(NamedTuple):
    """A resource left without a spec file: its kind gives a file another resource has."""

    resource: str
    file_name: str
    taken_by: str  # the resource that has the file

    @property
    def problem(self) -> str:
        return f"{self.taken_by} and {self.resource} would share the spec file {self.file_name}"


def spec_files(kinds: Mapping[str, str]) -> tuple[dict[str, str], list[SpecFileClash]]:
    """Which resource has which spec file, from resource -> CDI kind: resource -> its file
    name (in resource order), and the clashes. Two kinds can give one file (``a/b-c`` and
    ``a-b/c``, or one kind given twice): the first resource by name has it, each other one is
    a clash and has none. Raises CdiSpecError for an invalid kind."""
    files: dict[str, str] = {}
    holders: dict[str, str] = {}  # file name -> the resource that has it
    clashes: list[SpecFileClash] = []
    for resource in sorted(kinds):
        file_name = spec_file_name(kinds[resource])
        holder = holders.setdefault(file_name, resource)
        if holder == resource:
            files[resource] = file_name
        else:
            clashes.append(SpecFileClash(resource, file_name, holder))
    return files, clashes
