"""``devplug dra deviceclasses``: one ``resource.k8s.io/v1`` DeviceClass per DRA resource, valid
under the strict official schemas of Kubernetes 1.34 to 1.37, whose selector finds exactly
that resource's devices in the slices devplug publishes, under a stable DNS-subdomain name;
a config without DRA resources is one line on stderr and exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from devplug.cli.dra import device_class_name, device_classes
from devplug.dra.slices import build_pool
from devplug.model import DeviceInfo
from devplug.naming import DNS1123_SUBDOMAIN, resource_name_problem

VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")
DRIVER = "gpu.intel.com"
RESOURCES = ("gpu.intel.com/i915", "gpu.intel.com/xe", "example.com/Big_GPU")


def write_config(path: Path, dra: Mapping[str, Any] | None) -> Path:
    """A config whose generic entries produce every DRA resource (so that no check of the
    ``dra`` section can refuse one as unknown), plus ``dra`` when given."""
    resources = list(dra["resources"]) if dra else list(RESOURCES)
    document: dict[str, Any] = {
        "scanners": {
            "generic": [
                {"resource": resource, "match": {"subsystem": f"none{index}"}}
                for index, resource in enumerate(resources)
            ]
        }
    }
    if dra is not None:
        document["dra"] = dict(dra)
    path.write_text(yaml.safe_dump(document))
    return path


def dra_section(*resources: str) -> dict[str, Any]:
    return {"driver": DRIVER, "resources": list(resources), "kubelet_root": "/var/lib/kubelet"}


def devplug(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEVPLUG_")}
    return subprocess.run(
        [sys.executable, "-m", "devplug", *args],
        capture_output=True,
        text=True,
        env={**environ, **(env or {})},
        timeout=60,
        check=False,
    )


def printed_classes(config: Path, *flags: str) -> list[dict[str, Any]]:
    result = devplug("dra", "deviceclasses", "--config", str(config), *flags)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return [document for document in yaml.safe_load_all(result.stdout) if document is not None]


# ------------------------------------------------------------------------ the documents


def test_one_class_per_dra_resource_valid_under_every_schema(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", dra_section(*RESOURCES))
    classes = printed_classes(config)
    assert [c["spec"]["extendedResourceName"] for c in classes] == list(RESOURCES)
    assert [c["metadata"]["name"] for c in classes] == [device_class_name(r) for r in RESOURCES]
    for document in classes:
        assert (document["apiVersion"], document["kind"]) == ("resource.k8s.io/v1", "DeviceClass")
        for version in VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_the_strict_schemas_bite_on_a_deviceclass() -> None:
    """The control for the test above: a misspelt field fails every version's schema."""
    (document,) = device_classes(DRIVER, [RESOURCES[0]])
    document["spec"]["extendedResource"] = document["spec"].pop("extendedResourceName")
    for version in VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(document, version, strict=True)


def test_json_is_one_v1_list_of_the_same_classes(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", dra_section(*RESOURCES))
    result = devplug("dra", "deviceclasses", "--config", str(config), "-o", "json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert (listing["apiVersion"], listing["kind"]) == ("v1", "List")
    assert listing["items"] == printed_classes(config)


def test_flags_before_the_command_and_the_config_from_the_environment(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", dra_section(RESOURCES[0]))
    expected = printed_classes(config)
    hoisted = devplug("--config", str(config), "dra", "deviceclasses", "-o", "json")
    assert hoisted.returncode == 0, hoisted.stderr
    assert json.loads(hoisted.stdout)["items"] == expected
    from_env = devplug("dra", "deviceclasses", env={"DEVPLUG_CONFIG": str(config)})
    assert from_env.returncode == 0, from_env.stderr
    assert list(yaml.safe_load_all(from_env.stdout)) == expected


# ------------------------------------------------------------------------ the selector

# The one shape of selector devplug prints; read as Kubernetes' CEL environment reads it.
SELECTOR = re.compile(
    r"device\.driver == '(?P<driver>[^']+)' && "
    r"device\.attributes\['(?P<domain>[^']+)'\]\.(?P<attribute>\w+) == '(?P<value>[^']+)'"
)


def selects(expression: str, driver: str, device: Mapping[str, Any]) -> bool:
    """Whether ``expression`` selects ``device`` of ``driver``'s slice. Kubernetes gives CEL
    ``device.attributes[domain].name`` from the attribute ``domain/name``, or from the bare
    ``name`` when ``domain`` is the driver's (resource.k8s.io/v1 DeviceSelector doc)."""
    match = SELECTOR.fullmatch(expression)
    assert match is not None, expression
    if driver != match["driver"]:
        return False  # && stops here: the attribute is never looked up
    attributes = device.get("attributes", {})
    qualified = f"{match['domain']}/{match['attribute']}"
    value = attributes.get(qualified)
    if value is None and match["domain"] == driver:
        value = attributes.get(match["attribute"])
    assert value is not None, f"no such key: {qualified} in {sorted(attributes)}"
    return bool(value.get("string") == match["value"])


def test_each_class_selects_its_resources_devices_and_no_others() -> None:
    # Two devices per resource (ids are unique across a node's resources, as device names are).
    tree = {
        r: {f"0000:{n:02x}:0{k}.0": DeviceInfo() for k in (0, 1)} for n, r in enumerate(RESOURCES)
    }
    pool = build_pool(tree, node_name="node-1", driver=DRIVER, generation=1)
    # Another DRA driver's devices, with a 'resource' attribute of its own domain.
    foreign = build_pool(tree, node_name="node-1", driver="gpu.example.com", generation=1)
    for device_class in device_classes(DRIVER, RESOURCES):
        (cel,) = [s["cel"]["expression"] for s in device_class["spec"]["selectors"]]
        resource = device_class["spec"]["extendedResourceName"]
        chosen = {
            device["name"]
            for slice_ in pool.slices
            for device in slice_["spec"]["devices"]
            if selects(cel, slice_["spec"]["driver"], device)
        }
        wanted = {name for name, d in pool.devices.items() if d.resource == resource}
        assert chosen == wanted and len(wanted) == 2, (resource, chosen)
        for slice_ in foreign.slices:
            assert not any(
                selects(cel, slice_["spec"]["driver"], d) for d in slice_["spec"]["devices"]
            )


# ------------------------------------------------------------------------ class names


@pytest.mark.parametrize(
    ("resource", "name"),
    [
        ("gpu.intel.com/i915", "i915.gpu.intel.com"),
        ("gpu.intel.com/xe", "xe.gpu.intel.com"),
        ("devplug.io/serial", "serial.devplug.io"),
        # Rule 2: not a DNS label (case, '_', '.'), or the shape of a rule-2 label.
        ("example.com/Big_GPU", "big-gpu-{hash}.example.com"),
        ("intel.com/i915.gpu", "i915-gpu-{hash}.intel.com"),
        ("example.com/x-0123456789", "x-0123456789-{hash}.example.com"),
    ],
)
def test_class_names(resource: str, name: str) -> None:
    from devplug.dra.naming import id_hash

    assert device_class_name(resource) == name.format(hash=id_hash(resource))


def test_two_resources_that_read_alike_get_two_names() -> None:
    # gpu.intel.com/i915 -> i915.gpu.intel.com; intel.com/i915.gpu must not get it too.
    assert device_class_name("intel.com/i915.gpu") != device_class_name("gpu.intel.com/i915")
    assert device_class_name("example.com/GPU") != device_class_name("example.com/gpu")
    assert device_class_name("example.com/a_b") != device_class_name("example.com/a-b")


_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
_domains = st.lists(_LABEL, min_size=1, max_size=12).map(".".join)
_long_domains = st.lists(st.just("d" * 60), min_size=3, max_size=4).map(".".join)
_names = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", fullmatch=True)
resources = st.builds(lambda d, n: f"{d}/{n}", _domains | _long_domains, _names).filter(
    lambda r: resource_name_problem(r) is None
)


@settings(max_examples=300, deadline=None)
@given(st.lists(resources, min_size=1, max_size=20, unique=True))
def test_every_class_name_is_a_dns_subdomain_and_each_resource_has_its_own(
    names: list[str],
) -> None:
    classes = [device_class_name(resource) for resource in names]
    for name in classes:
        assert len(name) <= 253 and DNS1123_SUBDOMAIN.match(name), name
        assert all(len(label) <= 63 for label in name.split(".")), name
    assert len(set(classes)) == len(names)
    assert classes == [device_class_name(resource) for resource in names]  # deterministic


# ------------------------------------------------------------------------ refusals


def test_a_config_without_a_dra_section_is_one_line_and_status_2(tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", None)
    result = devplug("dra", "deviceclasses", "--config", str(config))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "dra" in result.stderr, result.stderr


def test_no_config_at_all_is_one_line_and_status_2() -> None:
    result = devplug("dra", "deviceclasses")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "dra" in result.stderr, result.stderr


def test_a_resource_too_long_for_the_resource_attribute_is_refused(tmp_path: Path) -> None:
    """No selector could find devices whose 'resource' attribute could not be published."""
    long = "example.com/" + "r" * 60  # 72 bytes: an attribute value holds at most 64
    config = write_config(tmp_path / "config.yaml", dra_section(RESOURCES[0], long))
    result = devplug("dra", "deviceclasses", "--config", str(config))
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "dra.resources" in result.stderr and "64" in result.stderr, result.stderr
