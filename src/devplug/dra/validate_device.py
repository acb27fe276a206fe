"""The API server's rules for one ResourceSlice device, and for the names inside it.

``validateDevice`` and what it calls, from kubernetes/kubernetes
``pkg/apis/resource/validation/validation.go`` (v1 field set of Kubernetes 1.34): the device
name, attributes and capacities (names and values), taints, counter consumption, per-device
node selection and binding conditions. Also the name checks the spec shares with devices
(driver, node name, node selector). The slice builder uses the attribute checks on each
attribute before it publishes one; :mod:`.validate` checks whole objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplug.dra import formats
from devplug.dra.field_errors import (
    INT64_MAX,
    INT64_MIN,
    FieldError,
    as_list,
    as_object,
    as_string,
    child,
    duplicate,
    each,
    forbidden,
    index,
    invalid,
    is_int,
    key,
    not_supported,
    required,
    too_long,
    too_many,
    type_invalid,
)

DRIVER_NAME_MAX = 63  # DriverNameMaxLength (the CSI driver name rule)
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
ATTRIBUTE_DOMAIN_MAX = 63  # DeviceMaxDomainLength
ATTRIBUTE_ID_MAX = 32  # DeviceMaxIDLength
ATTRIBUTE_VALUE_MAX = 64  # DeviceAttributeMaxValueLength, in bytes (Go's len)
MAX_TAINTS = 4  # DeviceTaintsMaxLength in 1.34
MAX_CONSUMPTIONS = 2  # ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS = 32  # ResourceSliceMaxCountersPerCounterSet, ...PerDeviceCounterConsumption
MAX_BINDING_CONDITIONS = 4  # BindingConditionsMaxSize, BindingFailureConditionsMaxSize
TAINT_EFFECTS = ("NoExecute", "NoSchedule")
_ATTRIBUTE_KEY_MAX = ATTRIBUTE_DOMAIN_MAX + 1 + ATTRIBUTE_ID_MAX  # where map keys are cut
_DEVICE_ONE_OF = (
    "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
    "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
)


def driver_name_errors(value: Any, path: str) -> list[FieldError]:
    """ValidateCSIDriverName, which DRA reuses: required, at most 63 characters, and a DNS
    subdomain once lower-cased."""
    errors: list[FieldError] = []
    name = as_string(value, path, errors)
    if name is None:
        return errors
    if not name:
        errors.append(required(path))
    if len(name) > DRIVER_NAME_MAX:
        errors.append(too_long(path, DRIVER_NAME_MAX))
    return errors + each(path, name, formats.dns_subdomain(name.lower()))


def node_name_errors(value: Any, path: str) -> list[FieldError]:
    """ValidateNodeName: a DNS subdomain."""
    errors: list[FieldError] = []
    name = as_string(value, path, errors)
    return errors if name is None else each(path, name, formats.dns_subdomain(name))


def node_selector_errors(value: Any, path: str) -> list[FieldError]:
    """Only the number of terms (ValidateNodeSelector's and DRA's exactly-one rule)."""
    errors: list[FieldError] = []
    selector = as_object(value, path, errors)
    if selector is None:
        return errors
    terms_path = child(path, "nodeSelectorTerms")
    terms = as_list(selector.get("nodeSelectorTerms"), terms_path, errors)
    if not terms:
        errors.append(required(terms_path, "must have at least one node selector term"))
    if len(terms) != 1:
        errors.append(invalid(terms_path, terms, "must have exactly one node selector term"))
    return errors


def device_errors(value: Any, path: str, per_device_node_selection: bool) -> list[FieldError]:
    """validateDevice: one entry of ``spec.devices`` at ``path`` (``spec.devices[3]``)."""
    errors: list[FieldError] = []
    device = as_object(value, path, errors)
    if device is None:
        return errors
    errors.extend(device_name_errors(device.get("name", ""), child(path, "name")))
    attributes = as_object(device.get("attributes") or {}, child(path, "attributes"), errors)
    capacity = as_object(device.get("capacity") or {}, child(path, "capacity"), errors)
    attributes, capacity = attributes or {}, capacity or {}
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        limit = MAX_ATTRIBUTES_AND_CAPACITIES
        message = f"the total number of attributes and capacities must not exceed {limit}"
        errors.append(invalid(path, total, message))
    for name, attribute in attributes.items():
        errors.extend(attribute_errors(name, attribute, child(path, "attributes")))
    shareable = device.get("allowMultipleAllocations") is True
    for name, entry in capacity.items():
        entry_path = key(child(path, "capacity"), name, _ATTRIBUTE_KEY_MAX)
        errors.extend(qualified_name_errors(name, child(path, "capacity")))
        if isinstance(entry, Mapping) and entry.get("requestPolicy") is not None and not shareable:
            detail = "allowMultipleAllocations must be true"
            errors.append(forbidden(child(entry_path, "requestPolicy"), detail))
    errors.extend(_taints_errors(device.get("taints"), child(path, "taints")))
    consumptions = as_list(device.get("consumesCounters"), child(path, "consumesCounters"), errors)
    errors.extend(
        named_sets_errors(
            consumptions, child(path, "consumesCounters"), MAX_CONSUMPTIONS, "counterSet"
        )
    )
    errors.extend(_device_node_errors(device, path, per_device_node_selection))
    errors.extend(_binding_errors(device, path))
    return errors


def device_name_errors(value: Any, path: str) -> list[FieldError]:
    """validateDeviceName: a DNS label."""
    errors: list[FieldError] = []
    name = as_string(value, path, errors)
    return errors if name is None else each(path, name, formats.dns_label(name))


def attribute_errors(name: str, value: Any, attributes_path: str) -> list[FieldError]:
    """One ``attributes`` entry: its name (validateQualifiedName), reported at
    ``attributes_path`` itself as ``validateMap`` does for keys, and its value
    (validateDeviceAttribute) at ``<attributes_path>[<name>]``."""
    path = key(attributes_path, name, _ATTRIBUTE_KEY_MAX)
    return qualified_name_errors(name, attributes_path) + attribute_value_errors(value, path)


def qualified_name_errors(name: str, path: str) -> list[FieldError]:
    """An attribute or capacity name: a C identifier of at most 32 characters, optionally
    after ``<driver-like domain>/``; not more than one slash."""
    parts = name.split("/")
    if len(parts) == 1:
        return _identifier_errors(name, path)
    if len(parts) != 2:
        return [invalid(path, name, "must not contain more than one slash")]
    domain, identifier = parts
    errors = driver_name_errors(domain, path) if domain else []
    if not domain:
        errors.append(invalid(path, "", "the domain must not be empty"))
    if identifier:
        errors.extend(_identifier_errors(identifier, path))
    else:
        errors.append(invalid(path, "", "the name must not be empty"))
    return errors


def _identifier_errors(identifier: str, path: str) -> list[FieldError]:
    errors = [too_long(path, ATTRIBUTE_ID_MAX)] if len(identifier) > ATTRIBUTE_ID_MAX else []
    return errors + each(path, identifier, formats.c_identifier(identifier))


def attribute_value_errors(value: Any, path: str) -> list[FieldError]:
    """Exactly one of ``int`` (64-bit), ``bool``, ``string`` or ``version`` (semver 2.0.0),
    a string or version at most 64 bytes long."""
    errors: list[FieldError] = []
    attribute = as_object(value, path, errors)
    if attribute is None:
        return errors
    kinds = [kind for kind, item in attribute.items() if item is not None]
    for kind in kinds:
        item, item_path = attribute[kind], child(path, kind)
        if kind == "int":
            if not is_int(item) or not INT64_MIN <= item <= INT64_MAX:
                errors.append(type_invalid(item_path, item, "a 64-bit integer"))
        elif kind == "bool":
            if not isinstance(item, bool):
                errors.append(type_invalid(item_path, item, "a boolean"))
        elif kind in ("string", "version"):
            text = as_string(item, item_path, errors)
            if text is None:
                continue
            if kind == "version" and not formats.SEMVER.match(text):
                detail = "must be a string compatible with semver.org spec 2.0.0"
                errors.append(invalid(item_path, text, detail))
            if len(text.encode("utf-8", "surrogatepass")) > ATTRIBUTE_VALUE_MAX:
                errors.append(too_long(item_path, ATTRIBUTE_VALUE_MAX))
        else:
            errors.append(type_invalid(item_path, item, "one of int, bool, string or version"))
    if len(kinds) != 1:
        errors.append(invalid(path, dict(attribute), "exactly one value must be specified"))
    return errors


def _taints_errors(value: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    taints = as_list(value, path, errors)
    if len(taints) > MAX_TAINTS:
        return [too_many(path, len(taints), MAX_TAINTS)]
    for position, item in enumerate(taints):
        taint_path = index(path, position)
        taint = as_object(item, taint_path, errors)
        if taint is None:
            continue
        taint_key = taint.get("key", "")
        if (text := as_string(taint_key, child(taint_path, "key"), errors)) is not None:
            errors.extend(each(child(taint_path, "key"), text, formats.qualified_name(text)))
        taint_value = taint.get("value")
        if isinstance(taint_value, str) and taint_value:
            messages = formats.label_value(taint_value)
            errors.extend(each(child(taint_path, "value"), taint_value, messages))
        effect = taint.get("effect")
        if not effect:
            errors.append(required(child(taint_path, "effect")))
        elif effect not in TAINT_EFFECTS:
            errors.append(not_supported(child(taint_path, "effect"), effect, TAINT_EFFECTS))
    return errors


def named_sets_errors(items: list[Any], path: str, limit: int, name_key: str) -> list[FieldError]:
    """``sharedCounters`` (named by ``name``) and ``consumesCounters`` (by ``counterSet``):
    at most ``limit``, names DNS labels and unique, 1 to 32 counters named by DNS labels."""
    if len(items) > limit:
        return [too_many(path, len(items), limit)]
    errors: list[FieldError] = []
    seen: set[str] = set()
    for position, item in enumerate(items):
        item_path = index(path, position)
        entry = as_object(item, item_path, errors)
        if entry is None:
            continue
        name = entry.get(name_key)
        if not name:
            errors.append(required(child(item_path, name_key)))
        elif (text := as_string(name, child(item_path, name_key), errors)) is not None:
            errors.extend(each(child(item_path, name_key), text, formats.dns_label(text)))
            if text in seen:
                errors.append(duplicate(item_path, text))
            seen.add(text)
        errors.extend(_counters_errors(entry.get("counters"), child(item_path, "counters")))
    return errors


def _counters_errors(value: Any, path: str) -> list[FieldError]:
    if not value:
        return [required(path)]
    errors: list[FieldError] = []
    counters = as_object(value, path, errors)
    if counters is None:
        return errors
    if len(counters) > MAX_COUNTERS:  # the same 32 for sets and consumptions
        return [too_many(path, len(counters), MAX_COUNTERS)]
    for name in counters:  # a key's problems at the map's own path, as validateMap puts them
        errors.extend(each(path, name, formats.dns_label(name)))
    return errors


def _device_node_errors(device: Mapping[str, Any], path: str, per_device: bool) -> list[FieldError]:
    present = [f for f in ("nodeName", "nodeSelector", "allNodes") if device.get(f) is not None]
    if not per_device:
        if not present:
            return []
        detail = (
            "`nodeName`, `nodeSelector` and `allNodes` can only be set if "
            "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
        )
        return [invalid(path, None, detail)]
    errors: list[FieldError] = []
    chosen = []
    if device.get("nodeName") == "":
        errors.append(invalid(child(path, "nodeName"), "", "must not be empty"))
    elif device.get("nodeName") is not None:
        chosen.append("`nodeName`")
        errors.extend(node_name_errors(device["nodeName"], child(path, "nodeName")))
    if device.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        errors.extend(node_selector_errors(device["nodeSelector"], child(path, "nodeSelector")))
    if device.get("allNodes") is True:
        chosen.append("`allNodes`")
    elif device.get("allNodes") is not None:
        detail = "must be either unset or set to true"
        errors.append(invalid(child(path, "allNodes"), device["allNodes"], detail))
    if not chosen:
        errors.append(required(path, _DEVICE_ONE_OF))
    elif len(chosen) > 1:
        errors.append(invalid(path, "{" + ", ".join(chosen) + "}", _DEVICE_ONE_OF))
    return errors


def _binding_errors(device: Mapping[str, Any], path: str) -> list[FieldError]:
    """validateDeviceBindingParameters: at most 4 of each, label-key names, no duplicates,
    no overlap, and neither list without the other."""
    errors: list[FieldError] = []
    lists: dict[str, list[str]] = {}
    for name in ("bindingConditions", "bindingFailureConditions"):
        list_path = child(path, name)
        items = as_list(device.get(name), list_path, errors)
        lists[name] = [item for item in items if isinstance(item, str)]
        if len(items) > MAX_BINDING_CONDITIONS:
            errors.append(too_many(list_path, len(items), MAX_BINDING_CONDITIONS))
            continue
        seen: set[str] = set()
        for position, item in enumerate(items):
            item_path = index(list_path, position)
            if (text := as_string(item, item_path, errors)) is None:
                continue
            errors.extend(each(item_path, text, formats.qualified_name(text)))
            if text in seen:
                errors.append(duplicate(item_path, text))
            seen.add(text)
    conditions, failures = lists["bindingConditions"], lists["bindingFailureConditions"]
    failures_path = child(path, "bindingFailureConditions")
    for position, condition in enumerate(failures):
        if condition in conditions:
            detail = "bindingFailureConditions must not overlap with bindingConditions"
            errors.append(invalid(index(failures_path, position), condition, detail))
    if failures and not conditions:
        detail = "bindingConditions are required to use bindingFailureConditions"
        errors.append(invalid(child(path, "bindingConditions"), conditions, detail))
    if conditions and not failures:
        detail = "bindingFailureConditions are required to use bindingConditions"
        errors.append(invalid(failures_path, failures, detail))
    return errors
