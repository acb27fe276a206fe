"""CDI names: kinds, device names, qualified names, default kinds, file names, annotation keys."""

from __future__ import annotations

import hashlib
import random
import re

import pytest

from devplug.cdi.allocate import ANNOTATION_PREFIX, MAX_ANNOTATION_NAME, annotation_key
from devplug.cdi.render import cdi_device_name, default_kind
from devplug.cdi.spec import device_name_problem, parse_kind, qualified_name
from devplug.errors import CdiSpecError, InvalidNameError
from devplug.naming import spec_file_name, validate_resource_name

# The Kubernetes rule for the part of a cdi.k8s.io/ annotation key after the prefix, written
# out here independently of the module under test.
ANNOTATION_KEY_RULE = re.compile(r"cdi\.k8s\.io/[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")

# ------------------------------------------------------------------------- parse_kind


@pytest.mark.parametrize(
    ("kind", "vendor", "cls"),
    [
        ("example.com/serial", "example.com", "serial"),
        ("gpu.intel.com/i915", "gpu.intel.com", "i915"),
        ("ab/cd", "ab", "cd"),
        ("AB/Z9", "AB", "Z9"),
        ("v1/c2", "v1", "c2"),
        ("my_vendor-x.io/my_class-y.z", "my_vendor-x.io", "my_class-y.z"),
        ("vendor.example/class.with.dots", "vendor.example", "class.with.dots"),
        ("a-._b/c._-d", "a-._b", "c._-d"),
    ],
)
def test_parse_kind_accepts_valid_kinds(kind: str, vendor: str, cls: str) -> None:
    assert parse_kind(kind) == (vendor, cls)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("", "<vendor>/<class>"),
        ("example.com", "<vendor>/<class>"),
        ("/serial", "vendor part is empty"),
        ("example.com/", "class part is empty"),
        ("/", "vendor part is empty"),
        ("1vendor.com/serial", "vendor '1vendor.com'"),
        ("example.com/3d", "class '3d'"),
        ("_vendor/serial", "vendor '_vendor'"),
        (".vendor/serial", "vendor '.vendor'"),
        ("vendor-/serial", "vendor 'vendor-'"),
        ("vendor./serial", "vendor 'vendor.'"),
        ("example.com/serial-", "class 'serial-'"),
        ("example.com/serial_", "class 'serial_'"),
        ("example.com/seri:al", "class 'seri:al'"),
        ("exa:mple.com/serial", "vendor 'exa:mple.com'"),
        ("ab/cd/ef", "class 'cd/ef'"),
        ("a/cd", "vendor 'a'"),  # one character: the library's check panics on it
        ("ab/c", "class 'c'"),
        ("example.com/se rial", "class 'se rial'"),
        ("example.com/sérial", "class 'sérial'"),
        ("example.com=x/serial", "vendor 'example.com=x'"),
    ],
)
def test_parse_kind_refuses_invalid_kinds(kind: str, words: str) -> None:
    with pytest.raises(CdiSpecError, match="invalid kind") as caught:
        parse_kind(kind)
    assert words in str(caught.value)


def test_parse_kind_refuses_a_trailing_newline() -> None:
    with pytest.raises(CdiSpecError):
        parse_kind("example.com/gpu\n")


# ------------------------------------------------------------------------- device names


@pytest.mark.parametrize(
    "name",
    ["0", "a", "Z", "gpu0", "card0", "0000:03:00.0", "a_b-c.d:e", "a:b", "1-2", "A.b_c:d-9"],
)
def test_valid_device_names(name: str) -> None:
    assert device_name_problem(name) is None


def test_empty_device_name_is_refused() -> None:
    assert device_name_problem("") == "empty device name"


@pytest.mark.parametrize(
    "name",
    ["-a", "a-", "_a", "a_", ".a", "a.", ":a", "a:", "a/b", "a b", "a=b", "é", "a\0b", "gpu*"],
)
def test_invalid_device_names(name: str) -> None:
    problem = device_name_problem(name)
    assert problem is not None
    assert repr(name) in problem and "start and end with a letter or digit" in problem


@pytest.mark.parametrize("device_id", ["card0", "0000:03:00.0", "renderD128", "a", "x.y_z-1"])
def test_cdi_device_name_is_the_id_itself(device_id: str) -> None:
    assert cdi_device_name(device_id) == device_id


@pytest.mark.parametrize("device_id", ["", "-a", "a-", "a/b", "a b", "x" * 64, "é"])
def test_cdi_device_name_refuses_what_is_not_a_name(device_id: str) -> None:
    with pytest.raises(CdiSpecError, match="is not a CDI device name"):
        cdi_device_name(device_id)


def test_cdi_device_name_keeps_the_kubelet_id_limit() -> None:
    assert cdi_device_name("x" * 63) == "x" * 63
    with pytest.raises(CdiSpecError, match="at most 63"):
        cdi_device_name("x" * 64)


def test_device_name_with_a_trailing_newline_is_refused() -> None:
    assert device_name_problem("gpu0\n") is not None
    with pytest.raises(CdiSpecError):
        cdi_device_name("gpu0\n")


# ------------------------------------------------------------------------- qualified names


@pytest.mark.parametrize(
    ("kind", "name", "text"),
    [
        ("gpu.intel.com/i915", "0000:03:00.0", "gpu.intel.com/i915=0000:03:00.0"),
        ("example.com/serial", "ttyUSB0", "example.com/serial=ttyUSB0"),
        ("ab/cd", "0", "ab/cd=0"),
    ],
)
def test_a_qualified_name_is_the_kind_and_the_device_name(kind: str, name: str, text: str) -> None:
    assert qualified_name(kind, name) == text


# ------------------------------------------------------------------------- default kinds


@pytest.mark.parametrize(
    ("resource", "kind"),
    [
        ("gpu.intel.com/i915", "gpu.intel.com/i915"),
        ("example.com/serial", "example.com/serial"),
        ("example.com/My_Class-1.x", "example.com/My_Class-1.x"),
        ("3d.example.com/cam", "x3d.example.com/cam"),
        ("example.com/3d", "example.com/x3d"),
        ("1.io/2", "x1.io/x2"),
        ("vfio.devplug.io/8086_1572", "vfio.devplug.io/x8086_1572"),
        ("ab/cd", "ab/cd"),
        ("example.com/a", "example.com/xa"),  # one character: "x" in front
        ("a/serial", "xa/serial"),
    ],
)
def test_default_kind(resource: str, kind: str) -> None:
    assert default_kind(resource) == kind
    parse_kind(kind)


def _random_resource_name(rng: random.Random) -> str:
    """A candidate extended resource name; about half start a part with a digit."""
    lower = "abcdefghijklmnopqrstuvwxyz"
    digits = "0123456789"

    def first() -> str:
        return rng.choice(digits) if rng.random() < 0.5 else rng.choice(lower)

    labels = []
    for _ in range(rng.randint(1, 4)):
        middle = "".join(rng.choice(lower + digits + "-") for _ in range(rng.randint(0, 8)))
        last = rng.choice(lower + digits) if middle or rng.random() < 0.5 else ""
        labels.append(first() + middle + last)
    upper = lower.upper()
    middle = "".join(rng.choice(lower + upper + digits + "-_.") for _ in range(rng.randint(0, 20)))
    last = rng.choice(lower + upper + digits) if middle or rng.random() < 0.5 else ""
    return ".".join(labels) + "/" + first() + middle + last


def test_default_kind_is_a_valid_kind_for_every_valid_resource_name() -> None:
    rng = random.Random(20240607)
    checked = digit_led = 0
    for _ in range(3000):
        resource = _random_resource_name(rng)
        try:
            validate_resource_name(resource)
        except InvalidNameError:
            continue
        kind = default_kind(resource)
        vendor, cls = parse_kind(kind)  # raises if the property breaks
        domain, short = resource.split("/")
        # Only a leading "x" is ever added, and only in front of a digit or a single character.
        for part, fixed in ((domain, vendor), (short, cls)):
            if part[0].isdigit() or len(part) == 1:
                assert fixed == "x" + part
                digit_led += 1
            else:
                assert fixed == part
        checked += 1
    assert checked > 1000 and digit_led > 500  # the generator reaches both branches


def test_default_kind_of_longest_resource_names() -> None:
    domain = ".".join(["9" * 63, "a" * 63, "b" * 63, "c" * 52])  # 244 characters
    resource = validate_resource_name(domain + "/" + "1" * 63)
    assert default_kind(resource) == "x" + domain + "/x" + "1" * 63


# ------------------------------------------------------------------------- spec file names


@pytest.mark.parametrize(
    ("kind", "file_name"),
    [
        ("gpu.intel.com/i915", "gpu.intel.com-i915.json"),
        ("example.com/serial", "example.com-serial.json"),
        ("ab/cd", "ab-cd.json"),
        ("x3d.example.com/cam", "x3d.example.com-cam.json"),
    ],
)
def test_spec_file_name(kind: str, file_name: str) -> None:
    assert spec_file_name(kind) == file_name


@pytest.mark.parametrize("kind", ["serial", "1a/b", "a/b/c", "a/", "../x/y"])
def test_spec_file_name_refuses_invalid_kinds(kind: str) -> None:
    with pytest.raises(CdiSpecError, match="invalid kind"):
        spec_file_name(kind)


# ------------------------------------------------------------------------- annotation keys


@pytest.mark.parametrize(
    ("plugin", "device", "key"),
    [
        ("devplug", "gpu.intel.com/i915", "cdi.k8s.io/devplug_gpu.intel.com_i915"),
        ("devplug", "example.com/serial", "cdi.k8s.io/devplug_example.com_serial"),
        ("devplug", "0000:03:00.0", "cdi.k8s.io/devplug_0000_03_00.0"),
        ("plug", "a b*c", "cdi.k8s.io/plug_a_b_c"),
        ("-plug", "dev.", "cdi.k8s.io/plug_dev"),
        ("", "dev", "cdi.k8s.io/dev"),
        ("x", "", "cdi.k8s.io/x"),
    ],
)
def test_annotation_key(plugin: str, device: str, key: str) -> None:
    assert annotation_key(plugin, device) == key
    assert ANNOTATION_KEY_RULE.fullmatch(key)


def test_annotation_key_at_the_length_limit_is_kept() -> None:
    device = "d" * (63 - len("devplug_"))
    assert annotation_key("devplug", device) == "cdi.k8s.io/devplug_" + device
    assert len(annotation_key("devplug", device)) - len(ANNOTATION_PREFIX) == 63


def test_long_annotation_key_keeps_a_prefix_and_a_hash() -> None:
    device = "gpu.example.com/" + "n" * 60
    raw = "devplug_" + device
    digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
    expected = "cdi.k8s.io/devplug_gpu.example.com_" + "n" * 26 + "_" + digest
    key = annotation_key("devplug", device)
    assert key == expected
    assert len(key) - len(ANNOTATION_PREFIX) == MAX_ANNOTATION_NAME == 63
    assert ANNOTATION_KEY_RULE.fullmatch(key)


def test_long_annotation_key_prefix_does_not_end_in_a_separator() -> None:
    # 50 characters are kept before the hash; the 50th here is a "-", which must go.
    device = "a" * (49 - len("p_")) + "-" + "b" * 40
    key = annotation_key("p", device)
    name = key.removeprefix(ANNOTATION_PREFIX)
    assert name.startswith("p_" + "a" * 47 + "_")
    assert len(name) == 2 + 47 + 1 + 12
    assert ANNOTATION_KEY_RULE.fullmatch(key)


def test_distinct_long_inputs_give_distinct_annotation_keys() -> None:
    base = "example.com/" + "x" * 80
    keys = {annotation_key("devplug", base + suffix) for suffix in ("a", "b", ":", "/", "_")}
    assert len(keys) == 5
    # Same cleaned text, different raw text: still distinct once hashed.
    assert annotation_key("devplug", base + ":0") != annotation_key("devplug", base + "/0")


def test_annotation_key_always_matches_the_rule() -> None:
    rng = random.Random(5)
    alphabet = "abcXYZ019_-.:/ é*="
    for _ in range(2000):
        plugin = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        device = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        key = annotation_key(plugin, device)
        assert ANNOTATION_KEY_RULE.fullmatch(key), (plugin, device, key)


@pytest.mark.parametrize(("plugin", "device"), [("", ""), ("-", "/"), ("é", ":")])
def test_annotation_key_of_nothing_usable_is_a_hash(plugin: str, device: str) -> None:
    key = annotation_key(plugin, device)
    assert ANNOTATION_KEY_RULE.fullmatch(key)
