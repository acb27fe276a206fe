"""The API server's own test cases for ResourceSlice validation, as data: each case's slice
(in wire JSON) and the errors the API server reports for it, by field path and reason.

Transcribed (the facts: inputs and expected field paths and error types, not the code) from
kubernetes/kubernetes ``pkg/apis/resource/validation/validation_resourceslice_test.go`` at
commit 00cb9913ff7c046982e2f7e5a39c2ae0c07239c4 (read 2026-11-26), ``TestValidateResourceSlice``
and ``TestValidateResourceSliceUpdate``. The Go errors map to the reasons of a 422's causes:
``field.Required`` FieldValueRequired, ``Invalid`` FieldValueInvalid, ``TooLong`` and
``TooLongMaxLength`` FieldValueTooLong, ``TooMany`` FieldValueTooMany, ``Duplicate``
FieldValueDuplicate, ``NotSupported`` FieldValueNotSupported.

Left out: the cases of fields and gates newer than the v1 field set of 1.34 that devplug's
validator mirrors (list-typed attributes, ``partitionTypeAttribute``, consumable capacity's
request policies, node-allocatable resources, ``skipNodeOperations``), node selector term
contents (core validation, which devplug does not mirror), and the limits whose constants the
file does not spell out (counters per counter set).

This table is independent of devplug's validator: a mistake in the mirror makes a case fail,
where a test of the stand-in API server (which validates with the mirror) could not see it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

JsonObject = dict[str, Any]

GOOD = "foo"  # goodName
BAD = "!@#$%^"  # badName
DRIVER = "test.example.com"  # driverName
BAD_VALUE = "spaces not allowed"  # badValue
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_ADVANCED = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_ID = 32  # DeviceMaxIDLength
MAX_DOMAIN = 63  # DeviceMaxDomainLength
MAX_VALUE = 64  # DeviceAttributeMaxValueLength
POOL_NAME_MAX = 253  # PoolNameMaxLength
MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets

REQUIRED = "FieldValueRequired"
INVALID = "FieldValueInvalid"
TOO_LONG = "FieldValueTooLong"
TOO_MANY = "FieldValueTooMany"
DUPLICATE = "FieldValueDuplicate"
NOT_SUPPORTED = "FieldValueNotSupported"

Errors = list[tuple[str, str]]  # (field path, reason)


def default_attributes() -> JsonObject:
    """testAttributes."""
    return {
        "int": {"int": 42},
        "string": {"string": "hello world"},
        "version": {"version": "1.2.3"},
        "bool": {"bool": True},
    }


def default_capacity() -> JsonObject:
    """testCapacity."""
    return {"memory": {"value": "1Gi"}}


def default_counters() -> JsonObject:
    """testCounters."""
    return {"memory": {"value": "1Gi"}}


def resource_slice(name: str, node: str, driver: str, devices: int) -> JsonObject:
    """testResourceSlice: ``devices`` devices ``device-<i>`` with four attributes and one
    capacity, on node ``node`` in the pool named after it."""
    spec: JsonObject = {
        "nodeName": node,
        "driver": driver,
        "pool": {"name": node, "resourceSliceCount": 1, "generation": 0},
    }
    if devices:
        spec["devices"] = [
            {
                "name": f"device-{i}",
                "attributes": default_attributes(),
                "capacity": default_capacity(),
            }
            for i in range(devices)
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def with_shared_counters(sets: int) -> JsonObject:
    """testResourceSliceWithSharedCounters: no devices, ``sets`` counter sets."""
    obj = resource_slice(GOOD, GOOD, DRIVER, 0)
    obj["spec"]["sharedCounters"] = [
        {"name": f"counterset-{i}", "counters": default_counters()} for i in range(sets)
    ]
    return obj


def changed(obj: JsonObject, change: Callable[[JsonObject], object]) -> JsonObject:
    obj = copy.deepcopy(obj)
    change(obj)
    return obj


def good(devices: int = 1, driver: str = DRIVER) -> JsonObject:
    return resource_slice(GOOD, GOOD, driver, devices)


@dataclass(frozen=True)
class Case:
    name: str
    slice: JsonObject
    errors: Errors


def _taint(effect: str = "NoExecute") -> JsonObject:
    return {"key": "example.com/taint", "effect": effect}


def _devices(obj: JsonObject) -> list[JsonObject]:
    devices: list[JsonObject] = obj["spec"]["devices"]
    return devices


def _meta(obj: JsonObject) -> JsonObject:
    meta: JsonObject = obj["metadata"]
    return meta


def _spec(obj: JsonObject) -> JsonObject:
    spec: JsonObject = obj["spec"]
    return spec


def _set(target: JsonObject, **values: Any) -> None:
    target.update(values)


def _drop(target: JsonObject, *names: str) -> None:
    for name in names:
        target.pop(name, None)


def _attrs(obj: JsonObject, index: int, attributes: JsonObject) -> None:
    _devices(obj)[index]["attributes"] = attributes


def _bad_attributes(obj: JsonObject) -> None:
    _attrs(obj, 1, {BAD: {}})  # a bad name, and no value
    _attrs(obj, 2, {GOOD: {"string": "x", "version": "1.2.3"}})  # two values
    _attrs(obj, 3, {GOOD: {"version": "x" * (MAX_VALUE + 1)}})
    _attrs(obj, 4, {GOOD: {"string": "x" * (MAX_VALUE + 1)}})


def _combined(obj: JsonObject) -> None:
    devices = _devices(obj)
    many = {f"attr_{i}": {"string": "x"} for i in range(MAX_ATTRIBUTES_AND_CAPACITIES)}
    devices[0]["attributes"] = many
    del devices[0]["capacity"]
    devices[1]["attributes"] = {}
    devices[1]["capacity"] = {
        f"cap_{i}": {"value": "1Gi"} for i in range(MAX_ATTRIBUTES_AND_CAPACITIES)
    }
    devices[3]["attributes"] = dict(many)  # too many together, by one
    devices[3]["capacity"] = {"cap": {"value": "1Gi"}}


def _taints(obj: JsonObject) -> None:
    _devices(obj)[0]["taints"] = [
        _taint(),  # minimal valid taint
        {
            "key": "taint",
            "value": "tainted",
            "effect": "NoSchedule",
            "timeAdded": "2026-01-01T00:00:00Z",
        },
        {},  # all empty
        {"key": BAD, "value": BAD, "effect": "some-other-effect"},
    ]


def _per_device_bad(obj: JsonObject) -> None:
    _spec(obj)["perDeviceNodeSelection"] = True
    del _spec(obj)["nodeName"]
    _devices(obj)[0].update(nodeName="", allNodes=False)


def _per_device_two(obj: JsonObject) -> None:
    _spec(obj)["perDeviceNodeSelection"] = True
    del _spec(obj)["nodeName"]
    _devices(obj)[0].update(nodeName="worker", allNodes=True)


_MATCH_WORKER = {
    "nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["worker"]}]}
    ]
}

D = "spec.devices"


def _with_taints(count: int) -> JsonObject:
    obj = resource_slice(GOOD, GOOD, GOOD, count)
    for device in _devices(obj):
        device["taints"] = [_taint()]
    return obj


CREATE_CASES: list[Case] = [
    Case("good", good(MAX_DEVICES), []),
    Case(
        "too-large",
        resource_slice(GOOD, GOOD, GOOD, MAX_DEVICES + 1),
        [(D, TOO_MANY)],
    ),
    Case("good-taints", _with_taints(MAX_DEVICES_ADVANCED), []),
    Case("too-large-taints", _with_taints(MAX_DEVICES_ADVANCED + 1), [(D, TOO_MANY)]),
    Case("missing-name", resource_slice("", GOOD, DRIVER, 1), [("metadata.name", REQUIRED)]),
    Case("bad-name", resource_slice(BAD, GOOD, DRIVER, 1), [("metadata.name", INVALID)]),
    Case("generate-name", changed(good(), lambda o: _set(_meta(o), generateName="prefix-")), []),
    Case(
        "uid",
        changed(good(), lambda o: _set(_meta(o), uid="ac051fac-2ead-46d9-b8b4-4e0fbeb7455d")),
        [],
    ),
    Case("resource-version", changed(good(), lambda o: _set(_meta(o), resourceVersion="1")), []),
    Case("generation", changed(good(), lambda o: _set(_meta(o), generation=100)), []),
    Case(
        "creation-timestamp",
        changed(good(), lambda o: _set(_meta(o), creationTimestamp="2026-01-01T00:00:00Z")),
        [],
    ),
    Case(
        "deletion-grace-period-seconds",
        changed(good(), lambda o: _set(_meta(o), deletionGracePeriodSeconds=10)),
        [],
    ),
    Case(
        "owner-references",
        changed(
            good(),
            lambda o: _set(
                _meta(o),
                ownerReferences=[
                    {
                        "apiVersion": "v1",
                        "kind": "pod",
                        "name": "foo",
                        "uid": "ac051fac-2ead-46d9-b8b4-4e0fbeb7455d",
                    }
                ],
            ),
        ),
        [],
    ),
    Case(
        "finalizers", changed(good(), lambda o: _set(_meta(o), finalizers=["example.com/foo"])), []
    ),
    Case(
        "managed-fields",
        changed(
            good(),
            lambda o: _set(
                _meta(o),
                managedFields=[
                    {
                        "fieldsType": "FieldsV1",
                        "operation": "Apply",
                        "apiVersion": "apps/v1",
                        "manager": "foo",
                    }
                ],
            ),
        ),
        [],
    ),
    Case(
        "good-labels",
        changed(good(), lambda o: _set(_meta(o), labels={"apps.kubernetes.io/name": "test"})),
        [],
    ),
    Case(
        "bad-labels",
        changed(good(), lambda o: _set(_meta(o), labels={"hello-world": BAD_VALUE})),
        [("metadata.labels", INVALID)],
    ),
    Case(
        "good-annotations",
        changed(good(), lambda o: _set(_meta(o), annotations={"foo": "bar"})),
        [],
    ),
    Case(
        "bad-annotations",
        changed(good(), lambda o: _set(_meta(o), annotations={BAD: "hello world"})),
        [("metadata.annotations", INVALID)],
    ),
    Case(
        "bad-nodename",
        resource_slice(GOOD, BAD, DRIVER, 1),
        [("spec.pool.name", INVALID), ("spec.nodeName", INVALID)],
    ),
    Case(
        "bad-multi-pool-name",
        resource_slice(GOOD, f"{BAD}/{BAD}", DRIVER, 1),
        [("spec.pool.name", INVALID), ("spec.pool.name", INVALID), ("spec.nodeName", INVALID)],
    ),
    Case(
        "good-pool-name",
        changed(good(), lambda o: _set(_spec(o)["pool"], name="x" * POOL_NAME_MAX)),
        [],
    ),
    Case(
        "bad-pool",
        changed(
            good(),
            lambda o: _set(
                _spec(o)["pool"],
                name="x/" * (POOL_NAME_MAX // 2) + "xy",
                resourceSliceCount=0,
                generation=-1,
            ),
        ),
        [
            ("spec.pool.name", TOO_LONG),
            ("spec.pool.resourceSliceCount", INVALID),
            ("spec.pool.generation", INVALID),
        ],
    ),
    Case(
        "missing-pool-name",
        changed(good(), lambda o: _set(_spec(o)["pool"], name="")),
        [("spec.pool.name", REQUIRED)],
    ),
    Case(
        "bad-node-selection",
        changed(good(), lambda o: _set(_spec(o), nodeName="worker", nodeSelector=_MATCH_WORKER)),
        [("spec", INVALID)],
    ),
    Case(
        "bad-node-selection-all-nodes",
        changed(good(), lambda o: _set(_spec(o), nodeName="worker", allNodes=True)),
        [("spec", INVALID)],
    ),
    Case(
        "empty-node-selection",
        changed(good(), lambda o: _drop(_spec(o), "nodeName")),
        [("spec", REQUIRED)],
    ),
    Case("bad-drivername", resource_slice(GOOD, GOOD, BAD, 1), [("spec.driver", INVALID)]),
    Case(
        "both-shared-counters-and-devices",
        changed(
            good(),
            lambda o: _set(
                _spec(o), sharedCounters=[{"name": "counterset", "counters": default_counters()}]
            ),
        ),
        [("spec", INVALID)],
    ),
    Case(
        "bad-devices",
        changed(good(3, GOOD), lambda o: _set(_devices(o)[1], name=BAD)),
        [(f"{D}[1].name", INVALID)],
    ),
    Case(
        "bad-attribute",
        changed(good(5, GOOD), _bad_attributes),
        [
            (f"{D}[1].attributes", INVALID),
            (f"{D}[1].attributes[{BAD}]", INVALID),
            (f"{D}[2].attributes[{GOOD}]", INVALID),
            (f"{D}[3].attributes[{GOOD}].version", INVALID),
            (f"{D}[3].attributes[{GOOD}].version", TOO_LONG),
            (f"{D}[4].attributes[{GOOD}].string", TOO_LONG),
        ],
    ),
    Case(
        "good-attribute-names",
        changed(
            good(2, GOOD),
            lambda o: _attrs(
                o,
                1,
                {
                    "x" * MAX_ID: {"string": "y"},
                    "x" * MAX_DOMAIN + "/" + "y" * MAX_ID: {"string": "z"},
                },
            ),
        ),
        [],
    ),
    Case(
        "bad-attribute-c-identifier",
        changed(good(2, GOOD), lambda o: _attrs(o, 1, {"." * (MAX_ID + 1): {"string": "y"}})),
        [(f"{D}[1].attributes", TOO_LONG), (f"{D}[1].attributes", INVALID)],
    ),
    Case(
        "bad-attribute-domain",
        changed(
            good(2, GOOD), lambda o: _attrs(o, 1, {"_" * (MAX_DOMAIN + 1) + "/y": {"string": "z"}})
        ),
        [(f"{D}[1].attributes", TOO_LONG), (f"{D}[1].attributes", INVALID)],
    ),
    Case(
        "bad-key-too-long",
        changed(
            good(2, GOOD),
            lambda o: _attrs(
                o, 1, {"x" * (MAX_DOMAIN + 1) + "/" + "y" * (MAX_ID + 1): {"string": "z"}}
            ),
        ),
        [(f"{D}[1].attributes", TOO_LONG), (f"{D}[1].attributes", TOO_LONG)],
    ),
    Case(
        "bad-attribute-empty-domain-and-c-identifier",
        changed(good(2, GOOD), lambda o: _attrs(o, 1, {"/": {"string": "z"}})),
        [(f"{D}[1].attributes", INVALID), (f"{D}[1].attributes", INVALID)],
    ),
    Case(
        "combined-attributes-capacity-length",
        changed(good(5, GOOD), _combined),
        [(f"{D}[3]", INVALID)],
    ),
    Case(
        "taints",
        changed(good(3, GOOD), _taints),
        [
            (f"{D}[0].taints[2].key", INVALID),
            (f"{D}[0].taints[2].key", INVALID),
            (f"{D}[0].taints[2].effect", REQUIRED),
            (f"{D}[0].taints[3].key", INVALID),
            (f"{D}[0].taints[3].value", INVALID),
            (f"{D}[0].taints[3].effect", NOT_SUPPORTED),
        ],
    ),
    Case(
        # 17: past DeviceTaintsMaxLength of 1.35+ (16) and of 1.34 (4) alike.
        "too-many-taints",
        changed(good(), lambda o: _set(_devices(o)[0], taints=[_taint()] * 17)),
        [(f"{D}[0].taints", TOO_MANY)],
    ),
    Case(
        "bad-PerDeviceNodeSelection",
        changed(good(), lambda o: _set(_spec(o), nodeName="worker", perDeviceNodeSelection=True)),
        [("spec", INVALID), (f"{D}[0]", REQUIRED)],
    ),
    Case(
        "invalid-false-PerDeviceNodeSelection",
        changed(good(), lambda o: _set(_spec(o), nodeName="worker", perDeviceNodeSelection=False)),
        [("spec.perDeviceNodeSelection", INVALID)],
    ),
    Case(
        "invalid-false-AllNodes",
        changed(good(), lambda o: _set(_spec(o), nodeName="worker", allNodes=False)),
        [("spec.allNodes", INVALID)],
    ),
    Case(
        "invalid-empty-NodeName",
        changed(good(), lambda o: _set(_spec(o), nodeName="", allNodes=True)),
        [("spec.nodeName", INVALID)],
    ),
    Case(
        "invalid-node-selector-in-basicdevice",
        changed(good(), _per_device_bad),
        [(f"{D}[0].nodeName", INVALID), (f"{D}[0].allNodes", INVALID), (f"{D}[0]", REQUIRED)],
    ),
    Case(
        "bad-node-selector-in-basicdevice",
        changed(good(), _per_device_two),
        [(f"{D}[0]", INVALID)],
    ),
    Case(
        "missing-name-shared-counters",
        changed(with_shared_counters(1), lambda o: _drop(_spec(o)["sharedCounters"][0], "name")),
        [("spec.sharedCounters[0].name", REQUIRED)],
    ),
    Case(
        "bad-name-shared-counters",
        changed(with_shared_counters(1), lambda o: _set(_spec(o)["sharedCounters"][0], name=BAD)),
        [("spec.sharedCounters[0].name", INVALID)],
    ),
    Case(
        "missing-counter-shared-counters",
        changed(
            with_shared_counters(1),
            lambda o: _set(_spec(o), sharedCounters=[{"name": GOOD}]),
        ),
        [("spec.sharedCounters[0].counters", REQUIRED)],
    ),
    Case(
        "bad-countername-shared-counters",
        changed(
            with_shared_counters(1),
            lambda o: _set(
                _spec(o), sharedCounters=[{"name": GOOD, "counters": {BAD: {"value": "1Gi"}}}]
            ),
        ),
        [("spec.sharedCounters[0].counters", INVALID)],
    ),
    Case(
        "duplicate-shared-counters",
        changed(
            with_shared_counters(1),
            lambda o: _set(
                _spec(o),
                sharedCounters=[{"name": GOOD, "counters": default_counters()}] * 2,
            ),
        ),
        [("spec.sharedCounters[1]", DUPLICATE)],
    ),
    Case("max-shared-counters", with_shared_counters(MAX_COUNTER_SETS), []),
    Case(
        "too-many-shared-counters",
        with_shared_counters(MAX_COUNTER_SETS + 1),
        [("spec.sharedCounters", TOO_MANY)],
    ),
    Case(
        "missing-name-counterset-consumes-counter",
        changed(
            good(),
            lambda o: _set(_devices(o)[0], consumesCounters=[{"counters": default_counters()}]),
        ),
        [(f"{D}[0].consumesCounters[0].counterSet", REQUIRED)],
    ),
    Case(
        "bad-name-counterset-consumes-counter",
        changed(
            good(),
            lambda o: _set(
                _devices(o)[0],
                consumesCounters=[{"counterSet": BAD, "counters": default_counters()}],
            ),
        ),
        [(f"{D}[0].consumesCounters[0].counterSet", INVALID)],
    ),
    Case(
        "duplicate-counterset-consumes-counter",
        changed(
            good(),
            lambda o: _set(
                _devices(o)[0],
                consumesCounters=[{"counterSet": GOOD, "counters": default_counters()}] * 2,
            ),
        ),
        [(f"{D}[0].consumesCounters[1]", DUPLICATE)],
    ),
    Case(
        "missing-counter-consumes-counter",
        changed(
            good(),
            lambda o: _set(_devices(o)[0], consumesCounters=[{"counterSet": "counterset-0"}]),
        ),
        [(f"{D}[0].consumesCounters[0].counters", REQUIRED)],
    ),
]


@dataclass(frozen=True)
class UpdateCase:
    name: str
    old: JsonObject
    new: JsonObject
    errors: Errors


_VALID = resource_slice("valid", "valid", "valid", 1)

UPDATE_CASES: list[UpdateCase] = [
    UpdateCase("valid-no-op-update", _VALID, _VALID, []),
    UpdateCase(
        "invalid-name-update",
        _VALID,
        changed(_VALID, lambda o: _set(_meta(o), name="valid-update")),
        [("metadata.name", INVALID)],
    ),
    UpdateCase(
        "invalid-update-nodename",
        _VALID,
        changed(_VALID, lambda o: _set(_spec(o), nodeName="valid-updated")),
        [("spec.nodeName", INVALID)],
    ),
    UpdateCase(
        "invalid-update-drivername",
        _VALID,
        changed(_VALID, lambda o: _set(_spec(o), driver="valid-updated")),
        [("spec.driver", INVALID)],
    ),
    UpdateCase(
        "invalid-update-pool",
        _VALID,
        changed(_VALID, lambda o: _set(_spec(o)["pool"], name="valid-updated")),
        [("spec.pool.name", INVALID)],
    ),
]
