"""The CDI spec (version 1.1.0): its names, its model, its validation, version choice and JSON.

Names follow the rules the CDI Go library applies (``pkg/parser``, ``pkg/cdi``):

- A kind is ``<vendor>/<class>``. Vendor and class each start with a letter, end with a
  letter or digit, and hold letters, digits, ``_``, ``-`` and ``.`` in between.
- A device name starts and ends with a letter or digit and holds letters, digits, ``_``,
  ``-``, ``.`` and ``:`` in between. devplug's device ids use the same alphabet, so an id is
  its own CDI name (:func:`devplug.cdi.render.cdi_device_name`).
- A qualified name is ``<vendor>/<class>=<name>``.

Validation applies the rules the CDI Go library applies when a runtime loads a spec (a spec
that breaks one is dropped by the runtime, so devplug refuses to write it), plus a few the
spec text states and the library leaves out (absolute paths). ``minimum_version`` is the
lowest ``cdiVersion`` that allows every field used, as the library's ``MinimumRequiredVersion``
computes it: runtimes reject a spec whose version is lower than that, and older runtimes
reject versions they do not know, so the lowest that works is the one to write. A device
node's ``fileMode``, ``uid`` and ``gid`` are fields of the first version the library computes
(0.3.0): both library generations read them at any version and neither raises it for them.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from devplug.errors import CdiSpecError
from devplug.naming import (
    DEVICE_ID,
    DNS1123_SUBDOMAIN,
    MAX_NAME,
    MAX_SUBDOMAIN,
    QUALIFIED_NAME,
    cdi_kind_problem,
)

# Every version the CDI library knows, oldest first; 0.3.0 is the lowest it computes.
VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
CURRENT_VERSION = VERSIONS[-1]
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_TYPES = frozenset({"b", "c", "u", "p"})
# The library's (Kubernetes') limit on the summed length of annotation keys and values.
MAX_ANNOTATIONS_BYTES = 256 * 1024
MAX_UINT32 = 2**32 - 1
# A node's fileMode: permission bits only. The library reads it as a Go os.FileMode, whose
# type and special bits are not the Unix ones (os.ModeSetuid is 1 << 23, not 0o4000), and runc
# masks only S_IFMT off before mknod: a value above 0o777 means different things to each.
MAX_FILE_MODE = 0o777
_EMPTY: Mapping[str, str] = MappingProxyType({})


# ------------------------------------------------------------------------- names


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


def qualified_name(kind: str, name: str) -> str:
    return f"{kind}={name}"


# ------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class DeviceNodeEdit:
    path: str  # in the container
    host_path: str | None = None  # None: the same as ``path``
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    permissions: str | None = None
    uid: int | None = None
    gid: int | None = None
    # The node's permission bits in the container; None: the runtime's default, which for
    # runc is 0666, whatever the host node's mode.
    file_mode: int | None = None


@dataclass(frozen=True, slots=True)
class MountEdit:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None


@dataclass(frozen=True, slots=True)
class HookEdit:
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None


@dataclass(frozen=True, slots=True)
class ContainerEdits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNodeEdit, ...] = ()
    mounts: tuple[MountEdit, ...] = ()
    hooks: tuple[HookEdit, ...] = ()
    additional_gids: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.env or self.device_nodes or self.mounts or self.hooks or self.additional_gids
        )


@dataclass(frozen=True, slots=True)
class SpecDevice:
    name: str
    edits: ContainerEdits
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str
    devices: tuple[SpecDevice, ...]
    edits: ContainerEdits | None = None  # applied with any of the spec's devices
    annotations: Mapping[str, str] = field(default_factory=lambda: _EMPTY)


# ------------------------------------------------------------------------- validation


def _absolute(value: str) -> bool:
    # normpath keeps a leading "//" (POSIX leaves it implementation-defined); Go's Clean does
    # not, so such a path is not normalised for the CDI library.
    if not value.startswith("/") or value.startswith("//") or "\0" in value:
        return False
    if "//" not in value and "/." not in value and (not value.endswith("/") or value == "/"):
        # No empty, "." or ".." part and no trailing slash: normpath would keep it as it is
        # (its own check, ~2 us a path, four paths a device, is left for the rest).
        return True
    return posixpath.normpath(value) == value


# Mount options already seen to be valid: devices repeat a handful of option lists.
_GOOD_OPTIONS: set[tuple[str, ...]] = set()
_GOOD_OPTIONS_MAX = 64


def _options_valid(options: tuple[str, ...]) -> bool:
    if options in _GOOD_OPTIONS:
        return True
    if any(not option or "," in option for option in options):
        return False
    if len(_GOOD_OPTIONS) < _GOOD_OPTIONS_MAX:
        _GOOD_OPTIONS.add(options)
    return True


def _env_problems(entries: tuple[str, ...], where: str) -> Iterator[str]:
    for entry in entries:
        # The library's rule: an "=" that is not the first character.
        if entry.find("=") <= 0 or "\0" in entry:
            yield f"{where}: invalid environment variable {entry!r} (want NAME=value)"


# The texts of problems are made only when there is one: a first render validates every
# device of the resource, and building each field's description up front costs more than
# the checks themselves.
def _at(field: str, key: str) -> str:
    return f"{field}[{key!r}]"


def _edits_problems(edits: ContainerEdits, where: str) -> Iterator[str]:
    if edits.env:
        yield from _env_problems(edits.env, f"{where}.env")
    nodes = f"{where}.deviceNodes"
    for node in edits.device_nodes:
        if not node.path:
            yield f"{nodes}: invalid (empty) device path"
        elif not _absolute(node.path):
            yield f"{_at(nodes, node.path)}: path must be absolute and normalised"
        if node.host_path is not None and not _absolute(node.host_path):
            spot = _at(nodes, node.path)
            yield f"{spot}: hostPath must be absolute and normalised, got {node.host_path!r}"
        if node.type is not None and node.type not in DEVICE_TYPES:
            yield f"{_at(nodes, node.path)}: invalid type {node.type!r} (one of b, c, u, p)"
        for number, what in ((node.major, "major"), (node.minor, "minor")):
            if number is not None and number < 0:
                yield f"{_at(nodes, node.path)}: invalid (negative) {what} number {number}"
        if node.permissions is not None and (
            not node.permissions or set(node.permissions) - set("rwm")
        ):
            spot = _at(nodes, node.path)
            yield f"{spot}: invalid permissions {node.permissions!r} (letters of 'rwm')"
        for number, what in ((node.uid, "uid"), (node.gid, "gid")):
            if number is not None and not 0 <= number <= MAX_UINT32:
                yield f"{_at(nodes, node.path)}: {what} {number} out of range"
        if node.file_mode is not None and not 0 <= node.file_mode <= MAX_FILE_MODE:
            spot = _at(nodes, node.path)
            yield (
                f"{spot}: fileMode {node.file_mode:#o} is not permission bits "
                f"(0 to {MAX_FILE_MODE:#o})"
            )
    mounts = f"{where}.mounts"
    for mount in edits.mounts:
        if not mount.host_path:
            yield f"{mounts}: invalid mount, empty host path"
        if not mount.container_path:
            yield f"{mounts}: invalid mount, empty container path"
        elif not _absolute(mount.container_path):
            spot = _at(mounts, mount.container_path)
            yield f"{spot}: containerPath must be absolute and normalised"
        if not _options_valid(mount.options):
            spot = _at(mounts, mount.container_path)
            yield f"{spot}: invalid options {list(mount.options)!r}"
    for hook in edits.hooks:
        spot = f"{where}.hooks[{hook.hook_name!r}]"
        if hook.hook_name not in HOOK_NAMES:
            known = ", ".join(sorted(HOOK_NAMES))
            yield f"{where}.hooks: invalid hook name {hook.hook_name!r} (one of {known})"
        if not hook.path:
            yield f"{spot}: invalid hook with empty path"
        elif not _absolute(hook.path):
            yield f"{spot}: path must be absolute"
        yield from _env_problems(hook.env, f"{spot}.env")
        if hook.timeout is not None and not 0 < hook.timeout <= MAX_UINT32:
            yield f"{spot}: timeout must be a positive number of seconds, got {hook.timeout}"
    for gid in edits.additional_gids:
        if not 0 <= gid <= MAX_UINT32:
            yield f"{where}.additionalGids: {gid} out of range"


def _annotation_problems(annotations: Mapping[str, str], where: str) -> Iterator[str]:
    total = 0
    for key, value in annotations.items():
        total += len(key.encode()) + len(value.encode())  # bytes, as the library counts
        prefix, slash, name = key.lower().rpartition("/")
        if (
            key.count("/") > 1
            or (
                slash
                and (
                    not prefix or len(prefix) > MAX_SUBDOMAIN or not DNS1123_SUBDOMAIN.match(prefix)
                )
            )
            or len(name) > MAX_NAME
            or not QUALIFIED_NAME.match(name)
        ):
            yield (
                f"{where}.annotations: invalid key {key!r} "
                "(want a qualified name, e.g. example.com/key)"
            )
    if total > MAX_ANNOTATIONS_BYTES:
        yield f"{where}.annotations: size {total} is larger than the limit {MAX_ANNOTATIONS_BYTES}"


def device_problems(device: SpecDevice) -> list[str]:
    """The rules one device breaks (all but uniqueness, which is the spec's)."""
    where = f"devices[{device.name!r}]"
    problems: list[str] = []
    problem = device_name_problem(device.name)
    if problem is not None:
        problems.append(f"{where}: {problem}")
    if device.edits.empty:
        problems.append(f"{where}: invalid device, empty device edits")
    problems.extend(_edits_problems(device.edits, f"{where}.containerEdits"))
    problems.extend(_annotation_problems(device.annotations, where))
    return problems


def head_problems(
    kind: str, annotations: Mapping[str, str], edits: ContainerEdits | None
) -> list[str]:
    """The rules the spec's own fields break (kind, spec-wide edits, annotations)."""
    problems: list[str] = []
    try:
        parse_kind(kind)
    except CdiSpecError as exc:
        problems.append(f"kind: {exc}")
    if edits is not None:
        problems.extend(_edits_problems(edits, "containerEdits"))
    problems.extend(_annotation_problems(annotations, "spec"))
    return problems


def spec_problems(spec: Spec) -> list[str]:
    """Every rule ``spec`` breaks, each naming the field; empty when it is valid."""
    problems = head_problems(spec.kind, spec.annotations, spec.edits)
    if not spec.devices:
        problems.append("devices: invalid spec, no devices")
    seen: set[str] = set()
    for device in spec.devices:
        if device.name in seen:
            problems.append(
                f"devices[{device.name!r}]: invalid spec, multiple device {device.name!r}"
            )
        seen.add(device.name)
        problems.extend(device_problems(device))
    return problems


def validate_spec(spec: Spec) -> None:
    """Raise CdiSpecError listing the broken rules (the first few) if ``spec`` is invalid."""
    problems = spec_problems(spec)
    if problems:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CdiSpecError(f"invalid CDI spec for kind {spec.kind!r}: {shown}{more}")


# ------------------------------------------------------------------------- versions


def later_version(*versions: str) -> str:
    """The latest of ``versions`` (the lowest known one if none)."""
    return max(versions, key=VERSIONS.index, default=VERSIONS[0])


def _edits_version(edits: ContainerEdits) -> str:
    # A node's fileMode, uid and gid need nothing above the lowest version (module docstring).
    needs = [VERSIONS[0]]
    if any(mount.type for mount in edits.mounts):
        needs.append("0.4.0")
    if any(node.host_path for node in edits.device_nodes):
        needs.append("0.5.0")
    if edits.additional_gids:
        needs.append("0.7.0")
    return later_version(*needs)


def device_version(device: SpecDevice) -> str:
    """The lowest cdiVersion one device's fields allow (the library's rules)."""
    needs = [_edits_version(device.edits)]
    if device.name[:1].isdigit():
        needs.append("0.5.0")
    if device.annotations:
        needs.append("0.6.0")
    return later_version(*needs)


def head_version(kind: str, annotations: Mapping[str, str], edits: ContainerEdits | None) -> str:
    """The lowest cdiVersion the spec's own fields allow."""
    needs = [VERSIONS[0] if edits is None else _edits_version(edits)]
    if annotations or "." in kind.partition("/")[2]:
        needs.append("0.6.0")
    return later_version(*needs)


def minimum_version(spec: Spec) -> str:
    """The lowest cdiVersion that allows every field ``spec`` uses (the library's rules)."""
    return later_version(
        head_version(spec.kind, spec.annotations, spec.edits),
        *(device_version(device) for device in spec.devices),
    )


# ------------------------------------------------------------------------- JSON


def _node_document(node: DeviceNodeEdit) -> dict[str, Any]:
    out: dict[str, Any] = {"path": node.path}
    for key, value in (
        ("hostPath", node.host_path),
        ("type", node.type),
        ("major", node.major),
        ("minor", node.minor),
        ("fileMode", node.file_mode),
        ("permissions", node.permissions),
        ("uid", node.uid),
        ("gid", node.gid),
    ):
        if value is not None:
            out[key] = value
    return out


def _edits_document(edits: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits.env:
        out["env"] = list(edits.env)
    if edits.device_nodes:
        out["deviceNodes"] = [_node_document(node) for node in edits.device_nodes]
    if edits.mounts:
        mounts = []
        for mount in edits.mounts:
            item: dict[str, Any] = {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
            }
            if mount.options:
                item["options"] = list(mount.options)
            if mount.type:
                item["type"] = mount.type
            mounts.append(item)
        out["mounts"] = mounts
    if edits.hooks:
        hooks = []
        for hook in edits.hooks:
            entry: dict[str, Any] = {"hookName": hook.hook_name, "path": hook.path}
            if hook.args:
                entry["args"] = list(hook.args)
            if hook.env:
                entry["env"] = list(hook.env)
            if hook.timeout is not None:
                entry["timeout"] = hook.timeout
            hooks.append(entry)
        out["hooks"] = hooks
    if edits.additional_gids:
        out["additionalGids"] = list(edits.additional_gids)
    return out


def device_document(device: SpecDevice) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": device.name}
    if device.annotations:
        entry["annotations"] = dict(device.annotations)
    entry["containerEdits"] = _edits_document(device.edits)
    return entry


def spec_document(spec: Spec) -> dict[str, Any]:
    """The spec as the JSON object a runtime reads, with its minimum ``cdiVersion``."""
    out: dict[str, Any] = {"cdiVersion": minimum_version(spec), "kind": spec.kind}
    if spec.annotations:
        out["annotations"] = dict(spec.annotations)
    out["devices"] = [device_document(device) for device in spec.devices]
    if spec.edits is not None and not spec.edits.empty:
        out["containerEdits"] = _edits_document(spec.edits)
    return out


def compact_json(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def spec_json(spec: Spec) -> bytes:
    """Validated, compact JSON (a spec of thousands of devices is written on every change)."""
    validate_spec(spec)
    return compact_json(spec_document(spec)) + b"\n"


def assemble_spec_json(
    kind: str,
    annotations: Mapping[str, str],
    version: str,
    device_fragments: list[bytes],
) -> bytes:
    """The bytes :func:`spec_json` gives for a spec without spec-wide edits, from the devices'
    compact JSON fragments (``compact_json(device_document(d))``), which callers cache."""
    head: dict[str, Any] = {"cdiVersion": version, "kind": kind}
    if annotations:
        head["annotations"] = dict(annotations)
    opening = compact_json(head)[:-1] + b',"devices":['
    if not device_fragments:
        return opening + b"]}\n"
    # One join, one copy of the devices' bytes: concatenating a spec of megabytes to the head
    # and tail would copy it twice more (8 ms for 10,000 devices against 0.2 ms for the join).
    parts = list(device_fragments)
    parts[0] = opening + parts[0]
    parts[-1] += b"]}\n"
    return b",".join(parts)
