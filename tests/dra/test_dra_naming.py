"""DRA names: device names are valid, stable, readable where they can be, and collision-safe;
pool, driver and slice names follow the API's rules."""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplug.dra.naming import (
    device_name,
    driver_name_problem,
    id_hash,
    pool_name,
    slice_name,
    validate_driver_name,
)
from devplug.dra.validate import validate_resource_slice
from devplug.dra.validate_device import device_name_errors
from devplug.errors import InvalidNameError

LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# Ids of every shape the rules tell apart, several of which sanitise to the same text.
CONFUSABLE = [
    "gpu0",
    "gpu-0",
    "gpu_0",
    "gpu.0",
    "gpu:0",
    "GPU-0",
    "Gpu_0",
    "gpu--0",
    "-gpu-0",
    "0000:03:00.0",
    "0000:03:00.0-1",
    "0000:03:00.0-01",
    "0000-03-00-0",
    "0000-03-00-0-1",
    "0000_03_00_0",
    "00000:03:00.0",
    "0000:03:00.0-1234567",
    "deadbeef00",
    "gpu-deadbeef00",
    "x" * 63,
    "x" * 64,
    "x" * 52 + "-" + "y" * 10,
    "Ünïcode-gpu",
    "unicode-gpu",
    "",
    "-",
    ":::",
]

pci_ids = st.builds(
    lambda domain, bus, dev, fn, share: (
        f"{domain:0{max(4, len(f'{domain:x}'))}x}:{bus:02x}:{dev:02x}.{fn}"
        + ("" if share is None else f"-{share}")
    ),
    st.integers(0, 0x1FFFF),
    st.integers(0, 255),
    st.integers(0, 31),
    st.integers(0, 7),
    st.none() | st.integers(0, 99),
)
ids = st.one_of(
    st.sampled_from(CONFUSABLE),
    pci_ids,
    st.text(alphabet=string.ascii_letters + string.digits + "_.:-", max_size=80),
    st.text(max_size=80),  # any unicode, lone surrogates included
)


@given(ids)
def test_dra_device_names_are_always_valid_dns_labels(device_id: str) -> None:
    name = device_name(device_id)
    assert LABEL.fullmatch(name) and len(name) <= 63, (device_id, name)
    assert device_name_errors(name, "spec.devices[0].name") == []


@given(st.lists(ids, unique=True, min_size=2, max_size=40))
def test_dra_distinct_ids_get_distinct_names(device_ids: list[str]) -> None:
    names = [device_name(i) for i in device_ids]
    assert len(set(names)) == len(names), dict(zip(device_ids, names, strict=True))


def test_dra_confusable_ids_get_distinct_names() -> None:
    names = {i: device_name(i) for i in CONFUSABLE}
    assert len(set(names.values())) == len(CONFUSABLE), names


@given(ids)
def test_dra_device_name_is_a_function_of_the_id_alone(device_id: str) -> None:
    # Names are computed per id; other ids computed before or after change nothing.
    before = device_name(device_id)
    for other in CONFUSABLE:
        device_name(other)
    assert device_name(device_id) == before == device_name(str(device_id))


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        ("gpu0", "gpu0"),  # already a label: itself
        ("renderd128", "renderd128"),
        ("0000:03:00.0", "0000-03-00-0"),  # a PCI address: readable, one-to-one
        ("0000:03:00.0-1", "0000-03-00-0-1"),  # an Intel share
        ("10000:e1:1f.7", "10000-e1-1f-7"),
    ],
)
def test_dra_readable_names_where_nothing_is_lost(device_id: str, expected: str) -> None:
    assert device_name(device_id) == expected


@pytest.mark.parametrize(
    "device_id",
    [
        "GPU0",  # case lost
        "gpu_0",  # '_' lost
        "card.0",
        "0000-03-00-0",  # shaped like a PCI name: would meet 0000:03:00.0's
        "gpu-deadbeef00",  # shaped like a hashed name
        "deadbeef00",
        "x" * 64,  # too long for a label
        "0000:03:00.0-1234567",  # a share suffix past six digits is not the PCI shape
    ],
)
def test_dra_lossy_ids_carry_the_hash_of_the_raw_id(device_id: str) -> None:
    name = device_name(device_id)
    assert name.endswith(id_hash(device_id)), name
    assert name != device_id


def test_dra_hashed_names_keep_a_readable_prefix() -> None:
    assert device_name("GPU_0") == f"gpu-0-{id_hash('GPU_0')}"
    long_id = "Serial" + "7" * 70
    name = device_name(long_id)
    assert len(name) == 63 and name.startswith("serial777") and name.endswith(id_hash(long_id))


def test_dra_pool_is_named_after_a_valid_node_name() -> None:
    assert pool_name("node-1.example.com") == "node-1.example.com"
    for bad in ("", "Node1", "node_1", "a" * 254, "node1."):
        with pytest.raises(InvalidNameError, match="invalid node name"):
            pool_name(bad)


def test_dra_driver_name_check() -> None:
    assert validate_driver_name("gpu.intel.com") == "gpu.intel.com"
    assert driver_name_problem("a" * 63) is None
    assert "at most 63" in (driver_name_problem("a" * 64) or "")
    assert "must not be empty" in (driver_name_problem("") or "")
    # The API server would take upper case (it lower-cases first); devplug asks for the
    # documented lower-case form, compared exactly by DeviceClass CEL and the kubelet.
    for bad in ("GPU.intel.com", "gpu_intel.com", "gpu.intel.com.", "-gpu.com", "gpu/intel"):
        assert driver_name_problem(bad) is not None, bad
        with pytest.raises(InvalidNameError, match="DNS subdomain"):
            validate_driver_name(bad)


@settings(max_examples=200)
@given(
    st.from_regex(SUBDOMAIN, fullmatch=True).filter(lambda n: len(n) <= 253),
    st.from_regex(SUBDOMAIN, fullmatch=True).filter(lambda n: len(n) <= 63),
    st.integers(0, 10_000),
)
def test_dra_slice_names_are_valid_deterministic_and_distinct(
    node: str, driver: str, index: int
) -> None:
    name = slice_name(node, driver, index)
    assert SUBDOMAIN.fullmatch(name) and len(name) <= 253, name
    assert slice_name(node, driver, index) == name
    assert slice_name(node, driver, index + 1) != name
    meta_only = {"metadata": {"name": name}, "spec": {}}
    assert not [e for e in validate_resource_slice(meta_only) if e.field == "metadata.name"]


def test_dra_long_slice_names_are_cut_with_a_hash_of_the_whole() -> None:
    node_a = "n" * 200 + ".a" + "x" * 40
    node_b = "n" * 200 + ".a" + "y" * 40
    driver = "d" * 63
    a, b = slice_name(node_a, driver, 0), slice_name(node_b, driver, 0)
    assert len(a) <= 253 and len(b) <= 253 and a != b
    assert slice_name("node1", "gpu.intel.com", 2) == "node1-gpu.intel.com-2"
