"""The API server's semantic rules for a ``resource.k8s.io/v1`` ResourceSlice, in Python.

A mirror of ``ValidateResourceSlice``, ``ValidateResourceSliceUpdate``,
``validateResourceSliceSpec`` and ``validateDevice`` in kubernetes/kubernetes
``pkg/apis/resource/validation/validation.go`` for the v1 field set of Kubernetes 1.34 (flat
devices, ``perDeviceNodeSelection``, shared counters, binding conditions), with the limits of
kubernetes/api ``resource/v1/types.go``. It checks what the structural schemas
(``kubernetes-validate``) cannot: counts, lengths, name formats, one-of rules, uniqueness.
Problems come back as :class:`~devplug.dra.field_errors.FieldError` (field, reason, message),
in the order the Go code finds them; an empty list means the API server would accept it. The
rules for one device live in :mod:`.validate_device`; the object, metadata and spec here.

Limits, as of 1.34: 128 devices per slice (64 once a device has taints or consumes counters),
32 attributes and capacities per device, attribute names a C identifier of at most 32
characters optionally after ``<DNS subdomain of at most 63>/``, string and version values of
at most 64 bytes, 4 taints per device (16 from 1.35) with effect NoSchedule or NoExecute,
exactly one of ``nodeName``/``nodeSelector``/``allNodes``/``perDeviceNodeSelection``, device
names DNS labels unique in the slice. List-typed attributes (``ints``, ``strings``, ...) are
1.36+ (gate ``DRAListTypeAttributes``) and refused here as unknown value types.

Not mirrored, as devplug never sends them and the API server refuses most while decoding (400,
before validation): node selector terms' contents, quantity syntax, capacity request policies
beyond "needs allowMultipleAllocations", owner references. Any JSON value is taken and nothing
raises: a wrong type is a ``FieldValueTypeInvalid`` error.

tests/dra/upstream_slice_cases.py holds the API server's own test cases (its
validation_resourceslice_test.go) as data, and tests/dra/test_dra_validate_upstream.py holds
this mirror to them: field paths and error types as the API server reports them (the problems
of a map's key at the map's path, its value's at ``map[key]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplug.dra import formats
from devplug.dra.field_errors import (
    FieldError,
    as_list,
    as_object,
    as_string,
    child,
    dig,
    duplicate,
    each,
    forbidden,
    index,
    invalid,
    is_int,
    key,
    required,
    too_long,
    too_many,
    type_invalid,
)
from devplug.dra.validate_device import (
    device_errors,
    driver_name_errors,
    named_sets_errors,
    node_name_errors,
    node_selector_errors,
)

POOL_NAME_MAX = 253  # PoolNameMaxLength
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64  # ResourceSliceMaxDevicesWithTaintsOrConsumesCounters
MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets
ANNOTATIONS_MAX = 256 * 1024  # TotalAnnotationSizeLimitB
_SLICE_ONE_OF = (
    "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
)


def validate_resource_slice(obj: Any) -> list[FieldError]:
    """What ValidateResourceSlice refuses in ``obj``, the JSON of a ResourceSlice to create."""
    errors: list[FieldError] = []
    resource_slice = as_object(obj, "", errors)
    if resource_slice is None:
        return errors
    errors.extend(validate_metadata(resource_slice.get("metadata")))
    if resource_slice.get("spec") is None:
        return [*errors, required("spec")]
    return errors + validate_spec(resource_slice["spec"])


def validate_resource_slice_update(new: Any, old: Any) -> list[FieldError]:
    """ValidateResourceSliceUpdate: ``new``'s own rules, and its name, driver, pool name and
    node name as they were (``apimachineryvalidation.ValidateImmutableField``)."""
    errors = validate_resource_slice(new)
    for path in ("metadata.name", "spec.pool.name", "spec.driver", "spec.nodeName"):
        before, after = dig(old, path.split(".")), dig(new, path.split("."))
        if before != after:
            errors.append(invalid(path, after, "field is immutable"))
    return errors


def validate_metadata(value: Any) -> list[FieldError]:
    """ValidateObjectMeta for a cluster-scoped kind named by DNS subdomains: a name or a
    generateName, no namespace, valid label keys and values, valid annotation keys."""
    errors: list[FieldError] = []
    meta = as_object({} if value is None else value, "metadata", errors)
    if meta is None:
        return errors
    generate = meta.get("generateName")
    if generate and (text := as_string(generate, "metadata.generateName", errors)) is not None:
        # NameIsDNSSubdomain(prefix=true): a trailing '-' is fine, the random part follows it.
        masked = text[:-1] + "a" if len(text) > 1 and text.endswith("-") else text
        errors.extend(each("metadata.generateName", text, formats.dns_subdomain(masked)))
    name = meta.get("name")
    if not name:
        if not generate:
            errors.append(required("metadata.name", "name or generateName is required"))
    elif (text := as_string(name, "metadata.name", errors)) is not None:
        errors.extend(each("metadata.name", text, formats.dns_subdomain(text)))
    if meta.get("namespace"):
        errors.append(forbidden("metadata.namespace", "not allowed on this type"))
    labels = as_object(meta.get("labels") or {}, "metadata.labels", errors) or {}
    for label, label_value in labels.items():
        errors.extend(each("metadata.labels", label, formats.qualified_name(label)))
        if (text := as_string(label_value, key("metadata.labels", label, 63), errors)) is not None:
            errors.extend(each("metadata.labels", text, formats.label_value(text)))
    errors.extend(_annotations_errors(meta.get("annotations")))
    return errors


def _annotations_errors(value: Any) -> list[FieldError]:
    """ValidateAnnotations: keys are qualified names in any case, and keys and values
    together at most 256 KiB."""
    errors: list[FieldError] = []
    annotations = as_object(value or {}, "metadata.annotations", errors) or {}
    size = 0
    for name, text in annotations.items():
        errors.extend(each("metadata.annotations", name, formats.qualified_name(name.lower())))
        size += len(name.encode()) + (len(text.encode()) if isinstance(text, str) else 0)
    if size > ANNOTATIONS_MAX:
        errors.append(too_long("metadata.annotations", ANNOTATIONS_MAX))
    return errors


def validate_spec(value: Any, path: str = "spec") -> list[FieldError]:
    """validateResourceSliceSpec, for a new object."""
    errors: list[FieldError] = []
    spec = as_object(value, path, errors)
    if spec is None:
        return errors
    errors.extend(driver_name_errors(spec.get("driver", ""), child(path, "driver")))
    errors.extend(_pool_errors(spec.get("pool"), child(path, "pool")))
    errors.extend(_node_selection_errors(spec, path))
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errors.append(invalid(path, "", "only one of `sharedCounters` or `devices` is allowed"))
    devices = as_list(spec.get("devices"), child(path, "devices"), errors)
    errors.extend(_devices_errors(devices, spec.get("perDeviceNodeSelection") is True, path))
    counter_sets = as_list(spec.get("sharedCounters"), child(path, "sharedCounters"), errors)
    errors.extend(
        named_sets_errors(counter_sets, child(path, "sharedCounters"), MAX_COUNTER_SETS, "name")
    )
    return errors


def pool_name_errors(value: Any, path: str) -> list[FieldError]:
    """validatePoolName: at most 253 characters of DNS subdomains joined by '/'."""
    errors: list[FieldError] = []
    name = as_string(value, path, errors)
    if name is None:
        return errors
    if not name:
        return [required(path)]
    if len(name) > POOL_NAME_MAX:
        errors.append(too_long(path, POOL_NAME_MAX))
    for part in name.split("/"):
        errors.extend(each(path, part, formats.dns_subdomain(part)))
    return errors


def _pool_errors(value: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    pool = as_object({} if value is None else value, path, errors)
    if pool is None:
        return errors
    errors.extend(pool_name_errors(pool.get("name", ""), child(path, "name")))
    count, generation = pool.get("resourceSliceCount", 0), pool.get("generation", 0)
    if not is_int(count):
        errors.append(type_invalid(child(path, "resourceSliceCount"), count, "an integer"))
    elif count <= 0:
        message = "must be greater than zero"
        errors.append(invalid(child(path, "resourceSliceCount"), count, message))
    if not is_int(generation):
        errors.append(type_invalid(child(path, "generation"), generation, "an integer"))
    elif generation < 0:
        message = "must be greater than or equal to zero"
        errors.append(invalid(child(path, "generation"), generation, message))
    return errors


def _node_selection_errors(spec: Mapping[str, Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    chosen = []
    node_name = spec.get("nodeName")
    if node_name == "":
        message = "must be either unset or set to a non-empty string"
        errors.append(invalid(child(path, "nodeName"), "", message))
    elif node_name is not None:
        chosen.append("`nodeName`")
        errors.extend(node_name_errors(node_name, child(path, "nodeName")))
    if spec.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        errors.extend(node_selector_errors(spec["nodeSelector"], child(path, "nodeSelector")))
    for flag in ("allNodes", "perDeviceNodeSelection"):
        setting = spec.get(flag)
        if setting is True:
            chosen.append(f"`{flag}`")
        elif setting is not None:
            message = "must be either unset or set to true"
            errors.append(invalid(child(path, flag), setting, message))
    if not chosen:
        errors.append(required(path, _SLICE_ONE_OF))
    elif len(chosen) > 1:
        shown = "{" + ", ".join(chosen) + "}"
        errors.append(invalid(path, shown, _SLICE_ONE_OF + ", but multiple fields are set"))
    return errors


def _devices_errors(devices: list[Any], per_device: bool, spec_path: str) -> list[FieldError]:
    path = child(spec_path, "devices")
    advanced = any(
        isinstance(d, Mapping) and (d.get("taints") or d.get("consumesCounters")) for d in devices
    )
    limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if advanced else MAX_DEVICES
    if len(devices) > limit:
        return [too_many(path, len(devices), limit)]  # validateSet stops here (DoS guard)
    errors: list[FieldError] = []
    for position, device in enumerate(devices):
        errors.extend(device_errors(device, index(path, position), per_device))
    seen: set[str] = set()
    for position, device in enumerate(devices):
        name = device.get("name") if isinstance(device, Mapping) else None
        if isinstance(name, str):
            if name in seen:
                errors.append(duplicate(index(path, position), name))
            seen.add(name)
    return errors
