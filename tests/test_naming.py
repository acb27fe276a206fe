from __future__ import annotations

import pytest

from devplug.errors import CdiSpecError, InvalidNameError
from devplug.naming import (
    MAX_DEVICE_ID,
    SpecFileClash,
    device_id_problem,
    natural_key,
    resource_name_problem,
    sanitize_device_id,
    socket_file_name,
    spec_files,
    validate_resource_name,
)


@pytest.mark.parametrize(
    "name",
    [
        "example.com/serial",
        "gpu.intel.com/i915",
        "a/b",
        "vfio.devplug.io/8086_1572",
        "x.io/A-b_c.1",
    ],
)
def test_resource_names_the_kubelet_accepts(name: str) -> None:
    assert resource_name_problem(name) is None
    assert validate_resource_name(name) == name


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("serial", "contains a '/'"),
        ("kubernetes.io/gpu", "kubernetes.io namespace"),
        ("foo.kubernetes.io/gpu", "kubernetes.io namespace"),
        ("requests.example.com/gpu", "requests."),
        ("example.com/a/b", "exactly one '/'"),
        ("Example.com/gpu", "DNS-1123 subdomain"),
        ("-example.com/gpu", "DNS-1123 subdomain"),
        ("example.com/", "part after '/'"),
        ("example.com/-gpu", "part after '/'"),
        ("example.com/gpu!", "part after '/'"),
        ("example.com/" + "g" * 64, "part after '/'"),
        ("e" * 245 + ".io/gpu", "DNS-1123 subdomain"),
    ],
)
def test_resource_names_the_kubelet_refuses(name: str, rule: str) -> None:
    problem = resource_name_problem(name)
    assert problem is not None and rule in problem
    with pytest.raises(InvalidNameError, match="invalid resource name"):
        validate_resource_name(name)


@pytest.mark.parametrize("device_id", ["card0", "0000:00:02.0", "a", "x-1", "A.b_c:d-9"])
def test_valid_device_ids(device_id: str) -> None:
    assert device_id_problem(device_id) is None


@pytest.mark.parametrize("device_id", ["", "-a", "a-", "a/b", "../x", "a\0b", "a b", "x" * 64, "é"])
def test_invalid_device_ids(device_id: str) -> None:
    assert device_id_problem(device_id) is not None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("ttyUSB0", "ttyUSB0"),
        ("dri/card0", "dri_card0"),
        ("/a b/", "a_b"),
        ("pci-0000:00:02.0", "pci-0000:00:02.0"),
    ],
)
def test_sanitize_device_id(raw: str, expected: str) -> None:
    assert sanitize_device_id(raw) == expected


def test_sanitize_device_id_hashes_what_cannot_be_kept() -> None:
    long_a, long_b = "a" * 100, "a" * 99 + "b"
    ids = {
        sanitize_device_id(long_a),
        sanitize_device_id(long_b),
        sanitize_device_id("///"),
        sanitize_device_id(""),
    }
    assert len(ids) == 4
    for device_id in ids:
        assert device_id_problem(device_id) is None
        assert len(device_id) <= MAX_DEVICE_ID
    assert len(sanitize_device_id("x" * 40, max_length=30)) <= 30


def test_socket_file_name_is_one_safe_component() -> None:
    assert socket_file_name("example.com/serial") == "devplug-example.com_serial.sock"
    with pytest.raises(InvalidNameError):
        socket_file_name("../../etc/x")


def test_natural_key_orders_numbers_numerically() -> None:
    assert sorted(["gpu10", "gpu2", "gpu1"], key=natural_key) == ["gpu1", "gpu2", "gpu10"]


def test_natural_key_orders_pci_addresses_in_bus_order() -> None:
    """Hex is not decimal: "0a" is bus 10, after bus 9; a five-digit domain (VMD) comes last."""
    addresses = ["10000:00:02.0", "0000:0a:00.0", "0000:09:00.1", "0000:09:00.0", "0000:1f:1f.7"]
    expected = ["0000:09:00.0", "0000:09:00.1", "0000:0a:00.0", "0000:1f:1f.7", "10000:00:02.0"]
    assert sorted(addresses, key=natural_key) == expected
    shares = ["0000:0a:00.0-10", "0000:0a:00.0-2", "0000:09:00.0-1"]
    assert sorted(shares, key=natural_key) == [
        "0000:09:00.0-1",
        "0000:0a:00.0-2",
        "0000:0a:00.0-10",
    ]
    paths = [
        "/sys/devices/pci0000:00/0000:00:1c.0/0000:0a:00.0",
        "/sys/devices/pci0000:00/0000:00:1c.0/0000:09:00.0",
    ]
    assert sorted(paths, key=natural_key) == paths[::-1]


def test_a_text_sorts_before_its_extensions() -> None:
    assert sorted(["gpu1a", "gpu10", "gpu", "gpu1"], key=natural_key) == [
        "gpu",
        "gpu1",
        "gpu1a",
        "gpu10",
    ]
    assert sorted(["0000:03:00.0-0", "0000:03:00.0"], key=natural_key) == [
        "0000:03:00.0",
        "0000:03:00.0-0",
    ]
    child, parent = "/sys/devices/pci0000:00/0000:00:02.0/drm", "/sys/devices/pci0000:00"
    assert sorted([child, parent], key=natural_key) == [parent, child]


def test_hex_inside_a_longer_word_is_not_taken_for_a_pci_address() -> None:
    """In "xa10000:00:02.0" the "a" belongs to the word "xa": the number is 10000 (decimal),
    after 9, not a PCI domain a10000."""
    assert sorted(["xa10000:00:02.0", "xa9:00:02.0"], key=natural_key) == [
        "xa9:00:02.0",
        "xa10000:00:02.0",
    ]


def test_natural_key_is_a_total_order() -> None:
    """Different texts never tie, so the order does not depend on the input's order."""
    texts = ["gpu01", "gpu1", "gpu001"]
    assert sorted(texts, key=natural_key) == sorted(reversed(texts), key=natural_key)
    assert len({natural_key(t) for t in texts}) == 3


def test_a_trailing_newline_is_not_part_of_any_valid_name() -> None:
    # Python's "$" also matches before a final newline; the rules must not.
    from devplug.naming import cdi_kind_problem, device_id_problem, resource_name_problem

    assert device_id_problem("gpu0\n") is not None
    assert resource_name_problem("example.com/gpu\n") is not None
    assert resource_name_problem("example.com\n/gpu") is not None
    assert cdi_kind_problem("example.com/gpu\n") is not None
    assert device_id_problem("gpu0") is None and resource_name_problem("example.com/gpu") is None


def test_two_kinds_on_one_spec_file_leave_it_to_the_first_resource_by_name() -> None:
    """``a/b-c`` and ``a-b/c`` both give ``a-b-c.json``, as does a kind given twice: the first
    resource by name has the file, whatever order the kinds come in."""
    kinds = {
        "example.com/z": "example.com/xy",
        "example.com/b": "example-com/bb",
        "example.com/a": "example.com/xy",
        "example-com/b": "example.com-b/xx",
        "example.com/c": "example.com/cc",
    }
    files, clashes = spec_files(kinds)
    assert files == {
        "example-com/b": "example.com-b-xx.json",
        "example.com/a": "example.com-xy.json",
        "example.com/b": "example-com-bb.json",
        "example.com/c": "example.com-cc.json",
    }
    assert list(files) == sorted(files)  # in resource order
    assert clashes == [SpecFileClash("example.com/z", "example.com-xy.json", "example.com/a")]
    assert clashes[0].problem == (
        "example.com/a and example.com/z would share the spec file example.com-xy.json"
    )
    assert spec_files({"b.io/y": "ab-cd/ef", "a.io/x": "ab/cd-ef"}) == (
        {"a.io/x": "ab-cd-ef.json"},
        [SpecFileClash("b.io/y", "ab-cd-ef.json", "a.io/x")],
    )


def test_spec_files_refuse_an_invalid_kind() -> None:
    with pytest.raises(CdiSpecError, match="invalid kind 'serial'"):
        spec_files({"example.com/serial": "serial"})
