"""The semantic validator refuses what the API server refuses, at the field the API server
names, and accepts the valid fixtures the official schemas accept too."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from dra_schemas import all_schema_errors

from devplug.dra.field_errors import FieldError
from devplug.dra.validate import validate_resource_slice, validate_resource_slice_update


def device(name: str = "gpu-0", **attributes: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "attributes": attributes or {"model": {"string": "A770"}}}


def resource_slice(devices: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "driver": "gpu.example.com",
        "pool": {"name": "node1", "generation": 1, "resourceSliceCount": 1},
        "nodeName": "node1",
    }
    body.update(spec)
    if devices is not None:
        body["devices"] = devices
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node1-gpu.example.com-0"},
        "spec": {k: v for k, v in body.items() if v is not None},
    }


def fields(errors: list[FieldError]) -> list[tuple[str, str]]:
    return [(e.field, e.reason) for e in errors]


def test_dra_valid_fixture_passes_the_validator_and_every_schema() -> None:
    good = resource_slice(
        [
            device(
                "gpu-0",
                model={"string": "x" * 64},
                numaNode={"int": 2**63 - 1},
                sriov={"bool": False},
                driverVersion={"version": "1.2.3-rc.1+build.5"},
                **{"resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"}},
            ),
            device("gpu-1", multibyte={"string": "é" * 32}),  # 64 bytes
        ]
    )
    assert validate_resource_slice(good) == []
    assert all_schema_errors(good) == {}
    assert validate_resource_slice(resource_slice()) == []  # the empty pool's slice


def test_dra_129_devices_are_too_many_and_nothing_else_is_checked() -> None:
    bad = resource_slice([device(f"gpu-{i}") for i in range(128)] + [device("Not_A_Label")])
    errors = validate_resource_slice(bad)
    assert fields(errors) == [("spec.devices", "FieldValueTooMany")]
    assert errors[0].message == "Too many: 129: must have at most 128 items"
    assert validate_resource_slice(resource_slice([device(f"gpu-{i}") for i in range(128)])) == []
    assert all_schema_errors(bad) == {}  # what only the semantic check catches


def test_dra_64_devices_once_a_device_has_a_taint() -> None:
    devices = [device(f"gpu-{i}") for i in range(65)]
    devices[7]["taints"] = [{"key": "example.com/broken", "effect": "NoSchedule"}]
    errors = validate_resource_slice(resource_slice(devices))
    assert fields(errors) == [("spec.devices", "FieldValueTooMany")]
    assert "at most 64 items" in errors[0].message


def test_dra_33_attributes_are_refused_on_the_device() -> None:
    bad = resource_slice([device("gpu-0", **{f"a{i}": {"int": i} for i in range(33)})])
    errors = validate_resource_slice(bad)
    assert fields(errors) == [("spec.devices[0]", "FieldValueInvalid")]
    assert errors[0].message == (
        "Invalid value: 33: the total number of attributes and capacities must not exceed 32"
    )
    ok = resource_slice([device("gpu-0", **{f"a{i}": {"int": i} for i in range(32)})])
    assert validate_resource_slice(ok) == []
    with_capacity = copy.deepcopy(ok)
    with_capacity["spec"]["devices"][0]["capacity"] = {"memory": {"value": "16Gi"}}
    assert fields(validate_resource_slice(with_capacity)) == [
        ("spec.devices[0]", "FieldValueInvalid")
    ]


@pytest.mark.parametrize(
    ("value", "kind"),
    [("x" * 65, "string"), ("é" * 33, "string"), ("1.2.3-" + "a" * 59, "version")],
)
def test_dra_string_and_version_values_over_64_bytes(value: str, kind: str) -> None:
    errors = validate_resource_slice(resource_slice([device("gpu-0", model={kind: value})]))
    assert fields(errors) == [(f"spec.devices[0].attributes[model].{kind}", "FieldValueTooLong")]
    assert errors[0].message == "Too long: may not be more than 64 bytes"


@pytest.mark.parametrize("name", ["Card_0.UPPER", "gpu.0", "-gpu", "gpu-", "", "g" * 64])
def test_dra_device_names_must_be_dns_labels(name: str) -> None:
    errors = validate_resource_slice(resource_slice([device(name)]))
    assert errors and {e.field for e in errors} == {"spec.devices[0].name"}
    assert {e.reason for e in errors} == {"FieldValueInvalid"}


def test_dra_duplicate_device_names_name_the_later_entry() -> None:
    errors = validate_resource_slice(resource_slice([device("a"), device("b"), device("a")]))
    assert fields(errors) == [("spec.devices[2]", "FieldValueDuplicate")]
    assert errors[0].message == 'Duplicate value: "a"'


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"allNodes": True}, "FieldValueInvalid"),  # with nodeName
        ({"nodeSelector": {"nodeSelectorTerms": [{}]}}, "FieldValueInvalid"),
        ({"perDeviceNodeSelection": True}, "FieldValueInvalid"),
        ({"nodeName": None}, "FieldValueRequired"),  # none at all
    ],
)
def test_dra_exactly_one_node_selection(spec: dict[str, Any], reason: str) -> None:
    errors = validate_resource_slice(resource_slice(**spec))
    assert ("spec", reason) in fields(errors), errors
    assert "exactly one of `nodeName`, `nodeSelector`, `allNodes`" in str(errors)


def test_dra_node_name_and_all_nodes_together_name_both() -> None:
    errors = validate_resource_slice(resource_slice(allNodes=True))
    assert fields(errors) == [("spec", "FieldValueInvalid")]
    assert errors[0].message.startswith('Invalid value: "{`nodeName`, `allNodes`}": exactly one')


def test_dra_false_flags_and_empty_node_name() -> None:
    errors = validate_resource_slice(resource_slice(nodeName="", allNodes=False))
    assert ("spec.nodeName", "FieldValueInvalid") in fields(errors)
    assert ("spec.allNodes", "FieldValueInvalid") in fields(errors)
    assert ("spec", "FieldValueRequired") in fields(errors)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("a" * 33, "FieldValueTooLong"),
        ("9lives", "FieldValueInvalid"),
        ("has-dash", "FieldValueInvalid"),
        ("/model", "FieldValueInvalid"),  # the domain must not be empty
        ("example.com/", "FieldValueInvalid"),
        ("Bad_Domain!/model", "FieldValueInvalid"),
        ("d" * 64 + "/model", "FieldValueTooLong"),
        # validation.go@009801d validateQualifiedName; its TODO about such names is older.
        ("example.com/a/b", "FieldValueInvalid"),
    ],
)
def test_dra_attribute_names(name: str, reason: str) -> None:
    errors = validate_resource_slice(resource_slice([device("gpu-0", **{name: {"int": 1}})]))
    # A map key's problems are reported at the map (validateMap), with the key as the value.
    assert ("spec.devices[0].attributes", reason) in fields(errors), errors
    assert all(error.field == "spec.devices[0].attributes" for error in errors), errors


@pytest.mark.parametrize(
    "name", ["model", "_x", "a" * 32, "gpu.example.com/model", "resource.kubernetes.io/pcieRoot"]
)
def test_dra_valid_attribute_names(name: str) -> None:
    assert validate_resource_slice(resource_slice([device("gpu-0", **{name: {"int": 1}})])) == []


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({}, "spec.devices[0].attributes[a]"),
        ({"int": 1, "bool": True}, "spec.devices[0].attributes[a]"),
        ({"version": "1.2"}, "spec.devices[0].attributes[a].version"),
        ({"version": "01.2.3"}, "spec.devices[0].attributes[a].version"),
        ({"int": 2**63}, "spec.devices[0].attributes[a].int"),
        ({"int": True}, "spec.devices[0].attributes[a].int"),
        ({"ints": [1, 2]}, "spec.devices[0].attributes[a].ints"),  # 1.36+, not in 1.34's v1
    ],
)
def test_dra_attribute_values(value: dict[str, Any], field: str) -> None:
    errors = validate_resource_slice(resource_slice([device("gpu-0", a=value)]))
    assert field in {e.field for e in errors}, errors


@pytest.mark.parametrize(
    ("driver", "reason"),
    [
        ("d" * 64, "FieldValueTooLong"),
        ("gpu_example.com", "FieldValueInvalid"),
        ("", "FieldValueRequired"),
    ],
)
def test_dra_driver_names(driver: str, reason: str) -> None:
    assert ("spec.driver", reason) in fields(validate_resource_slice(resource_slice(driver=driver)))


def test_dra_driver_name_is_checked_lower_cased_as_upstream_does() -> None:
    assert validate_resource_slice(resource_slice(driver="GPU.Example.com")) == []


@pytest.mark.parametrize(
    ("pool", "field"),
    [
        ({"name": "Node1", "generation": 0, "resourceSliceCount": 1}, "spec.pool.name"),
        ({"name": "a/b_c", "generation": 0, "resourceSliceCount": 1}, "spec.pool.name"),
        ({"name": "n" * 254, "generation": 0, "resourceSliceCount": 1}, "spec.pool.name"),
        (
            {"name": "node1", "generation": 0, "resourceSliceCount": 0},
            "spec.pool.resourceSliceCount",
        ),
        ({"name": "node1", "generation": -1, "resourceSliceCount": 1}, "spec.pool.generation"),
    ],
)
def test_dra_pool(pool: dict[str, Any], field: str) -> None:
    assert field in {e.field for e in validate_resource_slice(resource_slice(pool=pool))}


def test_dra_pool_names_may_be_subdomains_joined_by_slashes() -> None:
    pool = {"name": "cluster.example/rack-1", "generation": 0, "resourceSliceCount": 1}
    assert validate_resource_slice(resource_slice(pool=pool)) == []


def test_dra_devices_and_shared_counters_never_together() -> None:
    both = resource_slice(
        [device()], sharedCounters=[{"name": "mem", "counters": {"gb": {"value": "1"}}}]
    )
    assert ("spec", "FieldValueInvalid") in fields(validate_resource_slice(both))


def test_dra_metadata() -> None:
    nameless = resource_slice()
    del nameless["metadata"]["name"]
    assert fields(validate_resource_slice(nameless)) == [("metadata.name", "FieldValueRequired")]
    nameless["metadata"]["generateName"] = "node1-gpu.example.com-"
    assert validate_resource_slice(nameless) == []
    namespaced = resource_slice()
    namespaced["metadata"]["namespace"] = "default"
    assert fields(validate_resource_slice(namespaced)) == [
        ("metadata.namespace", "FieldValueForbidden")
    ]
    badly_named = resource_slice()
    badly_named["metadata"]["name"] = "Node1_GPU"
    assert fields(validate_resource_slice(badly_named)) == [("metadata.name", "FieldValueInvalid")]


def test_dra_update_keeps_driver_pool_and_node() -> None:
    old = resource_slice([device()])
    assert validate_resource_slice_update(copy.deepcopy(old), old) == []
    for path, value in [("driver", "other.example.com"), ("nodeName", "node2")]:
        new = copy.deepcopy(old)
        new["spec"][path] = value
        assert fields(validate_resource_slice_update(new, old)) == [
            (f"spec.{path}", "FieldValueInvalid")
        ]
        assert "field is immutable" in validate_resource_slice_update(new, old)[0].message
    renamed = copy.deepcopy(old)
    renamed["spec"]["pool"]["name"] = "node2"
    assert ("spec.pool.name", "FieldValueInvalid") in fields(
        validate_resource_slice_update(renamed, old)
    )


def test_dra_wrong_types_are_errors_not_exceptions() -> None:
    junks: list[Any] = [
        None,
        [],
        "x",
        1,
        {"spec": []},
        {"spec": {"devices": {}}},
        {"spec": {"pool": 3}},
    ]
    for junk in junks:
        errors = validate_resource_slice(junk)
        assert errors and all(isinstance(e, FieldError) for e in errors)
    errors = validate_resource_slice(resource_slice([device("gpu-0", a={"string": 5})]))
    assert fields(errors) == [("spec.devices[0].attributes[a].string", "FieldValueTypeInvalid")]


def test_dra_errors_read_like_status_causes() -> None:
    error = validate_resource_slice(resource_slice([device("Bad")]))[0]
    assert error.cause() == {
        "reason": "FieldValueInvalid",
        "message": error.message,
        "field": "spec.devices[0].name",
    }
    assert error.message.startswith('Invalid value: "Bad": a lowercase RFC 1123 label')
    assert str(error) == f"spec.devices[0].name: {error.message}"
